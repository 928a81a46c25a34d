// Package target owns the pod-side end of a step volume: the dir the kubelet
// names in NodePublishVolume. It accepts only paths of the kubelet's
// inline-volume layout under the kubelet dir, makes and opens them without
// following a symlink anywhere below the kubelet dir, says whether a mount
// there is the one cowvol made, and only ever removes an empty dir.
//
// It mounts nothing itself (package overlay mounts at the path it hands
// out, which stays pinned by an open file descriptor) and knows nothing of
// volumes, metadata or CSI.
package target

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/mountid"
	"github.com/concourse/cowvol/pkg/volume"
)

// ErrUnsafe marks a target that exists but must not be used: a symlink on
// the way, a non-directory, a non-empty dir, or someone else's mount.
var ErrUnsafe = errors.New("unsafe target")

// csiPluginDir is the kubelet's dir name for CSI volumes of a pod.
const csiPluginDir = "kubernetes.io~csi"

// Layout is the kubelet's dir, under which every target must lie as
// pods/<pod UID>/volumes/kubernetes.io~csi/<volume name>/mount.
type Layout struct{ KubeletDir string }

// Path is a target path that has the kubelet's layout.
type Path struct {
	Full, PodUID, VolumeName string
}

// Parse checks that p is a target of the kubelet's inline-volume layout.
func (l Layout) Parse(p string) (Path, error) {
	rel, ok := strings.CutPrefix(p, filepath.Clean(l.KubeletDir)+"/pods/")
	parts := strings.Split(rel, "/")
	if !ok || filepath.Clean(p) != p || len(parts) != 5 || parts[1] != "volumes" || parts[2] != csiPluginDir || parts[4] != "mount" {
		return Path{}, fmt.Errorf("target path %s is not the kubelet's: want %s/pods/<pod UID>/volumes/%s/<volume name>/mount",
			volume.Quote(p), l.KubeletDir, csiPluginDir)
	}
	if err := volume.ValidatePodUID(parts[0]); err != nil {
		return Path{}, fmt.Errorf("target path: %w", err)
	}
	if err := volume.ValidateLabel("volume name", parts[3]); err != nil {
		return Path{}, fmt.Errorf("target path: %w", err)
	}
	return Path{Full: p, PodUID: parts[0], VolumeName: parts[3]}, nil
}

// Dir is a target's parent dir, opened without following symlinks. The
// target is its entry "mount"; every operation on it goes through the open
// dir, so nothing swapped in on the way can redirect it.
type Dir struct {
	parent *os.File
	path   Path
}

// ErrGone says the target's parent dir does not exist: the pod's volume dir
// is gone (or was never made).
var ErrGone = errors.New("the pod's volume dir does not exist")

// Open opens the parent dir of p beneath the kubelet dir, refusing symlinks.
func (l Layout) Open(p Path) (*Dir, error) {
	root, err := os.Open(l.KubeletDir)
	if err != nil {
		return nil, fmt.Errorf("opening the kubelet dir: %w", err)
	}
	defer root.Close()
	rel := strings.TrimPrefix(filepath.Dir(p.Full), filepath.Clean(l.KubeletDir)+"/")
	fd, err := unix.Openat2(int(root.Fd()), rel, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	switch {
	case errors.Is(err, unix.ENOENT):
		return nil, fmt.Errorf("%s: %w", filepath.Dir(p.Full), ErrGone)
	case errors.Is(err, unix.ELOOP), errors.Is(err, unix.EXDEV), errors.Is(err, unix.ENOTDIR):
		return nil, fmt.Errorf("refusing %s: a symlink or a non-directory is on the way (%v): %w", p.Full, err, ErrUnsafe)
	case err != nil:
		return nil, fmt.Errorf("opening %s: %w", filepath.Dir(p.Full), err)
	}
	return &Dir{parent: os.NewFile(uintptr(fd), filepath.Dir(p.Full)), path: p}, nil
}

// Close releases the parent dir.
func (d *Dir) Close() error { return d.parent.Close() }

// MountPath names the target for syscalls that take a path: it goes through
// the open parent dir, and mount, unmount and stat calls there do not follow
// a symlink at the last component.
func (d *Dir) MountPath() string { return fmt.Sprintf("/proc/self/fd/%d/mount", d.parent.Fd()) }

// State is what is at a target.
type State struct {
	Exists bool
	// Mounted says a mount's root is at the target; MountID names it in
	// this mount namespace, and Root ("dev:ino" of the mount's root) in
	// every one: the copies of a mount that propagation makes in other
	// namespaces (a restarted plugin container's) have IDs of their own.
	Mounted bool
	MountID uint64
	Root    string
	// Empty says the target is an empty dir (and not mounted).
	Empty bool
}

// Stat says what is at the target. Anything but a dir is unsafe.
func (d *Dir) Stat() (State, error) {
	var st unix.Stat_t
	err := unix.Fstatat(int(d.parent.Fd()), "mount", &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return State{}, nil
	}
	if err != nil {
		return State{}, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return State{Exists: true}, fmt.Errorf("target %s is not a directory: %w", d.path.Full, ErrUnsafe)
	}
	id, root, err := mountid.Of(d.MountPath())
	if err != nil {
		return State{}, err
	}
	s := State{Exists: true, Mounted: root, MountID: id}
	if root {
		s.Root = mountid.Root(&st)
	} else {
		s.Empty, err = d.empty()
	}
	return s, err
}

func (d *Dir) empty() (bool, error) {
	fd, err := unix.Openat(int(d.parent.Fd()), "mount", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	f := os.NewFile(uintptr(fd), d.path.Full)
	defer f.Close()
	names, err := f.Readdirnames(1)
	if errors.Is(err, io.EOF) {
		return true, nil
	}
	return len(names) == 0, err
}

// Make makes the target dir if it is not there, and checks that it is an
// empty dir nobody has mounted anything on: cowvol never mounts over data
// or over another mount.
func (d *Dir) Make() error {
	if err := unix.Mkdirat(int(d.parent.Fd()), "mount", 0o750); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("making target %s: %w", d.path.Full, err)
	}
	s, err := d.Stat()
	switch {
	case err != nil:
		return err
	case s.Mounted:
		return fmt.Errorf("target %s is already a mount point: %w", d.path.Full, ErrUnsafe)
	case !s.Empty:
		return fmt.Errorf("target %s is not empty: %w", d.path.Full, ErrUnsafe)
	}
	return nil
}

// Remove removes the target if it is an empty dir; anything else is left.
func (d *Dir) Remove() error {
	err := unix.Unlinkat(int(d.parent.Fd()), "mount", unix.AT_REMOVEDIR)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return fmt.Errorf("removing target %s: %w", d.path.Full, err)
}
