// Package index makes the index of a volume's layer: an EROFS image of the
// layer's metadata (its tree, owners, modes, times, xattrs, hard links,
// symlinks and devices) whose regular files' data lies in a blob, each file
// at a block-aligned offset of its own. The blob is a layout, not a file:
// the holder serves any range of it from the layer's own files (Blob), so
// making an index reads no file data. A puller mounts the index with the
// blob as its extra device (a sparse file it fills as ranges arrive), and a
// step sees the whole tree at once, whatever its file count. The image is
// written as a walk of the layer meets its entries (Writer), by the holder
// from its disk or by a puller from the holder's stream alike: the tree is
// never whole in memory.
//
// It owns the image format and the layout. It never mounts (pkg/overlay
// does), never touches the network (pkg/streamer) and never writes to the
// layer it indexes.
package index

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
)

// Options say how a layer is indexed.
type Options struct {
	// KeepSetuid keeps regular files' setuid and setgid bits and file
	// capabilities, as a stream's extraction does with --allow-setuid;
	// otherwise they are cleared, as a capture clears them.
	KeepSetuid bool
	// Sums are the sums of the layer's files where Build's caller knows
	// them, by path: laid out with their extents, as a stream's entries
	// carry theirs (Entry.Sum).
	Sums *filesum.Table
}

// ErrUnindexable says a layer holds what an index cannot say (files past
// what a blob addresses, an image over 1 GiB, a symlink
// target too long to sit inline, an xattr EROFS has no prefix for): the
// caller falls back to another way.
var ErrUnindexable = errors.New("the layer cannot be indexed")

// attrs are what an image keeps of an entry's stat: 40 bytes of a
// 144-byte unix.Stat_t.
type attrs struct {
	Mode, Uid, Gid uint32
	MtimNsec       uint32
	MtimSec        int64
	Size           int64
	Rdev           uint64
}

// Build indexes the layer open as root: it writes the image to image, an
// empty file, and says where each regular file's data lies in the blob.
// It reads the layer's metadata, never its files' data.
func Build(root int, image *os.File, opt Options) (*Layout, error) {
	top := Entry{}
	if err := unix.Fstat(root, &top.Stat); err != nil {
		return nil, err
	}
	var err error
	if top.Xattrs, err = fdtree.Xattrs(root, "."); err != nil {
		return nil, fmt.Errorf("the root's xattrs: %w", err)
	}
	w, err := NewWriter(image, opt, top)
	if err != nil {
		return nil, err
	}
	firstNames := map[[2]uint64]string{} // of files with hard links
	sums := opt.Sums.Finder()            // (asked in the walk's order)
	err = fdtree.Walk(root, fdtree.Visitor{Visit: func(e *fdtree.Entry) (bool, error) {
		id := [2]uint64{e.Stat.Dev, e.Stat.Ino}
		if first, ok := firstNames[id]; ok && !e.IsDir() {
			return false, w.Link(e.Path, first)
		}
		sum, _ := sums.Sum(e.Path) // (a file not in it has no sum said)
		entry := Entry{Name: e.Path, Stat: e.Stat, Sum: sum}
		var err error
		if entry.Xattrs, err = fdtree.Xattrs(e.Parent, e.Name); err != nil {
			return false, fmt.Errorf("%s: xattrs: %w", e.Path, err)
		}
		if e.Stat.Mode&unix.S_IFMT == unix.S_IFLNK {
			if entry.Target, err = fdtree.Readlink(e.Parent, e.Name); err != nil {
				return false, fmt.Errorf("%s: %w", e.Path, err)
			}
		}
		if e.Stat.Nlink > 1 && !e.IsDir() {
			firstNames[id] = e.Path
		}
		return true, w.Add(entry)
	}})
	if err != nil {
		w.Abandon()
		return nil, err
	}
	return w.Close()
}

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }

// Blob reads the blob of Layout from the layer open as Root: each
// extent's bytes from its file, zeros between the extents and past a file
// that shrank (a layer is never written, but it is not trusted to be whole).
type Blob struct {
	Root   int
	Layout *Layout
}

// ReadAt implements io.ReaderAt.
func (b Blob) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("blob offset %d: %w", off, unix.EINVAL)
	}
	n := 0
	for n < len(p) {
		at := off + int64(n)
		if at >= b.Layout.Size {
			return n, io.EOF
		}
		want := min(int64(len(p)-n), b.Layout.Size-at)
		i := b.Layout.from(at)
		if i == b.Layout.Len() || b.Layout.span(i).offset() > at { // padding: zeros up to the next extent
			next := b.Layout.Size
			if i < b.Layout.Len() {
				next = b.Layout.span(i).offset()
			}
			clear(p[n : n+int(min(want, next-at))])
			n += int(min(want, next-at))
			continue
		}
		e := b.Layout.Extent(i)
		want = min(want, e.Offset+e.Size-at)
		got, err := b.readFile(e, p[n:n+int(want)], at-e.Offset)
		clear(p[n+got : n+int(want)]) // a file shorter than it was
		if err != nil {
			return n, err
		}
		n += int(want)
	}
	return n, nil
}

func (b Blob) readFile(e Extent, p []byte, off int64) (int, error) {
	fd, err := fdtree.OpenFileBeneath(b.Root, e.Path, unix.O_RDONLY)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", e.Path, err)
	}
	defer unix.Close(fd)
	got, err := fdtree.File(fd).ReadAt(p, off)
	if errors.Is(err, io.EOF) {
		err = nil
	}
	return got, err
}
