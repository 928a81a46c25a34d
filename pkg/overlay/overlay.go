// Package overlay owns cowvol's copy-on-write mechanics: building a step
// volume's private tree over a chain of cached layers (an overlay mount, a
// reflink clone, a btrfs snapshot or a plain copy), mounting it at the pod's
// target (as a plain tree where the runtime will idmap it), and turning it
// into a layer on capture with a rename and one walk that seals it (no
// setuid bits, no device nodes) and measures it.
//
// It works on the paths it is given. It knows nothing of handles, metadata,
// namespaces or CSI (package cache and package driver own those), and it never
// writes into a lower layer: cached layers are immutable.
package overlay

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Kind names a COW backend.
type Kind string

const (
	// KindOverlay stacks the source's layers under a fresh upper dir: O(1)
	// publish, O(1) capture, chains without copies.
	KindOverlay Kind = "overlay"
	// KindReflink clones the source tree file by file (FICLONE): XFS with
	// reflink. Publish is O(files), not O(bytes).
	KindReflink Kind = "reflink"
	// KindBtrfs snapshots the source subvolume: O(1).
	KindBtrfs Kind = "btrfs"
	// KindCopy copies the source tree: the last resort.
	KindCopy Kind = "copy"
)

// MaxLayers is the most layers overlayfs stacks in one mount: no chain may
// be deeper.
const MaxLayers = 500

// probeOrder lists the backends in the order auto-probing prefers them.
var probeOrder = []Kind{KindBtrfs, KindOverlay, KindReflink, KindCopy}

// Spec describes one step volume.
type Spec struct {
	// Dir is the volume's private dir; the backend creates what it needs
	// inside it.
	Dir string
	// Target is where the pod sees the volume; it must exist.
	Target string
	// Lowers are the source's layer dirs, top first; none for an empty
	// volume.
	Lowers []string
	// Attrs are the target mount's attributes; Attrs.ReadOnly volumes are
	// never captured.
	Attrs Attrs
	// Idmapped says the container runtime will idmap the target's mount
	// (a pod with a user namespace of its own): it must be a bind of a
	// plain tree, since an overlay mount cannot be idmapped.
	Idmapped bool
	// Limit caps what the step may write (bytes, 0: none), enforced by the
	// backend's Limiter under quota ID QuotaID.
	Limit   int64
	QuotaID uint32
}

// ErrNotIdmappable: a view whose mount the runtime will idmap would be an
// overlay mount, which the kernel cannot idmap.
var ErrNotIdmappable = errors.New("an overlay mount cannot be idmapped")

// Backend builds, mounts and captures step volumes one way.
type Backend interface {
	Kind() Kind
	// Prepare builds the volume's tree, unless an earlier Prepare built
	// it, and mounts it at the target. It may be called again after it
	// failed or was cut short at any point (a crash): a tree whose build
	// did not finish is built again, a finished one is mounted as the
	// step left it. The tree appears under its name only once whole.
	Prepare(ctx context.Context, s Spec) error
	// Content is the tree holding what the step sees and wrote, and
	// whether it is a diff over the lowers (an overlay upper dir) rather
	// than a whole tree.
	Content(s Spec) (dir string, diff bool)
}

// ParseKind checks a backend name.
func ParseKind(name string) (Kind, error) {
	switch k := Kind(name); k {
	case KindOverlay, KindReflink, KindCopy, KindBtrfs:
		return k, nil
	}
	return "", fmt.Errorf("unknown COW backend %q (known: overlay, reflink, btrfs, copy)", name)
}

// New returns the backend of a kind. lim enforces size limits; nil means
// none can be, and a Spec with a Limit is refused.
func New(kind Kind, m Mounter, lim Limiter) (Backend, error) {
	if _, err := ParseKind(string(kind)); err != nil {
		return nil, err
	}
	if kind == KindOverlay {
		return overlayBackend{m: m, lim: lim}, nil
	}
	return treeBackend{kind: kind, m: m, lim: lim}, nil
}

// Unmount takes a step volume down from its target (unless Target is
// empty: nothing is mounted there) and drops any mount the backend made
// inside its dir. Every backend's volumes come down the same way, so a
// restarted plugin running another backend can still do it.
func Unmount(m Mounter, s Spec) error {
	if s.Target != "" {
		if err := m.Unmount(s.Target); err != nil {
			return err
		}
	}
	return m.Unmount(mergedDir(s))
}

// Commit moves a step volume's content to layerDir, which becomes a cached
// layer: a rename, whatever the size. It is idempotent, so a capture cut
// short by a crash can be completed by calling it again. The step volume
// must be unmounted.
func Commit(b Backend, s Spec, layerDir string) (diff bool, err error) {
	content, diff := b.Content(s)
	if err := os.MkdirAll(filepath.Dir(layerDir), 0o700); err != nil {
		return false, err
	}
	if err := os.Rename(content, layerDir); err != nil {
		if _, statErr := os.Lstat(layerDir); errors.Is(err, os.ErrNotExist) && statErr == nil {
			return diff, nil // renamed before a crash
		}
		return false, fmt.Errorf("capturing %s: %w", content, err)
	}
	// No fsync here: the caller records the layer as unsynced and a
	// background syncfs makes it durable; a reboot that comes first makes
	// it failed, never half-there. (An fsync of the layer's parent forced
	// XFS's log of every file the step made: 43 ms for 50,000 files.)
	return diff, nil
}

// SyncFS flushes the whole filesystem holding path to disk.
func SyncFS(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.Syncfs(int(f.Fd()))
}

// Sync fsyncs a file, or a dir (making renames in it durable).
func Sync(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// mountReadOnly serves read-only volumes the same way in every backend:
// nothing is copied. One layer is bind-mounted read-only; a chain becomes a
// read-only overlay; an empty volume is an empty read-only dir.
func mountReadOnly(m Mounter, s Spec) error {
	switch len(s.Lowers) {
	case 0:
		empty := emptyDir(s)
		if err := os.MkdirAll(s.Dir, 0o700); err != nil {
			return err
		}
		if err := mkdirMode(empty, 0o755); err != nil {
			return err
		}
		return m.Bind(empty, s.Target, s.Attrs)
	case 1:
		return m.Bind(s.Lowers[0], s.Target, s.Attrs)
	}
	return m.Overlay(s.Target, s.Lowers, "", "", s.Attrs)
}

// limited checks that a limited volume can be limited.
func limited(lim Limiter, s Spec) (bool, error) {
	if s.Limit <= 0 || s.Attrs.ReadOnly {
		return false, nil
	}
	if lim == nil {
		return false, errors.New("this node cannot enforce size limits")
	}
	return true, nil
}

// mkdirMode makes a dir with exactly mode, whatever the umask.
func mkdirMode(dir string, mode os.FileMode) error {
	if err := os.Mkdir(dir, mode); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	return os.Chmod(dir, mode)
}

// emptyRootMode is an empty volume's root: writable by the step whatever
// user it runs as, like an emptyDir.
const emptyRootMode = 0o777

type overlayBackend struct {
	m   Mounter
	lim Limiter
}

func (overlayBackend) Kind() Kind { return KindOverlay }

func (b overlayBackend) Content(s Spec) (string, bool) {
	return filepath.Join(s.Dir, "upper"), len(s.Lowers) > 0
}

// needsOverlay says whether the overlay backend mounts an overlay for s: a
// writable view of a source, or a read-only one of a chain (one layer is a
// bind, and an empty volume its upper dir).
func needsOverlay(s Spec) bool {
	return len(s.Lowers) > 1 || (len(s.Lowers) == 1 && !s.Attrs.ReadOnly)
}

// refuseIdmapped refuses a view the runtime will idmap that would be an
// overlay mount: the pod would fail to start with the runtime's own error.
func refuseIdmapped(s Spec) error {
	if s.Idmapped && needsOverlay(s) {
		return fmt.Errorf("a pod with a user namespace of its own (hostUsers: false) gets its volumes idmapped by its runtime, and %w: "+
			"for such pods to use a writable or layered source, the node's state dir needs reflink clones (XFS made with reflink=1) or btrfs", ErrNotIdmappable)
	}
	return nil
}

func (b overlayBackend) Prepare(_ context.Context, s Spec) error {
	if err := refuseIdmapped(s); err != nil {
		return err
	}
	if mountsLowers(b, s) {
		return mountReadOnly(b.m, s)
	}
	if !Built(b, s) {
		if err := b.build(s); err != nil {
			return err
		}
	}
	return b.mount(s)
}

// Stager is a Backend that can make a new view before the view is recorded.
type Stager interface {
	// Stage builds a new view's tree (from one of trees, made ahead,
	// where one is ready) and makes its mount, attached nowhere: a publish
	// does both while its record commits, and attaches the mount once it
	// has. Until then nothing reaches the mount, which goes with the
	// process if it dies; a tree no record owns is a stray that recovery
	// removes. ErrNotStaged: this view is built and mounted by Prepare,
	// after its record.
	Stage(s Spec, trees *Trees) (Detached, error)
}

// ErrNotStaged: a view that Stage does not make.
var ErrNotStaged = errors.New("this view is made after it is recorded")

// Stage implements Stager for writable views (of a source: an overlay; of
// nothing: a bind of the upper dir) that have no size limit (a limit's
// quota ID comes with the record) and no tree yet. It leaves nothing
// behind when it fails.
func (b overlayBackend) Stage(s Spec, trees *Trees) (Detached, error) {
	if s.Attrs.ReadOnly || s.Idmapped || s.Limit > 0 {
		return nil, ErrNotStaged
	}
	if _, err := os.Lstat(s.Dir); !errors.Is(err, os.ErrNotExist) {
		return nil, ErrNotStaged // a tree an earlier call left: Prepare decides
	}
	upper, _ := b.Content(s)
	var err error
	if tree := trees.take(); tree != "" {
		err = adopt(s, tree)
	} else {
		err = b.build(s)
	}
	var d Detached
	switch {
	case err != nil:
	case len(s.Lowers) == 0: // as mount does
		d, err = b.m.BindDetached(upper, s.Attrs)
	default:
		d, err = b.m.OverlayDetached(s.Lowers, upper, filepath.Join(s.Dir, "work"), s.Attrs)
	}
	if err != nil {
		// Leave nothing: Prepare builds the tree again after the record.
		err = errors.Join(err, RemoveTree(s.Dir))
		if errors.Is(err, ErrNotDetachable) {
			return nil, ErrNotStaged
		}
		return nil, err
	}
	return d, nil
}

// adopt makes a tree made ahead a view's: its upper dir gets the root's
// attributes, then the tree the view's name, so that the view's tree
// appears whole. A tree it cannot adopt is removed.
func adopt(s Spec, tree string) error {
	uid, gid, mode, err := rootOf(s)
	if err == nil {
		err = setRoot(filepath.Join(tree, "upper"), uid, gid, mode)
	}
	if err == nil {
		err = unix.Renameat2(unix.AT_FDCWD, tree, unix.AT_FDCWD, s.Dir, unix.RENAME_NOREPLACE)
	}
	if err != nil {
		return errors.Join(fmt.Errorf("adopting a tree made ahead: %w", err), RemoveTree(tree))
	}
	return nil
}

// rootOf is the owner and mode of a view's upper root: an empty volume's,
// or, since the merged root takes the upper root's attributes, the
// source's, so that the view's root looks like the source's (-1 IDs: the
// owner stays).
func rootOf(s Spec) (uid, gid int, mode uint32, err error) {
	if len(s.Lowers) == 0 {
		return -1, -1, emptyRootMode, nil
	}
	var st unix.Stat_t
	if err := unix.Stat(s.Lowers[0], &st); err != nil {
		return 0, 0, 0, err
	}
	return int(st.Uid), int(st.Gid), st.Mode & 0o7777, nil
}

// setRoot gives an upper dir its root's owner and mode.
func setRoot(dir string, uid, gid int, mode uint32) error {
	if uid >= 0 {
		if err := os.Lchown(dir, uid, gid); err != nil {
			return err
		}
	}
	return unix.Chmod(dir, mode)
}

// build makes the upper and work dirs. The upper dir is made under another
// name and renamed into place once its quota and root attributes are set,
// so that one that exists is whole.
func (b overlayBackend) build(s Spec) error {
	limit, err := limited(b.lim, s)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return err
	}
	upper, _ := b.Content(s)
	staged, work := upper+stagedSuffix, filepath.Join(s.Dir, "work")
	if err := RemoveTree(staged); err != nil { // a build a crash cut short
		return err
	}
	uid, gid, mode, err := rootOf(s)
	if err != nil {
		return err
	}
	if err := os.Mkdir(staged, 0o700); err != nil {
		return err
	}
	if err := mkdirMode(work, 0o700); err != nil {
		return err
	}
	// Copy-ups are made in work and renamed into upper: both carry the
	// quota, so that what the step writes is counted wherever it lands.
	if limit {
		if err := b.lim.Limit(s.QuotaID, s.Limit, staged, work); err != nil {
			return err
		}
	}
	if err := setRoot(staged, uid, gid, mode); err != nil {
		return err
	}
	return os.Rename(staged, upper)
}

// mount mounts a built volume at the target.
func (b overlayBackend) mount(s Spec) error {
	upper, _ := b.Content(s)
	if len(s.Lowers) == 0 {
		// Nothing to stack on: the upper dir alone is the volume, and
		// capturing it gives a root layer.
		return b.m.Bind(upper, s.Target, s.Attrs)
	}
	work := filepath.Join(s.Dir, "work")
	// A volatile overlay leaves work/incompat/volatile behind, and the
	// kernel refuses to mount over it again: after a crash the upper dir
	// may be torn. Callers remount only within the boot that wrote it,
	// where the page cache kept every write, so the marker can go.
	if err := os.RemoveAll(filepath.Join(work, "work", "incompat")); err != nil {
		return err
	}
	return b.m.Overlay(s.Target, s.Lowers, upper, work, s.Attrs)
}

// Built says whether a step volume's tree has been built (by a Prepare that
// finished building it): a volume mounted straight from its lowers has none
// to build.
func Built(b Backend, s Spec) bool {
	if mountsLowers(b, s) {
		return true
	}
	content, _ := b.Content(s)
	_, err := os.Lstat(content)
	// Only a tree known to be missing is unbuilt: a state dir that cannot
	// say fails the capture or the mount with why, and loses nothing.
	return !errors.Is(err, os.ErrNotExist)
}

// mountsLowers says whether a backend mounts a volume straight from its
// lowers (see mountReadOnly) rather than a tree of its own.
func mountsLowers(b Backend, s Spec) bool {
	if _, tree := b.(treeBackend); tree {
		return s.Attrs.ReadOnly && !readOnlyTree(s)
	}
	return s.Attrs.ReadOnly
}

// stagedSuffix names a volume's tree while it is being built.
const stagedSuffix = ".new"

// treeBackend gives each step volume a whole tree of its own (a btrfs
// snapshot, a reflink clone or a copy) bind-mounted at the target.
type treeBackend struct {
	kind Kind
	m    Mounter
	lim  Limiter
}

func (b treeBackend) Kind() Kind { return b.kind }

func (b treeBackend) Content(s Spec) (string, bool) {
	return filepath.Join(s.Dir, "data"), false
}

// readOnlyTree says whether a read-only view gets a tree of its own: a
// chain, which read-only views elsewhere merge with an overlay mount, for a
// pod whose runtime idmaps its mounts.
func readOnlyTree(s Spec) bool { return s.Attrs.ReadOnly && s.Idmapped && len(s.Lowers) > 1 }

func (b treeBackend) Prepare(ctx context.Context, s Spec) error {
	if mountsLowers(b, s) {
		return mountReadOnly(b.m, s)
	}
	data, _ := b.Content(s)
	if !Built(b, s) {
		if err := os.MkdirAll(s.Dir, 0o700); err != nil {
			return err
		}
		staged := data + stagedSuffix
		if err := RemoveTree(staged); err != nil { // a build a crash cut short
			return err
		}
		if err := b.build(ctx, s, staged); err != nil {
			return errors.Join(err, RemoveTree(staged))
		}
		if err := os.Rename(staged, data); err != nil {
			return err
		}
	}
	return b.m.Bind(data, s.Target, s.Attrs)
}

// build makes the step's own tree. A limited tree is the limiter's before
// anything is copied in, so that the limit counts what the step writes on
// top of what it started with.
func (b treeBackend) build(ctx context.Context, s Spec, data string) error {
	limit, err := limited(b.lim, s)
	if err != nil {
		return err
	}
	if b.kind == KindBtrfs && len(s.Lowers) == 1 && isSubvolume(s.Lowers[0]) {
		if err := snapshot(s.Lowers[0], data); err != nil {
			return err
		}
	} else {
		if b.kind == KindBtrfs {
			if err := createSubvolume(data); err != nil {
				return err
			}
		}
		if err := mkdirMode(data, emptyRootMode); err != nil {
			return err
		}
		if limit {
			if err := b.lim.Claim(s.QuotaID, data); err != nil {
				return err
			}
		}
		if len(s.Lowers) > 0 {
			if _, err := CopyLayers(ctx, b.m, s.Lowers, mergedDir(s), data, b.kind != KindCopy); err != nil {
				return err
			}
		}
	}
	if limit {
		return b.lim.Limit(s.QuotaID, s.Limit, data)
	}
	return nil
}

func mergedDir(s Spec) string { return filepath.Join(s.Dir, "merged") }

// emptyDir is what an empty read-only volume mounts.
func emptyDir(s Spec) string { return filepath.Join(s.Dir, "empty") }

// Probe picks the best backend the filesystem under dir supports: btrfs
// snapshots on btrfs, else overlay, else reflink clones, else copies. Each is
// tried for real in a scratch dir under dir.
func Probe(dir string, m Mounter) (Kind, error) {
	for _, k := range probeOrder {
		if err := Supports(k, dir, m); err == nil {
			return k, nil
		}
	}
	return "", fmt.Errorf("no COW backend works under %s", dir)
}

func probeOverlay(scratch string, m Mounter) error {
	var dirs []string
	for _, d := range []string{"lower", "upper", "work", "mnt"} {
		p := filepath.Join(scratch, d)
		if err := os.Mkdir(p, 0o700); err != nil {
			return err
		}
		dirs = append(dirs, p)
	}
	if err := m.Overlay(dirs[3], dirs[:1], dirs[1], dirs[2], Attrs{}); err != nil {
		return err
	}
	return m.Unmount(dirs[3])
}

func probeReflink(scratch string) error {
	src, err := os.Create(filepath.Join(scratch, "src"))
	if err != nil {
		return err
	}
	defer src.Close()
	if _, err := src.Write([]byte("cowvol")); err != nil {
		return err
	}
	dst, err := os.Create(filepath.Join(scratch, "dst"))
	if err != nil {
		return err
	}
	defer dst.Close()
	return unix.IoctlFileClone(int(dst.Fd()), int(src.Fd()))
}

// Supports says whether kind works under dir, by trying it.
func Supports(kind Kind, dir string, m Mounter) error {
	scratch, err := os.MkdirTemp(dir, ".probe-")
	if err != nil {
		return err
	}
	defer RemoveTree(scratch)
	switch kind {
	case KindBtrfs:
		if !isBtrfs(scratch) {
			return fmt.Errorf("%s is not on btrfs", dir)
		}
		return createSubvolume(filepath.Join(scratch, "subvol"))
	case KindOverlay:
		return probeOverlay(scratch, m)
	case KindReflink:
		return probeReflink(scratch)
	case KindCopy:
		return nil
	}
	return fmt.Errorf("unknown COW backend %q", kind)
}

// NewLayerDir makes an empty dir to fill with a layer from elsewhere (a
// pull): a subvolume for the btrfs backend, whose step volumes snapshot
// it, a plain dir otherwise.
func NewLayerDir(kind Kind, path string) error {
	if kind == KindBtrfs {
		return createSubvolume(path)
	}
	return os.Mkdir(path, 0o700)
}
