package index

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/pkg/filesum"
)

// read.go reads a Layout back from an image this package wrote, for a
// process that did not write it: a restarted plugin copies a whole index
// into a plain layer by cloning each file's data out of the blob at its
// extent, which only the layout says. The image is the node's own, on
// its disk, but a crash or the disk may have torn it: every offset is
// checked against the image's size, only what the Writer writes is
// taken, and anything else fails the read (ErrNotLaidOut), never the
// process.

// ErrNotLaidOut says an image is not one whose layout ReadLayout can
// read: torn, or not the Writer's.
var ErrNotLaidOut = errors.New("the image is not an index this package laid out")

// readWindow is how much of the image ReadLayout reads at once: inodes
// lie in the walk's order, so most reads fall in the window read before.
const readWindow = 256 << 10

// ReadLayout reads the layout of the blob of image, an index the Writer
// wrote: each regular file's extent, at its first name in the walk's
// order, as the Writer laid them out. It holds no sums (SumOf says
// none): those were the writer's, checked as the blob filled.
func ReadLayout(image *os.File) (*Layout, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(image.Fd()), &st); err != nil {
		return nil, err
	}
	r := &imageReader{f: image, size: st.Size}
	head, err := r.at(superblockOffset, 128)
	if err != nil {
		return nil, err
	}
	le := binary.LittleEndian
	if le.Uint32(head[0:]) != erofsMagic || head[12] != blockBits {
		return nil, fmt.Errorf("no EROFS superblock of %d-byte blocks: %w", blockSize, ErrNotLaidOut)
	}
	root := uint64(le.Uint16(head[14:]))
	r.meta = int64(le.Uint32(head[40:])) * blockSize
	slot, err := r.at(deviceSlotOffset, 128)
	if err != nil {
		return nil, err
	}
	blobSize := int64(le.Uint32(slot[64:])) * blockSize
	l := &Layout{}
	rd := layoutReader{r: r, layout: l, dirs: map[uint64]bool{}, linked: map[uint64]bool{}}
	if err := rd.dir(root, ""); err != nil {
		return nil, err
	}
	if l.Size != blobSize {
		return nil, fmt.Errorf("extents of %d bytes in a blob of %d: %w", l.Size, blobSize, ErrNotLaidOut)
	}
	return l, nil
}

// imageReader reads an image through a window.
type imageReader struct {
	f     *os.File
	size  int64
	meta  int64 // where the inodes start
	win   []byte
	winAt int64
}

// at is the n bytes of the image at off, valid until the next call.
func (r *imageReader) at(off int64, n int) ([]byte, error) {
	if off < 0 || n < 0 || off > r.size-int64(n) {
		return nil, fmt.Errorf("%d bytes at %d of an image of %d: %w", n, off, r.size, ErrNotLaidOut)
	}
	if off >= r.winAt && off+int64(n) <= r.winAt+int64(len(r.win)) {
		return r.win[off-r.winAt:][:n], nil
	}
	size := int(min(int64(max(n, readWindow)), r.size-off))
	if cap(r.win) < size {
		r.win = make([]byte, size)
	}
	r.win = r.win[:size]
	if _, err := r.f.ReadAt(r.win, off); err != nil {
		r.win = r.win[:0]
		return nil, err
	}
	r.winAt = off
	return r.win[:n], nil
}

func (r *imageReader) inode(nid uint64) (decodedInode, error) {
	if nid > uint64(r.size)/32 { // (and at, below, cannot overflow)
		return decodedInode{}, fmt.Errorf("inode %d: %w", nid, ErrNotLaidOut)
	}
	at := r.meta + int64(nid)*32
	b, err := r.at(at, inodeSize)
	if err != nil {
		return decodedInode{}, err
	}
	in := decodeInode(b)
	if !in.extended || in.size < 0 {
		return decodedInode{}, fmt.Errorf("inode %d: not an extended inode the writer wrote: %w", nid, ErrNotLaidOut)
	}
	in.at = at
	return in, nil
}

// layoutReader walks an image's tree in the Writer's order (a directory
// before what is in it, each directory's names in byte order), laying
// out each regular file at its first name.
type layoutReader struct {
	r      *imageReader
	layout *Layout
	dirs   map[uint64]bool // met: a directory met twice is a cycle
	linked map[uint64]bool // regular files of more than one name, met
}

// child is a directory's entry, as its block says.
type child struct {
	name  string
	nid   uint64
	ftype uint8
}

// dir lays out what is below the directory whose inode is nid, at path.
func (rd *layoutReader) dir(nid uint64, path string) error {
	if rd.dirs[nid] {
		return fmt.Errorf("%q: a directory met twice: %w", path, ErrNotLaidOut)
	}
	rd.dirs[nid] = true
	in, err := rd.r.inode(nid)
	if err != nil {
		return err
	}
	if in.mode&unix.S_IFMT != unix.S_IFDIR || in.layout != layoutFlatPlain {
		return fmt.Errorf("%q: inode %d is not a directory's: %w", path, nid, ErrNotLaidOut)
	}
	children, err := rd.children(in, path)
	if err != nil {
		return err
	}
	for _, c := range children {
		name := c.name
		if path != "" {
			name = path + "/" + c.name
		}
		switch c.ftype {
		case fileType(unix.S_IFDIR):
			err = rd.dir(c.nid, name)
		case fileType(unix.S_IFREG):
			err = rd.file(c.nid, name)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// children are a directory's entries but "." and "..", in its blocks'
// order: its names' (checked).
func (rd *layoutReader) children(in decodedInode, path string) ([]child, error) {
	var out []child
	last, named := "", false
	for off := int64(0); off < in.size; off += blockSize {
		p, err := rd.r.at((int64(in.data))*blockSize+off, int(min(blockSize, in.size-off)))
		if err != nil {
			return nil, err
		}
		if len(p) < direntSize {
			return nil, fmt.Errorf("%q: a directory block of %d bytes: %w", path, len(p), ErrNotLaidOut)
		}
		n := direntCount(p)
		if n == 0 || n*direntSize > len(p) {
			return nil, fmt.Errorf("%q: a directory block of %d entries: %w", path, n, ErrNotLaidOut)
		}
		for i := range n {
			name := direntName(p, i)
			if name == nil || named && string(name) <= last {
				return nil, fmt.Errorf("%q: names out of order or torn: %w", path, ErrNotLaidOut)
			}
			last, named = string(name), true
			if last == "." || last == ".." {
				continue
			}
			if strings.IndexByte(last, '/') >= 0 || last == "" {
				return nil, fmt.Errorf("%q: a name %q: %w", path, last, ErrNotLaidOut)
			}
			e := p[i*direntSize:]
			out = append(out, child{name: last, nid: binary.LittleEndian.Uint64(e), ftype: e[10]})
		}
	}
	return out, nil
}

// file lays out the regular file whose inode is nid, at path: its extent
// is the next one, where its name is its first.
func (rd *layoutReader) file(nid uint64, path string) error {
	in, err := rd.r.inode(nid)
	if err != nil {
		return err
	}
	if in.mode&unix.S_IFMT != unix.S_IFREG || in.layout != layoutChunkBased || in.data&chunkIndexes == 0 {
		return fmt.Errorf("%q: inode %d is not a regular file's the writer wrote: %w", path, nid, ErrNotLaidOut)
	}
	if in.nlink > 1 {
		if rd.linked[nid] {
			return nil // a second name: its extent is the first's
		}
		rd.linked[nid] = true
	}
	if in.size == 0 {
		return nil
	}
	index, err := rd.r.at(roundUp(in.at+inodeSize+int64(in.xattrBytes), 8), 8)
	if err != nil {
		return err
	}
	l := rd.layout
	block := int64(binary.LittleEndian.Uint32(index[4:]))
	if binary.LittleEndian.Uint16(index[2:]) != blobDeviceID || block*blockSize != l.Size || in.size > maxBlobBytes-l.Size {
		return fmt.Errorf("%q: data at block %d, where the writer's next extent is at %d: %w", path, block, l.Size/blockSize, ErrNotLaidOut)
	}
	l.add(path, in.size, nil, filesum.Sum{})
	return nil
}
