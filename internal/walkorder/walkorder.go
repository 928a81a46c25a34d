// Package walkorder owns the order a tree walk (fdtree.Walk) meets a
// tree's slash-separated paths in, and List, a compact list of paths kept
// in that order and searched by it: what the tables and layouts of a
// million files hold instead of a map of their paths. It knows nothing of
// files or what is kept beside each path.
package walkorder

import (
	"cmp"
	"encoding/binary"
	"sort"
)

// Compare orders slash-separated paths as a walk meets them: depth first,
// each directory's names in byte order. That is byte order with "/"
// before every other byte: a name ends there, and a name sorts before the
// longer names it starts.
func Compare[A, B string | []byte](a A, b B) int {
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

// List keeps paths in the order they are added (the walk's, for Lookup),
// each as the length of the prefix it shares with the path before it and
// the rest (uvarints, then the rest's bytes), every Restart-th whole:
// where a read starts. Its bytes lie in chunks of about chunkSize that
// never move once full (a list grown by doubling is copied again and
// again, and held twice over as it grows), a path never across two; the
// first grows to it, so that a list of a few paths is small. The zero
// List is empty.
type List struct {
	chunks   [][]byte
	restarts []at   // of every Restart-th path
	last     []byte // the path added last
	n        int
}

// at is where a path's bytes start.
type at struct{ chunk, off uint32 }

const (
	// Restart is how often a path is kept whole.
	Restart = 16
	// chunkSize is the size of a full chunk of a List's bytes, and
	// firstChunk a chunk's when made.
	chunkSize  = 1 << 20
	firstChunk = 256
)

// Len is how many paths l has.
func (l *List) Len() int { return l.n }

// Last is the path added last (nil if none), valid until the next Add.
func (l *List) Last() []byte { return l.last }

// Add adds path after the others.
func (l *List) Add(path string) {
	shared := 0
	if l.n%Restart != 0 {
		for shared < min(len(l.last), len(path)) && l.last[shared] == path[shared] {
			shared++
		}
	}
	var head [2 * binary.MaxVarintLen64]byte
	h := binary.PutUvarint(head[:], uint64(shared))
	h += binary.PutUvarint(head[h:], uint64(len(path)-shared))
	size := h + len(path) - shared
	if n := len(l.chunks); n == 0 || len(l.chunks[n-1])+size > cap(l.chunks[n-1]) && cap(l.chunks[n-1]) >= chunkSize {
		grown := chunkSize
		if n == 0 {
			grown = firstChunk
		}
		l.chunks = append(l.chunks, make([]byte, 0, max(grown, size)))
	}
	chunk := &l.chunks[len(l.chunks)-1]
	if l.n%Restart == 0 {
		l.restarts = append(l.restarts, at{chunk: uint32(len(l.chunks) - 1), off: uint32(len(*chunk))})
	}
	*chunk = append(append(*chunk, head[:h]...), path[shared:]...)
	l.last = append(l.last[:0], path...)
	l.n++
}

// Reader reads a List's paths in order.
type Reader struct {
	l    *List
	at   at
	i    int
	path []byte // the last read; the next read reuses it
}

// From reads l's paths from the first of restart r on (path r*Restart).
func (l *List) From(r int) Reader {
	if r >= len(l.restarts) {
		return Reader{l: l, i: l.n}
	}
	return Reader{l: l, at: l.restarts[r], i: r * Restart}
}

// Next reads the next path, false past the last.
func (r *Reader) Next() bool {
	if r.i >= r.l.n {
		return false
	}
	chunk := r.l.chunks[r.at.chunk]
	if int(r.at.off) == len(chunk) {
		r.at = at{chunk: r.at.chunk + 1}
		chunk = r.l.chunks[r.at.chunk]
	}
	b := chunk[r.at.off:]
	shared, n := binary.Uvarint(b)
	rest, m := binary.Uvarint(b[n:])
	r.path = append(r.path[:shared], b[n+m:n+m+int(rest)]...)
	r.at.off += uint32(n + m + int(rest))
	r.i++
	return true
}

// Path is the path Next read, valid until the next call of Next.
func (r *Reader) Path() []byte { return r.path }

// Index is the index of the path Next read.
func (r *Reader) Index() int { return r.i - 1 }

// Path is path i.
func (l *List) Path(i int) string {
	r := l.From(i / Restart)
	for r.Next() && r.i <= i {
	}
	return string(r.path)
}

// restart is the path restart r starts with, whole where it lies.
func (l *List) restart(r int) []byte {
	at := l.restarts[r]
	b := l.chunks[at.chunk][at.off:]
	_, n := binary.Uvarint(b) // 0: nothing shared
	rest, m := binary.Uvarint(b[n:])
	return b[n+m : n+m+int(rest)]
}

// Lookup is the index of path, -1 if it is not in the list: the last
// restart whose path is not past it, then the paths after it. The paths
// must have been added in Compare's order.
func (l *List) Lookup(path string) int {
	_, i := l.find(path)
	return i
}

// find is Lookup, and a Reader that read the path found.
func (l *List) find(path string) (Reader, int) {
	r := sort.Search(len(l.restarts), func(r int) bool { return Compare(l.restart(r), path) > 0 }) - 1
	if r < 0 {
		return Reader{}, -1
	}
	rd := l.From(r)
	for k := 0; k < Restart && rd.Next(); k++ {
		switch c := Compare(rd.path, path); {
		case c == 0:
			return rd, rd.Index()
		case c > 0:
			return Reader{}, -1
		}
	}
	return Reader{}, -1
}

// Finder looks paths up in a List for one goroutine, fastest when asked
// in the List's order (a walk of the tree the list was made of): the path
// after the one found last is tried first, before a Lookup.
type Finder struct {
	l  *List
	r  Reader // at the path found last, if placed
	at bool
}

// Finder is a Finder of l's paths.
func (l *List) Finder() *Finder { return &Finder{l: l} }

// Find is Lookup(path).
func (f *Finder) Find(path string) int {
	if f.at && f.r.Next() && Compare(f.r.path, path) == 0 {
		return f.r.Index()
	}
	r, i := f.l.find(path)
	f.r, f.at = r, i >= 0
	return i
}
