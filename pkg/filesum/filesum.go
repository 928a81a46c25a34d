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
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

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
	t := Table{}
	if err := walkSums(ctx, root, known, func(path string, sum Sum) error { t[path] = sum; return nil }); err != nil {
		return nil, err
	}
	return t, nil
}

// walkSums hands visit each regular file of the tree at root with its sum,
// as OfTreeKnowing takes it, in the walk's order.
func walkSums(ctx context.Context, root string, known func(path string) (Sum, bool), visit func(path string, sum Sum) error) error {
	rootFD, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening %s: %w", root, err)
	}
	defer unix.Close(rootFD)
	linked := map[[2]uint64]Sum{} // the sums of files of several names, by inode
	return fdtree.Walk(rootFD, fdtree.Visitor{Visit: func(e *fdtree.Entry) (bool, error) {
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
			var err error
			if sum, err = fileSum(e); err != nil {
				return false, err
			}
		}
		if e.Stat.Nlink > 1 {
			linked[inode] = sum
		}
		return true, visit(e.Path, sum)
	}})
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
	return writeTableFile(path, func(emit func(string, Sum) error) error {
		for p, sum := range t {
			if err := emit(p, sum); err != nil {
				return err
			}
		}
		return nil
	}, nil)
}

// WriteTreeFile keeps the table of the tree at root, as OfTreeKnowing
// sums it, at path as WriteFile does, without holding it: each file's
// record is written as the walk meets it, and the table's digest taken
// from a listing spilled beside path (a run of 4 MiB in memory, whatever
// the file count). It is kept only if its digest is want, else nothing is
// (ErrMismatch).
func WriteTreeFile(ctx context.Context, root string, known func(path string) (Sum, bool), path string, want Sum) error {
	spill, err := fdtree.Unnamed(filepath.Dir(path), "a listing's runs")
	if err != nil {
		return err
	}
	defer spill.Close()
	var listing Listing
	listing.Spill(spill)
	files := 0
	return writeTableFile(path, func(emit func(string, Sum) error) error {
		return walkSums(ctx, root, known, func(p string, sum Sum) error {
			files++
			listing.File(p, sum)
			return emit(p, sum)
		})
	}, func() error {
		got, err := listing.Digest()
		if err == nil && got != want {
			err = fmt.Errorf("the table of %s (%d files): %w", root, files, ErrMismatch)
		}
		return err
	})
}

// writeTableFile writes the records records emits to a file beside path,
// as a table is kept (its header, each record, the SHA-256 of all that),
// syncs it and, if check (if any) says so, renames it over path.
func writeTableFile(path string, records func(emit func(string, Sum) error) error, check func() error) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".sums-*")
	if err != nil {
		return err
	}
	h := sha256.New()
	bw := bufio.NewWriterSize(io.MultiWriter(tmp, h), 1<<20)
	bw.Write(fileHeader)
	var length [binary.MaxVarintLen64]byte
	err = records(func(p string, sum Sum) error {
		bw.Write(sum[:])
		bw.Write(length[:binary.PutUvarint(length[:], uint64(len(p)))])
		_, err := bw.WriteString(p)
		return err
	})
	if err == nil {
		err = bw.Flush()
	}
	if err == nil {
		_, err = tmp.Write(h.Sum(nil))
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil && check != nil {
		err = check()
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
