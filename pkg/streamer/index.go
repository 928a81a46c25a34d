package streamer

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/batch"
	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
)

// IndexStubs reads a stub tree, a StubRecords stream or a StubTar one (a
// holder that knows no records sends the tar; their first bytes tell
// them apart), as UnpackStubs reads a StubTar, but makes nothing on disk
// but the index: it writes the tree's index into image (an empty file) as
// its entries come, which its caller mounts, whatever the tree's file
// count. It checks every entry as an extraction does (names, xattrs,
// links to files before them, devices, the small files inline asked for
// and their sums), takes only a packer's stream (its root first, then a
// walk's order: index.Writer's), and says where the tree's files lie in
// the index's blob: its small files with their data, and its regular
// files with their sums where lim.Summed, each also written to sums (if
// not nil) as it comes: the layer's table, which its caller keeps once
// the stream is checked, and no walk of the filled layer then makes.
// A tree the index cannot say fails it with index.ErrUnindexable; the
// image is then not whole.
func IndexStubs(ctx context.Context, r io.Reader, enc Encoding, lim Limits, inline Inline, image *os.File, sums *filesum.TableWriter) (*index.Layout, Summary, error) {
	if lim.Strict {
		return nil, Summary{}, errors.New("a stub tree is a peer's stream, never strict")
	}
	if !lim.Summed {
		sums = nil // (a table of no sums)
	}
	x := &indexer{lim: lim, inline: inline, image: image, sums: sums}
	if lim.Summed {
		// The listing's runs are spilled beside the image: 64 MB a
		// million files, which need not be in memory until the digest.
		spill, err := fdtree.Unnamed(filepath.Dir(image.Name()), "a listing's runs")
		if err != nil {
			return nil, Summary{}, err
		}
		defer spill.Close()
		x.listing.Spill(spill)
		x.lister = x.listing.Lister()
		defer x.lister.Close()
	}
	defer func() {
		if x.adder != nil {
			x.adder.Close()
		}
		if x.writer != nil {
			x.writer.Abandon() // (failed)
		}
	}()
	sum, err := readDecoded(r, enc, lim, func(in io.Reader) (int64, error) {
		br, release := fromPool[*bufio.Reader](&bufReaders, in)
		defer release()
		if magic, err := br.Peek(len(recordsMagic)); err == nil && string(magic) == recordsMagic {
			_, _ = br.Discard(len(recordsMagic))
			return x.records(ctx, br)
		}
		return readTar(ctx, br, lim, x.entry)
	})
	if err == nil && x.writer == nil {
		err = refused("an empty stub tree")
	}
	if err == nil {
		x.adder.Close()
		if failed := x.failed.Load(); failed != nil {
			err = *failed
		}
	}
	var layout *index.Layout
	if err == nil {
		// The listing's digest is taken while the index is finished: a
		// pull of a million files waits on both.
		var digestErr error
		var digesting sync.WaitGroup
		if lim.Summed {
			x.lister.Close()
			digesting.Go(func() {
				sum.Files, digestErr = x.listing.Digest()
				x.listing = filesum.Listing{} // (a run of them) not held with the layout
			})
		}
		layout, err = x.writer.Close()
		x.writer = nil
		digesting.Wait()
		if err == nil && digestErr != nil {
			err = digestErr
			layout.Close()
		}
	}
	if err != nil {
		return nil, Summary{}, err
	}
	sum.Inlined = x.inlined
	return layout, sum, nil
}

// indexer learns a stub tree's entries into an index.Writer.
type indexer struct {
	image  *os.File
	writer *index.Writer
	// adder adds the entries read and checked to writer on a goroutine of
	// its own, while the next ones are read and checked; failed is its
	// first error, which stops it and the reading.
	adder   *batch.Worker[learnt]
	failed  atomic.Pointer[error]
	lim     Limits
	inline  Inline
	inlined string
	listing filesum.Listing
	lister  *filesum.Lister      // into listing, where lim.Summed
	sums    *filesum.TableWriter // the table, where lim.Summed and asked for
}

// records learns the records of br, past their magic, to their end.
func (x *indexer) records(ctx context.Context, br *bufio.Reader) (int64, error) {
	rr := recordReader{r: br}
	return eachEntry(ctx, x.lim.Entries, rr.next, x.record)
}

// record learns one record, checked as entry checks a tar's.
func (x *indexer) record(rec *record) error {
	name := rec.name
	if x.writer == nil && name == "" && rec.kind == recDir {
		name = rootName
	} else if err := x.started(name); err != nil {
		return err
	} else if name, err := cleanName(name); err != nil || name != rec.name {
		return refused("entry name %q", rec.name)
	}
	if rec.kind == recLink {
		target, err := cleanName(rec.target)
		if err != nil || target != rec.target {
			return refused("%s: hardlink to %q", name, rec.target)
		}
		return x.link(name, target)
	}
	for k, v := range rec.xattrs {
		if err := checkXattr(name, k, v, false); err != nil {
			return err
		}
	}
	e := index.Entry{Name: name, Xattrs: rec.xattrs}
	e.Stat.Uid, e.Stat.Gid = rec.uid, rec.gid
	e.Stat.Mtim = unix.NsecToTimespec(rec.mtime)
	switch rec.kind {
	case recDir:
		e.Stat.Mode = unix.S_IFDIR | rec.mode
		if name == rootName {
			return x.root(e)
		}
	case recFile, recStub:
		e.Stat.Mode, e.Stat.Size, e.Sum = unix.S_IFREG|rec.mode, rec.size, rec.sum
		if !rec.summed && x.lim.Summed {
			return refused("%s: a layer's file with no sum", name)
		}
		var data func([]byte) error
		if rec.kind == recFile {
			data = func(b []byte) error { copy(b, rec.data); return nil }
		}
		if err := x.regular(&e, data); err != nil {
			return err
		}
	case recSymlink:
		e.Stat.Mode, e.Target = unix.S_IFLNK|0o777, rec.target // a symlink's mode is never set
	case recWhiteout:
		if rec.major != 0 || rec.minor != 0 {
			return refused("%s: device node %d:%d (only whiteouts, 0:0, are moved)", name, rec.major, rec.minor)
		}
		e.Stat.Mode = unix.S_IFCHR | rec.mode
	case recFifo:
		e.Stat.Mode = unix.S_IFIFO | rec.mode
	}
	return x.add(e)
}

// entry learns one entry of a StubTar.
func (x *indexer) entry(hdr *tar.Header, body io.Reader) error {
	if hdr.Name == rootName {
		if hdr.Typeflag != tar.TypeDir {
			return refused("a root entry (%q) that is not a dir", hdr.Name)
		}
		root, err := x.entryOf(rootName, hdr, unix.S_IFDIR)
		if err != nil {
			return err
		}
		return x.root(root)
	}
	if err := x.started(hdr.Name); err != nil {
		return err
	}
	name, err := cleanName(hdr.Name)
	if err != nil {
		return err
	}
	var e index.Entry
	switch hdr.Typeflag {
	case tar.TypeDir:
		e, err = x.entryOf(name, hdr, unix.S_IFDIR)
	case tar.TypeReg:
		e, err = x.file(name, hdr, body)
	case tar.TypeSymlink:
		e, err = x.entryOf(name, hdr, unix.S_IFLNK)
		e.Stat.Mode, e.Target = unix.S_IFLNK|0o777, hdr.Linkname // a symlink's mode is never set
	case tar.TypeLink:
		target, err := cleanName(hdr.Linkname)
		if err != nil {
			return refused("%s: hardlink to %q", name, hdr.Linkname)
		}
		return x.link(name, target)
	case tar.TypeChar:
		if hdr.Devmajor != 0 || hdr.Devminor != 0 {
			return refused("%s: device node %d:%d (only whiteouts, 0:0, are moved)", name, hdr.Devmajor, hdr.Devminor)
		}
		e, err = x.entryOf(name, hdr, unix.S_IFCHR)
	case tar.TypeFifo:
		e, err = x.entryOf(name, hdr, unix.S_IFIFO)
	default:
		return refused("%s: entry type %q", name, hdr.Typeflag)
	}
	if err != nil {
		return err
	}
	return x.add(e)
}

// root starts the tree at its root, the stream's first entry.
func (x *indexer) root(e index.Entry) error {
	if x.writer != nil {
		return refused("a root entry (%q) that is not the first", rootName)
	}
	var err error
	if x.writer, err = index.NewWriter(x.image, index.Options{KeepSetuid: x.lim.KeepSetuid}, e); err == nil {
		x.adder = batch.Start(learntBatch, x.learn)
	}
	return err
}

// started refuses an entry before the root: every entry but the root
// checks it first.
func (x *indexer) started(name string) error {
	if x.writer == nil {
		return refused("a stub tree whose first entry, %q, is not its root", name)
	}
	return nil
}

// learnt is an entry read and checked, for the adder: a hard link to
// linkTo if that is set.
type learnt struct {
	e      index.Entry
	linkTo string
}

// learntBatch is how many entries the adder is handed at once.
const learntBatch = 256

// add hands e to the adder, unless it failed.
func (x *indexer) add(e index.Entry) error {
	if failed := x.failed.Load(); failed != nil {
		return *failed
	}
	x.adder.Add(learnt{e: e})
	return nil
}

// link learns name as a hard link to target, a file before it.
func (x *indexer) link(name, target string) error {
	if failed := x.failed.Load(); failed != nil {
		return *failed
	}
	x.adder.Add(learnt{e: index.Entry{Name: name}, linkTo: target})
	if x.lim.Summed {
		x.listing.Link(name, target)
	}
	if x.sums != nil {
		x.sums.Link(name, target)
	}
	return nil
}

// learn adds a batch of entries to the index, on the adder's goroutine,
// until one fails: refused, but for what an index cannot say, which the
// caller falls back on another way for.
func (x *indexer) learn(batch []learnt) {
	if x.failed.Load() != nil {
		return
	}
	for _, l := range batch {
		var err error
		if l.linkTo != "" {
			err = x.writer.Link(l.e.Name, l.linkTo)
		} else {
			err = x.writer.Add(l.e)
		}
		if err != nil {
			if !errors.Is(err, index.ErrUnindexable) {
				err = refused("%v", err)
			}
			x.failed.Store(&err)
			return
		}
	}
}

// regular learns the regular file e says (its size and sum set), with its
// data written by data where the stream carried it whole (nil: a stub).
func (x *indexer) regular(e *index.Entry, data func([]byte) error) error {
	if x.lim.Summed {
		x.lister.File(e.Name, e.Sum)
	}
	if x.sums != nil {
		x.sums.File(e.Name, e.Sum)
	}
	if data == nil {
		return nil
	}
	// Its size, not its body's: the data is made whole here, and a sparse
	// map may say a size of terabytes over a body of a few bytes. A packer
	// inlines by size too.
	if err := x.inline.take(e.Name, e.Stat.Size); err != nil {
		return err
	}
	x.inlined = e.Name
	e.Data = make([]byte, e.Stat.Size) // at most inline.Max: holes read as zeros
	if err := data(e.Data); err != nil {
		return fmt.Errorf("%s: %w", e.Name, err)
	}
	if x.lim.Summed {
		if err := filesum.Check(bytes.NewReader(e.Data), e.Sum); errors.Is(err, filesum.ErrMismatch) {
			return fmt.Errorf("%w: %s: %w", ErrCorrupt, e.Name, err)
		}
	}
	return nil
}

// entryOf is the entry hdr says, of type kind, named name: its mode,
// owner, time and the xattrs that travel.
func (x *indexer) entryOf(name string, hdr *tar.Header, kind uint32) (index.Entry, error) {
	if err := checkEntry(name, hdr, false); err != nil {
		return index.Entry{}, err
	}
	if hdr.Uid < 0 || hdr.Uid > math.MaxUint32 || hdr.Gid < 0 || hdr.Gid > math.MaxUint32 {
		return index.Entry{}, refused("%s: owner %d:%d", name, hdr.Uid, hdr.Gid)
	}
	e := index.Entry{Name: name}
	e.Stat.Mode = kind | uint32(hdr.Mode&0o7777)
	e.Stat.Uid, e.Stat.Gid = uint32(hdr.Uid), uint32(hdr.Gid)
	e.Stat.Mtim = fileTime(hdr)
	for k, v := range hdr.PAXRecords {
		if xattr, ok := strings.CutPrefix(k, paxXattr); ok {
			if e.Xattrs == nil {
				e.Xattrs = map[string]string{}
			}
			e.Xattrs[xattr] = v
		}
	}
	return e, nil
}

// file is the regular file hdr says: a stub (its size in its sparse map,
// no data), or a small file carried whole, checked against its sum.
func (x *indexer) file(name string, hdr *tar.Header, body io.Reader) (index.Entry, error) {
	e, err := x.entryOf(name, hdr, unix.S_IFREG)
	if err != nil {
		return e, err
	}
	if hdr.Size < 0 {
		return e, refused("%s: size %d", name, hdr.Size)
	}
	segments, size := [][2]int64{{0, hdr.Size}}, hdr.Size
	if rec, ok := hdr.PAXRecords[paxHoles]; ok {
		if size, segments, err = parseHoles(rec, hdr.Size); err != nil {
			return e, err
		}
	}
	e.Stat.Size = size
	if x.lim.Summed {
		if e.Sum, err = entrySum(name, hdr); err != nil {
			return e, err
		}
	}
	var data func([]byte) error
	if !isStub(hdr) {
		data = func(b []byte) error {
			for _, s := range segments {
				if _, err := io.ReadFull(body, b[s[0]:s[0]+s[1]]); err != nil {
					return err
				}
			}
			return nil
		}
	}
	return e, x.regular(&e, data)
}
