// Package bufpool lends byte slices for a file's data held in memory
// between reading it from a stream and writing it to disk: a tree of
// 50,000 small files would otherwise make 50,000 slices for the garbage
// collector. It owns only the slices it lends; their contents are the
// borrower's (a slice comes back as it was left, not zeroed).
package bufpool

import (
	"math/bits"
	"sync"
)

// Slices from minSize to maxSize bytes are pooled, in powers of two;
// others are made and dropped as usual.
const (
	minShift = 12 // 4 KiB
	maxShift = 21 // 2 MiB: a stream chunk of 1 MiB and its framing
)

var pools [maxShift - minShift + 1]sync.Pool

// class is the pool of slices of n bytes' class, and its size; -1 for a
// size not pooled.
func class(n int) (int, int) {
	if n > 1<<maxShift {
		return -1, n
	}
	shift := max(minShift, bits.Len(uint(max(n, 1)-1)))
	return shift - minShift, 1 << shift
}

// Get lends a slice of n bytes, its contents unspecified.
func Get(n int) []byte {
	c, size := class(n)
	if c < 0 {
		return make([]byte, n)
	}
	if b, ok := pools[c].Get().(*[]byte); ok {
		return (*b)[:n]
	}
	return make([]byte, n, size)
}

// Put gives back a slice Get lent; the caller no longer uses it.
func Put(b []byte) {
	c, size := class(cap(b))
	if c < 0 || cap(b) != size {
		return // not one of ours
	}
	b = b[:size]
	pools[c].Put(&b)
}
