package overlay

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/mountid"
)

// Attrs are the mount attributes of a step volume. Every cowvol mount is
// nodev: a step must not reach the node's devices through a volume.
type Attrs struct {
	ReadOnly bool
	// AllowSetuid drops nosuid, for operators whose steps need setuid
	// binaries from their volumes.
	AllowSetuid bool
}

func (a Attrs) mountAttr() uint64 {
	attr := uint64(unix.MOUNT_ATTR_NODEV)
	if !a.AllowSetuid {
		attr |= unix.MOUNT_ATTR_NOSUID
	}
	if a.ReadOnly {
		attr |= unix.MOUNT_ATTR_RDONLY
	}
	return attr
}

// Mounter is the small set of mount operations the backends need. The real
// one makes syscalls; tests swap in a failing one for error paths that real
// mounts cannot be made to produce. Targets are never followed if they are
// symlinks.
type Mounter interface {
	// Overlay mounts an overlay of lowers (top first) at target. An empty
	// upper makes it read-only.
	Overlay(target string, lowers []string, upper, work string, a Attrs) error
	// OverlayDetached makes the overlay Overlay would mount at a target,
	// attached nowhere: ErrNotDetachable where the kernel cannot (it
	// lacks the new mount API or lowerdir+).
	OverlayDetached(lowers []string, upper, work string, a Attrs) (Detached, error)
	// Bind bind-mounts source at target.
	Bind(source, target string, a Attrs) error
	// BindDetached makes the mount Bind would, attached nowhere.
	BindDetached(source string, a Attrs) (Detached, error)
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

// SysMounter mounts with direct syscalls and the new mount API: fsopen with
// one lowerdir+ per layer (so chains are not bounded by a one-page option
// string; mount(2) where the kernel lacks lowerdir+), open_tree for binds,
// and move_mount, which never follows a symlink at the target.
type SysMounter struct{}

// NewSysMounter returns the real mounter.
func NewSysMounter() *SysMounter { return &SysMounter{} }

// Overlay implements Mounter.
func (m *SysMounter) Overlay(target string, lowers []string, upper, work string, a Attrs) error {
	d, err := m.OverlayDetached(lowers, upper, work, a)
	switch {
	case errors.Is(err, ErrNotDetachable):
		if err := overlayLegacy(target, lowers, upper, work, a); err != nil {
			return fmt.Errorf("mounting overlay of %d layers at %s: %w", len(lowers), target, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("mounting at %s: %w", target, err)
	}
	defer d.Close()
	return d.Attach(target)
}

// Detached is a mount made but attached nowhere: nothing can reach it until
// Attach puts it at a target, and it goes with Close (or with the process
// that made it, whatever kills it).
type Detached interface {
	Attach(target string) error
	Close() error
}

// ErrNotDetachable: the kernel cannot make an overlay mount attached nowhere.
var ErrNotDetachable = errors.New("the kernel cannot make an overlay mount without attaching it (it lacks fsopen or lowerdir+)")

// detachedMount is a mount's file descriptor from fsmount.
type detachedMount struct{ fd int }

func (d *detachedMount) Attach(target string) error { return moveMount(d.fd, target) }
func (d *detachedMount) Close() error               { return unix.Close(d.fd) }

// OverlayDetached implements Mounter.
func (m *SysMounter) OverlayDetached(lowers []string, upper, work string, a Attrs) (Detached, error) {
	if len(lowers) == 0 {
		return nil, errors.New("overlay needs at least one lower dir")
	}
	if upper == "" {
		a.ReadOnly = true
	}
	mfd, err := overlayFD(lowers, upper, work, a)
	if errors.Is(err, unix.ENOSYS) || errors.Is(err, errNoLowerdirPlus) {
		return nil, ErrNotDetachable
	}
	if err != nil {
		return nil, fmt.Errorf("making an overlay of %d layers: %w", len(lowers), err)
	}
	return &detachedMount{fd: mfd}, nil
}

var errNoLowerdirPlus = errors.New("kernel lacks lowerdir+")

// overlayFD makes an overlay with the new mount API and returns the
// detached mount's file descriptor.
func overlayFD(lowers []string, upper, work string, a Attrs) (int, error) {
	fd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, err
	}
	defer unix.Close(fd)
	for i, l := range lowers {
		if err := unix.FsconfigSetString(fd, "lowerdir+", l); err != nil {
			if i == 0 && errors.Is(err, unix.EINVAL) {
				return -1, errNoLowerdirPlus
			}
			return -1, fsError(fd, "lowerdir+ "+l, err)
		}
	}
	if upper != "" {
		// The kernel takes a backslash in these two (not in lowerdir+)
		// as escaping the next byte, as in mount(2)'s option string.
		if err := unix.FsconfigSetString(fd, "upperdir", escapeBackslashes(upper)); err != nil {
			return -1, fsError(fd, "upperdir", err)
		}
		if err := unix.FsconfigSetString(fd, "workdir", escapeBackslashes(work)); err != nil {
			return -1, fsError(fd, "workdir", err)
		}
		if err := unix.FsconfigSetFlag(fd, volatileOption); err != nil {
			return -1, fsError(fd, volatileOption, err)
		}
	}
	for _, o := range overlayOptions {
		if err := unix.FsconfigSetString(fd, o[0], o[1]); err != nil {
			return -1, fsError(fd, o[0], err)
		}
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		return -1, fsError(fd, "create", err)
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, int(a.mountAttr()))
	if err != nil {
		return -1, fsError(fd, "fsmount", err)
	}
	return mfd, nil
}

func escapeBackslashes(path string) string { return strings.ReplaceAll(path, `\`, `\\`) }

// moveMount attaches a detached mount at target. Without
// MOVE_MOUNT_T_SYMLINKS the kernel does not follow a symlink there.
func moveMount(mfd int, target string) error {
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attaching the mount at %s: %w", target, err)
	}
	return nil
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

func overlayLegacy(target string, lowers []string, upper, work string, a Attrs) error {
	for _, p := range append([]string{upper, work}, lowers...) {
		if strings.ContainsAny(p, ",:\\") {
			return fmt.Errorf("path %q cannot be passed to mount(2) for overlay", p)
		}
	}
	var st unix.Stat_t
	if err := unix.Lstat(target, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("target %s is not a directory (mount(2) would follow a symlink): %v", target, err)
	}
	opts := []string{"lowerdir=" + strings.Join(lowers, ":")}
	flags := uintptr(unix.MS_NODEV)
	if !a.AllowSetuid {
		flags |= unix.MS_NOSUID
	}
	if a.ReadOnly {
		flags |= unix.MS_RDONLY
	}
	if upper != "" {
		opts = append(opts, "upperdir="+upper, "workdir="+work, volatileOption)
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

// Bind implements Mounter: a clone of source's mount tree node, given its
// attributes before anyone can see it, then attached at target.
func (m *SysMounter) Bind(source, target string, a Attrs) error {
	d, err := m.BindDetached(source, a)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Attach(target)
}

// BindDetached implements Mounter.
func (m *SysMounter) BindDetached(source string, a Attrs) (Detached, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, source, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_SYMLINK_NOFOLLOW)
	if err != nil {
		return nil, fmt.Errorf("bind-mounting %s: %w", source, err)
	}
	attr := &unix.MountAttr{Attr_set: a.mountAttr()}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, attr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("setting mount attributes of %s: %w", source, err)
	}
	return &detachedMount{fd: fd}, nil
}

// Unmount implements Mounter. It never follows a symlink at target.
func (m *SysMounter) Unmount(target string) error {
	err := unix.Unmount(target, unix.UMOUNT_NOFOLLOW)
	switch {
	case err == nil, errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR):
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
	_, root, err := mountid.Of(path)
	return root, err
}

// Holds says whether the mount on top at path, whose root is root, is
// what backend b mounts for s: how the plugin recognises a mount it made
// but did not record (a publish records none; older plugins kept no mount
// root), from this mount namespace or another.
func Holds(b Backend, s Spec, path, root string) bool {
	sameRoot := func(dir string) bool {
		var st unix.Stat_t
		return unix.Stat(dir, &st) == nil && mountid.Root(&st) == root
	}
	if mountsLowers(b, s) {
		switch len(s.Lowers) {
		case 0:
			return sameRoot(emptyDir(s))
		case 1:
			return sameRoot(s.Lowers[0])
		}
		lowers, upper, ok := overlayAt(path)
		return ok && upper == "" && slices.Equal(lowers, s.Lowers)
	}
	content, diff := b.Content(s)
	if diff {
		_, upper, ok := overlayAt(path)
		return ok && upper == content
	}
	return sameRoot(content)
}

// overlayAt reads the overlay mounted on top at path from mountinfo: its
// lower dirs (top first) and upper dir; ok is false if what is on top is
// not an overlay.
func overlayAt(path string) (lowers []string, upper string, ok bool) {
	infos, err := mountinfo.GetMounts(func(mi *mountinfo.Info) (skip, stop bool) { return mi.Mountpoint != path, false })
	if err != nil {
		return nil, "", false
	}
	for _, mi := range infos { // the last at path is the one on top
		lowers, upper, ok = nil, "", mi.FSType == "overlay"
		for _, o := range strings.Split(mi.VFSOptions, ",") {
			k, v, _ := strings.Cut(o, "=")
			switch v = unescapeOctal(v); k {
			case "lowerdir+": // the new mount API's, one per layer
				lowers = append(lowers, v)
			case "lowerdir":
				lowers = append(lowers, strings.Split(v, ":")...)
			case "upperdir": // as it was given: escaped (escapeBackslashes)
				upper = strings.ReplaceAll(v, `\\`, `\`)
			}
		}
	}
	return lowers, upper, ok
}

// unescapeOctal undoes mountinfo's escapes of a mount option's value: the
// kernel writes a comma, a space, a tab, a newline or a backslash in one as
// a backslash and three octal digits.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }

// detachIndexes detaches the indexes (EROFS, read-only: nothing under
// one could be deleted) mounted at or below dir, most recent first.
func detachIndexes(dir string) error {
	infos, err := mountinfo.GetMounts(func(mi *mountinfo.Info) (skip, stop bool) {
		under := mi.Mountpoint == dir || strings.HasPrefix(mi.Mountpoint, dir+"/")
		return !under || mi.FSType != "erofs", false
	})
	if err != nil {
		return err
	}
	for i := len(infos) - 1; i >= 0; i-- {
		if err := UnmountIndex(infos[i].Mountpoint); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("detaching the index mounted at %s: %w", infos[i].Mountpoint, err)
		}
	}
	return nil
}

// MountsUnder lists the mount points at or below dir from
// /proc/self/mountinfo, most recent first: unmounting in this order takes a
// mount down before the one it sits on.
func MountsUnder(dir string) ([]string, error) {
	infos, err := mountinfo.GetMounts(func(mi *mountinfo.Info) (skip, stop bool) {
		return mi.Mountpoint != dir && !strings.HasPrefix(mi.Mountpoint, dir+"/"), false
	})
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(infos))
	for i := len(infos) - 1; i >= 0; i-- {
		out = append(out, infos[i].Mountpoint)
	}
	return out, nil
}
