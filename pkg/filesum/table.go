package filesum

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"iter"
	"os"
	"path/filepath"
	"slices"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/internal/walkorder"
)

// Table is a layer's regular files' sums, by their slash-separated path in
// the layer, kept in the order a walk meets the paths (walkorder): each
// path as what it does not share with the one before, and the sums in
// chunks beside them, or, for a table read from its file, left there and
// read as they are asked for. In memory, about 37 bytes a file
// (TestTableSize), where a map of them took 127; read from its file,
// about 5 (a million files of 12-byte paths: 5 MB, not 36). A node keeps
// the tables of up to 16 layers (those its peers pull). A Table is made
// by a TableBuilder or ReadFile and never changed after; a nil *Table is
// empty.
type Table struct {
	paths walkorder.List
	sums  [][]Sum   // in memory: chunks of sumChunk, each full but the last
	kept  *keptSums // or, if not nil, in the file the table was read from
}

// sumChunk is how many sums a chunk of a Table holds: 2 MiB of them.
const sumChunk = 1 << 16

// Len is how many files t has.
func (t *Table) Len() int {
	if t == nil {
		return 0
	}
	return t.paths.Len()
}

// Sum is the sum t has for path, if any. A sum that cannot be read from
// the table's file is none, and said in the log: what asks for it fails
// closed (a walk of the table, Digest and All, has it as the zero Sum,
// which no bytes have).
func (t *Table) Sum(path string) (Sum, bool) {
	if t == nil {
		return Sum{}, false
	}
	i := t.paths.Lookup(path)
	if i < 0 {
		return Sum{}, false
	}
	if t.kept == nil {
		return t.sum(i), true
	}
	return sumOf(t.kept.from(i, 4<<10), i, path)
}

// Finder finds sums in a Table for one goroutine, at a few nanoseconds a
// path asked in the walk's order (a packer's, a copy's), where Sum
// searches the whole table (a microsecond at a million files) and, for a
// table read from its file, reads its sum there.
type Finder struct {
	t *Table
	f *walkorder.Finder
	r *keptReader // at the table's file, where its sums lie
}

// Finder is a Finder of t's sums.
func (t *Table) Finder() *Finder {
	if t == nil {
		return &Finder{}
	}
	return &Finder{t: t, f: t.paths.Finder()}
}

// Sum is the sum the table has for path, if any, as Table.Sum says.
func (f *Finder) Sum(path string) (Sum, bool) {
	if f.t == nil {
		return Sum{}, false
	}
	i := f.f.Find(path)
	if i < 0 {
		return Sum{}, false
	}
	if f.t.kept == nil {
		return f.t.sum(i), true
	}
	if f.r == nil || f.r.next != i {
		f.r = f.t.kept.from(i, 8<<10) // (a lazy peer's request asks for one)
	}
	return sumOf(f.r, i, path)
}

// sum is sum i of a table whose sums are in memory.
func (t *Table) sum(i int) Sum { return t.sums[i/sumChunk][i%sumChunk] }

// add adds path, which comes after every path in t, with its sum.
func (t *Table) add(path string, sum Sum) {
	if n := len(t.sums); n == 0 || len(t.sums[n-1]) == sumChunk {
		t.sums = append(t.sums, make([]Sum, 0, min(sumChunk, max(16, t.Len()))))
	}
	k := len(t.sums) - 1
	t.sums[k] = append(t.sums[k], sum)
	t.paths.Add(path)
}

// files hands visit each of t's files in order, its path valid for the
// call only.
func (t *Table) files(visit func(path []byte, sum Sum) bool) {
	if t == nil {
		return
	}
	var kept *keptReader
	if t.kept != nil {
		kept = t.kept.from(0, 1<<20)
	}
	for r := t.paths.From(0); r.Next(); {
		sum := Sum{}
		if kept == nil {
			sum = t.sum(r.Index())
		} else {
			sum, _ = sumOf(kept, r.Index(), r.Path())
		}
		if !visit(r.Path(), sum) {
			return
		}
	}
}

// All is t's files in the order a walk meets them.
func (t *Table) All() iter.Seq2[string, Sum] {
	return func(yield func(string, Sum) bool) {
		t.files(func(path []byte, sum Sum) bool { return yield(string(path), sum) })
	}
}

// TableOf is the table of the files of m.
func TableOf(m map[string]Sum) *Table {
	var b TableBuilder
	for p, sum := range m {
		b.Add(p, sum)
	}
	return b.Table()
}

// TableBuilder gathers a table's files in any order, for one goroutine at
// a time: in the table's own form while they come in a walk's order, as
// a list to sort once one does not.
type TableBuilder struct {
	t     Table
	loose []looseFile // every file added, once one came out of order
	links [][2]string // a hardlink's path, its target's
}

type looseFile struct {
	path string
	sum  Sum
}

// Add adds the regular file at path with its sum. A path added again
// takes the sum added last.
func (b *TableBuilder) Add(path string, sum Sum) {
	if inOrder(b, path) {
		b.t.add(path, sum)
		return
	}
	if b.loose == nil {
		b.loose = make([]looseFile, 0, b.t.Len()+1)
		b.t.files(func(p []byte, sum Sum) bool { b.loose = append(b.loose, looseFile{string(p), sum}); return true })
		b.t = Table{}
	}
	b.loose = append(b.loose, looseFile{path, sum})
}

// inOrder says whether path comes after every path added, which are all
// in the walk's order.
func inOrder[P string | []byte](b *TableBuilder, path P) bool {
	return b.loose == nil && (b.t.Len() == 0 || walkorder.Compare(b.t.paths.Last(), path) < 0)
}

// Link adds a hardlink at path to the regular file at target, which takes
// its sum (added before or after). A link to a file not added is not in
// the table.
func (b *TableBuilder) Link(path, target string) {
	b.links = append(b.links, [2]string{path, target})
}

// Table is the table of the files added, and empties b.
func (b *TableBuilder) Table() *Table {
	t := b.t
	if b.loose != nil {
		t = tableOfLoose(b.loose)
	}
	if len(b.links) > 0 {
		loose := make([]looseFile, 0, t.Len()+len(b.links))
		t.files(func(p []byte, sum Sum) bool { loose = append(loose, looseFile{string(p), sum}); return true })
		for _, link := range b.links {
			if sum, ok := t.Sum(link[1]); ok {
				loose = append(loose, looseFile{link[0], sum})
			}
		}
		t = tableOfLoose(loose)
	}
	*b = TableBuilder{}
	t.trim()
	return &t
}

// trim lets go of what t's last chunk of sums holds past its end (up to
// 2 MiB: a table of a few files is small).
func (t *Table) trim() {
	if n := len(t.sums); n > 0 && cap(t.sums[n-1]) > len(t.sums[n-1]) {
		t.sums[n-1] = slices.Clone(t.sums[n-1])
	}
}

// tableOfLoose sorts files in place, and makes their table (of the last
// of each path added twice).
func tableOfLoose(files []looseFile) Table {
	slices.SortStableFunc(files, func(a, b looseFile) int { return walkorder.Compare(a.path, b.path) })
	var t Table
	for i, f := range files {
		if i+1 < len(files) && files[i+1].path == f.path {
			continue
		}
		t.add(f.path, f.sum)
	}
	return t
}

// Digest is the table's digest, taken as a Listing takes a stream's: its
// records in runs, each sorted as it fills. A table read from its file
// spills its runs beside the file (a run of 4 MiB in memory, where a
// million files' records are 64 MB), or keeps them in memory where it
// cannot.
func (t *Table) Digest() Sum {
	if t.Len() > listingRun && t.kept != nil {
		sum, err := t.spilledDigest()
		if err == nil {
			return sum
		}
		klog.V(2).InfoS("A table's digest could not spill its runs beside its file; taken in memory", "file", t.kept.path, "err", err)
	}
	sum, _ := t.listedDigest(nil) // (in memory, with no links: it cannot fail)
	return sum
}

// spilledDigest is the digest of a table read from its file, its runs
// spilled beside the file.
func (t *Table) spilledDigest() (Sum, error) {
	spill, err := fdtree.Unnamed(filepath.Dir(t.kept.path), "a table's digest's runs")
	if err != nil {
		return Sum{}, err
	}
	defer spill.Close()
	return t.listedDigest(spill)
}

// listedDigest is the digest of the table's records listed, their runs
// spilled to spill if not nil.
func (t *Table) listedDigest(spill *os.File) (Sum, error) {
	var listing Listing
	if spill != nil {
		listing.Spill(spill)
	}
	t.files(func(p []byte, sum Sum) bool { listing.add(recordOf(p, sum)); return true })
	return listing.Digest()
}

// The file a table is kept in: a header, then each file as its sum, its
// path's length (uvarint) and its path, in the walk's order (a file
// written before it was, in any order, is read all the same); then the
// SHA-256 of all that, so that a file torn or rotted reads as none.
var fileHeader = []byte("cowvol file sums v1\n")

// WriteFile keeps t at path: written beside it, synced, then renamed over
// it, so that a crash leaves the old file or the new one.
func (t *Table) WriteFile(path string) error {
	return writeTableFile(path, func(emit func([]byte, Sum) error) error {
		var err error
		t.files(func(p []byte, sum Sum) bool { err = emit(p, sum); return err == nil })
		return err
	}, nil)
}

// KeepTreeFile keeps the table of the tree at root, as OfTree sums it, at
// path as WriteFile does, without holding it: each file's record is
// written as the walk meets it (a capture's table, which nothing before it
// vouched for).
func KeepTreeFile(ctx context.Context, root, path string) error {
	return writeTableFile(path, treeRecords(ctx, root, nil, func(string, Sum) {}), nil)
}

// WriteTreeFile is KeepTreeFile taking sums from known as OfTreeKnowing
// does, with the table's digest taken from a listing spilled beside path
// (a run of 4 MiB in memory, whatever the file count). It is kept only if
// its digest is want, else nothing is (ErrMismatch).
func WriteTreeFile(ctx context.Context, root string, known func(path string) (Sum, bool), path string, want Sum) error {
	spill, err := fdtree.Unnamed(filepath.Dir(path), "a listing's runs")
	if err != nil {
		return err
	}
	defer spill.Close()
	var listing Listing
	listing.Spill(spill)
	files := 0
	return writeTableFile(path, treeRecords(ctx, root, known, func(p string, sum Sum) {
		files++
		listing.File(p, sum)
	}), func() error {
		got, err := listing.Digest()
		if err == nil && got != want {
			err = fmt.Errorf("the table of %s (%d files): %w", root, files, ErrMismatch)
		}
		return err
	})
}

// treeRecords emits the record of each regular file of the tree at root,
// summed as OfTreeKnowing sums it, in the walk's order, showing each to
// seen first.
func treeRecords(ctx context.Context, root string, known func(path string) (Sum, bool), seen func(path string, sum Sum)) func(emit func([]byte, Sum) error) error {
	return func(emit func([]byte, Sum) error) error {
		return walkSums(ctx, root, known, func(p string, sum Sum) error {
			seen(p, sum)
			return emit([]byte(p), sum)
		})
	}
}

// writeTableFile writes the records records emits to a file beside path,
// as a table is kept (its header, each record, the SHA-256 of all that),
// syncs it and, if check (if any) says so, renames it over path.
func writeTableFile(path string, records func(emit func([]byte, Sum) error) error, check func() error) error {
	w, err := CreateTableFile(path)
	if err != nil {
		return err
	}
	if err := records(func(p []byte, sum Sum) error { w.add(p, sum); return w.err }); err != nil && w.err == nil {
		w.err = err // (a walk's: nothing is kept)
	}
	return w.keep(true, check)
}

// TableWriter writes a table's file as its files come, never holding the
// table: a capture's walk's (KeepTreeFile), or a pull's, whose stream
// said each file's sum as it came (and whose digest the pull checked).
// Files come in the walk's order, a hard link's name after its target's
// (a file in another order is kept all the same; ReadFile reads it whole).
// It is written beside its path and renamed there once kept; what is not
// kept is removed (Abandon).
type TableWriter struct {
	path string
	f    *os.File
	h    hash.Hash // of all written (hashed again where links were: linkSums)
	w    *bufio.Writer
	head [sha256.Size + binary.MaxVarintLen64]byte // a record's sum and path length
	off  int64                                     // where the next record starts
	// links are the records written with no sum yet: hard links, whose
	// target's sum Keep reads back from the file.
	links []pendingLink
	err   error
}

// pendingLink is a hard link's record, at off in the file, whose sum is
// its target's.
type pendingLink struct {
	off    int64
	target string
}

// CreateTableFile starts the table to be kept at path.
func CreateTableFile(path string) (*TableWriter, error) {
	f, err := os.CreateTemp(filepath.Dir(path), ".sums-*")
	if err != nil {
		return nil, err
	}
	w := &TableWriter{path: path, f: f, h: sha256.New()}
	w.w = bufio.NewWriterSize(io.MultiWriter(f, w.h), 1<<20)
	w.w.Write(fileHeader)
	w.off = int64(len(fileHeader))
	return w, nil
}

// File writes the record of the regular file at path, whose data hashes
// to sum.
func (w *TableWriter) File(path string, sum Sum) { w.add([]byte(path), sum) }

// Link writes the record of path, a hard link to target, a regular file
// written before it by File (a link's name is not one, as a Listing
// says): its sum is target's.
func (w *TableWriter) Link(path, target string) {
	w.links = append(w.links, pendingLink{off: w.off, target: target})
	w.add([]byte(path), Sum{})
}

func (w *TableWriter) add(p []byte, sum Sum) {
	if w.err != nil {
		return
	}
	copy(w.head[:], sum[:])
	n := sha256.Size + binary.PutUvarint(w.head[sha256.Size:], uint64(len(p)))
	w.w.Write(w.head[:n])
	_, w.err = w.w.Write(p)
	w.off += int64(n + len(p))
}

// Keep gives each hard link its target's sum, ends the file with its
// trailer and renames it to its path, not synced (the caller syncs it
// before the layer is made ready): a file a crash tore reads as none
// (ErrBadFile), and its layer is summed again from its data. A link whose
// target is not before it fails it. It lets go of the file either way.
func (w *TableWriter) Keep() error { return w.keep(false, nil) }

// keep is Keep, syncing the file first if sync says, and renaming it only
// if check (if any) says so.
func (w *TableWriter) keep(sync bool, check func() error) error {
	if err := w.finish(sync, check); err != nil {
		w.Abandon()
		return fmt.Errorf("keeping file sums at %s: %w", w.path, err)
	}
	return nil
}

func (w *TableWriter) finish(sync bool, check func() error) error {
	err := w.err
	if err == nil {
		err = w.w.Flush()
	}
	if err == nil && len(w.links) > 0 {
		err = w.linkSums()
	}
	if err == nil {
		_, err = w.f.Write(w.h.Sum(nil))
	}
	if err == nil && sync {
		err = w.f.Sync()
	}
	if cerr := w.f.Close(); err == nil {
		err = cerr
	}
	if err == nil && check != nil {
		err = check()
	}
	if err == nil {
		err = os.Rename(w.f.Name(), w.path)
	}
	if err == nil {
		w.f = nil
	}
	return err
}

// linkSums writes each link's record's sum, its target's, read back from
// the file as the records before it, then hashes the file again.
func (w *TableWriter) linkSums() error {
	targets := make(map[string]*Sum, len(w.links))
	for _, l := range w.links {
		targets[l.target] = nil
	}
	r := keptReader{r: bufio.NewReaderSize(io.NewSectionReader(w.f, 0, w.off), 1<<20), limit: w.off}
	if _, err := r.r.Discard(len(fileHeader)); err != nil {
		return err
	}
	r.off = int64(len(fileHeader))
	links := w.links
	for len(links) > 0 {
		off := r.off
		if err := r.record(); err != nil {
			return err
		}
		if off == links[0].off {
			target := targets[links[0].target]
			if target == nil {
				return fmt.Errorf("%s: a hard link to %q, no file before it", r.rec.path, links[0].target)
			}
			if _, err := w.f.WriteAt(target[:], off); err != nil {
				return err
			}
			links = links[1:]
		} else if known, ok := targets[string(r.rec.path)]; ok && known == nil {
			sum := r.rec.sum
			targets[string(r.rec.path)] = &sum
		}
	}
	w.h.Reset()
	_, err := io.Copy(w.h, io.NewSectionReader(w.f, 0, w.off))
	return err
}

// Abandon removes the file of a table not kept. After Keep it does
// nothing.
func (w *TableWriter) Abandon() {
	if w == nil || w.f == nil {
		return
	}
	w.f.Close()
	if err := os.Remove(w.f.Name()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		klog.ErrorS(err, "Removing a table of file sums not kept", "path", w.f.Name())
	}
	w.f = nil
}

// ErrBadFile says a table's file is torn or rotted.
var ErrBadFile = errors.New("a file of sums that does not read whole")

// ReadFile reads a table kept at path, as it reads it (the file whole is
// never held), and answers nothing unless its last 32 bytes are the
// SHA-256 of all before. A file in the walk's order (as every table is
// written now) leaves the table's sums where they are: the table reads
// each from it as it is asked for (a record whose path is not the one
// asked for, in a file that is not the one read, answers none). One kept
// in no order (before tables were kept in the walk's) is read into
// memory whole.
func ReadFile(path string) (*Table, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, err
	}
	t := &Table{kept: &keptSums{path: path, id: [2]uint64{st.Dev, st.Ino}}}
	inOrder := true
	err = readRecords(f, st.Size, func(off int64, p []byte, _ Sum) {
		switch {
		case !inOrder:
		case t.Len() > 0 && walkorder.Compare(t.paths.Last(), p) >= 0:
			inOrder = false
		default:
			if t.Len()%walkorder.Restart == 0 {
				t.kept.at = append(t.kept.at, off)
			}
			t.kept.longest = max(t.kept.longest, int64(len(p)))
			t.paths.Add(unsafe.String(unsafe.SliceData(p), len(p))) // (kept as a copy: no string made a file)
		}
	})
	if err == nil && !inOrder {
		var b TableBuilder
		err = readRecords(f, st.Size, func(_ int64, p []byte, sum Sum) { b.Add(string(p), sum) })
		t = b.Table()
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if t.Len() == 0 {
		t.kept = nil // (nothing to read there)
	}
	return t, nil
}

// readRecords hands visit each record of the table kept in f (of size
// bytes), with where it starts, then checks the file's trailer: what
// visit was handed counts only if that says nil.
func readRecords(f *os.File, size int64, visit func(off int64, path []byte, sum Sum)) error {
	body := size - sha256.Size
	if body < int64(len(fileHeader)) {
		return ErrBadFile
	}
	h := sha256.New()
	r := keptReader{r: bufio.NewReaderSize(io.TeeReader(io.NewSectionReader(f, 0, body), h), 1<<20), limit: body}
	header := make([]byte, len(fileHeader))
	if _, err := io.ReadFull(r.r, header); err != nil || !bytes.Equal(header, fileHeader) {
		return ErrBadFile
	}
	r.off = int64(len(header))
	for {
		off := r.off
		if err := r.record(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return err
		}
		visit(off, r.rec.path, r.rec.sum)
	}
	var whole Sum
	if _, err := f.ReadAt(whole[:], body); err != nil || Sum(h.Sum(nil)) != whole {
		return ErrBadFile
	}
	return nil
}

// keptSums are the sums of a table read from its file, left there. The
// file is opened for each read, never held: a layer removed meanwhile
// frees its blocks at once, and its filesystem is never kept busy.
type keptSums struct {
	path string
	id   [2]uint64 // the file's device and inode, as it was read
	at   []int64   // where the record of each Restart-th path starts
	// longest is the longest path the file held as it was read: a
	// record that says a longer one since is not read (a length rotted
	// into a terabyte must not be allocated).
	longest int64
}

// keptFile reads a table's kept file from off on, a read at a time.
type keptFile struct {
	k   *keptSums
	off int64
}

// Read reads the file at r.off, opened for the read: not the file the
// table was read from (replaced, or gone) is ErrBadFile.
func (r *keptFile) Read(p []byte) (int, error) {
	f, err := os.Open(r.k.path)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, ErrBadFile
	} else if err != nil {
		return 0, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, err
	}
	if [2]uint64{st.Dev, st.Ino} != r.k.id {
		return 0, ErrBadFile
	}
	n, err := f.ReadAt(p, r.off)
	r.off += int64(n)
	if n > 0 && errors.Is(err, io.EOF) {
		err = nil
	}
	return n, err
}

// keptReader reads the records of a kept table in order.
type keptReader struct {
	r     *bufio.Reader
	off   int64 // where the next record starts
	next  int   // the index of the next record, where it reads a table's
	limit int64 // no path is longer
	rec   struct {
		sum  Sum
		path []byte
	}
}

// from reads k's records from record i's restart on, buffer bytes at a
// time.
func (k *keptSums) from(i, buffer int) *keptReader {
	r := i / walkorder.Restart
	at := k.at[r]
	return &keptReader{r: bufio.NewReaderSize(&keptFile{k: k, off: at}, buffer), off: at, next: r * walkorder.Restart, limit: k.longest}
}

// record reads the next record: io.EOF where none starts.
func (r *keptReader) record() error {
	if _, err := io.ReadFull(r.r, r.rec.sum[:]); errors.Is(err, io.EOF) {
		return io.EOF
	} else if err != nil {
		return ErrBadFile
	}
	n, err := binary.ReadUvarint(r.r)
	if err != nil || n > uint64(r.limit) {
		return ErrBadFile
	}
	r.rec.path = slices.Grow(r.rec.path[:0], int(n))[:n]
	if _, err := io.ReadFull(r.r, r.rec.path); err != nil {
		return ErrBadFile
	}
	r.off += int64(len(r.rec.sum)) + int64(uvarintLen(n)) + int64(n)
	r.next++
	return nil
}

func uvarintLen(n uint64) int {
	var b [binary.MaxVarintLen64]byte
	return binary.PutUvarint(b[:], n)
}

// sumOf reads on from r to record i, whose path is want, and says its sum:
// none (said in the log) if the file no longer reads so (it changed since
// the table was read from it, or cannot be read).
func sumOf[P string | []byte](r *keptReader, i int, want P) (Sum, bool) {
	var err error
	for err == nil && r.next <= i {
		err = r.record()
	}
	if errors.Is(err, io.EOF) || err == nil && walkorder.Compare(r.rec.path, want) != 0 {
		err = ErrBadFile // (cut short, or changed)
	}
	if err != nil {
		klog.ErrorS(err, "A layer's file sums could not be read from their file; the file's sum is taken as none", "file", string(want))
		return Sum{}, false
	}
	return r.rec.sum, true
}
