package overlay

import (
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// btrfs ioctls from linux/btrfs.h; x/sys does not carry them. The first
// three take 4096-byte argument structs: _IOW(0x94, nr, 4096).
const (
	btrfsIocSubvolCreate   = 0x5000940e
	btrfsIocSnapDestroy    = 0x5000940f
	btrfsIocSnapCreateV2   = 0x50009417
	btrfsIocInoLookup      = 0xd0009412 // _IOWR(0x94, 18, 4096)
	btrfsIocFsInfo         = 0x8400941f // _IOR(0x94, 31, 1024)
	btrfsIocQgroupLimit    = 0x8030942b // _IOR(0x94, 43, 48)
	btrfsFirstFreeObjectID = 256        // the inode number of every subvolume root
	btrfsPathNameMax       = 4087
)

// btrfsVolArgs is struct btrfs_ioctl_vol_args.
type btrfsVolArgs struct {
	fd   int64
	name [btrfsPathNameMax + 1]byte
}

// btrfsVolArgsV2 is struct btrfs_ioctl_vol_args_v2.
type btrfsVolArgsV2 struct {
	fd      int64
	transid uint64
	flags   uint64
	unused  [4]uint64
	name    [4040]byte
}

// isBtrfs says whether path lives on btrfs.
func isBtrfs(path string) bool {
	var fs unix.Statfs_t
	return unix.Statfs(path, &fs) == nil && fs.Type == unix.BTRFS_SUPER_MAGIC
}

// subvolumeAt says whether st, an entry of the dir dirfd, is the root of a
// btrfs subvolume.
func subvolumeAt(dirfd int, st *unix.Stat_t) bool {
	if st.Ino != btrfsFirstFreeObjectID || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return false
	}
	var fs unix.Statfs_t
	return unix.Fstatfs(dirfd, &fs) == nil && fs.Type == unix.BTRFS_SUPER_MAGIC
}

// isSubvolume says whether path is the root of a btrfs subvolume.
func isSubvolume(path string) bool {
	var st unix.Stat_t
	return unix.Lstat(path, &st) == nil && st.Ino == btrfsFirstFreeObjectID &&
		st.Mode&unix.S_IFMT == unix.S_IFDIR && isBtrfs(path)
}

func withParent(path string, do func(parentFd int, name string) error) error {
	name := filepath.Base(path)
	if len(name) > btrfsPathNameMax {
		return fmt.Errorf("name %q too long for a subvolume", name)
	}
	parent, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer parent.Close()
	return do(int(parent.Fd()), name)
}

// ioctlPtr makes an ioctl whose argument is a struct.
func ioctlPtr(fd int, req uintptr, arg unsafe.Pointer) error {
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg)); errno != 0 {
		return errno
	}
	return nil
}

// createSubvolume makes an empty subvolume at path.
func createSubvolume(path string) error {
	return withParent(path, func(pfd int, name string) error {
		var args btrfsVolArgs
		copy(args.name[:], name)
		if err := ioctlPtr(pfd, btrfsIocSubvolCreate, unsafe.Pointer(&args)); err != nil {
			return fmt.Errorf("creating subvolume %s: %w", path, err)
		}
		return nil
	})
}

// snapshot makes a writable snapshot of the subvolume src at dst: O(1).
func snapshot(src, dst string) error {
	s, err := os.Open(src)
	if err != nil {
		return err
	}
	defer s.Close()
	return withParent(dst, func(pfd int, name string) error {
		var args btrfsVolArgsV2
		args.fd = int64(s.Fd())
		copy(args.name[:], name)
		if err := ioctlPtr(pfd, btrfsIocSnapCreateV2, unsafe.Pointer(&args)); err != nil {
			return fmt.Errorf("snapshotting %s to %s: %w", src, dst, err)
		}
		return nil
	})
}

// destroySubvolumeAt destroys the subvolume name in the dir parentFd.
func destroySubvolumeAt(parentFd int, name string) error {
	if len(name) > btrfsPathNameMax {
		return fmt.Errorf("name %q too long for a subvolume", name)
	}
	var args btrfsVolArgs
	copy(args.name[:], name)
	if err := ioctlPtr(parentFd, btrfsIocSnapDestroy, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("destroying subvolume %s: %w", name, err)
	}
	return nil
}

// btrfsQgroupLimitArgs is struct btrfs_ioctl_qgroup_limit_args.
type btrfsQgroupLimitArgs struct {
	qgroupID                                  uint64
	flags, maxRfer, maxExcl, rsvRfer, rsvExcl uint64
}

const btrfsQgroupLimitMaxExcl = 1 << 1

// qgroupLimit caps the bytes exclusive to the subvolume dir is the root of.
func qgroupLimit(dir string, maxExcl uint64) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	args := btrfsQgroupLimitArgs{flags: btrfsQgroupLimitMaxExcl, maxExcl: maxExcl} // qgroup 0: dir's own
	if err := ioctlPtr(int(f.Fd()), btrfsIocQgroupLimit, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("setting a qgroup limit on %s: %w", dir, err)
	}
	return nil
}

// qgroupDir is the sysfs dir of the qgroup of the subvolume dir is in; it
// exists only while quotas are enabled on the filesystem.
func qgroupDir(dir string) (string, error) {
	f, err := os.Open(dir)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var info struct {
		maxID, numDevices uint64
		fsid              [16]byte
		rest              [1024 - 32]byte
	}
	if err := ioctlPtr(int(f.Fd()), btrfsIocFsInfo, unsafe.Pointer(&info)); err != nil {
		return "", fmt.Errorf("reading btrfs info of %s: %w", dir, err)
	}
	var lookup struct {
		treeID, objectID uint64
		name             [4080]byte
	}
	lookup.objectID = btrfsFirstFreeObjectID
	if err := ioctlPtr(int(f.Fd()), btrfsIocInoLookup, unsafe.Pointer(&lookup)); err != nil {
		return "", fmt.Errorf("finding the subvolume of %s: %w", dir, err)
	}
	u := info.fsid
	fsid := fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
	return fmt.Sprintf("/sys/fs/btrfs/%s/qgroups/0_%d", fsid, lookup.treeID), nil
}
