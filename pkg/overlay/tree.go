package overlay

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync/atomic"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
)

// CopyStats says how a tree copy went.
type CopyStats struct {
	Files, Cloned, Copied, Links int64
}

// copyWorkers clone or copy files in parallel: a FICLONE walk is bound by
// per-file syscalls, not bandwidth, and serial it was slower than cp -a.
const copyWorkers = 8

// treeCopier copies a tree faithfully: modes, owners, times, xattrs (the
// trusted.overlay.* ones too, so whiteouts and opaque dirs survive), symlinks,
// hardlinks, device nodes, fifos and sparse files. With reflink set it clones
// each regular file's extents (FICLONE) and falls back to copying the files
// the filesystem refuses to clone. It works from descriptors (fdtree), so a
// tree of any depth is copied, however long its paths.
//
// One walker makes the entries and hands regular files, open at both ends,
// to workers; a dir's attributes are set when the walker leaves it (filling
// a file does not touch its dir's times). Hardlinks come after the workers
// finish, since a link needs its first name in place; the dirs they land in
// get their times again.
type treeCopier struct {
	ctx     context.Context
	reflink bool
	workers *errgroup.Group

	files, cloned, copied atomic.Int64
	seen                  map[[2]uint64]string // walker only: first names of files with several links
	links                 []deferredLink
	// dst holds the destination dirs the walker is in, by depth: the
	// root's is dst[0].
	dst []int

	// realData lets a copy read each regular file's data from where it
	// really lies: a merged overlay's from the layer that provides it, an
	// index's from its blob. Extents can be cloned from an XFS or btrfs
	// file, never through an overlay or an EROFS one. nil: the file
	// itself.
	realData func(rel string) (fileData, error)
}

// fileData is where a regular file's data lies: in file, from at (a
// file closed once copied; none: the file itself). A range of a larger
// file (an index's blob) says that file's size and block size, stated
// once for all its ranges; blockSize 0: the data is all of file.
type fileData struct {
	file                *os.File
	at                  int64
	fileSize, blockSize int64
}

// deferredLink is a hardlink made after the walk: the first name's path
// and the new one's, and the times of the dir it lands in.
type deferredLink struct {
	first, name string
	dirTimes    [2]unix.Timespec
}

// CopyLayers copies the merged tree of lowers (top first) into dst. A chain
// is merged by a read-only overlay mounted at mnt for the duration.
func CopyLayers(ctx context.Context, m Mounter, lowers []string, mnt, dst string, reflink bool) (CopyStats, error) {
	if len(lowers) == 1 {
		return copyTree(ctx, lowers[0], dst, reflink, nil)
	}
	var roots []int
	defer func() {
		for _, fd := range roots {
			unix.Close(fd)
		}
	}()
	for _, l := range lowers {
		fd, err := unix.Open(l, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return CopyStats{}, err
		}
		roots = append(roots, fd)
	}
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return CopyStats{}, err
	}
	if err := m.Overlay(mnt, lowers, "", "", Attrs{ReadOnly: true}); err != nil {
		return CopyStats{}, err
	}
	stats, err := copyTree(ctx, mnt, dst, reflink, func(rel string) (fileData, error) {
		f, err := providingFile(roots, rel)
		return fileData{file: f}, err
	})
	if uerr := m.Unmount(mnt); uerr != nil {
		return stats, errors.Join(err, uerr)
	}
	return stats, errors.Join(err, os.Remove(mnt))
}

// providingFile opens the regular file at rel in the topmost of the layers
// open as roots that has an entry there: the one the merge shows (a
// whiteout or opaque dir above would have hidden it). nil: none has a
// regular file there.
func providingFile(roots []int, rel string) (*os.File, error) {
	dir, base := path.Split(rel)
	for _, root := range roots {
		parent, err := fdtree.OpenBeneath(root, strings.TrimSuffix(dir, "/"))
		if err != nil {
			continue // not in this layer (or not a plain dir in it)
		}
		var st unix.Stat_t
		if err := unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			unix.Close(parent)
			continue
		}
		if st.Mode&unix.S_IFMT != unix.S_IFREG {
			unix.Close(parent)
			return nil, nil
		}
		fd, err := unix.Openat(parent, base, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(parent)
		if err != nil {
			return nil, err
		}
		return os.NewFile(uintptr(fd), rel), nil
	}
	return nil, nil
}

// copyTree copies src into dst; dst may already exist as an empty dir (a
// fresh btrfs subvolume), in which case it takes src's root attributes.
func copyTree(ctx context.Context, src, dst string, reflink bool, realData func(string) (fileData, error)) (CopyStats, error) {
	srcRoot, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return CopyStats{}, fmt.Errorf("reading %s: %w", src, err)
	}
	defer unix.Close(srcRoot)
	if err := os.Mkdir(dst, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return CopyStats{}, err
	}
	dstRoot, err := fdtree.OpenDir(unix.AT_FDCWD, dst)
	if err != nil {
		return CopyStats{}, err
	}
	defer unix.Close(dstRoot)
	workers, wctx := errgroup.WithContext(ctx)
	workers.SetLimit(copyWorkers)
	c := &treeCopier{ctx: wctx, reflink: reflink, workers: workers, seen: map[[2]uint64]string{},
		dst: []int{dstRoot}, realData: realData}
	walkErr := fdtree.Walk(srcRoot, fdtree.Visitor{Visit: c.visit, Leave: c.leave})
	for _, fd := range c.dst[1:] { // left open by a walk that failed
		unix.Close(fd)
	}
	if err := errors.Join(workers.Wait(), walkErr); err != nil {
		return c.stats(), err
	}
	if err := c.link(dstRoot); err != nil {
		return c.stats(), err
	}
	var st unix.Stat_t
	if err := unix.Fstat(srcRoot, &st); err != nil {
		return c.stats(), err
	}
	return c.stats(), fdAttrs(srcRoot, dstRoot, &st)
}

func (c *treeCopier) stats() CopyStats {
	return CopyStats{Files: c.files.Load(), Cloned: c.cloned.Load(), Copied: c.copied.Load(), Links: int64(len(c.links))}
}

// visit makes the copy of one entry in the destination dir of its depth.
func (c *treeCopier) visit(e *fdtree.Entry) (bool, error) {
	if err := c.ctx.Err(); err != nil {
		return false, err
	}
	c.files.Add(1)
	parent := c.dst[e.Depth-1]
	st := &e.Stat
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		if err := unix.Mkdirat(parent, e.Name, 0o700); err != nil {
			return false, fmt.Errorf("%s: %w", e.Path, err)
		}
		fd, err := fdtree.OpenDir(parent, e.Name)
		if err != nil {
			return false, fmt.Errorf("%s: %w", e.Path, err)
		}
		c.dst = append(c.dst, fd)
		return true, nil
	case unix.S_IFREG:
		if st.Nlink > 1 {
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := c.seen[key]; ok {
				var dirSt unix.Stat_t
				if err := unix.Fstat(e.Parent, &dirSt); err != nil {
					return false, err
				}
				c.links = append(c.links, deferredLink{first: first, name: e.Path, dirTimes: [2]unix.Timespec{dirSt.Atim, dirSt.Mtim}})
				return false, nil
			}
			c.seen[key] = e.Path
		}
		return false, c.file(e, parent)
	case unix.S_IFLNK:
		target, err := fdtree.Readlink(e.Parent, e.Name)
		if err != nil {
			return false, fmt.Errorf("%s: %w", e.Path, err)
		}
		if err := unix.Symlinkat(target, parent, e.Name); err != nil {
			return false, fmt.Errorf("%s: %w", e.Path, err)
		}
	default: // devices (whiteouts are 0/0 char devices), fifos, sockets
		if err := unix.Mknodat(parent, e.Name, st.Mode, int(st.Rdev)); err != nil {
			return false, fmt.Errorf("making node %s: %w", e.Path, err)
		}
	}
	return false, entryAttrs(e, parent)
}

// leave gives a copied dir its attributes, its entries made.
func (c *treeCopier) leave(e *fdtree.Entry, dir int) error {
	fd := c.dst[len(c.dst)-1]
	c.dst = c.dst[:len(c.dst)-1]
	defer unix.Close(fd)
	if err := fdAttrs(dir, fd, &e.Stat); err != nil {
		return fmt.Errorf("%s: %w", e.Path, err)
	}
	return nil
}

// file opens a regular file at both ends and hands it to a worker, which
// fills the copy and gives it its attributes.
func (c *treeCopier) file(e *fdtree.Entry, parent int) error {
	inFd, err := unix.Openat(e.Parent, e.Name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("%s: %w", e.Path, err)
	}
	in := os.NewFile(uintptr(inFd), e.Path)
	outFd, err := unix.Openat(parent, e.Name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		in.Close()
		return fmt.Errorf("%s: %w", e.Path, err)
	}
	out := os.NewFile(uintptr(outFd), e.Path)
	data := fileData{file: in}
	if c.realData != nil {
		real, err := c.realData(e.Path)
		if err != nil {
			in.Close()
			out.Close()
			return fmt.Errorf("%s: %w", e.Path, err)
		}
		if real.file != nil {
			data = real
		}
	}
	st := e.Stat
	c.workers.Go(func() error {
		defer in.Close()
		defer out.Close()
		if data.file != in {
			defer data.file.Close()
		}
		if err := c.fill(data, out, st.Size); err != nil {
			return fmt.Errorf("copying %s: %w", e.Path, err)
		}
		if err := fdAttrs(int(in.Fd()), int(out.Fd()), &st); err != nil {
			return fmt.Errorf("%s: %w", e.Path, err)
		}
		return nil
	})
	return nil
}

// fill gives out the size bytes of data: their extents cloned where it
// can, else copied with their holes kept.
func (c *treeCopier) fill(data fileData, out *os.File, size int64) error {
	if c.reflink && size > 0 && cloneData(data, out, size) == nil {
		c.cloned.Add(1)
		return nil
	}
	c.copied.Add(1)
	return copySparse(data, out, size)
}

// cloneData clones size bytes of data into out. Of a range within a file
// (an index's blob), the whole blocks are cloned and the last block's part
// is copied: a clone to the block's end then cut would unshare that block,
// read back cold, once a file.
func cloneData(data fileData, out *os.File, size int64) error {
	if data.blockSize == 0 {
		return unix.IoctlFileClone(int(out.Fd()), int(data.file.Fd()))
	}
	if data.at < 0 || size > data.fileSize-data.at {
		return fmt.Errorf("%d bytes at %d of a file of %d: %w", size, data.at, data.fileSize, unix.EINVAL)
	}
	whole := size / data.blockSize * data.blockSize
	if whole == 0 {
		return errNoWholeBlock
	}
	if err := unix.IoctlFileCloneRange(int(out.Fd()), &unix.FileCloneRange{Src_fd: int64(data.file.Fd()),
		Src_offset: uint64(data.at), Src_length: uint64(whole)}); err != nil {
		return err
	}
	return copyRange(data, out, whole, size-whole)
}

// errNoWholeBlock: a range shorter than a block has nothing to clone; it
// is copied.
var errNoWholeBlock = errors.New("less than a block")

// link makes the hardlinks found on the walk, and puts back the times of
// the dirs they landed in.
func (c *treeCopier) link(root int) error {
	for _, l := range c.links {
		if err := linkBeneath(root, l); err != nil {
			return fmt.Errorf("linking %s to %s: %w", l.name, l.first, err)
		}
	}
	return nil
}

func linkBeneath(root int, l deferredLink) error {
	firstDir, firstBase := path.Split(l.first)
	from, err := fdtree.OpenBeneath(root, strings.TrimSuffix(firstDir, "/"))
	if err != nil {
		return err
	}
	defer unix.Close(from)
	dir, base := path.Split(l.name)
	to, err := fdtree.OpenBeneath(root, strings.TrimSuffix(dir, "/"))
	if err != nil {
		return err
	}
	defer unix.Close(to)
	if err := unix.Linkat(from, firstBase, to, base, 0); err != nil {
		return err
	}
	return fdtree.Futimens(to, l.dirTimes[:])
}

// fdAttrs gives the file or dir open as dst the owner, mode, xattrs and
// times of the one open as src (whose stat is st).
func fdAttrs(src, dst int, st *unix.Stat_t) error {
	if err := unix.Fchown(dst, int(st.Uid), int(st.Gid)); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	// After chown, which clears set-id bits.
	if err := unix.Fchmod(dst, st.Mode&0o7777); err != nil {
		return fmt.Errorf("chmod: %w", err)
	}
	if err := copyXattrs(fdXattrs(src), fdXattrs(dst)); err != nil {
		return err
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := fdtree.Futimens(dst, ts); err != nil {
		return fmt.Errorf("setting times: %w", err)
	}
	return nil
}

// entryAttrs gives what was copied of e (a symlink, device node or fifo)
// in the dir open as parent e's owner, mode, xattrs and times, by name:
// none of them can be opened to be changed.
func entryAttrs(e *fdtree.Entry, parent int) error {
	st := &e.Stat
	if err := unix.Fchownat(parent, e.Name, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown %s: %w", e.Path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		if err := unix.Fchmodat(parent, e.Name, st.Mode&0o7777, 0); err != nil {
			return fmt.Errorf("chmod %s: %w", e.Path, err)
		}
	}
	if err := copyXattrs(nameXattrs(fdtree.ProcPath(e.Parent, e.Name)), nameXattrs(fdtree.ProcPath(parent, e.Name))); err != nil {
		return fmt.Errorf("%s: %w", e.Path, err)
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(parent, e.Name, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("setting times of %s: %w", e.Path, err)
	}
	return nil
}

// copySparse copies the data segments of size bytes of data and leaves
// its holes as holes. It uses no file offset (an index's blob is one
// file for many copies at once).
func copySparse(data fileData, out *os.File, size int64) error {
	ifd := int(data.file.Fd())
	var off int64
	for off < size {
		seg, err := unix.Seek(ifd, data.at+off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		}
		if err != nil {
			return copyRange(data, out, 0, size) // no SEEK_DATA: all of it
		}
		if seg -= data.at; seg >= size {
			break
		}
		hole, err := unix.Seek(ifd, data.at+seg, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		hole = min(hole-data.at, size)
		if err := copyRange(data, out, seg, hole-seg); err != nil {
			return err
		}
		off = hole
	}
	return out.Truncate(size)
}

// copyRange copies n bytes at off of the data to off in out.
func copyRange(data fileData, out *os.File, off, n int64) error {
	return fdtree.CopyRange(out, off, data.file, data.at+off, n)
}

// xattrs reads and writes one entry's extended attributes: through its
// descriptor (files, dirs), or by a name that is not followed (symlinks and
// device nodes, which cannot be opened to be changed).
type xattrs struct {
	list func(buf []byte) (int, error)
	get  func(name string, buf []byte) (int, error)
	set  func(name string, val []byte) error
}

func fdXattrs(fd int) xattrs {
	return xattrs{
		list: func(buf []byte) (int, error) { return unix.Flistxattr(fd, buf) },
		get:  func(name string, buf []byte) (int, error) { return unix.Fgetxattr(fd, name, buf) },
		set:  func(name string, val []byte) error { return unix.Fsetxattr(fd, name, val, 0) },
	}
}

func nameXattrs(path string) xattrs {
	return xattrs{
		list: func(buf []byte) (int, error) { return unix.Llistxattr(path, buf) },
		get:  func(name string, buf []byte) (int, error) { return unix.Lgetxattr(path, name, buf) },
		set:  func(name string, val []byte) error { return unix.Lsetxattr(path, name, val, 0) },
	}
}

func copyXattrs(src, dst xattrs) error {
	names, err := fdtree.XattrNames(src.list)
	if err != nil {
		return fmt.Errorf("listing xattrs: %w", err)
	}
	for _, name := range names {
		val, err := fdtree.XattrValue(func(buf []byte) (int, error) { return src.get(name, buf) })
		if err != nil {
			return fmt.Errorf("reading xattr %s: %w", name, err)
		}
		if err := dst.set(name, val); err != nil {
			return fmt.Errorf("setting xattr %s: %w", name, err)
		}
	}
	return nil
}

// Usage sums what a tree holds on disk: allocated bytes (hardlinks once) and
// inodes. It walks dir by dir from file descriptors, so a tree of any depth
// is measured, however long its paths.
func Usage(root string) (bytes, inodes int64, err error) {
	var st unix.Stat_t
	if err := unix.Lstat(root, &st); err != nil {
		return 0, 0, err
	}
	u := usage{seen: map[[2]uint64]bool{}}
	u.add(&st)
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		fd, err := fdtree.OpenDir(unix.AT_FDCWD, root)
		if err != nil {
			return 0, 0, err
		}
		err = u.dir(fd)
		unix.Close(fd)
		if err != nil {
			return 0, 0, fmt.Errorf("measuring %s: %w", root, err)
		}
	}
	return u.bytes, u.inodes, nil
}

type usage struct {
	bytes, inodes int64
	seen          map[[2]uint64]bool
}

func (u *usage) add(st *unix.Stat_t) {
	if st.Nlink > 1 && st.Mode&unix.S_IFMT != unix.S_IFDIR {
		key := [2]uint64{st.Dev, st.Ino}
		if u.seen[key] {
			return
		}
		u.seen[key] = true
	}
	u.inodes++
	u.bytes += st.Blocks * 512
}

func (u *usage) dir(fd int) error {
	names, err := fdtree.Names(fd)
	if err != nil {
		return err
	}
	for _, name := range names {
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue
			}
			return err
		}
		u.add(&st)
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			continue
		}
		child, err := fdtree.OpenDir(fd, name)
		if err != nil {
			return err
		}
		err = u.dir(child)
		unix.Close(child)
		if err != nil {
			return err
		}
	}
	return nil
}

// RemoveTree deletes a tree, destroying btrfs subvolumes with one ioctl
// instead of unlinking their files. It refuses to descend into a mount
// point: a mount found under a tree being deleted is a bug to report, not
// data to delete; but an index mounted in it (a layer pulled as an index:
// MountIndex) is the layer's own, and read-only, and is detached first. It walks from file descriptors, so a tree of any depth
// goes, however long its paths. A missing path is done.
func RemoveTree(path string) error {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return err
	}
	if err := detachIndexes(path); err != nil {
		return err
	}
	if mounts, err := MountsUnder(path); err != nil {
		return err
	} else if len(mounts) > 0 {
		return fmt.Errorf("refusing to delete %s: %s is mounted", path, mounts[0])
	}
	parent, err := unix.Open(filepath.Dir(path), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(parent)
	if err := removeAt(parent, filepath.Base(path), &st); err != nil {
		return fmt.Errorf("removing %s: %w", path, err)
	}
	return nil
}

// removeAt removes the entry name (whose stat is st) of the dir dirfd.
func removeAt(dirfd int, name string, st *unix.Stat_t) error {
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return ignoreMissing(unix.Unlinkat(dirfd, name, 0))
	}
	subvol := subvolumeAt(dirfd, st)
	if subvol {
		err := destroySubvolumeAt(dirfd, name)
		if err == nil || !errors.Is(err, unix.ENOTEMPTY) {
			return err
		}
		// It holds nested subvolumes: empty it, then destroy it.
	}
	fd, err := fdtree.OpenDir(dirfd, name)
	if err != nil {
		return ignoreMissing(err)
	}
	err = removeChildren(fd, st.Dev)
	unix.Close(fd)
	if err != nil {
		return err
	}
	if subvol {
		return destroySubvolumeAt(dirfd, name)
	}
	return ignoreMissing(unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR))
}

func removeChildren(fd int, dev uint64) error {
	names, err := fdtree.Names(fd)
	if err != nil {
		return err
	}
	for _, name := range names {
		var cst unix.Stat_t
		if err := unix.Fstatat(fd, name, &cst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue
			}
			return err
		}
		if cst.Dev != dev && cst.Mode&unix.S_IFMT == unix.S_IFDIR && !subvolumeAt(fd, &cst) {
			return fmt.Errorf("refusing to delete across a filesystem boundary at %s", name)
		}
		if err := removeAt(fd, name, &cst); err != nil {
			return err
		}
	}
	return nil
}

func ignoreMissing(err error) error {
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}
