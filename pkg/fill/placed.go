package fill

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/pkg/index"
)

// placed.go: which blocks of an index's blob are in place, in memory the
// plugin shares with the fill keeper (keeper.go). Each read of a marked
// blob is a pre-content event, answered once every extent it touches is in
// place: a 1 GiB volume read whole raises about 13,000 of them, most for
// extents the stream wrote before the reader came. Through the keeper each
// such answer took two more hops between processes (the event handed to
// the plugin, its answer handed back), each a wakeup of a process that
// may be busy with the fill itself. With the blocks in place in a shared
// bitmap, the keeper answers those reads on its own and hands the plugin
// only the reads that wait for data.
//
// A bit is set only once its block's extent is written and checked, and
// never cleared: the keeper lets a read through only if every block it
// touches is set, so a read it answers reads bytes that are the volume's.
// The plugin sets bits; the keeper only reads them.

// blobBlock is the unit of the bitmap: the index's block, which every
// extent starts at a multiple of, so that a block set in place holds no
// byte of another extent.
const blobBlock = index.BlockSize

// maxPlacedBlocks bounds the bitmap (16 MiB, a blob of 512 GiB): a larger
// blob's reads all go through the plugin, as without a keeper.
const maxPlacedBlocks = (16 << 20) * 8

// placedBlocks is the bitmap of a blob of blocks blocks, mapped from a
// memfd.
type placedBlocks struct {
	mem    []byte
	words  []uint64
	blocks int64
}

// placedWords is how many 64-bit words hold the bits of blocks blocks.
func placedWords(blocks int64) int64 { return (blocks + 63) / 64 }

// newPlacedBlocks makes the bitmap of a blob of size bytes, none in place,
// and returns it with a descriptor of its memfd, for the keeper (the
// caller closes it once sent).
func newPlacedBlocks(size int64) (*placedBlocks, int, error) {
	blocks := (size + blobBlock - 1) / blobBlock
	if blocks == 0 || blocks > maxPlacedBlocks {
		return nil, -1, fmt.Errorf("a blob of %d blocks: %w", blocks, errNoPlacedBlocks)
	}
	fd, err := unix.MemfdCreate("cowvol-blob-placed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, err
	}
	if err := unix.Ftruncate(fd, placedWords(blocks)*8); err != nil {
		unix.Close(fd)
		return nil, -1, err
	}
	// Its size sealed: the keeper, which holds every reader, never
	// touches a page a shrink took away (SIGBUS).
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return nil, -1, err
	}
	p, err := mapPlacedBlocks(fd, blocks, unix.PROT_READ|unix.PROT_WRITE)
	if err != nil {
		unix.Close(fd)
		return nil, -1, err
	}
	return p, fd, nil
}

var errNoPlacedBlocks = errors.New("too large to share which blocks are in place")

// mapPlacedBlocks maps the bitmap of blocks blocks in the memfd fd (the
// keeper's end: read-only), once its size is what blocks need.
func mapPlacedBlocks(fd int, blocks int64, prot int) (*placedBlocks, error) {
	if blocks <= 0 || blocks > maxPlacedBlocks {
		return nil, fmt.Errorf("a blob of %d blocks: %w", blocks, errNoPlacedBlocks)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	size := placedWords(blocks) * 8
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != size {
		return nil, fmt.Errorf("a bitmap of %d bytes, mode %o: want %d", st.Size, st.Mode, size)
	}
	if seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0); err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return nil, fmt.Errorf("a bitmap whose size is not sealed (seals %#x): %w", seals, err)
	}
	mem, err := unix.Mmap(fd, 0, int(size), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	return &placedBlocks{mem: mem, words: unsafe.Slice((*uint64)(unsafe.Pointer(&mem[0])), len(mem)/8), blocks: blocks}, nil
}

// blockSpan is the blocks [first, end) that the bytes [off, off+n) touch.
func blockSpan(off, n int64) (first, end int64) {
	return off / blobBlock, (off + n + blobBlock - 1) / blobBlock
}

// set marks blocks [first, end) in place.
func (p *placedBlocks) set(first, end int64) {
	end = min(end, p.blocks)
	for b := max(first, 0); b < end; {
		w, bit := b/64, b%64
		n := min(64-bit, end-b)
		mask := ^uint64(0) >> (64 - n) << bit
		atomic.OrUint64(&p.words[w], mask)
		b += n
	}
}

// has says whether every block of [first, end) is in place (an empty or
// out-of-range span is not).
func (p *placedBlocks) has(first, end int64) bool {
	if first < 0 || first >= end || end > p.blocks {
		return false
	}
	for b := first; b < end; {
		w, bit := b/64, b%64
		n := min(64-bit, end-b)
		mask := ^uint64(0) >> (64 - n) << bit
		if atomic.LoadUint64(&p.words[w])&mask != mask {
			return false
		}
		b += n
	}
	return true
}

func (p *placedBlocks) close() error { return unix.Munmap(p.mem) }
