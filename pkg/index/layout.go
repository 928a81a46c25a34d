package index

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/internal/walkorder"
	"github.com/concourse/cowvol/pkg/filesum"
)

// layout.go: where each regular file's data lies in the blob, which a
// fill holds until the blob is whole, a million files' worth. What stays
// in memory is 8 bytes an extent, in chunks that never move (a layout
// that grew by doubling was copied again and again, and held twice over
// as it grew, at a pull's peak), and the paths apart, each as what it
// does not share with the path before it (the walk's order makes
// neighbours share most of theirs). The extents' sums, 32 bytes each and
// read once each (as an extent is checked, and as the filled layer's
// sums are kept), lie in a file no name reaches beside the image: a
// million of them were 32 MB of a fill's heap, and twice that of its RSS
// with the collector's headroom; in the page cache they are the kernel's
// to write back under pressure. So do the small files' bytes a stream
// carries (up to its budget, 16 MiB), until they are written into the
// blob: held on the heap from the first record to the blob's making, they
// were a third of a million-file pull's peak heap.

// Extent is where one regular file's data lies in the blob. Hard links
// share one.
type Extent struct {
	// Path is the file's first name in the layer, slash-separated.
	Path         string
	Offset, Size int64
}

// span is what a Layout keeps in memory of an extent but its path: its
// first block in the blob and how many bytes of its last block are
// padding. Extents lie one after the other, each at a block of its own,
// so an extent's size is the blocks up to the next one's (the blob's end,
// for the last) less its padding.
type span struct {
	block uint32
	pad   uint16
}

func (s span) offset() int64 { return int64(s.block) * blockSize }

// spanChunk is how many spans a Layout keeps in one chunk (128 KiB).
const spanChunk = 1 << 14

// sumSize is what an extent's sum takes in a Layout's file of sums.
const sumSize = len(filesum.Sum{})

// Layout is the blob of an index: each regular file's extent, in offset
// order (its first name's order in the walk), and the blob's size. The
// Writer that makes it lays it out (add) and finishes it (flush); what
// reads it after may do so from several goroutines.
type Layout struct {
	Size  int64
	n     int
	spans [][]span // of spanChunk each, but the last
	paths walkorder.List
	// inline is the bytes of the extents whose Entries carried them (a
	// stream's small files), one after the other, and inlined which
	// extents those are, in order: a few of a large tree's files, which
	// is why they are not a field of every span.
	inline  aside
	inlined []uint32
	// sums is each extent's sum (Entry.Sum; zeros where it had none), in
	// extent order, from the first extent that has one: not made till
	// then, and where none has.
	sums     aside
	sumsFrom int
}

// newLayout is an empty layout whose files of sums and inline bytes are
// made in dir.
func newLayout(dir string) *Layout {
	return &Layout{sums: aside{what: "an index's file sums", dir: dir}, inline: aside{what: "an index's inline bytes", dir: dir}}
}

// Len is how many extents the blob holds.
func (l *Layout) Len() int { return l.n }

// Extent is extent i.
func (l *Layout) Extent(i int) Extent {
	off, size := l.Range(i)
	return Extent{Path: l.paths.Path(i), Offset: off, Size: size}
}

// Range is extent i's offset and size: Extent but its path, which a
// fill's hot path need not decode.
func (l *Layout) Range(i int) (off, size int64) {
	s := l.span(i)
	end := l.Size
	if i+1 < l.n {
		end = l.span(i + 1).offset()
	}
	off = s.offset()
	return off, end - off - int64(s.pad)
}

func (l *Layout) span(i int) *span { return &l.spans[i/spanChunk][i%spanChunk] }

// add lays out the next extent, of size bytes, after the last one, the
// file's data bytes where its Entry carried them (nil if not) and its sum
// (zeros: none). The caller has checked that the blob can address it.
func (l *Layout) add(path string, size int64, data []byte, sum filesum.Sum) {
	if l.n%spanChunk == 0 {
		l.spans = append(l.spans, make([]span, 0, spanChunk))
	}
	last := &l.spans[len(l.spans)-1]
	padded := roundUp(size, blockSize)
	*last = append(*last, span{block: uint32(l.Size / blockSize), pad: uint16(padded - size)})
	l.Size += padded
	l.paths.Add(path)
	if data != nil {
		l.inline.append(data)
		l.inlined = append(l.inlined, uint32(l.n))
	}
	l.addSum(sum)
	l.n++
}

// addSum writes the next extent's sum to the file of sums, which the
// first sum that is not zeros makes.
func (l *Layout) addSum(sum filesum.Sum) {
	if !l.sums.started() {
		if sum == (filesum.Sum{}) {
			return
		}
		l.sumsFrom = l.n
	}
	l.sums.append(sum[:])
}

// flush writes what is buffered of the sums and the inline bytes, and
// says whether they are kept.
func (l *Layout) flush() error {
	return errors.Join(l.sums.flush(), l.inline.flush())
}

// SumOf says what extent i's data hashes to, where its Entry said (a
// stream's files): what a range fetched into the blob is checked
// against. Zeros where none did. An error is the file of sums failing a
// read (or let go of: Close).
func (l *Layout) SumOf(i int) (filesum.Sum, error) {
	var sum filesum.Sum
	if !l.sums.started() || i < l.sumsFrom {
		return sum, nil
	}
	if _, err := l.sums.readAt(sum[:], int64(i-l.sumsFrom)*int64(sumSize)); err != nil {
		return filesum.Sum{}, fmt.Errorf("reading extent %d's sum: %w", i, err)
	}
	return sum, nil
}

// Close lets go of the extents' sums (SumOf fails after it) and of the
// inline bytes not yet written (WriteInline writes none after it); the
// rest stays. Their files are also let go of by the collector, should a
// layout be dropped unclosed.
func (l *Layout) Close() error {
	l.inlined = nil
	return errors.Join(l.sums.close(), l.inline.close())
}

// WriteInline writes through w (the blob), at each one's offset, the
// bytes of every extent whose Entry carried them (a stream's small
// files: their ranges need no fetch), and tells written which extents
// those are, in order; then it lets go of them: a second call writes
// none.
func (l *Layout) WriteInline(w io.WriterAt, written func(i int)) error {
	return l.TakeInline().Write(context.Background(), w, written)
}

// InlineBytes are the bytes of the extents of a layout whose Entries
// carried them, taken from it (TakeInline) to be written into the blob:
// by whoever took them, on a goroutine of their own if they like, the
// layout no longer touching them (its Close lets go of the rest, not of
// these).
type InlineBytes struct {
	l       *Layout // (read only: its ranges and paths)
	extents []uint32
	file    aside
}

// TakeInline hands over the bytes the layout's Entries carried; it keeps
// none: a second call takes none, nor one after Close.
func (l *Layout) TakeInline() *InlineBytes {
	in := &InlineBytes{l: l, extents: l.inlined, file: l.inline}
	l.inlined, l.inline = nil, aside{}
	return in
}

// Extents are the extents whose bytes in carries, in order.
func (in *InlineBytes) Extents() []uint32 { return in.extents }

// Write writes the bytes through w as WriteInline says, then lets go of
// them (as Close does). It stops, with ctx's error, once ctx is done.
func (in *InlineBytes) Write(ctx context.Context, w io.WriterAt, written func(i int)) error {
	defer in.Close()
	if len(in.extents) == 0 {
		return nil
	}
	buf := make([]byte, 64<<10)
	var at int64 // in the file of inline bytes
	for _, i := range in.extents {
		if err := ctx.Err(); err != nil {
			return err
		}
		off, size := in.l.Range(int(i))
		n, err := io.CopyBuffer(io.NewOffsetWriter(w, off), io.NewSectionReader(in.file.file(), at, size), buf)
		if err == nil && n != size {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			return fmt.Errorf("writing %s's inline bytes into the blob: %w", in.l.paths.Path(int(i)), err)
		}
		at += size
		written(int(i))
	}
	return nil
}

// Close lets go of the bytes not written. Twice is once.
func (in *InlineBytes) Close() error {
	in.extents = nil
	return in.file.close()
}

// Data is how many bytes of data the files hold: the blob's size, less
// the padding to each extent's last block.
func (l *Layout) Data() int64 {
	n := l.Size
	for _, chunk := range l.spans {
		for _, s := range chunk {
			n -= int64(s.pad)
		}
	}
	return n
}

// Lookup is the extent of the file whose first name (Extent.Path) is
// path, -1 if none: a search of the paths, which lie in the walk's order
// (walkorder.Compare), not a map, which a fill of a million files would hold
// as 50 MB more.
func (l *Layout) Lookup(path string) int {
	return l.paths.Lookup(path)
}

// Sum says what the data of the file whose first name is path hashes to,
// if it has an extent whose Entry said (see SumOf) and its sum can be
// read.
func (l *Layout) Sum(path string) (filesum.Sum, bool) {
	if i := l.Lookup(path); i >= 0 {
		sum, err := l.SumOf(i)
		return sum, err == nil && sum != (filesum.Sum{})
	}
	return filesum.Sum{}, false
}

// Offset says where the data of the file whose first name is path starts
// in the blob, if it has an extent.
func (l *Layout) Offset(path string) (int64, bool) {
	if i := l.Lookup(path); i >= 0 {
		return l.span(i).offset(), true
	}
	return 0, false
}

// Find is the extent holding the blob's byte off (-1: none, padding).
func (l *Layout) Find(off int64) int {
	if i := l.from(off); i < l.n {
		if start, _ := l.Range(i); start <= off {
			return i
		}
	}
	return -1
}

// Touching are the extents [first, end) that hold a byte of the blob's
// range of n bytes at off.
func (l *Layout) Touching(off, n int64) (first, end int) {
	first = l.from(off)
	end = first
	for end < l.n && l.span(end).offset() < off+n {
		end++
	}
	return first, end
}

// from is the first extent that ends past off: the one holding off if it
// starts at or before it, else the next.
func (l *Layout) from(off int64) int {
	return sort.Search(l.n, func(i int) bool { start, size := l.Range(i); return start+size > off })
}

// aside is a file no name reaches, beside the image, that a Layout
// appends to as its Writer lays extents out, made by the first append:
// what a fill reads back once or twice rather than holds. One that cannot
// be made or written fails the index (flush).
type aside struct {
	what string // what it holds, for errors
	dir  string // where it is made
	*appender
	err    error // why it could not be made
	closed bool
}

// asideBuffer is how much of an aside file a Writer buffers.
const asideBuffer = 64 << 10

// started says whether anything was appended.
func (a *aside) started() bool { return a.appender != nil || a.err != nil }

func (a *aside) append(p []byte) {
	if a.appender == nil {
		if a.err != nil {
			return
		}
		f, err := fdtree.Unnamed(a.dir, a.what)
		if err != nil {
			a.err = err
			return
		}
		a.appender = newAppender(f, 0, asideBuffer)
	}
	a.write(p)
}

// flush writes what is buffered, and lets go of the buffer.
func (a *aside) flush() error {
	if a.appender != nil {
		if err := a.appender.flush(); err != nil {
			return fmt.Errorf("%s: %w", a.what, err)
		}
		a.buf = nil
	}
	if a.err != nil {
		return fmt.Errorf("%s: %w", a.what, a.err)
	}
	return nil
}

// file is the file, nil if nothing was appended.
func (a *aside) file() *os.File {
	if a.appender == nil {
		return nil
	}
	return a.f
}

func (a *aside) readAt(p []byte, off int64) (int, error) { return a.file().ReadAt(p, off) }

// close lets go of the file; reads of it fail after.
func (a *aside) close() error {
	if a.appender == nil || a.closed {
		return nil
	}
	a.closed = true
	return a.f.Close()
}
