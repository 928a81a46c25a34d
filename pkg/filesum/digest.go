package filesum

import (
	"bufio"
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"slices"
	"sync"

	"github.com/concourse/cowvol/internal/batch"
)

// A table's digest stands for the whole of it in one sum, so that the node
// that captured a layer can vouch for it to the fleet: the SHA-256 of its
// files' records, each the SHA-256 of the file's path followed by the
// file's sum, sorted. A puller computes it from a stream's records as they
// come, in any order (Listing), keeping 64 bytes a file and no path, in
// memory or spilled to a file.
type record [2 * sha256.Size]byte

func recordOf[P string | []byte](path P, sum Sum) record {
	var r record
	p := sha256.Sum256([]byte(path))
	copy(r[:sha256.Size], p[:])
	copy(r[sha256.Size:], sum[:])
	return r
}

// compareRecords orders records as bytes.Compare does, the first eight
// bytes (of a path's hash: they differ but for one pair in 2^64) first.
func compareRecords(a, b *record) int {
	if x, y := binary.BigEndian.Uint64(a[:8]), binary.BigEndian.Uint64(b[:8]); x != y {
		return cmp.Compare(x, y)
	}
	return bytes.Compare(a[:], b[:])
}

// sortRecords sorts records in place: their keys (each record's first
// eight bytes, and where it was) first, which move a quarter of the bytes
// a record does, then the records into the keys' order, a cycle of the
// permutation at a time.
func sortRecords(records []record) {
	keys := keyBuffers.Get().(*[]recordKey)
	defer keyBuffers.Put(keys)
	k := (*keys)[:0]
	for i := range records {
		k = append(k, recordKey{key: binary.BigEndian.Uint64(records[i][:8]), at: uint32(i)})
	}
	*keys = k
	slices.SortFunc(k, func(a, b recordKey) int {
		if a.key != b.key {
			return cmp.Compare(a.key, b.key)
		}
		return bytes.Compare(records[a.at][:], records[b.at][:])
	})
	// Record j is to be what record k[j].at was.
	const moved = ^uint32(0)
	for i := range k {
		if k[i].at == moved {
			continue
		}
		first := records[i]
		for j := i; ; {
			from := k[j].at
			k[j].at = moved
			if from == uint32(i) {
				records[j] = first
				break
			}
			records[j] = records[from]
			j = int(from)
		}
	}
}

// keyBuffers are sortRecords' keys, a run's worth each once grown.
var keyBuffers = sync.Pool{New: func() any { return new([]recordKey) }}

// recordKey is a record's first eight bytes and where it lies.
type recordKey struct {
	key uint64
	at  uint32
}

// run is a sorted run of records, read in order by a merge: in memory
// (memRun) or spilled to a file (fileRun).
type run interface {
	// head is the run's next record, nil past its end.
	head() *record
	advance()
}

type memRun []record

func (r *memRun) head() *record {
	if len(*r) == 0 {
		return nil
	}
	return &(*r)[0]
}

func (r *memRun) advance() { *r = (*r)[1:] }

// fileRun reads a run of records spilled to a file. A read that fails
// ends it, keeping the error.
type fileRun struct {
	br   *bufio.Reader
	left int
	rec  record
	ok   bool
	err  error
}

// fileRunBuffer is what each spilled run a merge reads is read by.
const fileRunBuffer = 64 << 10

func newFileRun(f *os.File, off int64, records int) *fileRun {
	r := &fileRun{br: bufio.NewReaderSize(io.NewSectionReader(f, off, int64(records)*int64(len(record{}))), fileRunBuffer), left: records}
	r.advance()
	return r
}

func (r *fileRun) head() *record {
	if !r.ok {
		return nil
	}
	return &r.rec
}

func (r *fileRun) advance() {
	r.ok = false
	if r.left == 0 || r.err != nil {
		return
	}
	if _, r.err = io.ReadFull(r.br, r.rec[:]); r.err == nil {
		r.left--
		r.ok = true
	}
}

// digestRuns is the digest of the records of runs, each sorted, in sorted
// order: hashed as the runs are merged.
func digestRuns(runs []run) Sum {
	h := sha256.New()
	h.Write([]byte("cowvol file table v1\n"))
	// Written to the hash 32 KiB at a time: a write per record costs more
	// than the hashing of its 64 bytes.
	buf := make([]byte, 0, 512*len(record{}))
	mergeRuns(runs, func(r *record) {
		if buf = append(buf, r[:]...); len(buf) == cap(buf) {
			h.Write(buf)
			buf = buf[:0]
		}
	})
	h.Write(buf)
	var s Sum
	h.Sum(s[:0])
	return s
}

// mergeRuns calls emit with the records of sorted runs in sorted order:
// a heap of the runs by their next record.
func mergeRuns(runs []run, emit func(*record)) {
	heads := make([]run, 0, len(runs))
	for _, r := range runs {
		if r.head() != nil {
			heads = append(heads, r)
		}
	}
	less := func(i, j int) bool { return compareRecords(heads[i].head(), heads[j].head()) < 0 }
	down := func(i int) {
		for {
			least := i
			if c := 2*i + 1; c < len(heads) && less(c, least) {
				least = c
			}
			if c := 2*i + 2; c < len(heads) && less(c, least) {
				least = c
			}
			if least == i {
				return
			}
			heads[i], heads[least] = heads[least], heads[i]
			i = least
		}
	}
	for i := len(heads)/2 - 1; i >= 0; i-- {
		down(i)
	}
	for len(heads) > 0 {
		emit(heads[0].head())
		if heads[0].advance(); heads[0].head() == nil {
			heads[0] = heads[len(heads)-1]
			heads = heads[:len(heads)-1]
		}
		down(0)
	}
}

// Listing gathers a table's digest from a stream's files as they come (any
// order, from several goroutines): each regular file with its sum, each
// hardlink with the file it names, which takes that file's sum under its
// own path, as a walk of the tree finds it. Its files are kept in runs of
// a fixed size, not one slice: a million files are 64 MB, which a slice
// that grows by doubling would copy again and again, and hold twice over
// as it does, at the peak of a pull. Where it spills (Spill), each full
// run is written to a file and its memory used for the next: a run of
// 4 MiB in memory, whatever the file count.
type Listing struct {
	mu    sync.Mutex
	files [][]record             // runs of listingRun, each full but the last; nil: spilled
	links [][2][sha256.Size]byte // the link's path's hash, its target's
	spill *os.File
	free  []record // a spilled run's memory, for the next
	err   error    // the first spill that failed
}

// listingRun is how many files a Listing keeps in one run: 4 MiB of them,
// 16 runs a million files for Digest's merge to choose between.
const listingRun = 1 << 16

// Spill has the listing write each run it fills to f (an empty file, the
// listing's until Digest is done with it), not keep it. Before any File.
func (l *Listing) Spill(f *os.File) { l.spill = f }

// File lists a regular file. A run it fills it sorts (Digest finds it
// sorted), and spills where asked: a pull's sorting is done as its files
// come, not after.
func (l *Listing) File(path string, sum Sum) { l.add(recordOf(path, sum)) }

func (l *Listing) add(r record) {
	l.mu.Lock()
	if n := len(l.files); n == 0 || l.files[n-1] == nil || len(l.files[n-1]) == listingRun { // (nil: full, and spilled)
		run := l.free
		if l.free = nil; run == nil {
			run = make([]record, 0, listingRun)
		}
		l.files = append(l.files, run[:0])
	}
	k := len(l.files) - 1
	l.files[k] = append(l.files[k], r)
	full := l.files[k]
	l.mu.Unlock()
	if len(full) < listingRun {
		return
	}
	sortRecords(full) // (no File appends to a full run, and Digest comes after every File)
	if l.spill == nil {
		return
	}
	bw := bufio.NewWriterSize(io.NewOffsetWriter(l.spill, int64(k)*listingRun*int64(len(record{}))), fileRunBuffer)
	for i := range full {
		_, _ = bw.Write(full[i][:])
	}
	err := bw.Flush()
	l.mu.Lock()
	if err != nil {
		l.err = cmp.Or(l.err, err)
	} else {
		l.files[k], l.free = nil, full
	}
	l.mu.Unlock()
}

// Lister lists files into a Listing from a goroutine of its own, in
// batches: a stream's reader hands each file over and moves on, the
// hashing of its path done beside it.
type Lister struct{ w *batch.Worker[listed] }

type listed struct {
	path string
	sum  Sum
}

// Lister starts a Lister into l. Close it before l's Digest.
func (l *Listing) Lister() *Lister {
	return &Lister{w: batch.Start(1024, func(files []listed) {
		for _, f := range files {
			l.File(f.path, f.sum)
		}
	})}
}

// File lists a regular file, as Listing.File does.
func (ls *Lister) File(path string, sum Sum) { ls.w.Add(listed{path, sum}) }

// Close returns once every file handed over is listed. Twice is once.
func (ls *Lister) Close() { ls.w.Close() }

// Link lists a hardlink at path to the regular file at target.
func (l *Listing) Link(path, target string) {
	link := [2][sha256.Size]byte{sha256.Sum256([]byte(path)), sha256.Sum256([]byte(target))}
	l.mu.Lock()
	l.links = append(l.links, link)
	l.mu.Unlock()
}

// Digest is the digest of the table listed. A link to a file not listed
// fails it (an extraction refuses such a link before). It sorts the
// files listed in place, which lists them no differently: a listing of a
// million files is 64 MB, not to be copied at the peak of a pull. Only
// the last run is sorted here: File sorted every full one. Links take
// their targets' sums in a merge of the runs (the links sorted by their
// targets' hashes, the runs by their paths'), and go into the digest's.
func (l *Listing) Digest() (Sum, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return Sum{}, l.err
	}
	if n := len(l.files); n > 0 && l.files[n-1] != nil && len(l.files[n-1]) < listingRun {
		sortRecords(l.files[n-1])
	}
	var linked []record
	if len(l.links) > 0 {
		slices.SortFunc(l.links, func(a, b [2][sha256.Size]byte) int { return bytes.Compare(a[1][:], b[1][:]) })
		linked = make([]record, 0, len(l.links))
		next := 0
		runs := l.runs()
		mergeRuns(runs, func(r *record) {
			for ; next < len(l.links) && bytes.Equal(l.links[next][1][:], r[:sha256.Size]); next++ {
				var link record
				copy(link[:sha256.Size], l.links[next][0][:])
				copy(link[sha256.Size:], r[sha256.Size:])
				linked = append(linked, link)
			}
		})
		if err := runsErr(runs); err != nil {
			return Sum{}, err
		}
		if len(linked) < len(l.links) {
			return Sum{}, errors.New("a hardlink to a file the stream did not carry")
		}
		sortRecords(linked)
	}
	runs := l.runs()
	r := memRun(linked)
	digest := digestRuns(append(runs, &r))
	return digest, runsErr(runs)
}

// runs are readers of the listing's runs, from their starts.
func (l *Listing) runs() []run {
	runs := make([]run, 0, len(l.files))
	for k, files := range l.files {
		if files == nil {
			runs = append(runs, newFileRun(l.spill, int64(k)*listingRun*int64(len(record{})), listingRun))
			continue
		}
		r := memRun(files)
		runs = append(runs, &r)
	}
	return runs
}

// runsErr is the first error a spilled run's read met.
func runsErr(runs []run) error {
	for _, r := range runs {
		if fr, ok := r.(*fileRun); ok && fr.err != nil {
			return fr.err
		}
	}
	return nil
}
