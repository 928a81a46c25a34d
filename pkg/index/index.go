// Package index makes the index of a volume's layer: an EROFS image of the
// layer's metadata (its tree, owners, modes, times, xattrs, hard links,
// symlinks and devices) whose regular files' data lies in a blob, each file
// at a block-aligned offset of its own. The blob is a layout, not a file:
// the holder serves any range of it from the layer's own files (Blob), so
// making an index reads no file data. A puller mounts the index with the
// blob as its extra device (a sparse file it fills as ranges arrive), and a
// step sees the whole tree at once, whatever its file count.
//
// It owns the image format and the layout. It never mounts (pkg/overlay
// does), never touches the network (pkg/streamer) and never writes to the
// layer it indexes.
package index

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"

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
}

// Extent is where one regular file's data lies in the blob. Hard links
// share one.
type Extent struct {
	// Path is the file's first name in the layer, slash-separated.
	Path         string
	Offset, Size int64
	// Sum is what the file's bytes hash to, where its Tree entry said (a
	// stream's files): what a range fetched into the blob is checked
	// against. Zero from Build.
	Sum filesum.Sum
}

// Layout is the blob of an index: each regular file's extent, in offset
// order, and the blob's size.
type Layout struct {
	Extents []Extent
	Size    int64
	// inline is the bytes of the extents whose Tree entries carried them
	// (a stream's small files), by extent: a few of a large tree's
	// files, which is why they are not a field of every Extent.
	inline map[int][]byte
}

// Inline is the bytes of extent i where its Tree entry carried them (a
// stream's small files), nil if it did not: its range needs no fetch.
func (l *Layout) Inline(i int) []byte { return l.inline[i] }

// TakeInline is every extent's bytes that Inline says, by extent, which
// the layout lets go of: they need not live as long as it does.
func (l *Layout) TakeInline() map[int][]byte {
	inline := l.inline
	l.inline = nil
	return inline
}

// ErrUnindexable says a layer holds what an index cannot say (files past
// what a blob addresses, an image over 1 GiB, a symlink
// target too long to sit inline, an xattr EROFS has no prefix for): the
// caller falls back to another way.
var ErrUnindexable = errors.New("the layer cannot be indexed")

// node is one inode of the tree being indexed: 104 bytes (112 with the
// allocator's rounding), as a tree of a million of them is what a pull
// of a million files holds until its image is written.
type node struct {
	st     attrs
	sum    filesum.Sum
	dir    *dir  // a directory's, made by its first entry or seal
	rare   *rare // what few nodes have
	extent int32 // a regular file's, in the layout (-1: none, empty)
	// Where the image keeps it (erofs.go).
	nid   uint32 // (an image is at most 1 GiB: 2^25 slots of 32 bytes)
	nlink uint32
	ino   uint32
}

// rare is what few of a tree's nodes have, kept apart so that the rest
// do not carry room for it.
type rare struct {
	xattrs map[string]string
	// data is a regular file's bytes, where its entry carried them, or a
	// symlink's target.
	data []byte
}

func (n *node) xattrs() map[string]string {
	if n.rare == nil {
		return nil
	}
	return n.rare.xattrs
}

func (n *node) data() []byte {
	if n.rare == nil {
		return nil
	}
	return n.rare.data
}

// dir is what a directory's node holds more.
type dir struct {
	entries []dent // sorted by name, "." and ".." included, once sealed
	// byName finds entries by name, made by the first lookup: a
	// directory a hard link names a file of.
	byName map[string]*node
	block  uint32 // its first data block
	size   int64  // its data's
}

// attrs are what an image keeps of an entry's stat: 40 bytes of a
// 144-byte unix.Stat_t.
type attrs struct {
	Mode, Uid, Gid uint32
	MtimNsec       uint32
	MtimSec        int64
	Size           int64
	Rdev           uint64
}

// entries are a directory's (none for any other node).
func (n *node) entries() []dent {
	if n.dir == nil {
		return nil
	}
	return n.dir.entries
}

type dent struct {
	name string
	n    *node
}

// walk reads the layer open as root into a tree, as a Tree learns one
// from a stream.
func walk(root int, opt Options) (*Tree, error) {
	top := Entry{}
	if err := unix.Fstat(root, &top.Stat); err != nil {
		return nil, err
	}
	var err error
	if top.Xattrs, err = fdtree.Xattrs(root, "."); err != nil {
		return nil, fmt.Errorf("the root's xattrs: %w", err)
	}
	t, err := NewTree(opt, top)
	if err != nil {
		return nil, err
	}
	firstNames := map[[2]uint64]string{} // of files with hard links
	err = fdtree.Walk(root, fdtree.Visitor{Visit: func(e *fdtree.Entry) (bool, error) {
		id := [2]uint64{e.Stat.Dev, e.Stat.Ino}
		if first, ok := firstNames[id]; ok && !e.IsDir() {
			return false, t.Link(e.Path, first)
		}
		entry := Entry{Name: e.Path, Stat: e.Stat}
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
		return true, t.Add(entry)
	}})
	return t, err
}

// add names child in directory d.
func (d *node) add(name string, child *node) {
	if d.dir == nil {
		d.dir = &dir{}
	}
	d.dir.entries = append(d.dir.entries, dent{name: name, n: child})
	if _, taken := d.dir.byName[name]; d.dir.byName != nil && !taken {
		d.dir.byName[name] = child
	}
}

// lookup is the node directory d names name (nil: none; the first, if
// added twice).
func (d *node) lookup(name string) *node {
	if d.dir == nil {
		return nil
	}
	if d.dir.byName == nil {
		d.dir.byName = make(map[string]*node, len(d.dir.entries))
		for _, e := range d.dir.entries {
			if _, taken := d.dir.byName[e.name]; !taken {
				d.dir.byName[e.name] = e.n
			}
		}
	}
	return d.dir.byName[name]
}

// seal finishes the tree below top: each directory's "." and "..", its
// entries in byte order, and the blob's layout, each regular file's extent
// in the order of a walk of the tree (depth first, names in byte order;
// a hard link's at its first name). A puller that knows the tree (from
// its metadata stream) lays out the same blob as the holder. files is how
// many regular files with data the tree holds: room made for their
// extents at once.
func seal(top *node, files int) (*Layout, error) {
	layout := &Layout{Extents: make([]Extent, 0, files)}
	var visit func(d *node, path string, parent *node) error
	visit = func(d *node, path string, parent *node) error {
		d.add(".", d)
		d.add("..", parent)
		d.dir.byName = nil
		slices.SortFunc(d.dir.entries, func(a, b dent) int { return strings.Compare(a.name, b.name) })
		for i, c := range d.dir.entries {
			if i > 0 && c.name == d.dir.entries[i-1].name {
				return fmt.Errorf("%q: added twice", path+c.name)
			}
			if c.name == "." || c.name == ".." {
				continue
			}
			switch n := c.n; n.st.Mode & unix.S_IFMT {
			case unix.S_IFDIR:
				if err := visit(n, path+c.name+"/", d); err != nil {
					return err
				}
			case unix.S_IFREG:
				if n.extent >= 0 || n.st.Size == 0 {
					continue
				}
				name := path + c.name
				if n.st.Size > maxBlobBytes-layout.Size { // (a step may make a sparse file of exabytes)
					return fmt.Errorf("%s: %d bytes past a blob of %d: %w", name, n.st.Size, layout.Size, ErrUnindexable)
				}
				n.extent = int32(len(layout.Extents))
				if data := n.data(); data != nil {
					if layout.inline == nil {
						layout.inline = map[int][]byte{}
					}
					layout.inline[int(n.extent)] = data
				}
				layout.Extents = append(layout.Extents, Extent{Path: name, Offset: layout.Size, Size: n.st.Size, Sum: n.sum})
				layout.Size += roundUp(n.st.Size, blockSize)
			}
		}
		return nil
	}
	return layout, visit(top, "", top)
}

// Data is how many bytes of data the files hold: the blob's size, less
// the padding to each extent's last block.
func (l *Layout) Data() int64 {
	var n int64
	for _, e := range l.Extents {
		n += e.Size
	}
	return n
}

// Lookup is the extent of the file whose first name (Extent.Path) is
// path, -1 if none: a search of the extents, which lie in path order
// (comparePaths), not a map, which a fill of a million files would hold
// as 50 MB more.
func (l *Layout) Lookup(path string) int {
	if i, found := slices.BinarySearchFunc(l.Extents, path, func(e Extent, path string) int { return comparePaths(e.Path, path) }); found {
		return i
	}
	return -1
}

// Sum says what the data of the file whose first name is path hashes to,
// if it has an extent whose Tree entry said (see Extent.Sum).
func (l *Layout) Sum(path string) (filesum.Sum, bool) {
	if i := l.Lookup(path); i >= 0 && l.Extents[i].Sum != (filesum.Sum{}) {
		return l.Extents[i].Sum, true
	}
	return filesum.Sum{}, false
}

// Offset says where the data of the file whose first name is path starts
// in the blob, if it has an extent.
func (l *Layout) Offset(path string) (int64, bool) {
	if i := l.Lookup(path); i >= 0 {
		return l.Extents[i].Offset, true
	}
	return 0, false
}

// comparePaths orders slash-separated paths as seal's walk meets them:
// depth first, each directory's names in byte order. That is byte order
// with "/" before every other byte: a name ends there, and a name sorts
// before the longer names it starts.
func comparePaths(a, b string) int {
	for i := range min(len(a), len(b)) {
		switch x, y := a[i], b[i]; {
		case x == y:
		case x == '/':
			return -1
		case y == '/':
			return 1
		default:
			return cmp.Compare(x, y)
		}
	}
	return cmp.Compare(len(a), len(b))
}

// Find is the extent holding the blob's byte off (-1: none, padding).
func (l *Layout) Find(off int64) int {
	if i := l.from(off); i < len(l.Extents) && l.Extents[i].Offset <= off {
		return i
	}
	return -1
}

// Touching are the extents [first, end) that hold a byte of the blob's
// range of n bytes at off.
func (l *Layout) Touching(off, n int64) (first, end int) {
	first = l.from(off)
	end = first
	for end < len(l.Extents) && l.Extents[end].Offset < off+n {
		end++
	}
	return first, end
}

// from is the first extent that ends past off: the one holding off if it
// starts at or before it, else the next.
func (l *Layout) from(off int64) int {
	return sort.Search(len(l.Extents), func(i int) bool { return l.Extents[i].Offset+l.Extents[i].Size > off })
}

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }

// Build indexes the layer open as root: it writes the image to w and says
// where each regular file's data lies in the blob. It reads the layer's
// metadata, never its files' data.
func Build(root int, w io.Writer, opt Options) (*Layout, error) {
	t, err := walk(root, opt)
	if err != nil {
		return nil, err
	}
	return t.Write(w)
}

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
		if i == len(b.Layout.Extents) || b.Layout.Extents[i].Offset > at { // padding: zeros up to the next extent
			next := b.Layout.Size
			if i < len(b.Layout.Extents) {
				next = b.Layout.Extents[i].Offset
			}
			clear(p[n : n+int(min(want, next-at))])
			n += int(min(want, next-at))
			continue
		}
		e := b.Layout.Extents[i]
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
