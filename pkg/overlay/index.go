package overlay

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ErrNoIndexMounts says the kernel mounts no EROFS image from a regular
// file with a regular file as its extra device (no EROFS, no file-backed
// mounts: before 6.12, or CONFIG_EROFS_FS_BACKED_BY_FILE off).
var ErrNoIndexMounts = errors.New("the kernel mounts no file-backed EROFS index")

// MountIndex mounts the index image at image, file-backed, with the file
// blob as its extra device (where its regular files' data lies), read-only
// and without devices, at target, which it does not follow if it is a
// symlink. Both files are the caller's, made by it: the kernel opens them
// by path.
func MountIndex(image, blob, target string) error {
	fd, err := unix.Fsopen("erofs", unix.FSOPEN_CLOEXEC)
	if errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENOSYS) {
		return fmt.Errorf("%w: %w", ErrNoIndexMounts, err)
	}
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.FsconfigSetString(fd, "source", image); err != nil {
		return fsError(fd, "source", err)
	}
	if err := unix.FsconfigSetString(fd, "device", blob); err != nil {
		return fsError(fd, "device", err)
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		if errors.Is(err, unix.ENOTBLK) {
			return fmt.Errorf("%w: %w", ErrNoIndexMounts, fsError(fd, "create", err))
		}
		return fsError(fd, "create", err)
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return fsError(fd, "fsmount", err)
	}
	defer unix.Close(mfd)
	return moveMount(mfd, target)
}

// UnmountIndex detaches the index mounted at target (MountIndex), not
// following target if it is a symlink: the views made over it keep their
// own clones of it.
func UnmountIndex(target string) error {
	return unix.Unmount(target, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW)
}

// IndexMounted says whether an index is mounted at path.
func IndexMounted(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.EROFS_SUPER_MAGIC_V1
}

// CopyIndex makes dst a tree of its own with what the index mounted at
// mnt holds, each regular file's data cloned from the file blob, the
// index's extra device, where at says its data starts (by the file's
// first name; a file it has no offset for is copied from the mount): how a
// volume pulled as an index becomes a plain layer once its blob is whole,
// in block clones on a filesystem that has them (a copy elsewhere). The
// blob is read, never changed, and is to be whole: a read of a hole the
// index's fill has not filled yet would be held.
func CopyIndex(ctx context.Context, mnt, blob string, at func(rel string) (int64, bool), dst string) (CopyStats, error) {
	fd, err := unix.Open(blob, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return CopyStats{}, fmt.Errorf("the blob of %s: %w", mnt, err)
	}
	defer unix.Close(fd)
	// Written back first, at once: a clone of a range not written back
	// yet writes that range back, alone, and waits for it.
	if err := unix.Fdatasync(fd); err != nil {
		return CopyStats{}, fmt.Errorf("the blob of %s: %w", mnt, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return CopyStats{}, err
	}
	return copyTree(ctx, mnt, dst, true, func(rel string) (fileData, error) {
		off, ok := at(rel)
		if !ok {
			return fileData{}, nil
		}
		// A descriptor of each copy's own, closed with it; they share no
		// offset that a copy uses.
		own, err := unix.Dup(fd)
		if err != nil {
			return fileData{}, err
		}
		unix.CloseOnExec(own)
		return fileData{file: os.NewFile(uintptr(own), blob), at: off, fileSize: st.Size, blockSize: int64(st.Blksize)}, nil // (Blksize: an int32 on some architectures)
	})
}
