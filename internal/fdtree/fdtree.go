// Package fdtree walks and opens trees by directory file descriptor, so that
// no path handed to the kernel is longer than one name: a tree of any depth
// is walked, however far past PATH_MAX (4096 bytes) its paths run, and no
// symlink is followed. A step can make such a tree (a recursive copy of a
// dir into itself), and the copies, archives and descriptions of volumes
// must not fail on it.
//
// It owns only the walking and the calls made on descriptors it hands out
// (opening beneath a dir, reading, writing, setting times); what is done
// with each entry is its callers'. Beside them, the two file calls every
// tree writer needs: a scratch file no name reaches, and a range copy made
// in the kernel where it can be.
package fdtree

import (
	"errors"
	"fmt"
	"io"
	"path"
	"slices"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Entry is one entry below a walked root.
type Entry struct {
	// Parent is the directory holding it, open for the call.
	Parent int
	Name   string
	// Path is relative to the root, slash-separated; it may be longer
	// than PATH_MAX. Depth counts its names (1 for the root's children).
	Path  string
	Depth int
	Stat  unix.Stat_t
}

// IsDir says whether the entry is a directory.
func (e *Entry) IsDir() bool { return e.Stat.Mode&unix.S_IFMT == unix.S_IFDIR }

// Visitor is called with each entry, parents before children and each
// directory's entries in name order. For a directory, descend says whether
// to walk it; leave, if not nil, is then called with it open, once its
// entries are done. Omit, if not nil, is asked of each entry's path before
// the entry is looked at: true leaves it out, not stat'ed and not visited
// (for a caller that has it already). Visit and Leave must not keep e past
// their return: a directory's entries are each made in one Entry, not one
// each (250 bytes allocated an entry walked became 60: a walk of a million
// files, as a pull's end makes to keep the table of sums of what it
// pulled, made 190 MB less garbage beside the fill's heap).
type Visitor struct {
	Visit func(e *Entry) (descend bool, err error)
	Leave func(e *Entry, dir int) error
	Omit  func(path string) bool
}

// Walk walks the tree below the directory open as root. It holds one
// descriptor per level of the directory it is in, and no more.
func Walk(root int, v Visitor) error {
	return walk(root, "", 0, v)
}

func walk(dir int, prefix string, depth int, v Visitor) error {
	names, err := Names(dir)
	if err != nil {
		return fmt.Errorf("reading %s: %w", orRoot(prefix), err)
	}
	e := new(Entry)
	for _, name := range names {
		*e = Entry{Parent: dir, Name: name, Path: prefix + name, Depth: depth + 1}
		if v.Omit != nil && v.Omit(e.Path) {
			continue
		}
		if err := unix.Fstatat(dir, name, &e.Stat, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("%s: %w", e.Path, err)
		}
		descend, err := v.Visit(e)
		if err != nil {
			return err
		}
		if !descend || !e.IsDir() {
			continue
		}
		child, err := OpenDir(dir, name)
		if err != nil {
			return fmt.Errorf("%s: %w", e.Path, err)
		}
		err = walk(child, e.Path+"/", e.Depth, v)
		if err == nil && v.Leave != nil {
			err = v.Leave(e, child)
		}
		unix.Close(child)
		if err != nil {
			return err
		}
	}
	return nil
}

func orRoot(prefix string) string {
	if prefix == "" {
		return "the root"
	}
	return strings.TrimSuffix(prefix, "/")
}

// OpenDir opens the directory name in dir, following no symlink.
func OpenDir(dir int, name string) (int, error) {
	return unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
}

// Names lists the entries of the directory open as fd, sorted ("." and
// ".." left out), from its start.
func Names(fd int) ([]string, error) {
	if _, err := unix.Seek(fd, 0, 0); err != nil {
		return nil, err
	}
	var names []string
	buf := make([]byte, 64<<10)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			slices.Sort(names)
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
}

// OpenBeneath opens the directory at rel (slash-separated, no "..") below
// the directory open as root, following no symlink on the way, however
// long rel is: a long one is opened a stretch of names at a time.
func OpenBeneath(root int, rel string) (int, error) {
	if rel != "" && len(rel) < maxStretch {
		return openat2Beneath(root, rel, unix.O_DIRECTORY|unix.O_RDONLY) // one call: most paths
	}
	fd, err := unix.Dup(root)
	if err != nil {
		return -1, err
	}
	for rel != "" {
		stretch := rel
		if len(stretch) >= maxStretch {
			cut := strings.LastIndexByte(rel[:maxStretch], '/')
			if cut <= 0 {
				unix.Close(fd)
				return -1, unix.ENAMETOOLONG
			}
			stretch = rel[:cut]
		}
		rel = strings.TrimPrefix(rel[len(stretch):], "/")
		next, err := openat2Beneath(fd, stretch, unix.O_DIRECTORY|unix.O_RDONLY)
		unix.Close(fd)
		if err != nil {
			return -1, err
		}
		fd = next
	}
	return fd, nil
}

// OpenFileBeneath opens the file at rel below the directory open as root
// with flags, following no symlink on the way nor at its end: in one call
// unless rel is longer than a path may be.
func OpenFileBeneath(root int, rel string, flags int) (int, error) {
	if len(rel) < maxStretch {
		return openat2Beneath(root, rel, flags)
	}
	dir, err := OpenBeneath(root, path.Dir(rel))
	if err != nil {
		return -1, err
	}
	defer unix.Close(dir)
	return openat2Beneath(dir, path.Base(rel), flags)
}

func openat2Beneath(dir int, rel string, flags int) (int, error) {
	return unix.Openat2(dir, rel, &unix.OpenHow{
		Flags:   uint64(flags) | unix.O_CLOEXEC | unix.O_NOFOLLOW,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	})
}

// File reads and writes a file through its descriptor: an os.File
// would cost a system call to make (it asks whether the descriptor is
// non-blocking) and a finalizer, per file of a tree.
type File int

// ReadAt reads len(p) bytes at off, or what there is up to the file's end
// (then io.EOF).
func (f File) ReadAt(p []byte, off int64) (int, error) { return f.whole(unix.Pread, p, off, io.EOF) }

// WriteAt writes p at off.
func (f File) WriteAt(p []byte, off int64) (int, error) {
	return f.whole(unix.Pwrite, p, off, io.ErrShortWrite)
}

// whole calls op (pread or pwrite) until all of p is done, from off; a
// call that does nothing ends it with none.
func (f File) whole(op func(int, []byte, int64) (int, error), p []byte, off int64, none error) (int, error) {
	n := 0
	for n < len(p) {
		m, err := op(int(f), p[n:], off+int64(n))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return n, err
		}
		if m == 0 {
			return n, none
		}
		n += m
	}
	return n, nil
}

// Futimens sets the times (atime, mtime) of what fd is open as: through
// the descriptor itself, with no path to look up.
func Futimens(fd int, ts []unix.Timespec) error {
	if len(ts) != 2 {
		return unix.EINVAL
	}
	_, _, errno := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

// maxStretch is the longest stretch of a path opened in one call: under
// PATH_MAX, with its terminating NUL.
const maxStretch = unix.PathMax - 1

// ProcPath names name in the directory open as dir through /proc, for the
// calls that take only a path (the l*xattr ones): short whatever the
// depth, and resolved from the descriptor, not from a path someone could
// swap. With name "", it names what dir is open as (any file), through a
// link only calls that follow links follow.
func ProcPath(dir int, name string) string {
	if name == "" {
		return fmt.Sprintf("/proc/self/fd/%d", dir)
	}
	return fmt.Sprintf("/proc/self/fd/%d/%s", dir, name)
}

// Readlink reads the target of the symlink name in the directory open as
// dir.
func Readlink(dir int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dir, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
}
