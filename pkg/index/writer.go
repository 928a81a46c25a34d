package index

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/internal/walkorder"
	"github.com/concourse/cowvol/pkg/filesum"
)

// Writer writes a layer's index as a walk of the layer meets its entries
// (fdtree.Walk's order: a directory before what is in it, each
// directory's names in byte order), keeping nothing of a directory once
// the walk has left it: what a pull of a million files holds is the
// directories open on the way and the blob's layout, never the tree.
//
// The image is its first block (the superblock and the blob's device
// slot), then each directory's blocks of entries, written as the walk
// leaves the directory, then the inodes: each with its xattrs and a
// regular file's chunk indexes or a symlink's target, written as it comes
// into a file of their own, which Close appends to the image. EROFS
// numbers an inode by its offset from the superblock's meta_blkaddr, so
// an inode's number is known as it is written, before the image's size
// is, and a directory's blocks are where they land. A directory's inode
// is reserved as it comes (its children's ".." names it) and written as
// the walk leaves it; a regular file named again by a hard link has its
// link count set at the end.
//
// The blob is laid out as the entries come: each regular file's extent
// after the one before, at its first name. A puller that learns the tree
// from a holder's walk lays out the same blob as the holder.
type Writer struct {
	opt    Options
	image  *os.File
	dirs   *appender // the image past its first block: the directories' blocks
	inodes *appender // the inodes, appended to the image by Close
	open   []*openDir
	spare  []*openDir // left, their buffers kept for the next (enterDir)
	block  [blockSize]byte
	last   string // the name added last
	layout *Layout
	count  uint32            // inodes written: the next's ino is count+1
	named  map[uint32]uint32 // files named more than once (nid: names)
	err    error             // the first: nothing is added after it
	closed bool
}

// openDir is a directory the walk is in: its entries so far, in name
// order ("." and ".." apart), their names in one buffer.
type openDir struct {
	path    string
	nid     uint32
	ino     uint32
	parent  uint32 // the nid of its parent (the root's own)
	st      attrs
	xattrs  []byte // its inline xattrs' body
	names   []byte
	ents    []dirent
	subdirs uint32
}

// dirent is one entry of an open directory.
type dirent struct {
	nid     uint32
	nameEnd uint32 // in names; a name starts where the one before ends
	ftype   uint8
}

func (d *openDir) name(i int) []byte {
	start := uint32(0)
	if i > 0 {
		start = d.ents[i-1].nameEnd
	}
	return d.names[start:d.ents[i].nameEnd]
}

func (d *openDir) add(name string, nid uint32, ftype uint8) {
	d.names = append(d.names, name...)
	d.ents = append(d.ents, dirent{nid: nid, nameEnd: uint32(len(d.names)), ftype: ftype})
}

// find is the entry of the directory named name, if any.
func (d *openDir) find(name string) (dirent, bool) {
	i := sort.Search(len(d.ents), func(i int) bool { return string(d.name(i)) >= name })
	if i < len(d.ents) && string(d.name(i)) == name {
		return d.ents[i], true
	}
	return dirent{}, false
}

// NewWriter starts the index of a layer whose root is root (its Name
// unused) in image, an empty file; the inodes are kept in an unnamed file
// beside it until Close. Close it, whatever Add says.
func NewWriter(image *os.File, opt Options, root Entry) (*Writer, error) {
	if root.Stat.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, fmt.Errorf("a root of mode %o, not a directory", root.Stat.Mode)
	}
	inodes, err := fdtree.Unnamed(filepath.Dir(image.Name()), "an index's inodes")
	if err != nil {
		return nil, err
	}
	w := &Writer{opt: opt, image: image, layout: newLayout(filepath.Dir(image.Name())),
		dirs: newAppender(image, blockSize, appendBuffer), inodes: newAppender(inodes, 0, appendBuffer)}
	// The root's inode is not the first 32 bytes: a nid of 0 would be an
	// inode number of 0, which readers of a directory skip.
	w.inodes.pad(32)
	st, xattrs := w.attrs(root)
	body, err := xattrBody(xattrs)
	var nid uint32
	if err == nil {
		nid, err = w.reserve(inodeSize + len(body))
	}
	if err != nil {
		inodes.Close()
		return nil, fmt.Errorf("the root: %w", err)
	}
	w.enterDir("", nid, nid, st, body)
	return w, nil
}

// Add adds a directory, a regular file, a symlink, a fifo, a socket or a
// device (a whiteout is a character device 0:0) in a directory added
// before, after every entry before it in the walk's order.
func (w *Writer) Add(e Entry) error {
	if w.err == nil {
		w.err = w.add(e)
	}
	return w.err
}

// Link names the regular file added as target once more, as name.
func (w *Writer) Link(name, target string) error {
	if w.err == nil {
		w.err = w.link(name, target)
	}
	return w.err
}

func (w *Writer) add(e Entry) error {
	switch e.Stat.Mode & unix.S_IFMT {
	case unix.S_IFDIR, unix.S_IFLNK, unix.S_IFIFO, unix.S_IFCHR, unix.S_IFBLK, unix.S_IFSOCK:
		if e.Data != nil {
			return fmt.Errorf("%q: data in an entry that is not a regular file", e.Name)
		}
	case unix.S_IFREG:
		if e.Stat.Size < 0 || (e.Data != nil && int64(len(e.Data)) != e.Stat.Size) {
			return fmt.Errorf("%q: %d bytes of data for a size of %d", e.Name, len(e.Data), e.Stat.Size)
		}
	default:
		return fmt.Errorf("%q: an entry of mode %o", e.Name, e.Stat.Mode)
	}
	if e.Stat.Mode&unix.S_IFMT != unix.S_IFLNK && e.Target != "" {
		return fmt.Errorf("%q: a target for an entry that is not a symlink", e.Name)
	}
	parent, base, err := w.enter(e.Name)
	if err != nil {
		return err
	}
	st, xattrs := w.attrs(e)
	body, err := xattrBody(xattrs)
	if err != nil {
		return fmt.Errorf("%s: %w", e.Name, err)
	}
	var nid uint32
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		if nid, err = w.reserve(inodeSize + len(body)); err != nil {
			return err
		}
		w.enterDir(e.Name, nid, parent.nid, st, body)
		parent.subdirs++
	case unix.S_IFREG:
		if nid, err = w.file(e, st, body); err != nil {
			return err
		}
	case unix.S_IFLNK:
		if inodeSize+len(body)+len(e.Target) > blockSize {
			// Inline in the inode's block, or not at all (a data block
			// of its own for a target this long is not written yet).
			return fmt.Errorf("%s: a symlink's target of %d bytes: %w", e.Name, len(e.Target), ErrUnindexable)
		}
		in := inode{st: st, layout: layoutFlatInline, size: uint64(len(e.Target)), data: nullBlock, ino: w.nextIno(), nlink: 1}
		if nid, err = w.record(in, body, nil, []byte(e.Target)); err != nil {
			return err
		}
	default:
		in := inode{st: st, layout: layoutFlatPlain, ino: w.nextIno(), nlink: 1}
		if t := st.Mode & unix.S_IFMT; t == unix.S_IFCHR || t == unix.S_IFBLK {
			in.data = encodeDev(st.Rdev)
		}
		if nid, err = w.record(in, body, nil, nil); err != nil {
			return err
		}
	}
	parent.add(base, nid, fileType(st.Mode))
	w.last = e.Name
	return nil
}

// file writes a regular file's inode, its chunk indexes pointing at its
// extent, laid out after the one before.
func (w *Writer) file(e Entry, st attrs, body []byte) (uint32, error) {
	in := inode{st: st, layout: layoutChunkBased, size: uint64(st.Size), data: chunkIndexes, ino: w.nextIno(), nlink: 1}
	if st.Size == 0 {
		return w.record(in, body, nil, nil)
	}
	if st.Size > maxBlobBytes-w.layout.Size { // (a step may make a sparse file of exabytes)
		return 0, fmt.Errorf("%s: %d bytes past a blob of %d: %w", e.Name, st.Size, w.layout.Size, ErrUnindexable)
	}
	ext := Extent{Path: e.Name, Offset: w.layout.Size, Size: st.Size}
	w.layout.add(e.Name, st.Size, e.Data, e.Sum)
	in.data |= uint32(chunkBits(st.Size))
	return w.record(in, body, &ext, nil)
}

func (w *Writer) link(name, target string) error {
	nid, ftype, found, err := w.lookup(target)
	if err != nil {
		return err
	}
	if !found || ftype != fileType(unix.S_IFREG) {
		return fmt.Errorf("%q: a hard link to %q, which is not a regular file added before it", name, target)
	}
	parent, base, err := w.enter(name)
	if err != nil {
		return err
	}
	if w.named == nil {
		w.named = map[uint32]uint32{}
	}
	w.named[nid] = max(w.named[nid], 1) + 1
	parent.add(base, nid, ftype)
	w.last = name
	return nil
}

// enter checks that name comes after the entry before it in the walk's
// order, leaves the directories that are not its own, and says its
// directory (open) and its last component.
func (w *Writer) enter(name string) (*openDir, string, error) {
	dir, base, ok := splitName(name)
	if !ok {
		return nil, "", fmt.Errorf("entry name %q", name)
	}
	switch c := walkorder.Compare(w.last, name); {
	case c == 0:
		return nil, "", fmt.Errorf("%q: added twice", name)
	case c > 0:
		return nil, "", fmt.Errorf("%q after %q: not in a walk's order", name, w.last)
	}
	for len(w.open) > 1 && w.open[len(w.open)-1].path != dir {
		if err := w.leave(); err != nil {
			return nil, "", err
		}
	}
	if top := w.open[len(w.open)-1]; top.path != dir {
		return nil, "", fmt.Errorf("%q: its directory was not added before it", name)
	}
	return w.open[len(w.open)-1], base, nil
}

// splitName is a name's directory and last component, which must be a
// name a directory can hold.
func splitName(name string) (dir, base string, ok bool) {
	dir, base = "", name
	if i := strings.LastIndexByte(name, '/'); i >= 0 {
		dir, base = name[:i], name[i+1:]
	}
	ok = base != "" && base != "." && base != ".." && len(base) <= unix.NAME_MAX && strings.IndexByte(base, 0) < 0
	return dir, base, ok
}

// attrs are what the image keeps of e's stat and xattrs: a regular file's
// set-ID bits and capabilities only where opt keeps them (as a capture
// clears them).
func (w *Writer) attrs(e Entry) (attrs, map[string]string) {
	st := attrs{Mode: e.Stat.Mode, Uid: e.Stat.Uid, Gid: e.Stat.Gid, MtimSec: e.Stat.Mtim.Sec, MtimNsec: uint32(e.Stat.Mtim.Nsec),
		Size: e.Stat.Size, Rdev: e.Stat.Rdev}
	xattrs := e.Xattrs
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		st.Size = 0 // a directory's and a symlink's are the image's
	}
	if !w.opt.KeepSetuid {
		if st.Mode&unix.S_IFMT == unix.S_IFREG {
			st.Mode &^= unix.S_ISUID | unix.S_ISGID
		}
		if _, ok := xattrs[fdtree.CapsXattr]; ok {
			xattrs = cloneWithout(xattrs, fdtree.CapsXattr)
		}
	}
	return st, xattrs
}

func cloneWithout(m map[string]string, key string) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		if k != key {
			out[k] = v
		}
	}
	return out
}

func (w *Writer) nextIno() uint32 {
	w.count++
	return w.count
}

// place is where the next record of size bytes starts: in the block it
// fits in, 32-aligned (an inode's number is its offset / 32).
func (w *Writer) place(size int) (uint32, error) {
	pos := w.inodes.end()
	if pos/blockSize != (pos+min(int64(size), blockSize)-1)/blockSize {
		pos = roundUp(pos, blockSize)
	}
	if err := w.fits(pos + int64(size)); err != nil {
		return 0, err
	}
	w.inodes.pad(pos)
	return uint32(pos / 32), nil
}

// reserve makes room for a directory's inode and xattrs, written as the
// walk leaves it.
func (w *Writer) reserve(size int) (uint32, error) {
	nid, err := w.place(size)
	if err == nil {
		w.inodes.pad(roundUp(w.inodes.end()+int64(size), 32))
	}
	return nid, err
}

// record writes an inode, its xattrs' body and its tail: the chunk
// indexes of ext (a regular file's, 8-aligned), or tail's bytes.
func (w *Writer) record(in inode, body []byte, ext *Extent, tail []byte) (uint32, error) {
	size := inodeSize + len(body)
	if ext != nil {
		size = int(roundUp(int64(size), 8)) + 8*int(ext.chunks())
	}
	size += len(tail)
	nid, err := w.place(size)
	if err != nil {
		return 0, err
	}
	var head [inodeSize]byte
	in.put(head[:], len(body))
	w.inodes.write(head[:])
	w.inodes.write(body)
	if ext != nil {
		w.inodes.pad(roundUp(w.inodes.end(), 8))
		chunk := int64(blockSize) << chunkBits(ext.Size)
		var index [8]byte
		binary.LittleEndian.PutUint16(index[2:], blobDeviceID)
		for i := range ext.chunks() {
			binary.LittleEndian.PutUint32(index[4:], uint32((ext.Offset+i*chunk)/blockSize))
			w.inodes.write(index[:])
		}
	}
	w.inodes.write(tail)
	w.inodes.pad(roundUp(w.inodes.end(), 32))
	return nid, w.inodes.err
}

// enterDir opens a directory the walk enters, whose inode is reserved at
// nid, on the buffers of one it left where it kept one: a walk of a
// million files enters and leaves tens of thousands, and their entries
// grown anew each time (and a block made for each) were 40% of what a
// pull of a million files allocated.
func (w *Writer) enterDir(path string, nid, parent uint32, st attrs, xattrs []byte) {
	d := &openDir{}
	if n := len(w.spare); n > 0 {
		d, w.spare = w.spare[n-1], w.spare[:n-1]
	}
	*d = openDir{path: path, nid: nid, ino: w.nextIno(), parent: parent, st: st, xattrs: xattrs, names: d.names[:0], ents: d.ents[:0]}
	w.open = append(w.open, d)
}

// Bounds on the directories' buffers a Writer keeps for the next ones: a
// few, none of a directory of many thousands of names.
const (
	spareDirs      = 16
	spareDirsNames = 256 << 10
)

// leave writes the blocks of the innermost open directory, which the walk
// has left, and its inode.
func (w *Writer) leave() error {
	d := w.open[len(w.open)-1]
	w.open = w.open[:len(w.open)-1]
	block := uint32(1 + w.dirs.end()/blockSize)
	size, err := writeDir(d, w.block[:], w.dirs.write)
	if err != nil {
		return err
	}
	if len(w.spare) < spareDirs && cap(d.names) <= spareDirsNames {
		w.spare = append(w.spare, d)
	}
	w.dirs.pad(roundUp(w.dirs.end(), blockSize))
	if err := w.fits(w.inodes.end()); err != nil {
		return err
	}
	in := inode{st: d.st, layout: layoutFlatPlain, size: uint64(size), data: block, ino: d.ino, nlink: 2 + d.subdirs}
	rec := w.block[:inodeSize+len(d.xattrs)]
	clear(rec)
	in.put(rec, len(d.xattrs))
	copy(rec[inodeSize:], d.xattrs)
	w.inodes.patch(int64(d.nid)*32, rec)
	return cmp.Or(w.dirs.err, w.inodes.err)
}

// fits says whether an image whose inodes end at inodesEnd is one the
// kernel mounts (block addresses of 32 bits).
func (w *Writer) fits(inodesEnd int64) error {
	if end := blockSize + w.dirs.end() + inodesEnd; end > maxImageBytes {
		return fmt.Errorf("an index of more than %d bytes: %w", end, ErrUnindexable)
	}
	return nil
}

// lookup finds the entry named name, added before, and says its nid and
// file type: in an open directory's entries, or read back from the image
// where the walk has left its directory.
func (w *Writer) lookup(name string) (nid uint32, ftype uint8, found bool, err error) {
	d, rest := w.open[0], name
	for _, o := range w.open[1:] {
		if after, ok := strings.CutPrefix(name, o.path+"/"); ok {
			d, rest = o, after
		}
	}
	first, rest, deeper := strings.Cut(rest, "/")
	e, found := d.find(first)
	nid, ftype = e.nid, e.ftype
	for found && deeper {
		if ftype != fileType(unix.S_IFDIR) {
			return 0, 0, false, nil
		}
		var next string
		next, rest, deeper = strings.Cut(rest, "/")
		if nid, ftype, found, err = w.lookupLeft(nid, next); err != nil {
			return 0, 0, false, err
		}
	}
	return nid, ftype, found, nil
}

// lookupLeft looks name up in the directory the walk has left whose inode
// is nid, in its blocks in the image: a binary search of its blocks by
// their first names, then of the block's.
func (w *Writer) lookupLeft(nid uint32, name string) (uint32, uint8, bool, error) {
	if err := cmp.Or(w.dirs.flush(), w.inodes.flush()); err != nil {
		return 0, 0, false, err
	}
	var head [inodeSize]byte
	if _, err := w.inodes.f.ReadAt(head[:], int64(nid)*32); err != nil {
		return 0, 0, false, err
	}
	in := decodeInode(head[:])
	size, first := in.size, int64(in.data)
	blocks := int((size + blockSize - 1) / blockSize)
	buf := make([]byte, blockSize)
	read := func(b int) ([]byte, error) {
		p := buf[:min(blockSize, size-int64(b)*blockSize)]
		_, err := w.image.ReadAt(p, (first+int64(b))*blockSize)
		return p, err
	}
	// The last block whose first name is not past name.
	lo, hi := 0, blocks
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		p, err := read(mid)
		if err != nil {
			return 0, 0, false, err
		}
		if string(direntName(p, 0)) <= name {
			lo = mid
		} else {
			hi = mid
		}
	}
	p, err := read(lo)
	if err != nil {
		return 0, 0, false, err
	}
	n := direntCount(p)
	if i := sort.Search(n, func(i int) bool { return string(direntName(p, i)) >= name }); i < n && string(direntName(p, i)) == name {
		e := p[i*direntSize:]
		return uint32(binary.LittleEndian.Uint64(e)), e[10], true, nil
	}
	return 0, 0, false, nil
}

// direntCount is how many entries a directory's block p holds: the
// first one's name starts after them all.
func direntCount(p []byte) int { return int(binary.LittleEndian.Uint16(p[8:])) / direntSize }

// direntName is the name of entry i of a directory's block p, which
// holds n entries: up to the next one's, or to the block's end past its
// padding.
func direntName(p []byte, i int) []byte {
	n := direntCount(p)
	start := int(binary.LittleEndian.Uint16(p[i*direntSize+8:]))
	end := len(p)
	if i+1 < n {
		end = int(binary.LittleEndian.Uint16(p[(i+1)*direntSize+8:]))
	}
	if start > end || end > len(p) {
		return nil // (the writer's own blocks: never)
	}
	name := p[start:end]
	if i+1 == n {
		for len(name) > 0 && name[len(name)-1] == 0 {
			name = name[:len(name)-1]
		}
	}
	return name
}

// writeDir hands a directory's blocks of entries, each made in block (a
// scratch block), to emit and says their size. Each block holds the
// entries (nid, name offset, file type) of a run of names, then those
// names; the names are in byte order across the blocks, "." and ".."
// among them, as lookups' binary search needs. The last block is as long
// as it is used.
func writeDir(d *openDir, block []byte, emit func([]byte)) (int64, error) {
	// "." and ".." where they sort: a name may sort before either
	// (" a", "-") or between them (".-").
	dot := sort.Search(len(d.ents), func(i int) bool { return string(d.name(i)) > "." })
	dotdot := sort.Search(len(d.ents), func(i int) bool { return string(d.name(i)) > ".." })
	count := len(d.ents) + 2
	entry := func(k int) (name []byte, nid uint32, ftype uint8) {
		switch {
		case k < dot:
			e := d.ents[k]
			return d.name(k), e.nid, e.ftype
		case k == dot:
			return []byte("."), d.nid, fileType(unix.S_IFDIR)
		case k <= dotdot:
			e := d.ents[k-1]
			return d.name(k - 1), e.nid, e.ftype
		case k == dotdot+1:
			return []byte(".."), d.parent, fileType(unix.S_IFDIR)
		default:
			e := d.ents[k-2]
			return d.name(k - 2), e.nid, e.ftype
		}
	}
	var size int64
	for i := 0; i < count; {
		// As many entries as fit in a block.
		j, used := i, 0
		for j < count {
			name, _, _ := entry(j)
			if used+direntSize+len(name) > blockSize {
				break
			}
			used += direntSize + len(name)
			j++
		}
		if j == i {
			name, _, _ := entry(i)
			return 0, fmt.Errorf("a name of %d bytes: %w", len(name), ErrUnindexable)
		}
		clear(block)
		nameAt := direntSize * (j - i)
		for k := i; k < j; k++ {
			name, nid, ftype := entry(k)
			e := block[direntSize*(k-i):]
			binary.LittleEndian.PutUint64(e, uint64(nid))
			binary.LittleEndian.PutUint16(e[8:], uint16(nameAt))
			e[10] = ftype
			nameAt += copy(block[nameAt:], name)
		}
		if j == count {
			emit(block[:used])
			size += int64(used)
		} else {
			emit(block)
			size += blockSize
		}
		i = j
	}
	return size, nil
}

// Close leaves the directories still open, the root last, sets the link
// counts of the files named more than once, appends the inodes to the
// image and writes its first block. It says where each regular file's
// data lies in the blob. It lets go of the inodes' file whatever happens,
// and of the layout's sums and inline bytes where it fails; an image it
// fails is not whole.
func (w *Writer) Close() (*Layout, error) {
	if w.closed {
		return nil, errors.New("an index writer closed twice")
	}
	if err := w.close(); err != nil {
		w.Abandon()
		return nil, err
	}
	w.closed = true
	w.inodes.f.Close() // (read back and appended: nothing of it is kept)
	return w.layout, nil
}

// Abandon lets go of what a Writer holds (its inodes' file, its layout's
// sums and inline bytes) where its index will not be finished: a pull
// that failed. It does nothing to a Writer closed.
func (w *Writer) Abandon() {
	if w.closed {
		return
	}
	w.closed = true
	w.inodes.f.Close()
	w.layout.Close()
}

func (w *Writer) close() error {
	if w.err != nil {
		return w.err
	}
	w.err = errors.New("a closed index writer")
	root := w.open[0]
	for len(w.open) > 0 {
		if err := w.leave(); err != nil {
			return err
		}
	}
	if root.nid > 0xffff { // the superblock holds the root's nid in 16 bits
		return fmt.Errorf("a root inode at %d: %w", root.nid, ErrUnindexable)
	}
	return w.finish(root)
}

// finish sets the link counts, appends the inodes to the image and writes
// its first block.
func (w *Writer) finish(root *openDir) error {
	var nlink [4]byte
	for nid, names := range w.named {
		binary.LittleEndian.PutUint32(nlink[:], names)
		w.inodes.patch(int64(nid)*32+44, nlink[:])
	}
	if err := cmp.Or(w.dirs.flush(), w.inodes.flush(), w.layout.flush()); err != nil {
		return err
	}
	meta := 1 + w.dirs.end()/blockSize
	inodes := w.inodes.end()
	// Through user space, so that the image's pages are in the page cache
	// as a mount's first lookups want them: copy_file_range would make
	// them a reflink of the spill on a filesystem that shares extents
	// (XFS, btrfs), which writes the spill back first and leaves the
	// image's pages uncached, so that every block of inodes a step reached
	// first was read from disk, a page at a time (1.4 s of a 50,000-file
	// lazy read, bench/RESULTS.md, 12-02).
	if err := fdtree.CopyThrough(w.image, meta*blockSize, w.inodes.f, 0, inodes, w.inodes.buf[:cap(w.inodes.buf)]); err != nil {
		return fmt.Errorf("appending the inodes to the index: %w", err)
	}
	blocks := meta + roundUp(inodes, blockSize)/blockSize
	if err := w.image.Truncate(blocks * blockSize); err != nil {
		return err
	}
	head := make([]byte, blockSize)
	putSuperblock(head, superblock{root: root.nid, mtime: root.st, inodes: uint64(w.count), blocks: uint32(blocks), meta: uint32(meta),
		blobBlocks: uint32(w.layout.Size / blockSize)})
	_, err := w.image.WriteAt(head, 0)
	return err
}

// appender writes a file in order from base, through a buffer, and
// patches what it wrote before.
type appender struct {
	f     *os.File
	base  int64
	buf   []byte
	bufAt int64 // where buf starts, from base
	err   error
}

const appendBuffer = 1 << 20

func newAppender(f *os.File, base int64, buffer int) *appender {
	return &appender{f: f, base: base, buf: make([]byte, 0, buffer)}
}

// end is how much is written, from base.
func (a *appender) end() int64 { return a.bufAt + int64(len(a.buf)) }

func (a *appender) write(p []byte) {
	for len(p) > 0 && a.err == nil {
		if len(a.buf) == cap(a.buf) {
			a.err = a.flush()
		}
		n := copy(a.buf[len(a.buf):cap(a.buf)], p)
		a.buf = a.buf[:len(a.buf)+n]
		p = p[n:]
	}
}

// pad writes zeros up to to.
func (a *appender) pad(to int64) {
	for a.err == nil && a.end() < to {
		a.write(zeroBlock[:min(to-a.end(), blockSize)])
	}
}

var zeroBlock [blockSize]byte

// patch writes p at off, before end.
func (a *appender) patch(off int64, p []byte) {
	if a.err != nil {
		return
	}
	if off < a.bufAt {
		n := min(int64(len(p)), a.bufAt-off)
		if _, err := a.f.WriteAt(p[:n], a.base+off); err != nil {
			a.err = err
			return
		}
		p, off = p[n:], off+n
	}
	if len(p) > 0 {
		copy(a.buf[off-a.bufAt:], p)
	}
}

func (a *appender) flush() error {
	if a.err == nil && len(a.buf) > 0 {
		_, a.err = a.f.WriteAt(a.buf, a.base+a.bufAt)
		a.bufAt += int64(len(a.buf))
		a.buf = a.buf[:0]
	}
	return a.err
}

// Entry is one entry of a layer's tree, as a walk of it meets it.
type Entry struct {
	// Name is slash-separated, relative and clean.
	Name string
	// Stat holds the entry's type and permission bits (Mode), owner,
	// modification time, device and a regular file's size; its other
	// fields are unused.
	Stat   unix.Stat_t
	Xattrs map[string]string
	// Target is a symlink's.
	Target string
	// Data is a regular file's bytes, where the stream carried them
	// whole (a small file): its extent needs no fetch (Layout.TakeInline).
	Data []byte
	// Sum is what a regular file's bytes hash to, where known.
	Sum filesum.Sum
}
