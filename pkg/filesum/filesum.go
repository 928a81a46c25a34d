// Package filesum owns a layer's table of per-file SHA-256 sums: how it is
// computed from a tree (walked by descriptor, no symlink followed), how it
// is kept in a file, and how bytes are checked against a sum. The sums of
// a captured layer are what it held when it was captured; every byte a peer
// sends of it is checked against them before a reader sees it (the node
// engine computes and keeps them, the streamer carries them, fill checks
// them). It knows nothing of volumes, peers or metadata.
package filesum

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/batch"
	"github.com/concourse/cowvol/internal/fdtree"
)

// Sum is a file's SHA-256.
type Sum [sha256.Size]byte

// String is the sum in hex, as a stream's records carry it.
func (s Sum) String() string { return hex.EncodeToString(s[:]) }

// Parse reads a sum in hex.
func Parse(s string) (Sum, error) {
	var sum Sum
	if len(s) != 2*len(sum) {
		return Sum{}, fmt.Errorf("a file sum of %d characters: want %d hex digits", len(s), 2*len(sum))
	}
	if _, err := hex.Decode(sum[:], []byte(s)); err != nil {
		return Sum{}, fmt.Errorf("a file sum: %w", err)
	}
	return sum, nil
}

// Table is a layer's regular files' sums, by their slash-separated path in
// the layer.
type Table map[string]Sum

// Sum is the sum the table has for path, if any.
func (t Table) Sum(path string) (Sum, bool) {
	s, ok := t[path]
	return s, ok
}

// ErrMismatch says bytes are not what their sum says.
var ErrMismatch = errors.New("not the bytes the volume was captured with")

// Of is the sum of what r reads.
func Of(r io.Reader) (Sum, error) {
	h := sha256.New()
	if _, err := io.Copy(h, r); err != nil {
		return Sum{}, err
	}
	var s Sum
	h.Sum(s[:0])
	return s, nil
}

// Check says whether what r reads has sum want (ErrMismatch if not).
func Check(r io.Reader, want Sum) error {
	got, err := Of(r)
	if err != nil {
		return err
	}
	if got != want {
		return ErrMismatch
	}
	return nil
}

// OfTree computes the table of the tree at root: every regular file's sum,
// read through a descriptor opened beneath its dir.
func OfTree(ctx context.Context, root string) (Table, error) {
	return OfTreeKnowing(ctx, root, nil)
}

// emptySum is the sum of a file of no bytes, which is not read.
var emptySum = Sum(sha256.Sum256(nil))

// OfTreeKnowing is OfTree taking a file's sum from known (if not nil) where
// it knows one, by any of the file's names, instead of reading the file:
// the sums a pull checked the bytes against as they landed, which a copy
// of them carries. A file known under none of the names walked before it
// is read. The caller answers for known: its sums are not checked here.
func OfTreeKnowing(ctx context.Context, root string, known func(path string) (Sum, bool)) (Table, error) {
	rootFD, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", root, err)
	}
	defer unix.Close(rootFD)
	t := Table{}
	linked := map[[2]uint64]Sum{} // the sums of files of several names, by inode
	err = fdtree.Walk(rootFD, fdtree.Visitor{Visit: func(e *fdtree.Entry) (bool, error) {
		if err := ctx.Err(); err != nil {
			return false, err
		}
		if e.Stat.Mode&unix.S_IFMT != unix.S_IFREG {
			return true, nil
		}
		inode := [2]uint64{e.Stat.Dev, e.Stat.Ino}
		sum, ok := emptySum, e.Stat.Size == 0
		if !ok && e.Stat.Nlink > 1 {
			sum, ok = linked[inode]
		}
		if !ok && known != nil {
			sum, ok = known(e.Path)
		}
		if !ok {
			if sum, err = fileSum(e); err != nil {
				return false, err
			}
		}
		if e.Stat.Nlink > 1 {
			linked[inode] = sum
		}
		t[e.Path] = sum
		return true, nil
	}})
	if err != nil {
		return nil, err
	}
	return t, nil
}

// fileSum reads the regular file e and sums it.
func fileSum(e *fdtree.Entry) (Sum, error) {
	fd, err := unix.Openat(e.Parent, e.Name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NOATIME, 0)
	if errors.Is(err, unix.EPERM) { // O_NOATIME on a file of another owner
		fd, err = unix.Openat(e.Parent, e.Name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return Sum{}, fmt.Errorf("%s: %w", e.Path, err)
	}
	f := os.NewFile(uintptr(fd), e.Path)
	defer f.Close()
	sum, err := Of(f)
	if err != nil {
		return Sum{}, fmt.Errorf("%s: %w", e.Path, err)
	}
	return sum, nil
}

// The file a table is kept in: a header, then each file as its sum, its
// path's length (uvarint) and its path, in no order; then the SHA-256 of
// all that, so that a file torn or rotted reads as none.
var fileHeader = []byte("cowvol file sums v1\n")

// WriteFile keeps t at path: written beside it, synced, then renamed over
// it, so that a crash leaves the old file or the new one.
func (t Table) WriteFile(path string) error {
	var buf bytes.Buffer
	buf.Write(fileHeader)
	for p, sum := range t {
		buf.Write(sum[:])
		buf.Write(binary.AppendUvarint(nil, uint64(len(p))))
		buf.WriteString(p)
	}
	whole := sha256.Sum256(buf.Bytes())
	buf.Write(whole[:])
	tmp, err := os.CreateTemp(filepath.Dir(path), ".sums-*")
	if err != nil {
		return err
	}
	_, err = tmp.Write(buf.Bytes())
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("keeping file sums at %s: %w", path, err)
	}
	return nil
}

// ErrBadFile says a table's file is torn or rotted.
var ErrBadFile = errors.New("a file of sums that does not read whole")

// ReadFile reads a table kept at path.
func ReadFile(path string) (Table, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if len(raw) < len(fileHeader)+sha256.Size || !bytes.HasPrefix(raw, fileHeader) {
		return nil, fmt.Errorf("%s: %w", path, ErrBadFile)
	}
	body, whole := raw[:len(raw)-sha256.Size], raw[len(raw)-sha256.Size:]
	if sha256.Sum256(body) != [sha256.Size]byte(whole) {
		return nil, fmt.Errorf("%s: %w", path, ErrBadFile)
	}
	t := Table{}
	r := bufio.NewReader(bytes.NewReader(body[len(fileHeader):]))
	for {
		var sum Sum
		if _, err := io.ReadFull(r, sum[:]); errors.Is(err, io.EOF) {
			return t, nil
		} else if err != nil {
			return nil, fmt.Errorf("%s: %w", path, ErrBadFile)
		}
		n, err := binary.ReadUvarint(r)
		if err != nil || n > uint64(len(body)) {
			return nil, fmt.Errorf("%s: %w", path, ErrBadFile)
		}
		p := make([]byte, n)
		if _, err := io.ReadFull(r, p); err != nil {
			return nil, fmt.Errorf("%s: %w", path, ErrBadFile)
		}
		t[string(p)] = sum
	}
}

// A table's digest stands for the whole of it in one sum, so that the node
// that captured a layer can vouch for it to the fleet: the SHA-256 of its
// files' records, each the SHA-256 of the file's path followed by the
// file's sum, sorted. A puller computes it from a stream's records as they
// come, in any order (Listing), keeping 64 bytes a file and no path.
type record [2 * sha256.Size]byte

func recordOf(path string, sum Sum) record {
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

func sortRecords(records []record) {
	slices.SortFunc(records, func(a, b record) int { return compareRecords(&a, &b) })
}

// sortRuns sorts each of runs in place, as many at once as there are
// CPUs.
func sortRuns(runs ...[]record) {
	work := make(chan []record)
	var wg sync.WaitGroup
	for range min(len(runs), runtime.GOMAXPROCS(0)) - 1 {
		wg.Go(func() {
			for run := range work {
				sortRecords(run)
			}
		})
	}
	for _, run := range runs {
		select {
		case work <- run:
		default: // every worker busy: sort it here
			sortRecords(run)
		}
	}
	close(work)
	wg.Wait()
}

// digestOf is the digest of the records of runs, each sorted, in sorted
// order: hashed as the runs are merged.
func digestOf(runs ...[]record) Sum {
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
// a heap of the runs by their first record.
func mergeRuns(runs [][]record, emit func(*record)) {
	heads := make([][]record, 0, len(runs))
	for _, run := range runs {
		if len(run) > 0 {
			heads = append(heads, run)
		}
	}
	less := func(i, j int) bool { return compareRecords(&heads[i][0], &heads[j][0]) < 0 }
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
		emit(&heads[0][0])
		if heads[0] = heads[0][1:]; len(heads[0]) == 0 {
			heads[0] = heads[len(heads)-1]
			heads = heads[:len(heads)-1]
		}
		down(0)
	}
}

// Digest is the table's digest.
func (t Table) Digest() Sum {
	records := make([]record, 0, len(t))
	for p, sum := range t {
		records = append(records, recordOf(p, sum))
	}
	runs := runsOf(records)
	sortRuns(runs...)
	return digestOf(runs...)
}

// runsOf cuts records into runs of listingRun, which sortRuns sorts at
// once.
func runsOf(records []record) [][]record {
	var runs [][]record
	for len(records) > listingRun {
		runs = append(runs, records[:listingRun:listingRun])
		records = records[listingRun:]
	}
	return append(runs, records)
}

// LayerDigest is the digest of a layer that is a diff over the volume
// named base ("" for a root layer) and whose own table's digest is table:
// the same files over another volume are another view, so the base is
// part of what is vouched for.
func LayerDigest(base string, table Sum) Sum {
	h := sha256.New()
	h.Write([]byte("cowvol layer v1\n"))
	h.Write([]byte(base))
	h.Write([]byte{0})
	h.Write(table[:])
	var s Sum
	h.Sum(s[:0])
	return s
}

// Listing gathers a table's digest from a stream's files as they come (any
// order, from several goroutines): each regular file with its sum, each
// hardlink with the file it names, which takes that file's sum under its
// own path, as a walk of the tree finds it. Its files are kept in runs of
// a fixed size, not one slice: a million files are 64 MB, which a slice
// that grows by doubling would copy again and again, and hold twice over
// as it does, at the peak of a pull.
type Listing struct {
	mu    sync.Mutex
	files [][]record             // runs of listingRun, each full but the last
	links [][2][sha256.Size]byte // the link's path's hash, its target's
}

// listingRun is how many files a Listing keeps in one run: 4 MiB of them,
// 16 runs a million files for Digest's merge to choose between.
const listingRun = 1 << 16

// File lists a regular file. A run it fills it sorts (Digest finds it
// sorted): a pull's sorting is done as its files come, not after.
func (l *Listing) File(path string, sum Sum) {
	r := recordOf(path, sum)
	l.mu.Lock()
	if n := len(l.files); n == 0 || len(l.files[n-1]) == listingRun {
		l.files = append(l.files, make([]record, 0, listingRun))
	}
	last := &l.files[len(l.files)-1]
	*last = append(*last, r)
	full := *last
	l.mu.Unlock()
	if len(full) == listingRun {
		sortRecords(full) // (no File appends to a full run, and Digest comes after every File)
	}
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
// the last run is sorted here: File sorted every full one.
func (l *Listing) Digest() (Sum, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if n := len(l.files); n > 0 && len(l.files[n-1]) < listingRun {
		sortRecords(l.files[n-1])
	}
	if len(l.links) == 0 {
		return digestOf(l.files...), nil
	}
	linked := make([]record, 0, len(l.links))
	for _, link := range l.links {
		target, ok := l.lookup(link[1])
		if !ok {
			return Sum{}, errors.New("a hardlink to a file the stream did not carry")
		}
		var r record
		copy(r[:sha256.Size], link[0][:])
		copy(r[sha256.Size:], target[sha256.Size:])
		linked = append(linked, r)
	}
	sortRecords(linked)
	return digestOf(append(slices.Clip(l.files), linked)...), nil
}

// lookup is the record of the file whose path hashes to path, in runs
// sorted already.
func (l *Listing) lookup(path [sha256.Size]byte) (*record, bool) {
	for _, run := range l.files {
		if i, ok := slices.BinarySearchFunc(run, path, func(r record, target [sha256.Size]byte) int {
			return bytes.Compare(r[:sha256.Size], target[:])
		}); ok {
			return &run[i], true
		}
	}
	return nil, false
}
