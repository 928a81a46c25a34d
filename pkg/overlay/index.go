package overlay

import (
	"errors"
	"fmt"

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
