package mountid

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
)

// A bind mount's root is its mount's root, a dir below it is not, a
// symlink to it is not followed, and a missing path is on no mount; the
// mount's root has the name of the dir it shows, as every copy of it does.
func TestOf(t *testing.T) {
	testfs.Need(t)
	dir := t.TempDir()
	src, at := filepath.Join(dir, "src"), filepath.Join(dir, "at")
	require.NoError(t, os.MkdirAll(filepath.Join(src, "sub"), 0o755))
	require.NoError(t, os.Mkdir(at, 0o755))
	require.NoError(t, os.Symlink(at, filepath.Join(dir, "link")))
	require.NoError(t, unix.Mount(src, at, "", unix.MS_BIND, ""))
	t.Cleanup(func() { _ = unix.Unmount(at, unix.MNT_DETACH) })

	outer, root, err := Of(dir)
	require.NoError(t, err)
	require.False(t, root)
	id, root, err := Of(at)
	require.NoError(t, err)
	require.True(t, root, "the bind mount's root")
	require.NotEqual(t, outer, id)
	below, root, err := Of(filepath.Join(at, "sub"))
	require.NoError(t, err)
	require.False(t, root)
	require.Equal(t, id, below, "a dir below is on the mount")
	linked, root, err := Of(filepath.Join(dir, "link"))
	require.NoError(t, err)
	require.False(t, root, "the symlink itself, not what it names")
	require.Equal(t, outer, linked)
	id, root, err = Of(filepath.Join(dir, "missing", "x"))
	require.NoError(t, err)
	require.Zero(t, id)
	require.False(t, root)

	var mounted, shown unix.Stat_t
	require.NoError(t, unix.Stat(at, &mounted))
	require.NoError(t, unix.Stat(src, &shown))
	require.Equal(t, Root(&shown), Root(&mounted))
}
