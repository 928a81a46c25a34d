package streamer

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/pkg/filesum"
)

// Shape is what a packed tar carries of regular files.
type Shape int

const (
	// PlainTar: every byte, holes as zeros; any tar reader reads it.
	PlainTar Shape = iota
	// SparseTar: sparse files as their data segments only, for Unpack (a
	// plain tar reader would misread them).
	SparseTar
	// StubTar: no data at all, each file a sparse map with no segment, so
	// that Unpack makes it the right size with nothing in it: the stubs a
	// lazy pull fills as they are read.
	StubTar
	// DataTar: only the regular files with data, each once (a file's
	// other names are left out), as SparseTar carries them but with their
	// names and sizes alone: no dirs, links or empty files, no owners,
	// modes, times or xattrs. What fills a lazy pull's stubs (Files), which
	// have all that already; the holder reads and sends no more.
	DataTar
	// StubRecords: what a StubTar says, as index records (records.go),
	// not a tar: what an index pull learns a tree from.
	StubRecords
)

func (s Shape) String() string {
	if names := []string{"plain", "sparse", "stubs", "data", "records"}; int(s) < len(names) {
		return names[s]
	}
	return fmt.Sprintf("shape %d", int(s))
}

// stubs says the shape is a stub tree's, whichever form.
func (s Shape) stubs() bool { return s == StubTar || s == StubRecords }

// Inline is which small regular files travel whole. In a StubTar: those
// of at most Max bytes, in the walk's order, until one would take their
// data over Budget bytes; from that file on, none (so that they are all
// the small files up to the last one carried). Their puller has them
// complete at once, and a file that small costs less to send than to
// stub and fill. In a stream of the rest of the layer's data: Through is
// the last file the stub tree carried, and the files it carried (those of
// at most Max bytes the walk meets up to Through) are left out.
type Inline struct {
	Max, Budget int64
	Through     string
}

// The bounds of Inline a holder takes: the data a stub tree carries stays
// a small part of it, so that a lazy publish stays flat in the size.
const (
	MaxInlineFile   = 64 << 10
	MaxInlineBudget = 64 << 20
)

// take notes that the regular file name of a stub tree came whole with
// size bytes, and refuses more than was asked for.
func (in *Inline) take(name string, size int64) error {
	if size > in.Max || size > in.Budget {
		return refused("%s: %d bytes of data in a stub tree, which asked for files of at most %d, %d in all", name, size, in.Max, in.Budget)
	}
	in.Budget -= size
	return nil
}

// Check says whether a puller's Inline is within bounds.
func (in Inline) Check() error {
	if in.Max < 0 || in.Max > MaxInlineFile || in.Budget < 0 || in.Budget > MaxInlineBudget {
		return fmt.Errorf("inlining files of at most %d bytes, %d in all: want at most %d and %d", in.Max, in.Budget, MaxInlineFile, MaxInlineBudget)
	}
	return nil
}

// A Stub is a regular file with a size that an extraction of a StubTar
// stream made (no data yet), its attributes set.
type Stub struct {
	FD   int // open while the StubFunc call lasts
	Name string
	Size int64
	// Place is its place among the stream's regular files (0 first),
	// which is its place in a stream of the tree's data from the same
	// holder (Pack walks a tree in one order).
	Place int
	// Caps says its entry carried file capabilities (security.capability),
	// which a write into the file drops: without, it has none.
	Caps bool
	// Dev and Ino are the file's, and Mtime what its access and
	// modification times were set to: what a stub's filler needs of it,
	// with no stat of its own.
	Dev, Ino uint64
	Mtime    unix.Timespec
	// Sum is what its bytes must hash to (in a Limits.Summed extraction:
	// the zero Sum otherwise).
	Sum filesum.Sum
}

// StubFunc is told of each Stub as it is made. It may be called from
// several goroutines at once, in any order; an error ends the extraction.
type StubFunc func(Stub) error
