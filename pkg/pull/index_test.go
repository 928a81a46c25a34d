package pull

import (
	"errors"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/overlay"
)

// Lazy pulls mount indexes only where asked and where the node can; a
// node that cannot (a kernel without file-backed EROFS, which no machine
// here lacks: the probe's answer is given) makes stub trees and says why.
func TestChooseIndex(t *testing.T) {
	noMounts := errors.Join(overlay.ErrNoIndexMounts, errors.New("no such device"))
	tests := []struct {
		name      string
		asked     bool
		probe     error
		wantIndex bool
		wantWhy   string
	}{
		{name: "not asked", asked: false, probe: noMounts, wantIndex: false, wantWhy: ""},
		{name: "asked, and the kernel can", asked: true, wantIndex: true, wantWhy: "; as indexes mounted file-backed (EROFS), not stub trees"},
		{name: "asked, and the kernel cannot", asked: true, probe: noMounts, wantIndex: false,
			wantWhy: "; as stub trees, not indexes: " + noMounts.Error()},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			probed := false
			index, why := chooseIndex(tc.asked, func() error { probed = true; return tc.probe })
			require.Equal(t, tc.wantIndex, index)
			require.Equal(t, tc.wantWhy, why)
			require.Equal(t, tc.asked, probed, "probed only where asked")
		})
	}
}

// The probe mounts an index on this machine's kernel (6.12 and later with
// file-backed EROFS), as root, and leaves nothing behind.
func TestIndexSupported(t *testing.T) {
	testfs.Need(t)
	dir := t.TempDir()
	err := IndexSupported(dir)
	if errors.Is(err, overlay.ErrNoIndexMounts) {
		t.Skip(err)
	}
	require.NoError(t, err)
	mounts, err := overlay.MountsUnder(dir)
	require.NoError(t, err)
	require.Empty(t, mounts)
	left, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, left)
}
