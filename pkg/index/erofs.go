package index

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// erofs.go is the image's format, which Writer lays out: the superblock
// and its one device slot (the blob), 64-byte extended inodes (each with
// its inline xattrs, then a regular file's chunk indexes or a symlink's
// target), and directories' blocks of entries. See the kernel's
// Documentation/filesystems/erofs.rst and fs/erofs/erofs_fs.h.

// BlockSize is the image's block: every extent of a blob starts at a
// multiple of it, so a block of the blob holds one extent's bytes at most.
const BlockSize = blockSize

const (
	blockBits = 12
	blockSize = 1 << blockBits

	erofsMagic       = 0xe0f5e1e2
	superblockOffset = 1024
	deviceSlotOffset = superblockOffset + 128 // right after the superblock

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

// inode is what an extended inode says of an entry.
type inode struct {
	st     attrs
	layout uint16 // layoutFlatPlain, layoutFlatInline or layoutChunkBased
	size   uint64
	// data is a directory's first block, a regular file's chunk format,
	// a device's number.
	data       uint32
	ino, nlink uint32
}

// put writes the inode at b, followed by xattrBytes of xattrs.
func (in inode) put(b []byte, xattrBytes int) {
	le := binary.LittleEndian
	le.PutUint16(b[0:], 1|in.layout<<1) // 1: extended
	if xattrBytes > 0 {
		le.PutUint16(b[2:], uint16((xattrBytes-xattrHeader)/4+1))
	}
	le.PutUint16(b[4:], uint16(in.st.Mode))
	le.PutUint64(b[8:], in.size)
	le.PutUint32(b[16:], in.data)
	le.PutUint32(b[20:], in.ino)
	le.PutUint32(b[24:], in.st.Uid)
	le.PutUint32(b[28:], in.st.Gid)
	le.PutUint64(b[32:], uint64(in.st.MtimSec))
	le.PutUint32(b[40:], in.st.MtimNsec)
	le.PutUint32(b[44:], in.nlink)
}

// decodedInode is what a reader of an image takes of an inode put wrote:
// decodeInode's, and where it lies (at, its reader's to set).
type decodedInode struct {
	at         int64
	extended   bool
	layout     uint16
	xattrBytes int
	mode       uint32
	size       int64
	data       uint32
	nlink      uint32
}

// decodeInode reads the inode at b, as put wrote it.
func decodeInode(b []byte) decodedInode {
	le := binary.LittleEndian
	format := le.Uint16(b[0:])
	in := decodedInode{extended: format&1 != 0, layout: format >> 1 & 7, mode: uint32(le.Uint16(b[4:])),
		size: int64(le.Uint64(b[8:])), data: le.Uint32(b[16:]), nlink: le.Uint32(b[44:])}
	if count := int(le.Uint16(b[2:])); count > 0 {
		in.xattrBytes = xattrHeader + (count-1)*4
	}
	return in
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

// superblock is what the image's superblock says.
type superblock struct {
	root       uint32 // the root's nid
	mtime      attrs  // the root's, the image's build time
	inodes     uint64
	blocks     uint32 // the image's
	meta       uint32 // the block the inodes start at
	blobBlocks uint32
}

// putSuperblock writes the superblock and the blob's device slot into the
// image's first block.
func putSuperblock(img []byte, sb superblock) {
	le := binary.LittleEndian
	b := img[superblockOffset:]
	le.PutUint32(b[0:], erofsMagic)
	b[12] = blockBits
	le.PutUint16(b[14:], uint16(sb.root))
	le.PutUint64(b[16:], sb.inodes)
	le.PutUint64(b[24:], uint64(sb.mtime.MtimSec))
	le.PutUint32(b[32:], sb.mtime.MtimNsec)
	le.PutUint32(b[36:], sb.blocks)
	le.PutUint32(b[40:], sb.meta) // meta_blkaddr; xattr_blkaddr (44) is 0: no xattr is shared
	le.PutUint32(b[80:], incompatChunkedFile|incompatDeviceTable)
	le.PutUint16(b[86:], 1)                    // extra_devices
	le.PutUint16(b[88:], deviceSlotOffset/128) // devt_slotoff
	slot := img[deviceSlotOffset:]
	le.PutUint32(slot[64:], sb.blobBlocks)
}
