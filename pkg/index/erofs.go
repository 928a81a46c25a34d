package index

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"math/bits"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// erofs.go writes the image: the superblock and its one device slot (the
// blob), then every inode (64-byte extended ones, each with its inline
// xattrs, then a regular file's chunk indexes or a symlink's target), then
// the directories' blocks of entries. See the kernel's
// Documentation/filesystems/erofs.rst and fs/erofs/erofs_fs.h.

const (
	blockBits = 12
	blockSize = 1 << blockBits

	erofsMagic       = 0xe0f5e1e2
	superblockOffset = 1024
	deviceSlotOffset = superblockOffset + 128 // right after the superblock
	inodesOffset     = deviceSlotOffset + 128 // the root's inode first

	incompatChunkedFile = 0x4
	incompatDeviceTable = 0x8

	layoutFlatPlain  = 0
	layoutFlatInline = 2
	layoutChunkBased = 4

	chunkIndexes  = 0x20 // chunk format: 8-byte indexes with a device ID
	maxChunkBits  = 22   // 4 MiB chunks at most (and so per-chunk checks)
	nullBlock     = 0xffffffff
	inodeSize     = 64
	xattrHeader   = 12
	direntSize    = 12
	blobDeviceID  = 1
	maxBlobBlocks = 1<<32 - 2 // the last block address is nullBlock's
	maxBlobBytes  = maxBlobBlocks * blockSize
	// maxImageBytes bounds an index, which a step waits for whole before
	// its first read: a million files make about 110 MB, and a file's
	// chunk indexes 2 KiB a GiB.
	maxImageBytes  = 1 << 30
	maxInlineBytes = blockSize - inodeSize
)

// xattrIndexes are the name prefixes EROFS stores an xattr's name under
// (its short prefix table; longer ones are those the kernel adds).
var xattrIndexes = []struct {
	prefix string
	index  uint8
}{{"user.", 1}, {"trusted.", 4}, {"security.", 6}}

// write lays out the tree below top and writes the image to w, in one
// pass in offset order: the image is never whole in memory (a million
// files make about 110 MB of it), only the tree and each inode's xattrs.
func write(w io.Writer, top *node, layout *Layout) error {
	// Number the inodes, parents before children, and count links.
	order := []*node{top}
	top.ino = 1
	for i := 0; i < len(order); i++ {
		for _, d := range order[i].entries() {
			d.n.nlink++
			if d.n.ino == 0 {
				order = append(order, d.n)
				d.n.ino = uint32(len(order))
			}
		}
	}
	// Where each inode's record starts: its inode, xattrs and tail.
	xattrs := map[*node][]byte{}
	pos := int64(inodesOffset)
	for _, n := range order {
		body, err := xattrBody(n.xattrs())
		if err != nil {
			return err
		}
		if body != nil {
			xattrs[n] = body
		}
		tail := n.tailSize(layout)
		if n.st.Mode&unix.S_IFMT == unix.S_IFLNK && inodeSize+len(body)+int(tail) > blockSize {
			// Inline in the inode's block, or not at all (a data block
			// of its own for a target this long is not written yet).
			return fmt.Errorf("a symlink's target of %d bytes: %w", len(n.data()), ErrUnindexable)
		}
		size := n.tailAt(len(body)) + tail
		if pos/blockSize != (pos+min(size, blockSize)-1)/blockSize {
			pos = roundUp(pos, blockSize) // a record starts in the block it fits in
		}
		n.nid = uint32(pos / 32)
		if pos = roundUp(pos+size, 32); pos > maxImageBytes {
			return fmt.Errorf("an index of more than %d bytes: %w", pos, ErrUnindexable)
		}
	}
	// The directories' blocks follow the inodes.
	block := uint32(roundUp(pos, blockSize) / blockSize)
	for _, n := range order {
		if n.st.Mode&unix.S_IFMT != unix.S_IFDIR {
			continue
		}
		size, err := dirData(n, nil)
		if err != nil {
			return err
		}
		n.dir.block, n.dir.size = block, size
		block += uint32(roundUp(size, blockSize) / blockSize)
		if int64(block)*blockSize > maxImageBytes {
			return fmt.Errorf("an index of %d blocks: %w", block, ErrUnindexable)
		}
	}

	iw := &imageWriter{w: bufio.NewWriterSize(w, 1<<20)}
	head := make([]byte, inodesOffset)
	putSuperblock(head, top, uint64(len(order)), block, layout)
	iw.write(head)
	record := make([]byte, 0, blockSize)
	for _, n := range order {
		body := xattrs[n]
		record = record[:n.tailAt(len(body))]
		clear(record)
		n.putInode(record, len(body))
		copy(record[inodeSize:], body)
		record = n.appendTail(record, layout)
		iw.pad(int64(n.nid) * 32)
		iw.write(record)
	}
	for _, n := range order {
		if n.st.Mode&unix.S_IFMT == unix.S_IFDIR {
			iw.pad(int64(n.dir.block) * blockSize)
			if _, err := dirData(n, iw.write); err != nil {
				return err
			}
		}
	}
	iw.pad(int64(block) * blockSize)
	if iw.err != nil {
		return iw.err
	}
	return iw.w.Flush()
}

// imageWriter writes an image in offset order, zeros between what it is
// given, and keeps the first error.
type imageWriter struct {
	w   *bufio.Writer
	at  int64
	err error
}

var zeroBlock [blockSize]byte

func (iw *imageWriter) write(p []byte) {
	if iw.err == nil {
		_, iw.err = iw.w.Write(p)
		iw.at += int64(len(p))
	}
}

// pad writes zeros up to the image's offset to.
func (iw *imageWriter) pad(to int64) {
	for iw.err == nil && iw.at < to {
		iw.write(zeroBlock[:min(to-iw.at, blockSize)])
	}
}

// tailAt is where n's tail starts in its record, past its inode and
// xattrBytes of xattrs: a regular file's chunk indexes are 8-aligned.
func (n *node) tailAt(xattrBytes int) int64 {
	at := int64(inodeSize + xattrBytes)
	if n.st.Mode&unix.S_IFMT == unix.S_IFREG && n.extent >= 0 {
		at = roundUp(at, 8)
	}
	return at
}

// chunkBits is the chunk size of a regular file's data, as a shift past
// the block size: the smallest power of two that holds it, at most
// maxChunkBits. The file lies contiguous in the blob, so its chunks do.
func chunkBits(size int64) uint16 {
	b := bits.Len64(uint64(size - 1))
	return uint16(min(max(b, blockBits), maxChunkBits) - blockBits)
}

// chunks is the count of a regular file's chunk indexes: one per chunk
// of its extent.
func (e Extent) chunks() int64 {
	chunk := int64(blockSize) << chunkBits(e.Size)
	return (e.Size + chunk - 1) / chunk
}

// tailSize is the size of what follows n's inode and xattrs: a regular
// file's chunk indexes, or a symlink's target.
func (n *node) tailSize(layout *Layout) int64 {
	switch n.st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		if n.extent >= 0 {
			return 8 * layout.Extents[n.extent].chunks()
		}
	case unix.S_IFLNK:
		return int64(len(n.data()))
	}
	return 0
}

// appendTail appends n's tail to its record.
func (n *node) appendTail(record []byte, layout *Layout) []byte {
	switch n.st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		if n.extent < 0 {
			return record
		}
		e := layout.Extents[n.extent]
		chunk := int64(blockSize) << chunkBits(e.Size)
		var index [8]byte
		binary.LittleEndian.PutUint16(index[2:], blobDeviceID)
		for i := range e.chunks() {
			binary.LittleEndian.PutUint32(index[4:], uint32((e.Offset+i*chunk)/blockSize))
			record = append(record, index[:]...)
		}
		return record
	case unix.S_IFLNK:
		return append(record, n.data()...)
	}
	return record
}

// putInode writes n's extended inode at b.
func (n *node) putInode(b []byte, xattrBytes int) {
	le := binary.LittleEndian
	format, size, data := uint16(1), uint64(0), uint32(0) // 1: extended
	switch n.st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		format |= layoutChunkBased << 1
		size = uint64(n.st.Size)
		if n.st.Size > 0 {
			data = uint32(chunkIndexes | chunkBits(n.st.Size))
		} else {
			data = uint32(chunkIndexes)
		}
	case unix.S_IFDIR:
		format |= layoutFlatPlain << 1
		size, data = uint64(n.dir.size), n.dir.block
	case unix.S_IFLNK:
		format |= layoutFlatInline << 1
		size, data = uint64(len(n.data())), nullBlock
	case unix.S_IFCHR, unix.S_IFBLK:
		data = encodeDev(n.st.Rdev)
	}
	le.PutUint16(b[0:], format)
	if xattrBytes > 0 {
		le.PutUint16(b[2:], uint16((xattrBytes-xattrHeader)/4+1))
	}
	le.PutUint16(b[4:], uint16(n.st.Mode))
	le.PutUint64(b[8:], size)
	le.PutUint32(b[16:], data)
	le.PutUint32(b[20:], n.ino)
	le.PutUint32(b[24:], n.st.Uid)
	le.PutUint32(b[28:], n.st.Gid)
	le.PutUint64(b[32:], uint64(n.st.MtimSec))
	le.PutUint32(b[40:], n.st.MtimNsec)
	le.PutUint32(b[44:], n.nlink)
}

// encodeDev is the kernel's new_encode_dev.
func encodeDev(rdev uint64) uint32 {
	major, minor := unix.Major(rdev), unix.Minor(rdev)
	return minor&0xff | major<<8 | (minor&^0xff)<<12
}

// xattrBody is an inode's inline xattrs: a header, then each entry
// (name's length, prefix index, value's length, name, value), 4-aligned.
func xattrBody(xattrs map[string]string) ([]byte, error) {
	if len(xattrs) == 0 {
		return nil, nil
	}
	names := make([]string, 0, len(xattrs))
	for k := range xattrs {
		names = append(names, k)
	}
	sort.Strings(names)
	out := make([]byte, xattrHeader)
	for _, name := range names {
		var index uint8
		var suffix string
		for _, p := range xattrIndexes {
			if s, ok := strings.CutPrefix(name, p.prefix); ok {
				index, suffix = p.index, s
				break
			}
		}
		value := xattrs[name]
		if index == 0 || len(suffix) > 255 || len(value) > 0xffff {
			return nil, fmt.Errorf("xattr %q: %w", name, ErrUnindexable)
		}
		entry := []byte{uint8(len(suffix)), index, 0, 0}
		binary.LittleEndian.PutUint16(entry[2:], uint16(len(value)))
		entry = append(append(entry, suffix...), value...)
		out = append(out, entry...)
		out = append(out, make([]byte, roundUp(int64(len(entry)), 4)-int64(len(entry)))...)
	}
	if len(out) > maxInlineBytes {
		return nil, fmt.Errorf("%d bytes of xattrs on one inode: %w", len(out), ErrUnindexable)
	}
	return out, nil
}

// dirData is the size of a directory's blocks of entries, each handed to
// emit if it is not nil. Each block holds the entries (nid, name offset,
// file type) of a run of names, then those names; the names are in byte
// order across the blocks, as lookups' binary search needs. The last
// block is as long as it is used.
func dirData(n *node, emit func([]byte)) (int64, error) {
	entries := n.entries()
	var size int64
	var block []byte
	if emit != nil {
		block = make([]byte, blockSize)
	}
	for i := 0; i < len(entries); {
		// As many entries as fit in a block.
		j, used := i, 0
		for j < len(entries) && used+direntSize+len(entries[j].name) <= blockSize {
			used += direntSize + len(entries[j].name)
			j++
		}
		if j == i {
			return 0, fmt.Errorf("a name of %d bytes: %w", len(entries[i].name), ErrUnindexable)
		}
		last := j == len(entries)
		if last {
			size += int64(used)
		} else {
			size += blockSize
		}
		if emit != nil {
			clear(block)
			nameAt := direntSize * (j - i)
			for k, d := range entries[i:j] {
				e := block[direntSize*k:]
				binary.LittleEndian.PutUint64(e, uint64(d.n.nid))
				binary.LittleEndian.PutUint16(e[8:], uint16(nameAt))
				e[10] = fileType(d.n.st.Mode)
				nameAt += copy(block[nameAt:], d.name)
			}
			if last {
				emit(block[:used])
			} else {
				emit(block)
			}
		}
		i = j
	}
	return size, nil
}

func fileType(mode uint32) uint8 {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return 1
	case unix.S_IFDIR:
		return 2
	case unix.S_IFCHR:
		return 3
	case unix.S_IFBLK:
		return 4
	case unix.S_IFIFO:
		return 5
	case unix.S_IFSOCK:
		return 6
	case unix.S_IFLNK:
		return 7
	}
	return 0
}

// putSuperblock writes the superblock and the blob's device slot.
func putSuperblock(img []byte, top *node, inodes uint64, blocks uint32, layout *Layout) {
	le := binary.LittleEndian
	sb := img[superblockOffset:]
	le.PutUint32(sb[0:], erofsMagic)
	sb[12] = blockBits
	le.PutUint16(sb[14:], uint16(top.nid))
	le.PutUint64(sb[16:], inodes)
	le.PutUint64(sb[24:], uint64(top.st.MtimSec))
	le.PutUint32(sb[32:], top.st.MtimNsec)
	le.PutUint32(sb[36:], blocks)
	// meta_blkaddr (40) and xattr_blkaddr (44) are 0: inodes count from
	// the image's start, and no xattr is shared.
	le.PutUint32(sb[80:], incompatChunkedFile|incompatDeviceTable)
	le.PutUint16(sb[86:], 1)                    // extra_devices
	le.PutUint16(sb[88:], deviceSlotOffset/128) // devt_slotoff
	slot := img[deviceSlotOffset:]
	le.PutUint32(slot[64:], uint32(layout.Size/blockSize))
}
