package overlay

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
	mountutils "k8s.io/mount-utils"
)

// Mounter is the small set of mount operations the backends need. The real
// one makes syscalls; tests swap in a failing one for error paths that real
// mounts cannot be made to produce.
type Mounter interface {
	// Overlay mounts an overlay of lowers (top first) at target. An empty
	// upper makes it read-only.
	Overlay(target string, lowers []string, upper, work string) error
	// Bind bind-mounts source at target.
	Bind(source, target string, readOnly bool) error
	// Unmount unmounts target; a path that is not mounted is done.
	Unmount(target string) error
	// IsMountPoint says whether path is a mount point.
	IsMountPoint(path string) (bool, error)
}

// Writable overlays are mounted volatile: without it, unmounting syncs the
// whole upper filesystem, which made capturing a step that wrote 1 GiB take
// seconds instead of milliseconds. A step volume needs no durability of its
// own (a step cut short by a node crash is not captured); cowvol syncs a
// captured volume itself, in the background, and never serves one that a
// crash caught unsynced (see package driver). The price: fsync in a step is
// a no-op on a cowvol overlay volume.
const volatileOption = "volatile"

// overlayOptions are fixed for every mount of every chain. redirect_dir,
// metacopy and index leave upper dirs that are only valid over the very same
// lower stack; with them off an upper dir stays a valid middle layer over any
// stack presenting the same merged tree, which is what capture and flatten
// rely on. The cost: renaming a directory that came from a lower layer fails
// with EXDEV, which mv and friends answer by copying.
var overlayOptions = [][2]string{{"index", "off"}, {"metacopy", "off"}, {"redirect_dir", "off"}}

// SysMounter mounts with direct syscalls: the new mount API (fsopen with one
// lowerdir+ per layer, so chains are not bounded by a one-page option string)
// where the kernel has it, mount(2) otherwise.
type SysMounter struct {
	checker mountutils.Interface
}

// NewSysMounter returns the real mounter.
func NewSysMounter() *SysMounter {
	return &SysMounter{checker: mountutils.New("")}
}

// Overlay implements Mounter.
func (m *SysMounter) Overlay(target string, lowers []string, upper, work string) error {
	if len(lowers) == 0 {
		return errors.New("overlay needs at least one lower dir")
	}
	err := overlayNewAPI(target, lowers, upper, work)
	if errors.Is(err, unix.ENOSYS) || errors.Is(err, errNoLowerdirPlus) {
		err = overlayLegacy(target, lowers, upper, work)
	}
	if err != nil {
		return fmt.Errorf("mounting overlay of %d layers at %s: %w", len(lowers), target, err)
	}
	return nil
}

var errNoLowerdirPlus = errors.New("kernel lacks lowerdir+")

func overlayNewAPI(target string, lowers []string, upper, work string) error {
	fd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for i, l := range lowers {
		if err := unix.FsconfigSetString(fd, "lowerdir+", l); err != nil {
			if i == 0 && errors.Is(err, unix.EINVAL) {
				return errNoLowerdirPlus
			}
			return fsError(fd, "lowerdir+ "+l, err)
		}
	}
	var attrs int
	if upper != "" {
		if err := unix.FsconfigSetString(fd, "upperdir", upper); err != nil {
			return fsError(fd, "upperdir", err)
		}
		if err := unix.FsconfigSetString(fd, "workdir", work); err != nil {
			return fsError(fd, "workdir", err)
		}
		if err := unix.FsconfigSetFlag(fd, volatileOption); err != nil {
			return fsError(fd, volatileOption, err)
		}
	} else {
		attrs = unix.MOUNT_ATTR_RDONLY
	}
	for _, o := range overlayOptions {
		if err := unix.FsconfigSetString(fd, o[0], o[1]); err != nil {
			return fsError(fd, o[0], err)
		}
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		return fsError(fd, "create", err)
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, attrs)
	if err != nil {
		return fsError(fd, "fsmount", err)
	}
	defer unix.Close(mfd)
	return unix.MoveMount(mfd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH)
}

// fsError adds the kernel's own explanation, which it queues on the fs
// context fd, to a failed fsconfig step.
func fsError(fd int, step string, err error) error {
	buf := make([]byte, 1024)
	var msgs []string
	for range 8 {
		n, rerr := unix.Read(fd, buf)
		if rerr != nil || n <= 0 {
			break
		}
		msgs = append(msgs, strings.TrimSpace(string(buf[:n])))
	}
	if len(msgs) > 0 {
		return fmt.Errorf("%s: %w (%s)", step, err, strings.Join(msgs, "; "))
	}
	return fmt.Errorf("%s: %w", step, err)
}

func overlayLegacy(target string, lowers []string, upper, work string) error {
	for _, p := range append([]string{upper, work}, lowers...) {
		if strings.ContainsAny(p, ",:") {
			return fmt.Errorf("path %q cannot be passed to mount(2) for overlay", p)
		}
	}
	opts := []string{"lowerdir=" + strings.Join(lowers, ":")}
	var flags uintptr
	if upper != "" {
		opts = append(opts, "upperdir="+upper, "workdir="+work, volatileOption)
	} else {
		flags = unix.MS_RDONLY
	}
	for _, o := range overlayOptions {
		opts = append(opts, o[0]+"="+o[1])
	}
	data := strings.Join(opts, ",")
	if len(data) >= os.Getpagesize() {
		return fmt.Errorf("overlay options of %d bytes exceed mount(2)'s one page and this kernel lacks lowerdir+", len(data))
	}
	return unix.Mount("overlay", target, "overlay", flags, data)
}

// Bind implements Mounter.
func (m *SysMounter) Bind(source, target string, readOnly bool) error {
	if err := unix.Mount(source, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind-mounting %s at %s: %w", source, target, err)
	}
	if !readOnly {
		return nil
	}
	if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		_ = unix.Unmount(target, unix.MNT_DETACH)
		return fmt.Errorf("making %s read-only: %w", target, err)
	}
	return nil
}

// Unmount implements Mounter.
func (m *SysMounter) Unmount(target string) error {
	err := unix.Unmount(target, unix.UMOUNT_NOFOLLOW)
	switch {
	case err == nil, errors.Is(err, unix.ENOENT):
		return nil
	case errors.Is(err, unix.EINVAL):
		// Not a mount point (or not ours to unmount): say which.
		if mp, merr := m.IsMountPoint(target); merr == nil && !mp {
			return nil
		}
	}
	return fmt.Errorf("unmounting %s: %w", target, err)
}

// IsMountPoint implements Mounter. Unlike a device-number comparison it sees
// bind mounts of the same filesystem, which is what most of ours are.
func (m *SysMounter) IsMountPoint(path string) (bool, error) {
	mp, err := m.checker.IsMountPoint(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	return mp, err
}

// MountsUnder lists the mount points at or below dir, deepest first, from
// /proc/self/mountinfo.
func MountsUnder(dir string) ([]string, error) {
	infos, err := mountutils.ParseMountInfo("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var out []string
	for i := len(infos) - 1; i >= 0; i-- {
		mp := infos[i].MountPoint
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	return out, nil
}
