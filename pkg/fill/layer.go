package fill

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/filesum"
)

// FetchFunc writes the whole data of the layer file rel (size bytes) into
// w at its offsets. It returns once all of it is written or it cannot be.
type FetchFunc func(ctx context.Context, rel string, size int64, w io.WriterAt) error

// Layer is the stubs of one layer dir being filled from one source.
type Layer struct {
	g *Group
	// dir is the layer's dir below the group's root, slash-separated.
	dir       string
	fetch     FetchFunc
	fetchMany FetchManyFunc
	// corrupt, if not nil, checks every file's data against its stub's
	// sum (CheckSums) and is told of what did not match.
	corrupt CorruptFunc
	ctx     context.Context
	cancel  context.CancelCauseFunc

	mu      sync.Mutex
	files   []*file
	byRel   map[string]*file
	dirs    map[string][]*file // by dir, as added: what a read-ahead takes
	ahead   map[string]*readAhead
	reached []string // what readers reached, in order
	// recording: a step over the layer names a read profile, so a filled
	// file is watched until a reader reaches it (see RecordReaches).
	recording atomic.Bool
	// watch sees the first readers of filled files (nil: it could not be
	// made, and such files stay held instead); closeWatch closes it once.
	watch      *watcher
	closeWatch sync.Once
	pending    int
	sealed     bool
	err        error
	done       chan struct{}
	// urgent counts the fetches its readers are held for, and urgentDone
	// is closed when that drops to zero; lastUrgent is when the last one
	// ended (all under the group's mu): its background fills wait while
	// there are any, and a little after (see readersFirst).
	urgent     int
	urgentDone chan struct{}
	lastUrgent time.Time
	// streaming says a stream of the whole layer is offering its files,
	// and streamAt and streamBytes are the place of the file it offers
	// now (all three under the group's mu; see Streaming).
	streaming   bool
	streamAt    int
	streamBytes int64
}

// FetchManyFunc brings the data of the layer files rels at once, handing
// each to each as it arrives (write writes it into w at its offsets), in
// any order; files it does not bring are fetched one by one.
type FetchManyFunc func(ctx context.Context, rels []string, each func(rel string, write func(w io.WriterAt) error) error) error

// NewLayer starts a layer of stubs under dir (below the group's root),
// whose files fetch brings, one at a time, and fetchMany (if not nil) many
// at a time, for read-ahead.
func (g *Group) NewLayer(dir string, fetch FetchFunc, fetchMany FetchManyFunc) (*Layer, error) {
	rel, err := g.below(dir)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	l := &Layer{g: g, dir: rel, fetch: fetch, fetchMany: fetchMany, ctx: ctx, cancel: cancel,
		byRel: map[string]*file{}, dirs: map[string][]*file{}, ahead: map[string]*readAhead{}, done: make(chan struct{})}
	if l.watch, err = newWatcher(l); err != nil {
		klog.ErrorS(err, "Readers of a lazy layer's filled files are held, not watched", "layer", dir)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		l.closeWatcher()
		cancel(errStopping)
		return nil, errors.New("the fill group is closed")
	}
	g.layers[l] = true
	return l, nil
}

// below is path below the group's root, slash-separated.
func (g *Group) below(path string) (string, error) {
	rel, err := filepath.Rel(g.root, filepath.Clean(path))
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") || filepath.IsAbs(rel) {
		return "", fmt.Errorf("%s is not below %s", path, g.root)
	}
	return filepath.ToSlash(rel), nil
}

// watchFilled has f's readers seen by the layer's watcher: see
// file.reached.
func (l *Layer) watchFilled(f *file) error {
	if l.watch == nil {
		return errors.New("the layer has no watcher")
	}
	return l.watch.watch(f)
}

// closeWatcher closes the layer's watcher, if it has one, and drops its
// marks.
func (l *Layer) closeWatcher() {
	l.closeWatch.Do(func() {
		if l.watch != nil {
			l.watch.close()
		}
	})
}

// A Stub is a file of the layer whose data is to come.
type Stub struct {
	Rel  string // below the layer's dir, slash-separated; its data is Rel's in the source
	Size int64
	// Place is its place among the regular files of the stream that
	// made the stubs (see streamer.Stub).
	Place int
	// Caps says it may carry file capabilities, which its fill puts back
	// (a write drops them); without, none are looked for.
	Caps bool
	// Dev and Ino are the stub's, and Times its access and modification
	// times (its fill puts them back): its maker has them, and a stat of
	// each stub would lengthen the publish.
	Dev, Ino uint64
	Times    [2]unix.Timespec
	// Sum is what its data hashes to (checked where the layer checks
	// sums).
	Sum filesum.Sum
}

// CorruptFunc is told that the data of the file rel, from a source of
// kind from (FromStream, FromHolder), did not hash to its sum: the file is
// fetched again, from a holder, once it returns.
type CorruptFunc func(rel, from string, err error)

// Where wrong bytes came from, for a CorruptFunc.
const (
	// FromStream: the stream of the whole layer (the holder's, or a
	// relay's copy of it).
	FromStream = "stream"
	// FromHolder: a fetch of the file alone from the current holder.
	FromHolder = "holder"
)

// CheckSums has every file's data checked against its stub's sum before it
// is put in place: no reader ever sees bytes that are not the volume's. A
// file whose bytes do not match is told to corrupt, and fetched again.
// Call it before the first Add.
func (l *Layer) CheckSums(corrupt CorruptFunc) { l.corrupt = corrupt }

// Sum is the sum the data of the stub rel (or of a file it is a link of)
// is checked against, if the layer checks sums and its stub says one: a
// filled layer's files' sums, known without reading them.
func (l *Layer) Sum(rel string) (filesum.Sum, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := l.byRel[rel]
	if f == nil || l.corrupt == nil || f.sum == (filesum.Sum{}) {
		return filesum.Sum{}, false
	}
	return f.sum, true
}

// Add holds readers of the stub s, open as fd (any flags; fd stays the
// caller's). An empty file needs nothing and is not held.
func (l *Layer) Add(fd int, s Stub) error {
	rel, size := s.Rel, s.Size
	if size == 0 {
		return nil
	}
	f := &file{layer: l, key: fileKey{dev: s.Dev, ino: s.Ino}, rel: rel, size: size, times: s.Times[:], place: s.Place, caps: s.Caps,
		sum: s.Sum, streamAt: -1}
	if l.g.byHandle.Load() {
		var err error
		f.handle, err = xfsHandleOf(fd)
		f.byHandle = err == nil
	}
	l.g.mu.Lock()
	if l.g.closed {
		l.g.mu.Unlock()
		return errors.New("the fill group is closed")
	}
	if linked, dup := l.g.files[f.key]; dup {
		l.g.mu.Unlock()
		// A hard link of a file added already: its readers by this name
		// are seen too (a watcher's events name what was opened).
		if linked.layer == l {
			l.mu.Lock()
			l.byRel[rel] = linked
			l.mu.Unlock()
		}
		return nil
	}
	l.g.files[f.key] = f
	delete(l.g.stale, f.key) // (an inode of a stale stub's, since freed)
	l.g.mu.Unlock()
	l.mu.Lock()
	l.files = append(l.files, f)
	l.byRel[rel] = f
	d := path.Dir(rel)
	f.index = len(l.dirs[d])
	l.dirs[d] = append(l.dirs[d], f)
	l.pending++
	l.mu.Unlock()
	if err := unix.FanotifyMark(l.g.fd, unix.FAN_MARK_ADD, marked, fd, ""); err != nil {
		l.g.finish(f, err)
		return fmt.Errorf("marking %s: %w", rel, err)
	}
	return nil
}

// RecordReaches says a step over the layer names a read profile: from
// now on a filled file is watched until its first reader (noted, not
// held), so that Reached sees every file readers open. Without it a
// filled file's mark goes with its fill (but where a read-ahead brought
// it), and its readers raise no event at all.
func (l *Layer) RecordReaches() { l.recording.Store(true) }

// Recording says RecordReaches was called.
func (l *Layer) Recording() bool { return l.recording.Load() }

// Seal says every stub is added: once they are all filled, the layer is
// done.
func (l *Layer) Seal() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sealed = true
	l.checkDone()
}

// settled counts a file's fill that ended (err nil: filled). One file that
// cannot be filled fails the layer, and the other fills stop.
func (l *Layer) settled(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.pending--
	if err != nil && l.err == nil {
		l.err = err
		l.cancel(err)
	}
	l.checkDone()
}

func (l *Layer) checkDone() {
	select {
	case <-l.done:
	default:
		if l.sealed && (l.pending == 0 || l.err != nil) {
			close(l.done)
		}
	}
}

// Offer fills rel from write, which writes its data into w at its
// offsets, unless rel is filled or being filled already (then write is not
// called, and Offer returns nil): how a stream of the whole layer fills
// what readers have not asked for. If write fails, the layer's FetchFunc
// brings the file instead. It returns once rel's data is read (a small
// file is put in place behind it), with an error once the layer failed.
func (l *Layer) Offer(rel string, write func(w io.WriterAt) error) error {
	l.mu.Lock()
	f := l.byRel[rel]
	l.mu.Unlock()
	if f == nil {
		return nil // empty, a link to a file offered already, or not a stub
	}
	l.g.mu.Lock()
	if f.streamAt >= l.streamAt {
		l.streamAt, l.streamBytes = f.streamAt, f.streamBytes
	}
	l.g.mu.Unlock()
	l.readersFirst()
	l.g.mu.Lock()
	mine := take(f, claim)
	l.g.mu.Unlock()
	if !mine {
		return nil
	}
	l.g.fillBehind(f, f.orFetch(write, nil))
	if l.ctx.Err() != nil {
		return context.Cause(l.ctx) // a fill failed: the layer is done for
	}
	return nil
}

// Fail stops the layer: files not filled fail, their waiters get EIO
// (now, not when a running fetch notices).
func (l *Layer) Fail(err error) {
	l.cancel(err)
	for _, f := range l.snapshot() {
		l.g.finish(f, err)
	}
}

// Release forgets the layer's files and their marks: its data is gone, or
// it is recorded ready or failed and no longer needs holding (a failed
// layer is released only once nothing mounts it, so its stubs answer EIO
// till then).
func (l *Layer) Release() {
	l.cancel(errors.New("released"))
	for _, f := range l.snapshot() {
		l.g.forget(f)
	}
	l.g.mu.Lock()
	delete(l.g.layers, l)
	l.g.mu.Unlock()
	l.closeWatcher()
}

func (l *Layer) snapshot() []*file {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]*file(nil), l.files...)
}

// Reached is the layer's files readers opened while it was being filled,
// in the order of their first opens (what its fills brought unasked is
// there once a reader reached it, if the layer records reaches: see
// RecordReaches), up to the opens that returned before the call.
func (l *Layer) Reached() []string {
	if l.watch != nil {
		l.watch.drain()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.reached)
}

// Done is closed once every file is filled or one failed (then Err says
// why).
func (l *Layer) Done() <-chan struct{} { return l.done }

// Err is why the layer failed, or nil.
func (l *Layer) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}
