package cache

import (
	"errors"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/volume"
)

// TestImageHoldsKeepChains: a runtime's snapshot holds a volume's whole
// chain in the metadata, through a destroy and a reopen, until released;
// a volume that is gone, hidden or refused is never held.
func TestImageHoldsKeepChains(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	require.NoError(t, err)
	base := ready(t, s, "ci", "base", volume.Ref{}, volume.ScopeNamespace, nil)
	img := ready(t, s, "ci", "img", ref("ci", "base"), volume.ScopeNamespace, nil)
	ok := func(Volume) error { return nil }

	dirs, err := s.HoldImage("k8s.io/1/container", ref("ci", "img"), ok)
	require.NoError(t, err)
	assert.Equal(t, []string{s.DataPath(img), s.DataPath(base)}, dirs)
	for _, r := range []volume.Ref{ref("ci", "img"), ref("ci", "base")} {
		assert.Equal(t, []string{"k8s.io/1/container"}, s.Holders(r).Images, r)
		assert.NotContains(t, refs(s.Candidates(time.Now())), r, "held: not evictable")
	}

	refused := errors.New("refused")
	_, err = s.HoldImage("other", ref("ci", "img"), func(Volume) error { return refused })
	assert.ErrorIs(t, err, refused)
	_, err = s.HoldImage("other", ref("ci", "nope"), ok)
	assert.ErrorIs(t, err, ErrNotFound)
	_, err = s.HoldImage("bad\x00holder", ref("ci", "img"), ok)
	assert.Error(t, err)
	assert.Equal(t, []string{"k8s.io/1/container"}, s.ImageHolders())

	require.NoError(t, s.Destroy(ref("ci", "img")))
	_, err = s.HoldImage("new", ref("ci", "img"), ok)
	assert.ErrorIs(t, err, ErrNotFound, "a destroyed volume takes no new hold")
	again, err := s.HoldImage("k8s.io/1/container", ref("ci", "img"), func(Volume) error { return refused })
	require.NoError(t, err, "its holder still has it, unchecked")
	assert.Equal(t, dirs, again)
	require.NoError(t, s.Close())

	s, err = Open(dir)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	assert.Empty(t, s.Reapable(), "the hold outlives the process")
	require.ErrorIs(t, s.Reap(ref("ci", "img"), os.RemoveAll), ErrInUse)
	require.NoError(t, s.ReleaseImage("k8s.io/1/container"))
	require.NoError(t, s.ReleaseImage("k8s.io/1/container"), "releasing twice is a no-op")
	assert.Empty(t, s.ImageHolders())
	assert.Equal(t, []volume.Ref{ref("ci", "img")}, refs(s.Reapable()))
	assert.Empty(t, s.Holders(ref("ci", "base")).Images)
}
