package overlay

import (
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// btrfs ioctls from linux/btrfs.h; x/sys does not carry them. All three
// take 4096-byte argument structs: _IOW(0x94, nr, 4096).
const (
	btrfsIocSubvolCreate  = 0x5000940e
	btrfsIocSnapDestroy   = 0x5000940f
	btrfsIocSnapCreateV2  = 0x50009417
	btrfsFirstFreeObjecID = 256 // the inode number of every subvolume root
	btrfsPathNameMax      = 4087
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

// IsBtrfs says whether path lives on btrfs.
func IsBtrfs(path string) bool {
	var fs unix.Statfs_t
	return unix.Statfs(path, &fs) == nil && fs.Type == unix.BTRFS_SUPER_MAGIC
}

func isSubvolume(path string, st *unix.Stat_t) bool {
	return st.Ino == btrfsFirstFreeObjecID && st.Mode&unix.S_IFMT == unix.S_IFDIR && IsBtrfs(path)
}

// IsSubvolume says whether path is the root of a btrfs subvolume.
func IsSubvolume(path string) bool {
	var st unix.Stat_t
	return unix.Lstat(path, &st) == nil && isSubvolume(path, &st)
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

func btrfsIoctl(fd int, req uintptr, arg unsafe.Pointer) error {
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg)); errno != 0 {
		return errno
	}
	return nil
}

// CreateSubvolume makes an empty subvolume at path.
func CreateSubvolume(path string) error {
	return withParent(path, func(pfd int, name string) error {
		var args btrfsVolArgs
		copy(args.name[:], name)
		if err := btrfsIoctl(pfd, btrfsIocSubvolCreate, unsafe.Pointer(&args)); err != nil {
			return fmt.Errorf("creating subvolume %s: %w", path, err)
		}
		return nil
	})
}

// Snapshot makes a writable snapshot of the subvolume src at dst: O(1).
func Snapshot(src, dst string) error {
	s, err := os.Open(src)
	if err != nil {
		return err
	}
	defer s.Close()
	return withParent(dst, func(pfd int, name string) error {
		var args btrfsVolArgsV2
		args.fd = int64(s.Fd())
		copy(args.name[:], name)
		if err := btrfsIoctl(pfd, btrfsIocSnapCreateV2, unsafe.Pointer(&args)); err != nil {
			return fmt.Errorf("snapshotting %s to %s: %w", src, dst, err)
		}
		return nil
	})
}

func destroySubvolume(path string) error {
	return withParent(path, func(pfd int, name string) error {
		var args btrfsVolArgs
		copy(args.name[:], name)
		if err := btrfsIoctl(pfd, btrfsIocSnapDestroy, unsafe.Pointer(&args)); err != nil {
			return fmt.Errorf("destroying subvolume %s: %w", path, err)
		}
		return nil
	})
}
