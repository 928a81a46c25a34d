package fill

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
)

// blob.go fills the blob of a mounted index (pkg/index) on demand. A read
// of a file of the index's mount makes the kernel read the blob, its extra
// device, at the file's extent; the blob is marked for pre-content events
// in the node's group, each event says the range the kernel reads, and
// the reader waits while every extent that range touches is fetched whole,
// checked against its sum and written in place. Unlike a stub's, a
// mapping of a file of the index raises events too: EROFS reads its blob
// through the kernel's read path, page faults included, so files are
// filled by extent, not on open. (The process holding a Blob must not
// fault on a mapping of its index itself: a Go thread held in a page fault
// stalls the collector's stop of the world, and the answer with it.)
//
// A blob's readers are held in the group that holds stubs' readers, so
// that the fill keeper keeps them across a restart of the plugin as it
// keeps theirs (keeper.go; a group closed would let them read the blob's
// holes), and a restarted plugin answers EIO to the readers of a blob it
// does not know in a layer left unfinished, as it does those of stubs.

// errBlobFailed: the Blob was failed (or closed), and fills nothing more.
var errBlobFailed = errors.New("the blob was failed")

// BlobFetch brings extent e's bytes whole: it writes them through w at
// their offsets in the file (0 to e.Size), and may leave runs of zeros
// unwritten.
type BlobFetch func(ctx context.Context, e index.Extent, w io.WriterAt) error

// Blob holds the readers of an index's blob until the extents their reads
// touch are in place.
type Blob struct {
	g *Group
	// file is the blob, opened through the group's clone (its writes and
	// reads raise no event), key how the group knows its events.
	file   fdtree.File
	key    fileKey
	layout *index.Layout
	fetch  BlobFetch
	// corrupt, if not nil, is told of bytes that were not an extent's
	// sum (then fetched again).
	corrupt CorruptFunc
	ctx     context.Context
	cancel  context.CancelFunc

	// recording: the first reads of each extent are noted (reached, in
	// order; seen by extent), see RecordReaches.
	recording atomic.Bool
	// placed marks the blocks of the extents in place (nil: none is
	// kept), which the group's fill keeper reads while shared, to answer
	// the reads of those itself (placed.go).
	placed *placedBlocks
	shared atomic.Bool

	mu      sync.Mutex
	reached []string
	seen    []bool
	// state is each extent's, and waiters the readers of those being
	// fetched: a byte an extent, not a list, for a blob of a million.
	state   []extentState
	waiters map[int][]*blobReader
	left    int           // extents neither in place nor failed
	err     error         // the first failure
	closed  bool          // failed: no fill starts
	done    chan struct{} // closed once all are in place, or one failed
	ended   bool          // done is closed
	fills   sync.WaitGroup

	closeOnce sync.Once
	closeErr  error
}

type extentState uint8

const (
	extentMissing extentState = iota
	extentFetching
	extentInPlace
	extentFailed
)

// blobReader is a held read of the blob: its event, and the extents it
// waits for.
type blobReader struct {
	ev       event
	pending  int
	answered bool
}

// OpenBlob holds the readers of the blob at path (below the group's root,
// made by the caller, of layout.Size bytes), whose extents layout says,
// from now on: every extent that carries its data is written in place
// at once, on a goroutine of its own (Layout.TakeInline; a reader of one
// waits for it), and every other one is fetched with fetch when a read
// first touches it, or offered by a stream (Offer), or prefetched
// (Prefetch). Bytes that are not an extent's sum are told to
// corrupt (if not nil) and fetched again, a few times at most.
func (g *Group) OpenBlob(path string, layout *index.Layout, fetch BlobFetch, corrupt CorruptFunc) (*Blob, error) {
	rel, err := g.below(path)
	if err != nil {
		return nil, err
	}
	b := &Blob{g: g, file: -1, layout: layout, fetch: fetch, corrupt: corrupt, state: make([]extentState, layout.Len()),
		waiters: map[int][]*blobReader{}, left: layout.Len(), done: make(chan struct{})}
	b.ctx, b.cancel = context.WithCancel(context.Background())
	if err := b.open(rel); err != nil {
		b.cancel()
		if b.file >= 0 {
			unix.Close(int(b.file))
		}
		if b.placed != nil {
			_ = b.placed.close()
		}
		return nil, err
	}
	return b, nil
}

// open opens the blob through the group's clone, marks it, and has the
// extents that carry their data (which the layout hands over) written
// behind the mark.
func (b *Blob) open(rel string) error {
	file, err := fdtree.OpenFileBeneath(b.g.tree, rel, unix.O_RDWR)
	if err != nil {
		return fmt.Errorf("the blob %s: %w", rel, err)
	}
	b.file = fdtree.File(file)
	var st unix.Stat_t
	if err := unix.Fstat(file, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != b.layout.Size {
		return fmt.Errorf("the blob %s: mode %o, %d bytes: want a regular file of %d", rel, st.Mode, st.Size, b.layout.Size)
	}
	b.key = fileKey{dev: st.Dev, ino: st.Ino}
	if b.left == 0 {
		b.end()
		return nil
	}
	// The bytes the layout carries are written behind the marked blob,
	// not before the mount: a million-file index's first 16 MB of small
	// files, one write each, were a fifth of its publish. A reader that
	// reaches one first waits for it as for a fetch: their extents are
	// fetching before the mark shows the blob to the group's dispatch.
	inline := b.layout.TakeInline()
	for _, i := range inline.Extents() {
		b.state[i] = extentFetching
	}
	b.share() // (before the mark: a fill started by a reader sets its bits)
	if err := b.mark(rel); err != nil {
		b.unshare()
		return errors.Join(err, inline.Close())
	}
	b.fills.Add(1)
	go b.writeInline(inline)
	return nil
}

// share has the group's fill keeper, if it can, answer the reads of the
// blob's blocks in place (placed.go), which the Blob marks from now on
// (b.placed is set before any fill can run). Where it cannot, every read
// goes through this process, as without a keeper.
func (b *Blob) share() {
	kc := b.g.keeper.Load()
	if kc == nil || !kc.answersPlaced || b.recording.Load() {
		return
	}
	placed, fd, err := newPlacedBlocks(b.layout.Size)
	if err != nil {
		klog.V(2).InfoS("The fill keeper is not told which blocks of a blob are in place; its reads all come here", "err", err)
		return
	}
	defer unix.Close(fd)
	b.placed = placed
	if err := kc.shareBlob(b.key, placed.blocks, fd); err != nil {
		klog.ErrorS(err, "Telling the fill keeper which blocks of a blob are in place; its reads all come here")
		return
	}
	b.shared.Store(true)
}

// unshare has the keeper hand every read of the blob to this process
// again, and returns once it does.
func (b *Blob) unshare() {
	if !b.shared.CompareAndSwap(true, false) {
		return
	}
	if kc := b.g.keeper.Load(); kc != nil && kc.forgetBlob(b.key) == nil {
		kc.sync()
	}
}

// mark has the group hold the readers of the blob, at rel.
func (b *Blob) mark(rel string) error {
	g := b.g
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return errors.New("the fill group is closed")
	}
	if _, dup := g.blobs[b.key]; dup {
		return fmt.Errorf("the blob %s is held already", rel)
	}
	if err := unix.FanotifyMark(g.fd, unix.FAN_MARK_ADD, unix.FAN_PRE_ACCESS, int(b.file), ""); err != nil {
		return fmt.Errorf("marking the blob for pre-content events: %w", err)
	}
	g.blobs[b.key] = b
	delete(g.stale, b.key) // (an inode of a stale blob's, since freed)
	return nil
}

// writeInline writes the extents whose bytes the layout carried into the
// blob, each settled as it is written, until the blob fails; one that
// cannot be fails the blob (with the rest: the disk is full, or their
// file is gone).
func (b *Blob) writeInline(inline *index.InlineBytes) {
	defer b.fills.Done()
	extents := inline.Extents()
	written := 0
	err := inline.Write(b.ctx, b.file, func(i int) {
		written++
		b.finish(i, nil)
	})
	for _, i := range extents[written:] {
		b.finish(int(i), err)
	}
}

// Done is closed once every extent is in place, or one failed (then Err
// says why).
func (b *Blob) Done() <-chan struct{} { return b.done }

// Err is the first extent's failure (nil: none yet).
func (b *Blob) Err() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.err
}

// dispatch answers ev, a read of the blob, once every extent its range
// touches is in place, EIO if one failed.
func (b *Blob) dispatch(ev event) {
	off, n := ev.off, ev.n
	if n < 0 || off < 0 || n > b.layout.Size {
		off, n = 0, b.layout.Size
	}
	r := &blobReader{ev: ev}
	b.mu.Lock()
	first, end := b.layout.Touching(off, n)
	if b.recording.Load() {
		b.reach(first, end)
	}
	failed := false
	for i := first; i < end && !failed; i++ {
		switch s := b.state[i]; {
		case s == extentInPlace:
			continue
		case s == extentFailed || b.closed:
			failed = true
			continue
		case s == extentMissing:
			b.state[i] = extentFetching
			b.fills.Add(1)
			go b.fill(i, nil)
		}
		b.waiters[i] = append(b.waiters[i], r)
		r.pending++
	}
	switch {
	case failed:
		r.answered = true
		b.mu.Unlock()
		b.g.respond(ev, denyEIO)
	case r.pending == 0:
		r.answered = true
		b.mu.Unlock()
		b.g.respond(ev, unix.FAN_ALLOW)
	default:
		b.mu.Unlock()
	}
}

// RecordReaches has the Blob note, from now on, the files whose extents
// readers reach first, in that order (Reached): what a read profile
// records, and a later pull streams first. A read reaches the extents its
// range touches, the kernel's read-ahead of the blob included.
func (b *Blob) RecordReaches() {
	b.recording.Store(true)
	b.unshare() // the keeper's answers would not be seen
}

// Recording says RecordReaches was called.
func (b *Blob) Recording() bool { return b.recording.Load() }

// Reached is the files whose extents readers reached since RecordReaches,
// in the order of their first reads, up to the reads answered before the
// call. Once every extent is in place its readers raise no event, and are
// not seen.
func (b *Blob) Reached() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.reached)
}

// reach notes the first reads of extents first to end. The caller holds
// mu.
func (b *Blob) reach(first, end int) {
	if b.seen == nil {
		b.seen = make([]bool, b.layout.Len())
	}
	for i := first; i < end; i++ {
		if !b.seen[i] {
			b.seen[i] = true
			b.reached = append(b.reached, b.layout.Extent(i).Path)
		}
	}
}

// Offer fills the extent of the file path from write, which writes its
// bytes through w at their offsets in the file, unless it is in place or
// being filled already (then write is not called, and Offer returns nil):
// how a stream of the whole layer fills what readers have not asked for.
// If write fails, or what it wrote is not the extent's sum, fetch brings
// the extent instead. It returns once the extent is settled, with an error
// once the blob failed.
func (b *Blob) Offer(path string, write func(w io.WriterAt) error) error {
	i := b.layout.Lookup(path)
	b.mu.Lock()
	mine := i >= 0 && !b.closed && b.state[i] == extentMissing
	if mine {
		b.state[i] = extentFetching
		b.fills.Add(1)
	}
	err := b.err
	b.mu.Unlock()
	if mine {
		b.fill(i, write)
		err = b.Err()
	}
	return err
}

// blobFetchTries is how many times an extent is fetched whose bytes were
// not its sum: each time from another holder (the source's CorruptFunc
// drops the one that sent them).
const blobFetchTries = 3

// fill brings extent i whole (from write if not nil and it can, else with
// the Blob's fetch, failed once it writes nothing for the group's stall,
// as a stub's is), checks it and answers its waiters.
func (b *Blob) fill(i int, write func(w io.WriterAt) error) {
	defer b.fills.Done()
	sum, err := b.layout.SumOf(i)
	if err != nil {
		b.finish(i, fmt.Errorf("%s: %w", b.layout.Extent(i).Path, err))
		return
	}
	// Its range, not its path: a path is decoded only where it is said.
	ew := extentWriter{file: b.file}
	ew.off, ew.size = b.layout.Range(i)
	fresh := true // the extent is a hole until a try writes it
	attempt := func(write func(w io.WriterAt) error) error {
		var w io.WriterAt = ew
		var landing *filesum.Landing
		if fresh && sum != (filesum.Sum{}) { // (an extent with no sum is not checked)
			landing = filesum.NewLanding(w)
			w = landing
		}
		fresh = false
		if err := write(w); err != nil {
			return err
		}
		return b.check(ew, sum, landing)
	}
	err = errors.New("no stream")
	if write != nil {
		err = attempt(write)
		b.tell(i, FromStream, err)
	}
	for try := 0; err != nil && try < blobFetchTries && b.ctx.Err() == nil; try++ {
		e := b.layout.Extent(i)
		err = attempt(func(w io.WriterAt) error {
			return fetchWatched(b.ctx, b.g.stall, w, func(ctx context.Context, w io.WriterAt) error { return b.fetch(ctx, e, w) })
		})
		if !errors.Is(err, filesum.ErrMismatch) {
			break
		}
		b.tell(i, FromHolder, err)
	}
	if err != nil {
		err = fmt.Errorf("%s: %w", b.layout.Extent(i).Path, err)
	}
	b.finish(i, err)
}

// tell says what came of extent i's bytes from a source of kind from
// that failed: wrong bytes to the CorruptFunc, the rest to the log.
func (b *Blob) tell(i int, from string, err error) {
	switch {
	case err == nil || b.ctx.Err() != nil:
	case errors.Is(err, filesum.ErrMismatch) && b.corrupt != nil:
		b.corrupt(b.layout.Extent(i).Path, from, err)
	default:
		klog.V(2).InfoS("An extent of an index's blob did not arrive whole; fetching it", "path", b.layout.Extent(i).Path, "from", from, "err", err)
	}
}

// Prefetch fetches every extent neither in place nor being filled,
// workers at once, in the blob's order, and returns once they are settled
// or the blob failed: what no reader asked for and no stream brought.
func (b *Blob) Prefetch(workers int) {
	next := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				b.fill(i, nil)
			}
		}()
	}
	for i := range b.layout.Len() {
		b.mu.Lock()
		stop := b.closed || b.err != nil
		mine := !stop && b.state[i] == extentMissing
		if mine {
			b.state[i] = extentFetching
			b.fills.Add(1)
		}
		b.mu.Unlock()
		if stop {
			break
		}
		if mine {
			next <- i
		}
	}
	close(next)
	wg.Wait()
}

// check says whether the extent ew wrote is sum (zeros: it has none): a
// wrong byte never reaches a reader. Where the try that wrote it was the
// first (landing not nil), its bytes were summed as they were written,
// unless they came out of order; else, or then, the extent is read back
// through the clone.
func (b *Blob) check(ew extentWriter, sum filesum.Sum, landing *filesum.Landing) error {
	if sum == (filesum.Sum{}) {
		return nil
	}
	back := io.NewSectionReader(b.file, ew.off, ew.size)
	if landing == nil {
		return filesum.Check(back, sum)
	}
	return landing.Check(ew.size, sum, back)
}

// finish records how extent i's fill ended and answers the readers it
// was the last one of, or fails those it was one of.
func (b *Blob) finish(i int, err error) {
	b.mu.Lock()
	waiters := b.waiters[i]
	delete(b.waiters, i)
	b.state[i] = extentInPlace
	var allow, deny []event
	if err == nil && b.placed != nil {
		b.placed.set(blockSpan(b.layout.Range(i)))
	}
	if err != nil {
		b.state[i] = extentFailed
		if !b.closed {
			klog.ErrorS(err, "Filling an extent of an index's blob failed; its readers, and every later one of what is not here, get EIO")
		}
		deny = b.failLocked(err)
	}
	for _, r := range waiters {
		r.pending--
		switch {
		case r.answered:
		case err != nil:
			r.answered = true
			deny = append(deny, r.ev)
		case r.pending == 0:
			r.answered = true
			allow = append(allow, r.ev)
		}
	}
	b.left--
	filled := b.left == 0 && b.err == nil
	if b.left == 0 {
		b.end()
	}
	b.mu.Unlock()
	if err != nil {
		b.cancel() // the fills under way are of a blob that cannot be whole
	}
	// Once all are in place, readers need not wait for this process; a
	// failed extent keeps the mark, which answers its readers EIO.
	if filled {
		b.unmark()
	}
	for _, ev := range allow {
		b.g.respond(ev, unix.FAN_ALLOW)
	}
	for _, ev := range deny {
		b.g.respond(ev, denyEIO)
	}
}

// end closes done, once. The caller holds mu, or is OpenBlob.
func (b *Blob) end() {
	if !b.ended {
		b.ended = true
		close(b.done)
	}
}

// unmark drops the blob's mark and the group's knowledge of it: its
// readers go through from now on.
func (b *Blob) unmark() {
	b.unshare()
	g := b.g
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.blobs[b.key] != b {
		return
	}
	delete(g.blobs, b.key)
	if g.closed {
		return // its marks went with it
	}
	if err := unix.FanotifyMark(g.fd, unix.FAN_MARK_REMOVE, unix.FAN_PRE_ACCESS, int(b.file), ""); err != nil {
		klog.ErrorS(err, "Unmarking a filled index's blob")
	}
}

// Fail stops the fills under way and answers every held reader EIO, and
// every later reader of an extent not in place, until Close.
func (b *Blob) Fail() {
	b.mu.Lock()
	deny := b.failLocked(errBlobFailed)
	b.mu.Unlock()
	b.cancel()
	for _, ev := range deny {
		b.g.respond(ev, denyEIO)
	}
	b.fills.Wait()
}

// failLocked fails the blob with err (unless it failed already): no fill
// starts, and done is closed. One extent that cannot be filled fails the
// blob, as one stub fails its layer: the volume cannot be whole, so no
// reader waits for the fills still under way (a hung holder would hold
// each for its own --pull-wait). It returns the held readers, each now
// answered, for the caller to deny once mu is let go; the fills under way
// find theirs answered. The caller holds mu.
func (b *Blob) failLocked(err error) []event {
	b.closed = true
	if b.err == nil {
		b.err = err
	}
	b.end()
	var deny []event
	for _, waiters := range b.waiters {
		for _, r := range waiters {
			if !r.answered {
				r.answered = true
				deny = append(deny, r.ev)
			}
		}
	}
	return deny
}

// Close fails the blob and lets go of it: its mark goes, and a read of
// it is no longer held, and reads its holes. The index is to be
// unmounted, and its files closed, before a blob not filled is closed. A
// second Close returns the first's error.
func (b *Blob) Close() error {
	b.closeOnce.Do(func() {
		b.Fail()
		b.unmark()
		b.closeErr = unix.Close(int(b.file))
		if b.placed != nil { // (no fill sets a bit once Fail returned)
			b.closeErr = errors.Join(b.closeErr, b.placed.close())
		}
	})
	return b.closeErr
}

// extentWriter writes an extent's bytes into the blob, at offsets in its
// file, and refuses any past its end.
type extentWriter struct {
	file      fdtree.File
	off, size int64 // the extent's, in the blob
}

func (w extentWriter) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off > w.size || int64(len(p)) > w.size-off {
		return 0, fmt.Errorf("%d bytes at %d of a file of %d: %w", len(p), off, w.size, unix.EINVAL)
	}
	return w.file.WriteAt(p, w.off+off)
}
