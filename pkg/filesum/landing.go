package filesum

import (
	"crypto/sha256"
	"hash"
	"io"
	"sync"
)

// Landing sums a file's bytes as they are written into a region that read
// as zeros before (a file just made and sized, a blob's extent never
// written): the bytes handed to a write that succeeded are the bytes the
// region holds, and what no write touched is still zeros (a hole). So
// while the writes come in order, none over another, the sum of what was
// written, gaps as zeros, is the sum of what landed, with no read back.
// A write behind the last one makes it unknown: Check then reads the
// region back.
type Landing struct {
	w         io.WriterAt
	mu        sync.Mutex // (writes from one fetch come one at a time: uncontended)
	h         hash.Hash
	next      int64 // past the last byte summed
	unordered bool
}

// NewLanding sums the writes through it to w, a region that holds only
// zeros.
func NewLanding(w io.WriterAt) *Landing { return &Landing{w: w, h: sha256.New()} }

func (l *Landing) WriteAt(p []byte, off int64) (int, error) {
	n, err := l.w.WriteAt(p, off)
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.unordered:
	case off < l.next:
		l.unordered = true
	default:
		l.zeros(off - l.next)
		l.h.Write(p[:n])
		l.next = off + int64(n)
	}
	return n, err
}

// zeros sums n zero bytes: a gap no write touched.
func (l *Landing) zeros(n int64) {
	for n > 0 {
		k := min(n, int64(len(zeroBlock)))
		l.h.Write(zeroBlock[:k])
		n -= k
	}
}

// zeroBlock is what a gap is summed from.
var zeroBlock = make([]byte, 64<<10)

// Check says whether the region's size bytes have sum want (ErrMismatch
// if not): from the writes where they came in order, else by reading
// back, from the region's start, what back reads.
func (l *Landing) Check(size int64, want Sum, back io.Reader) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.unordered || l.next > size {
		return Check(io.LimitReader(back, size), want)
	}
	l.zeros(size - l.next)
	l.next = size
	var got Sum
	l.h.Sum(got[:0])
	if got != want {
		return ErrMismatch
	}
	return nil
}
