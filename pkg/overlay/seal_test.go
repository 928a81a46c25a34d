package overlay

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
)

// sealTree writes what a hostile step could leave in an output volume.
func sealTree(t *testing.T, root string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Join(root, "bin"), 0o755))
	for name, mode := range map[string]uint32{"bin/suid": 0o4755, "bin/sgid": 0o2755, "bin/both": 0o6711, "bin/plain": 0o755} {
		p := filepath.Join(root, name)
		require.NoError(t, os.WriteFile(p, []byte("#!/bin/sh\n"), 0o600))
		require.NoError(t, unix.Chmod(p, mode))
	}
	require.NoError(t, os.Link(filepath.Join(root, "bin/suid"), filepath.Join(root, "bin/suid-link")))
	// A binary that would give whoever runs it cap_setuid, setuid bit or
	// not, and a hard link of it.
	for _, name := range []string{"bin/capped", "bin/suid-capped"} {
		p := filepath.Join(root, name)
		require.NoError(t, os.WriteFile(p, []byte("#!/bin/sh\n"), 0o755))
		require.NoError(t, unix.Setxattr(p, "security.capability", capSetuid, 0))
	}
	require.NoError(t, unix.Chmod(filepath.Join(root, "bin/suid-capped"), 0o4755))
	require.NoError(t, os.Link(filepath.Join(root, "bin/capped"), filepath.Join(root, "bin/capped-link")))
	require.NoError(t, os.Mkdir(filepath.Join(root, "shared"), 0o755))
	require.NoError(t, unix.Chmod(filepath.Join(root, "shared"), 0o2775)) // a dir's setgid only sets new entries' group
	require.NoError(t, unix.Mknod(filepath.Join(root, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	require.NoError(t, unix.Mknod(filepath.Join(root, "shared/disk"), unix.S_IFBLK|0o600, int(unix.Mkdev(7, 0))))
	require.NoError(t, unix.Mknod(filepath.Join(root, "whiteout"), unix.S_IFCHR, 0))
	require.NoError(t, unix.Mkfifo(filepath.Join(root, "fifo"), 0o644))
	require.NoError(t, os.Symlink("bin/suid", filepath.Join(root, "link")))
}

// capSetuid is a security.capability xattr (VFS_CAP_REVISION_2,
// effective) granting CAP_SETUID (7).
var capSetuid = []byte{0x01, 0, 0, 0x02, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

// hasCapsAt says whether the file at path has file capabilities.
func hasCapsAt(t *testing.T, path string) bool {
	t.Helper()
	_, err := unix.Lgetxattr(path, "security.capability", nil)
	if errors.Is(err, unix.ENODATA) {
		return false
	}
	require.NoError(t, err)
	return true
}

func mode(t *testing.T, path string) uint32 {
	t.Helper()
	var st unix.Stat_t
	require.NoError(t, unix.Lstat(path, &st))
	return st.Mode
}

func TestSealClearsSetuidAndRemovesDevices(t *testing.T) {
	testfs.Need(t)
	root := t.TempDir()
	sealTree(t, root)
	bytes, inodes, err := Usage(root)
	require.NoError(t, err)

	stats, err := Seal(root, false)
	require.NoError(t, err)
	require.Equal(t, int64(5), stats.Cleared, "suid, sgid, both, capped and suid-capped (the hardlinks are the same files)")
	require.Equal(t, int64(2), stats.Removed, "the char and block devices, not the whiteout")
	require.Equal(t, inodes-2, stats.Inodes, "measured as Usage measures, less what it removed")
	require.LessOrEqual(t, stats.Bytes, bytes)

	for name, want := range map[string]uint32{"bin/suid": 0o755, "bin/sgid": 0o755, "bin/both": 0o711, "bin/plain": 0o755,
		"bin/suid-link": 0o755, "shared": 0o2775, "bin/suid-capped": 0o755, "bin/capped": 0o755} {
		require.Equal(t, want, mode(t, filepath.Join(root, name))&0o7777, name)
	}
	for _, name := range []string{"bin/capped", "bin/capped-link", "bin/suid-capped"} {
		require.False(t, hasCapsAt(t, filepath.Join(root, name)), "%s keeps no file capabilities", name)
	}
	for _, gone := range []string{"null", "shared/disk"} {
		_, err := os.Lstat(filepath.Join(root, gone))
		require.ErrorIs(t, err, os.ErrNotExist, gone)
	}
	require.Equal(t, uint32(unix.S_IFCHR), mode(t, filepath.Join(root, "whiteout"))&unix.S_IFMT, "whiteouts stay: they open nothing")
	require.Equal(t, uint32(unix.S_IFIFO), mode(t, filepath.Join(root, "fifo"))&unix.S_IFMT)

	again, err := Seal(root, false)
	require.NoError(t, err)
	require.Zero(t, again.Cleared+again.Removed, "sealing again changes nothing (a capture cut short seals again)")
	require.Equal(t, stats.Inodes, again.Inodes)
}

// --allow-setuid keeps what the step wrote, and still measures it.
func TestSealKeepsPrivilegedWhenAllowed(t *testing.T) {
	testfs.Need(t)
	root := t.TempDir()
	sealTree(t, root)
	_, inodes, err := Usage(root)
	require.NoError(t, err)
	stats, err := Seal(root, true)
	require.NoError(t, err)
	require.Zero(t, stats.Cleared+stats.Removed)
	require.Equal(t, inodes, stats.Inodes)
	require.Equal(t, uint32(0o4755), mode(t, filepath.Join(root, "bin/suid"))&0o7777)
	require.True(t, hasCapsAt(t, filepath.Join(root, "bin/capped")))
	require.Equal(t, uint32(unix.S_IFCHR), mode(t, filepath.Join(root, "null"))&unix.S_IFMT)
}
