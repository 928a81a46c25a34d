package cache

import (
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/volume"
)

// A layer's sums are computed once and kept beside it: read back after a
// change to the layer (they are the capture's, not the disk's now), kept by
// recovery with their layer, and dropped by it when their layer is not the
// volume's.
func TestLayerSumsAreKeptWithTheirLayer(t *testing.T) {
	s := openStore(t)
	v := ready(t, s, "ci", "summed", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NoError(t, os.WriteFile(filepath.Join(s.DataPath(v), "f"), []byte("captured"), 0o644))
	sums, err := s.LayerSums(v)
	require.NoError(t, err)
	want, err := filesum.OfTree(t.Context(), s.DataPath(v))
	require.NoError(t, err)
	require.Equal(t, maps.Collect(want.All()), maps.Collect(sums.All()))

	require.NoError(t, os.WriteFile(filepath.Join(s.DataPath(v), "f"), []byte("rotted!!"), 0o644))
	s.sums = newSumsCache() // as after a restart: read from the file, not computed
	again, err := s.LayerSums(v)
	require.NoError(t, err)
	require.Equal(t, maps.Collect(want.All()), maps.Collect(again.All()), "the capture's sums, not the disk's now")

	kept := s.StubsPath(v)
	require.NoError(t, os.WriteFile(kept, []byte("its stub tree"), 0o600))
	for _, stray := range []string{
		s.sumsPath(v.Ref(), "not-a-layer"),
		s.LayerPath(v.Ref(), "not-a-layer") + stubsSuffix,
		kept + ".tmp123", // a kept stub tree a crash left half written
	} {
		require.NoError(t, os.WriteFile(stray, []byte("x"), 0o600))
	}
	rep, err := s.Recover(os.RemoveAll, false)
	require.NoError(t, err)
	require.Equal(t, 3, rep.RemovedOrphans, "the sums and stub tree of no layer, and a stub tree half kept")
	for _, own := range []string{s.sumsPath(v.Ref(), v.Layer), kept} {
		_, err = os.Stat(own)
		require.NoError(t, err, "the layer's own sums and stub tree stay")
	}
}

// Sums that cannot be written (a full disk, here a dir in their place) are
// still answered: the node goes on serving what it holds.
func TestLayerSumsAnsweredWhenTheyCannotBeKept(t *testing.T) {
	s := openStore(t)
	v := ready(t, s, "ci", "unkept", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NoError(t, os.WriteFile(filepath.Join(s.DataPath(v), "f"), []byte("data"), 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(s.sumsPath(v.Ref(), v.Layer), "in-the-way"), 0o755))
	sums, err := s.LayerSums(v)
	require.NoError(t, err)
	require.Equal(t, 1, sums.Len())
}
