package overlay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync/atomic"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
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
// the filesystem refuses to clone.
//
// One walker makes the dirs and hands regular files to workers; hardlinks
// and dir attributes come after the workers finish, since a link needs its
// first name in place and filling a dir would bump the times set on it.
type treeCopier struct {
	ctx     context.Context
	reflink bool
	workers *errgroup.Group

	files, cloned, copied atomic.Int64
	seen                  map[[2]uint64]string // walker only
	links                 [][2]string          // first name, new name
	dirs                  []dirEntry           // in walk order

	// root and realFile let a copy of a merged overlay read each regular
	// file from the layer that provides it: extents can be cloned from
	// an XFS or btrfs file, never through an overlay one.
	root     string
	realFile func(rel string) string
}

type dirEntry struct {
	src, dst string
	st       unix.Stat_t
}

// CopyLayers copies the merged tree of lowers (top first) into dst. A chain
// is merged by a read-only overlay mounted at mnt for the duration.
func CopyLayers(ctx context.Context, m Mounter, lowers []string, mnt, dst string, reflink bool) (CopyStats, error) {
	if len(lowers) == 1 {
		return copyTree(ctx, lowers[0], dst, reflink, nil)
	}
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return CopyStats{}, err
	}
	if err := m.Overlay(mnt, lowers, "", "", Attrs{ReadOnly: true}); err != nil {
		return CopyStats{}, err
	}
	stats, err := copyTree(ctx, mnt, dst, reflink, func(rel string) string {
		// The topmost layer with an entry at rel provides it: a whiteout
		// or opaque dir above would have hidden it from the merge.
		for _, l := range lowers {
			p := filepath.Join(l, rel)
			var st unix.Stat_t
			if unix.Lstat(p, &st) == nil {
				if st.Mode&unix.S_IFMT == unix.S_IFREG {
					return p
				}
				break
			}
		}
		return filepath.Join(mnt, rel)
	})
	if uerr := m.Unmount(mnt); uerr != nil {
		return stats, errors.Join(err, uerr)
	}
	return stats, errors.Join(err, os.Remove(mnt))
}

// copyTree copies src into dst; dst may already exist as an empty dir (a
// fresh btrfs subvolume), in which case it takes src's root attributes.
func copyTree(ctx context.Context, src, dst string, reflink bool, realFile func(string) string) (CopyStats, error) {
	workers, wctx := errgroup.WithContext(ctx)
	workers.SetLimit(copyWorkers)
	c := &treeCopier{ctx: wctx, reflink: reflink, workers: workers, seen: map[[2]uint64]string{},
		root: src, realFile: realFile}
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return CopyStats{}, fmt.Errorf("reading %s: %w", src, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return CopyStats{}, fmt.Errorf("%s is not a directory", src)
	}
	if err := os.Mkdir(dst, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return CopyStats{}, err
	}
	c.dirs = append(c.dirs, dirEntry{src, dst, st})
	walkErr := c.dir(src, dst)
	if err := errors.Join(workers.Wait(), walkErr); err != nil {
		return c.stats(), err
	}
	for _, l := range c.links {
		if err := os.Link(l[0], l[1]); err != nil {
			return c.stats(), err
		}
	}
	for i := len(c.dirs) - 1; i >= 0; i-- { // children before parents
		d := c.dirs[i]
		if err := setAttrs(d.src, d.dst, &d.st); err != nil {
			return c.stats(), err
		}
	}
	return c.stats(), nil
}

func (c *treeCopier) stats() CopyStats {
	return CopyStats{Files: c.files.Load(), Cloned: c.cloned.Load(), Copied: c.copied.Load(), Links: int64(len(c.links))}
}

func (c *treeCopier) dir(src, dst string) error {
	entries, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := c.ctx.Err(); err != nil {
			return err
		}
		if err := c.entry(filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

func (c *treeCopier) entry(src, dst string) error {
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return err
	}
	c.files.Add(1)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		if err := os.Mkdir(dst, 0o700); err != nil {
			return err
		}
		c.dirs = append(c.dirs, dirEntry{src, dst, st})
		return c.dir(src, dst)
	case unix.S_IFREG:
		if st.Nlink > 1 {
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := c.seen[key]; ok {
				c.links = append(c.links, [2]string{first, dst})
				return nil
			}
			c.seen[key] = dst
		}
		c.workers.Go(func() error {
			if err := c.file(src, dst, &st); err != nil {
				return fmt.Errorf("copying %s: %w", src, err)
			}
			return setAttrs(src, dst, &st)
		})
		return nil
	case unix.S_IFLNK:
		target, err := os.Readlink(src)
		if err != nil {
			return err
		}
		if err := os.Symlink(target, dst); err != nil {
			return err
		}
	default: // devices (whiteouts are 0/0 char devices), fifos, sockets
		if err := unix.Mknod(dst, st.Mode, int(st.Rdev)); err != nil {
			return fmt.Errorf("making node %s: %w", dst, err)
		}
	}
	return setAttrs(src, dst, &st)
}

func (c *treeCopier) file(src, dst string, st *unix.Stat_t) error {
	if c.realFile != nil {
		rel, err := filepath.Rel(c.root, src)
		if err != nil {
			return err
		}
		src = c.realFile(rel)
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if c.reflink && st.Size > 0 {
		if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err == nil {
			c.cloned.Add(1)
			return out.Close()
		}
	}
	c.copied.Add(1)
	if err := copySparse(in, out, st.Size); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// copySparse copies the data segments of in and leaves its holes as holes.
func copySparse(in, out *os.File, size int64) error {
	ifd := int(in.Fd())
	var off int64
	for off < size {
		data, err := unix.Seek(ifd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		}
		if err != nil {
			return plainCopy(in, out)
		}
		hole, err := unix.Seek(ifd, data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		if err := copyRange(in, out, data, hole-data); err != nil {
			return err
		}
		off = hole
	}
	return out.Truncate(size)
}

// copyRange copies n bytes at off in the kernel where it can, and through
// user space where copy_file_range refuses (across filesystem types).
func copyRange(in, out *os.File, off, n int64) error {
	for n > 0 {
		src, dst := off, off
		w, err := unix.CopyFileRange(int(in.Fd()), &src, int(out.Fd()), &dst, int(n), 0)
		switch {
		case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EOPNOTSUPP):
			_, err = io.Copy(io.NewOffsetWriter(out, off), io.NewSectionReader(in, off, n))
			return err
		case err != nil:
			return err
		case w == 0:
			return io.ErrUnexpectedEOF
		}
		off += int64(w)
		n -= int64(w)
	}
	return nil
}

func plainCopy(in, out *os.File) error {
	if _, err := in.Seek(0, io.SeekStart); err != nil {
		return err
	}
	_, err := io.Copy(out, in)
	return err
}

// setAttrs gives dst the owner, mode, xattrs and times of src.
func setAttrs(src, dst string, st *unix.Stat_t) error {
	if err := unix.Lchown(dst, int(st.Uid), int(st.Gid)); err != nil {
		return fmt.Errorf("chown %s: %w", dst, err)
	}
	isLink := st.Mode&unix.S_IFMT == unix.S_IFLNK
	if !isLink {
		// After chown, which clears set-id bits.
		if err := unix.Fchmodat(unix.AT_FDCWD, dst, st.Mode&0o7777, 0); err != nil {
			return fmt.Errorf("chmod %s: %w", dst, err)
		}
	}
	if err := copyXattrs(src, dst); err != nil {
		return err
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, dst, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("setting times of %s: %w", dst, err)
	}
	return nil
}

func copyXattrs(src, dst string) error {
	names, err := listXattrs(src)
	if err != nil {
		return err
	}
	for _, name := range names {
		val, err := getXattr(src, name)
		if err != nil {
			return err
		}
		if err := unix.Lsetxattr(dst, name, val, 0); err != nil {
			return fmt.Errorf("setting xattr %s on %s: %w", name, dst, err)
		}
	}
	return nil
}

func listXattrs(path string) ([]string, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Llistxattr(path, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("listing xattrs of %s: %w", path, err)
		}
		var names []string
		start := 0
		for i := 0; i < n; i++ {
			if buf[i] == 0 {
				if i > start {
					names = append(names, string(buf[start:i]))
				}
				start = i + 1
			}
		}
		return names, nil
	}
}

func getXattr(path, name string) ([]byte, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Lgetxattr(path, name, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading xattr %s of %s: %w", name, path, err)
		}
		return buf[:n], nil
	}
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
		fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
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
	names, err := readDirNames(fd)
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
		child, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
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

// readDirNames lists the dir open at fd without closing it.
func readDirNames(fd int) ([]string, error) {
	dup, err := unix.Dup(fd)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(dup), "dir")
	defer f.Close()
	return f.Readdirnames(-1)
}

// RemoveTree deletes a tree, destroying btrfs subvolumes with one ioctl
// instead of unlinking their files. It refuses to descend into a mount
// point: a mount found under a tree being deleted is a bug to report, not
// data to delete. It walks from file descriptors, so a tree of any depth
// goes, however long its paths. A missing path is done.
func RemoveTree(path string) error {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
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
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
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
	names, err := readDirNames(fd)
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
