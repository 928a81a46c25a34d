// Package filesum owns a layer's table of per-file SHA-256 sums: how it is
// computed from a tree (walked by descriptor, no symlink followed), how it
// is kept in a file, and how bytes are checked against a sum. The sums of
// a captured layer are what it held when it was captured; every byte a peer
// sends of it is checked against them before a reader sees it (the node
// engine computes and keeps them, the streamer carries them, fill checks
// them). It knows nothing of volumes, peers or metadata.
package filesum

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/bufpool"
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

// ErrMismatch says bytes are not what their sum says.
var ErrMismatch = errors.New("not the bytes the volume was captured with")

// Of is the sum of what r reads.
func Of(r io.Reader) (Sum, error) {
	// A buffer of the pool's, read into by hand: io.Copy from an
	// *os.File goes through its WriteTo, which makes a new 32 KiB buffer
	// for each file (a 300,000-file layer's table allocated 9.95 GB).
	buf := bufpool.Get(sumBuffer)
	defer bufpool.Put(buf)
	h := sha256.New()
	for {
		n, err := r.Read(buf)
		h.Write(buf[:n])
		if err == io.EOF {
			break
		}
		if err != nil {
			return Sum{}, err
		}
	}
	var s Sum
	h.Sum(s[:0])
	return s, nil
}

// sumBuffer is how much of a file Of reads at once.
const sumBuffer = 128 << 10

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
func OfTree(ctx context.Context, root string) (*Table, error) {
	return OfTreeKnowing(ctx, root, nil)
}

// emptySum is the sum of a file of no bytes, which is not read.
var emptySum = Sum(sha256.Sum256(nil))

// OfTreeKnowing is OfTree taking a file's sum from known (if not nil) where
// it knows one, by any of the file's names, instead of reading the file:
// the sums a pull checked the bytes against as they landed, which a copy
// of them carries. A file known under none of the names walked before it
// is read. The caller answers for known: its sums are not checked here.
func OfTreeKnowing(ctx context.Context, root string, known func(path string) (Sum, bool)) (*Table, error) {
	var b TableBuilder
	if err := walkSums(ctx, root, known, func(path string, sum Sum) error { b.Add(path, sum); return nil }); err != nil {
		return nil, err
	}
	return b.Table(), nil
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
