// Package mountid names mounts as the kernel knows them: which mount a
// path is on, whether the path is that mount's root, and a name for a
// root that is the same in every mount namespace. It mounts nothing and
// reads no mount table: package overlay mounts, and package target tells a
// pod's dir holding the mount cowvol made, both by these names.
package mountid

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// Of says which mount path is on (its unique ID where the kernel has
// them) and whether path is that mount's root. A symlink at path is not
// followed; a missing path is on no mount.
func Of(path string) (id uint64, root bool, err error) {
	var stx unix.Statx_t
	err = unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT,
		unix.STATX_MNT_ID_UNIQUE|unix.STATX_MNT_ID, &stx)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("statx %s: %w", path, err)
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return 0, false, fmt.Errorf("statx %s: the kernel does not say whether it is a mount root (cowvol needs Linux 5.8 or later)", path)
	}
	return stx.Mnt_id, stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
}

// Root names a mount's root (or any dir) by device and inode: the same in
// every mount namespace, where a mount's copies have IDs of their own.
func Root(st *unix.Stat_t) string { return fmt.Sprintf("%d:%d", st.Dev, st.Ino) }
