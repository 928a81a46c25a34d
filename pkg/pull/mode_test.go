package pull

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/fill"
	"github.com/concourse/cowvol/pkg/overlay"
)

// ChooseMode decides, and opens nothing: lazily only on the overlay
// backend over a filesystem with pre-content events; asked lazy where that
// cannot be, it refuses.
func TestChooseMode(t *testing.T) {
	testfs.Need(t, "mkfs.xfs")
	xfs := testfs.Mount(t, testfs.XFS, 512<<20)
	tmpfs := t.TempDir()
	require.NoError(t, unix.Mount("tmpfs", tmpfs, "tmpfs", 0, "size=1m"))
	t.Cleanup(func() { _ = unix.Unmount(tmpfs, unix.MNT_DETACH) })
	if err := fill.Supported(xfs); err != nil {
		t.Skipf("this kernel has no fanotify pre-content events on XFS: %v", err)
	}
	tests := []struct {
		name     string
		asked    Mode
		backend  overlay.Kind
		dir      string
		want     Mode
		whyOrErr string
	}{
		{"eager asked", Eager, overlay.KindOverlay, xfs, Eager, "--pull-mode=eager"},
		{"auto on overlay over XFS", Auto, overlay.KindOverlay, xfs, Lazy, "pre-content events"},
		{"lazy on overlay over XFS", Lazy, overlay.KindOverlay, xfs, Lazy, "pre-content events"},
		{"auto on reflink", Auto, overlay.KindReflink, xfs, Eager, "reflink backend's views copy"},
		{"auto over tmpfs", Auto, overlay.KindOverlay, tmpfs, Eager, ""},
		{"lazy on reflink", Lazy, overlay.KindReflink, xfs, "", "--pull-mode=lazy"},
		{"lazy over tmpfs", Lazy, overlay.KindOverlay, tmpfs, "", "--pull-mode=lazy"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, why, err := ChooseMode(tc.asked, tc.backend, tc.dir)
			if tc.want == "" {
				require.ErrorContains(t, err, tc.whyOrErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			require.Contains(t, why, tc.whyOrErr)
		})
	}
}
