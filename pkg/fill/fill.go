// Package fill holds the readers of a lazily pulled layer until the data
// they open is in place: the layer's regular files are made as stubs (the
// right size, no data), each stub is marked in one fanotify pre-content
// group, and an open or a read of a stub that is not filled yet waits while
// the file's bytes are fetched and written in place, then goes on; if they
// cannot be fetched it fails with EIO.
//
// A file is filled whole before its first open returns. Ranges would let a
// reader of a few pages of a large file go on sooner, but a mapping made
// through an overlay mount raises no event (the kernel maps the lower file
// without asking), so an executable, a shared library or a git pack opened
// from a step's view and then mapped would read holes as zeros. Opens raise
// events through overlayfs on every kernel with pre-content events, so
// filling on open is correct for every way of reading.
//
// Where the order readers reach files in is recorded (or a read-ahead's
// hits are counted), a file filled before its first reader came is watched
// by its layer's notification group (watch.go), which notes that reader
// without holding it.
//
// A fill writes through a clone of the stubs' mount that the group ignores,
// opening the stub by its XFS handle where it can (handle.go: its writes
// leave the stub's times alone), else by name, checked to be the stub.
//
// It owns the fanotify groups, the marks and the writes into stubs. It does
// not know where bytes come from (a FetchFunc brings them), nor the cache's
// states: the caller makes the stubs, adds them, and records the layer
// filled or failed.
package fill

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/bufpool"
	"github.com/concourse/cowvol/internal/fdtree"
)

// marked are the events a stub is marked for: every way a process can
// reach its data (an exec opens with FAN_OPEN_EXEC_PERM; a read of a file
// opened before the mark raises FAN_PRE_ACCESS).
const marked = unix.FAN_OPEN_PERM | unix.FAN_OPEN_EXEC_PERM | unix.FAN_PRE_ACCESS

// denyEIO answers a waiting reader with EIO (pre-content groups may give
// an errno, kernel 6.14 and later).
const denyEIO = unix.FAN_DENY | uint32(unix.EIO)<<unix.FAN_ERRNO_SHIFT

// FetchFunc writes the whole data of the layer file rel (size bytes) into
// w at its offsets. It returns once all of it is written or it cannot be.
type FetchFunc func(ctx context.Context, rel string, size int64, w io.WriterAt) error

// Supported says whether readers of stubs under dir can be held: the kernel
// has pre-content events (6.14 or later, CONFIG_FANOTIFY_ACCESS_PERMISSIONS)
// and dir's filesystem allows them (XFS, ext4, btrfs do; tmpfs and
// overlayfs do not). The error says why not.
func Supported(dir string) error {
	fd, err := unix.FanotifyInit(unix.FAN_CLASS_PRE_CONTENT|unix.FAN_CLOEXEC, unix.O_RDONLY|unix.O_LARGEFILE)
	if err != nil {
		return fmt.Errorf("the kernel has no fanotify pre-content events (6.14 or later, with fanotify access permissions): %w", err)
	}
	defer unix.Close(fd)
	probe, err := os.CreateTemp(dir, ".fill-probe-")
	if err != nil {
		return fmt.Errorf("making a probe file: %w", err)
	}
	defer os.Remove(probe.Name())
	defer probe.Close()
	if err := unix.FanotifyMark(fd, unix.FAN_MARK_ADD, marked, int(probe.Fd()), ""); err != nil {
		var st unix.Statfs_t
		_ = unix.Fstatfs(int(probe.Fd()), &st)
		return fmt.Errorf("the filesystem of %s (magic %#x) allows no pre-content events: %w", dir, st.Type, err)
	}
	return nil
}

// Group is the node's fanotify pre-content group and the stubs it holds
// readers of.
type Group struct {
	events *os.File // the fanotify fd: read events, write responses
	// fd is events' descriptor, for marks (File.Fd would make events
	// blocking, and Close could no longer stop a Read).
	fd int
	// clone is a detached clone of the mount holding the stubs, marked
	// ignored: the fills write through it without raising events of
	// their own. tree is its root.
	clone int
	tree  int
	root  string
	stall time.Duration
	// byHandle says fills open stubs by their XFS handle (handle.go): the
	// stubs are on XFS, and the process may (until an open is refused).
	byHandle atomic.Bool

	mu     sync.Mutex
	files  map[fileKey]*file
	closed bool
	loop   sync.WaitGroup
	// unmarking are the mark removals under way off the loop (the loop
	// adds them, and forget under mu while the group is not closed: none
	// is added once Close has waited for the loop).
	unmarking sync.WaitGroup
	// putSlots bounds the files a stream's fills put in place behind it,
	// and putting are those under way (added under mu, unless closed).
	putSlots chan struct{}
	putting  sync.WaitGroup
	// answering is held (shared) by each answer from its write to the
	// close of the event's descriptor, which pins the mount the reader
	// opened the file through (a step volume's): see Settle.
	answering sync.RWMutex
	// layers are those not released, whose watchers Close closes.
	layers map[*Layer]bool
}

var errStopping = errors.New("the plugin is stopping")

type fileKey struct{ dev, ino uint64 }

// keyOf is the key of the file open as fd.
func keyOf(fd int) (fileKey, error) {
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	return fileKey{dev: st.Dev, ino: st.Ino}, err
}

// file is one stub. A fill runs at most once at a time (filling is
// non-nil, closed when it ends); waiters are the event fds of readers held
// for it.
type file struct {
	layer *Layer
	key   fileKey
	rel   string
	size  int64
	times []unix.Timespec // atime, mtime: put back after the writes
	index int             // in its dir's files, as added
	// reached says a reader opened (or read) it. A file no reader reached
	// is watched once filled if its first reader must be seen: where the
	// layer records the order readers reach files in, and where a
	// read-ahead brought it (its hit grows the window). Its pre-content
	// mark goes all the same, and its reader is not held, only noted by
	// the layer's watcher. Elsewhere nothing sees its readers: a step that
	// opens every file of a layer would otherwise raise an event for
	// each. (A file keeps its pre-content mark while it is in
	// Group.files: a fill that removes the mark does so just before
	// finish drops the file from there.)
	reached bool
	// unmarked says its fill removed its pre-content mark (else it is
	// kept: a file that must be watched and could not be stays held,
	// and its readers are answered at once); watched, that the layer's
	// watcher sees its readers instead.
	unmarked, watched bool
	// ahead says a read-ahead claimed it and no reader has reached it yet.
	ahead bool
	// place is its place among the regular files of the stub tree's
	// stream, the order a stream of the layer's data brings them in.
	place int
	// caps says it may carry file capabilities (see Stub).
	caps bool
	// handle names its stub where fills open stubs by handle (byHandle).
	handle   xfsHandle
	byHandle bool
	// streamAt is its place in the order the layer's stream brings files
	// in (-1: none, or no stream), and streamBytes what the stream brings
	// before it (both under the group's mu; see Layer.Streaming).
	streamAt    int
	streamBytes int64
	done        bool
	err         error
	filling     chan struct{}
	waiters     []int32
}

// Open makes the group for stubs on the filesystem mounted at (or holding)
// root. A fill that writes nothing for stall fails, so a reader waits at
// most about that long for a holder that stopped sending.
func Open(root string, stall time.Duration) (*Group, error) {
	fd, err := unix.FanotifyInit(unix.FAN_CLASS_PRE_CONTENT|unix.FAN_CLOEXEC|unix.FAN_NONBLOCK|unix.FAN_UNLIMITED_QUEUE|unix.FAN_UNLIMITED_MARKS,
		unix.O_RDONLY|unix.O_LARGEFILE)
	if err != nil {
		return nil, fmt.Errorf("making a fanotify pre-content group: %w", err)
	}
	// The clone is dissolved (and its marks with it) when the fd open_tree
	// gives is closed, so that one is kept; a mark takes no O_PATH fd, so
	// the marks and opens use a real fd of the clone's root.
	clone, err := unix.OpenTree(unix.AT_FDCWD, root, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	tree := -1
	if err == nil {
		tree, err = unix.Openat(clone, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	}
	if err == nil {
		err = unix.FanotifyMark(fd, unix.FAN_MARK_ADD|unix.FAN_MARK_MOUNT|unix.FAN_MARK_IGNORED_MASK|unix.FAN_MARK_IGNORED_SURV_MODIFY, marked, tree, "")
	}
	if err != nil {
		err = fmt.Errorf("cloning the mount of %s for fills, exempt from events: %w", root, err)
	}
	if err != nil {
		for _, c := range []int{tree, clone, fd} {
			if c >= 0 {
				unix.Close(c)
			}
		}
		return nil, err
	}
	g := &Group{events: os.NewFile(uintptr(fd), "fanotify"), fd: fd, clone: clone, tree: tree, root: filepath.Clean(root), stall: stall,
		files: map[fileKey]*file{}, putSlots: make(chan struct{}, runtime.GOMAXPROCS(0)), layers: map[*Layer]bool{}}
	var fs unix.Statfs_t
	g.byHandle.Store(unix.Fstatfs(tree, &fs) == nil && fs.Type == unix.XFS_SUPER_MAGIC)
	g.loop.Add(1)
	go g.run()
	return g, nil
}

// Close fails every file not filled yet (its waiters get EIO), removes
// the marks and closes the group. Readers that reach a stub after Close are
// no longer held; a caller closes the group only once the layers it held
// are recorded failed or filled.
func (g *Group) Close() error {
	g.mu.Lock()
	g.closed = true
	var open []*file
	for _, f := range g.files {
		open = append(open, f)
	}
	layers := g.layers
	g.layers = nil
	g.mu.Unlock()
	for _, f := range open {
		f.layer.cancel(errStopping)
		g.finish(f, errStopping)
	}
	for l := range layers {
		l.closeWatcher()
	}
	err := g.events.Close()
	g.loop.Wait()
	g.unmarking.Wait()
	g.putting.Wait()
	return errors.Join(err, unix.Close(g.tree), unix.Close(g.clone))
}

// run reads events until the group is closed, and answers each at once or
// hands it to the file's fill: it never blocks on a fetch.
func (g *Group) run() {
	defer g.loop.Done()
	buf := make([]byte, 64<<10)
	for {
		n, err := g.events.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				klog.ErrorS(err, "Reading fanotify events; lazy fills stop")
			}
			return
		}
		for off := 0; off+unix.FAN_EVENT_METADATA_LEN <= n; {
			md := (*unix.FanotifyEventMetadata)(unsafe.Pointer(&buf[off]))
			if md.Event_len < unix.FAN_EVENT_METADATA_LEN || off+int(md.Event_len) > n {
				klog.ErrorS(nil, "A malformed fanotify event", "length", md.Event_len)
				break
			}
			off += int(md.Event_len)
			if md.Fd >= 0 {
				g.dispatch(md.Fd)
			}
		}
	}
}

// dispatch answers the event whose fd is fd: at once if its file is filled
// or not one of ours, else when its fill ends.
func (g *Group) dispatch(fd int32) {
	key, err := keyOf(int(fd))
	if err != nil {
		g.respond(fd, denyEIO)
		return
	}
	g.mu.Lock()
	f := g.files[key]
	if f != nil && f.layer.watch != nil {
		// Readers seen by the layer's watcher whose opens came first
		// reach their files first.
		g.mu.Unlock()
		f.layer.watch.drain()
		g.mu.Lock()
		f = g.files[key]
	}
	if f == nil {
		g.mu.Unlock()
		g.respond(fd, unix.FAN_ALLOW) // filled: an event that raced the removal of its mark
		return
	}
	f.layer.reach(f)
	switch {
	case f.done && f.err == nil: // filled before a reader came
		delete(g.files, f.key)
		g.unmarking.Add(1)
		g.mu.Unlock()
		g.respond(fd, unix.FAN_ALLOW)
		go func() { // off the loop: the next reader's event waits for it
			defer g.unmarking.Done()
			g.unmark(f)
		}()
		return
	case f.done:
		g.mu.Unlock()
		g.respond(fd, denyEIO) // failed: its data will never be here
		return
	}
	f.waiters = append(f.waiters, fd)
	if f.layer.streamBringsNext(f) {
		g.mu.Unlock()
		time.AfterFunc(streamWaitMax, func() { f.layer.fetchStranded(f) })
		return // the stream's fill of it answers it
	}
	if !claim(f) {
		g.mu.Unlock()
		return // its fill answers it
	}
	ahead := f.layer.claimAhead(f)
	f.layer.urgent++
	g.mu.Unlock()
	go func() {
		defer f.layer.urgentEnded()
		if len(ahead) == 0 {
			g.fill(f, f.fetch)
			return
		}
		g.fillMany(append([]*file{f}, ahead...))
	}()
}

// urgentEnded counts out a fetch a reader of the layer was held for.
func (l *Layer) urgentEnded() {
	l.g.mu.Lock()
	defer l.g.mu.Unlock()
	l.lastUrgent = time.Now()
	if l.urgent--; l.urgent == 0 && l.urgentDone != nil {
		close(l.urgentDone)
		l.urgentDone = nil
	}
}

// readersGrace is how long a layer's background fills keep waiting after
// its readers' last fetch: a reader that just missed a file away from the
// stream (see streamBringsNext) is about to miss the next one, and each of
// its fetches waits for the CPUs the background would take meanwhile
// (a scattered read of 5% of 1 GiB: 2,500 fetches).
const readersGrace = 10 * time.Millisecond

// readersFirst waits while readers of the layer are held for fetches of
// their own, and for readersGrace after the last (or until the layer is
// done for): its background fills then stop taking the link and the CPUs
// from them. A step that reads a few files of a large input, none of them
// next in the stream, would otherwise wait for each behind the stream's
// megabytes. Only the layer's own background waits: a reader of one
// namespace's input must not be able to stall the fills of another's.
func (l *Layer) readersFirst() {
	for {
		l.g.mu.Lock()
		if l.urgent == 0 {
			grace := readersGrace - time.Since(l.lastUrgent)
			l.g.mu.Unlock()
			if grace <= 0 {
				return
			}
			select {
			case <-time.After(grace):
			case <-l.ctx.Done():
				return
			}
			continue
		}
		if l.urgentDone == nil {
			l.urgentDone = make(chan struct{})
		}
		done := l.urgentDone
		l.g.mu.Unlock()
		select {
		case <-done:
		case <-l.ctx.Done():
			return
		}
	}
}

// Read-ahead: a reader of one file of a dir is often about to read the
// next ones, and one request for many files costs what one for one does.
// Each dir's window adapts, as the kernel's page read-ahead does: it
// doubles when what it brought is read, and halves when a reader misses
// while what it brought lies unread (a reader picking a few files here and
// there, for whom fetching the others is waste).
const (
	readaheadStart = 4
	readaheadFiles = 256
	readaheadBytes = 32 << 20
)

// readAhead is one dir's read-ahead window and what it brought unread.
type readAhead struct{ window, unread int }

// claimAhead claims, for f's fill, the files after f in its dir that are
// neither filled nor being filled, within the dir's window (under g.mu).
// A layer without FetchMany reads no ahead.
func (l *Layer) claimAhead(f *file) []*file {
	if l.fetchMany == nil {
		return nil
	}
	l.mu.Lock()
	dir := path.Dir(f.rel)
	siblings := l.dirs[dir]
	ra := l.ahead[dir]
	if ra == nil {
		ra = &readAhead{window: readaheadStart}
		l.ahead[dir] = ra
	} else if ra.unread >= ra.window {
		ra.window = max(1, ra.window/2)
	}
	window := ra.window
	l.mu.Unlock()
	var out []*file
	bytes := f.size
	for _, s := range siblings[f.index+1:] {
		if len(out) >= window || bytes+s.size > readaheadBytes {
			break
		}
		if !claim(s) {
			continue
		}
		s.ahead = true
		out = append(out, s)
		bytes += s.size
	}
	l.mu.Lock()
	ra.unread += len(out)
	l.mu.Unlock()
	return out
}

// reach records a reader's first open (or read) of f (under g.mu): f
// joins the order readers reach files in, and if a read-ahead claimed
// it, that dir's window grows.
func (l *Layer) reach(f *file) {
	if f.reached {
		return
	}
	f.reached = true
	if f.watched {
		l.watch.unseen.Add(-1)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.reached = append(l.reached, f.rel)
	if !f.ahead {
		return
	}
	f.ahead = false
	if ra := l.ahead[path.Dir(f.rel)]; ra != nil {
		ra.unread = max(0, ra.unread-1)
		ra.window = min(readaheadFiles, ra.window*2)
	}
}

// fillMany fills files (claimed) from one request for all of them; what
// it did not bring is fetched file by file.
func (g *Group) fillMany(files []*file) {
	l := files[0].layer
	byRel := make(map[string]*file, len(files))
	rels := make([]string, len(files))
	for i, f := range files {
		byRel[f.rel], rels[i] = f, f.rel
	}
	err := l.fetchMany(l.ctx, rels, func(rel string, write func(w io.WriterAt) error) error {
		f := byRel[rel]
		if f == nil {
			return fmt.Errorf("%s came, not asked for", rel)
		}
		delete(byRel, rel)
		var broke error
		g.fillBehind(f, f.orFetch(write, &broke))
		return broke
	})
	if err != nil && l.ctx.Err() == nil {
		klog.V(2).InfoS("A read-ahead stopped; fetching the rest file by file", "files", len(byRel), "err", err)
	}
	for _, f := range files {
		if _, left := byRel[f.rel]; left {
			g.fill(f, f.fetch)
		}
	}
}

func (g *Group) respond(fd int32, answer uint32) {
	g.answering.RLock()
	defer g.answering.RUnlock()
	resp := unix.FanotifyResponse{Fd: fd, Response: answer}
	if _, err := g.events.Write((*[unsafe.Sizeof(resp)]byte)(unsafe.Pointer(&resp))[:]); err != nil && !errors.Is(err, os.ErrClosed) {
		klog.ErrorS(err, "Answering a held reader")
	}
	unix.Close(int(fd))
}

// Settle waits until every answer given so far is complete. An event
// holds the path its reader used (through a step volume's mount) until the
// loop closes its descriptor, just after its answer: the reader goes on the
// moment the answer is written. A step that read its last file and ended
// may have its volume unmounted before the close, which would find the
// mount busy. An event not answered yet holds a reader still waiting, so
// the step is not done; the events of a layer's watcher hold no path.
func (g *Group) Settle() {
	g.answering.Lock()
	g.answering.Unlock() // empty: waiting for the answers under way is the point
}

// claim makes the caller f's filler (under g.mu), unless f is filled or
// a fill of it is running.
func claim(f *file) bool {
	if f.done || f.filling != nil {
		return false
	}
	f.filling = make(chan struct{})
	return true
}

// ensure fills f unless it is filled, waiting for a fill already running.
func (g *Group) ensure(f *file) error {
	g.mu.Lock()
	mine, running := claim(f), f.filling
	g.mu.Unlock()
	if mine {
		g.fill(f, f.fetch)
	} else if running != nil {
		<-running
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return f.err
}

// source writes a file's data into w at its offsets.
type source func(ctx context.Context, w io.WriterAt) error

// fetch is f's data as its layer's FetchFunc brings it, failed once it
// writes nothing for the group's stall: a holder that hangs must not hold
// a reader for ever. (A stream's writes are not watched here: the stream
// is its caller's, which breaks it off, and then the file is fetched.)
func (f *file) fetch(ctx context.Context, w io.WriterAt) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	pw := &progressWriter{w: w, last: time.Now()}
	defer pw.watch(cancel, f.layer.g.stall)()
	if err := f.layer.fetch(ctx, f.rel, f.size, pw); err != nil {
		if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
			return cause
		}
		return err
	}
	return nil
}

// orFetch is f's data as write (part of a stream of many files) brings
// it, or, if write breaks off, as f's own fetch does; broke, if not nil,
// is told why write broke off (the stream is done for).
func (f *file) orFetch(write func(w io.WriterAt) error, broke *error) source {
	return func(ctx context.Context, w io.WriterAt) error {
		err := write(w)
		if err == nil {
			return nil
		}
		if broke != nil {
			*broke = err
		}
		klog.V(2).InfoS("A file of a stream did not arrive; fetching it alone", "file", f.rel, "err", err)
		return f.fetch(ctx, w)
	}
}

// fill writes f's data from src into the stub through the exempt mount,
// then answers its waiters. The caller claimed f (set f.filling).
func (g *Group) fill(f *file, src source) {
	put, done, err := g.fetch(f, src)
	if err == nil {
		err = g.store(f, put)
		done()
	}
	g.filled(f, err)
}

// fillBehind is fill for a file of a stream, which goes on to the next
// file once this one's data is read: a small file is then put in place by
// another goroutine (one per CPU at most), as the stream reads on.
func (g *Group) fillBehind(f *file, src source) {
	if f.size > directFill {
		g.fill(f, src)
		return
	}
	put, done, err := g.fetch(f, src) // in memory
	if err != nil {
		g.filled(f, err)
		return
	}
	g.putSlots <- struct{}{}
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		<-g.putSlots
		done()
		g.filled(f, errStopping)
		return
	}
	g.putting.Add(1)
	g.mu.Unlock()
	go func() {
		defer func() {
			<-g.putSlots
			g.putting.Done()
		}()
		err := g.store(f, put)
		done()
		g.filled(f, err)
	}()
}

// filled records how f's fill ended.
func (g *Group) filled(f *file, err error) {
	if err != nil {
		err = fmt.Errorf("filling %s: %w", f.rel, err)
	}
	g.finish(f, err)
}

// directFill is the largest file fetched into memory and written into its
// stub with one call.
const directFill = 1 << 20

// A fill puts f's data from src into its stub so that a stat of the stub
// meanwhile sees the stub's own mtime but for an instant (a build tool
// comparing times would think the file changed): fetch brings a small
// file into memory, a larger one into an unlinked file beside the stubs;
// store then writes it into the stub with one call, or clones it there
// (copied where the filesystem cannot clone), puts the times back, and
// removes the mark, or leaves one that only notes the first reader (see
// file.reached): later opens go straight through. Runs of zeros stay
// holes. No fsync: the caller syncs the whole layer before it is ready,
// and a crash before that fails it anyway.

// fetch brings f's data from src and returns how to put it into the
// stub, and done, to call once it is put.
func (g *Group) fetch(f *file, src source) (put func(out int) error, done func(), err error) {
	ctx := f.layer.ctx
	if err := ctx.Err(); err != nil {
		return nil, nil, context.Cause(ctx)
	}
	if f.size <= directFill {
		buf := &memFile{b: bufpool.Get(int(f.size))}
		clear(buf.b) // what the fetch leaves out (a sparse file's holes) reads as zeros
		if err := src(ctx, buf); err != nil {
			bufpool.Put(buf.b)
			return nil, nil, err
		}
		return func(out int) error {
			if allZero(buf.b) {
				return nil
			}
			_, err := fdtree.File(out).WriteAt(buf.b, 0)
			return err
		}, func() { bufpool.Put(buf.b) }, nil
	}
	tmpFD, err := unix.Openat(g.tree, ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, nil, fmt.Errorf("making a file to fetch into: %w", err)
	}
	tmp := os.NewFile(uintptr(tmpFD), f.rel+" (fetching)")
	err = tmp.Truncate(f.size)
	if err == nil {
		err = src(ctx, holeWriter{tmp})
	}
	if err != nil {
		tmp.Close()
		return nil, nil, err
	}
	return func(out int) error {
		if unix.IoctlFileClone(out, tmpFD) == nil {
			return nil
		}
		return copyInto(out, tmpFD, f.size)
	}, func() { tmp.Close() }, nil
}

// store puts f's data into its stub with put, then its file capabilities
// (a write into a file drops them) and, where the write moved them, its
// times, and removes its mark; where its first reader must still be seen
// (see file.reached), the layer's watcher sees it instead, and a file it
// cannot watch keeps its mark.
func (g *Group) store(f *file, put func(out int) error) error {
	fd, timesKept, err := g.openStub(f, unix.O_WRONLY)
	if err != nil {
		return fmt.Errorf("opening the stub: %w", err)
	}
	defer unix.Close(fd)
	var caps []byte
	if f.caps { // read here, not when the stub is added: off the publish's path
		if caps, err = stubCaps(fd); err != nil {
			return err
		}
	}
	if err := put(fd); err != nil {
		return err
	}
	if caps != nil {
		if err := unix.Fsetxattr(fd, fdtree.CapsXattr, caps, 0); err != nil {
			return fmt.Errorf("putting back the file capabilities: %w", err)
		}
	}
	if !timesKept {
		if err := fdtree.Futimens(fd, f.times); err != nil {
			return fmt.Errorf("putting back the times: %w", err)
		}
	}
	g.mu.Lock()
	watch := !f.reached && (f.ahead || f.layer.recording.Load()) // see file.reached
	g.mu.Unlock()
	if watch {
		if err := f.layer.watchFilled(f); err != nil {
			klog.V(2).InfoS("Watching a filled file; its readers are held instead", "file", f.rel, "err", err)
			return nil
		}
	}
	g.mu.Lock()
	f.unmarked = true
	if watch && !f.reached {
		f.watched = true
		f.layer.watch.unseen.Add(1)
	}
	g.mu.Unlock()
	g.removeMark(fd, f)
	return nil
}

// stubCaps reads a stub's file capabilities (nil: none).
func stubCaps(fd int) ([]byte, error) {
	var buf [64]byte // a v3 capability is 24 bytes
	n, err := unix.Fgetxattr(fd, fdtree.CapsXattr, buf[:])
	switch {
	case errors.Is(err, unix.ENODATA), errors.Is(err, unix.EOPNOTSUPP):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("reading the stub's file capabilities: %w", err)
	}
	return bytes.Clone(buf[:n]), nil
}

// memFile is a file's data fetched into memory.
type memFile struct{ b []byte }

func (m *memFile) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off > int64(len(m.b)) || int64(len(p)) > int64(len(m.b))-off {
		return 0, fmt.Errorf("%d bytes at %d: more than the file's %d", len(p), off, len(m.b))
	}
	return copy(m.b[off:], p), nil
}

// copyInto copies size bytes of src into dst, both from offset 0, in the
// kernel, skipping src's holes.
func copyInto(dst, src int, size int64) error {
	for off := int64(0); off < size; {
		data, err := unix.Seek(src, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // holes to the end; the stub is sized already
		}
		if err != nil {
			return err
		}
		hole, err := unix.Seek(src, data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		for data < hole {
			in, out := data, data
			n, err := unix.CopyFileRange(src, &in, dst, &out, int(hole-data), 0)
			if err != nil {
				return fmt.Errorf("copying into the stub: %w", err)
			}
			if n == 0 {
				return fmt.Errorf("copying into the stub: %w", io.ErrUnexpectedEOF)
			}
			data += int64(n)
		}
		off = hole
	}
	return nil
}

// finish records how f's fill ended and answers its waiters. A filled
// file's mark goes (later opens go straight through); a failed one stays
// marked and answers EIO until its layer is released.
func (g *Group) finish(f *file, err error) {
	g.mu.Lock()
	if f.done {
		g.mu.Unlock()
		return
	}
	f.done, f.err = true, err
	waiters := f.waiters
	f.waiters = nil
	if f.filling != nil {
		close(f.filling)
	}
	if err == nil && f.unmarked {
		delete(g.files, f.key) // one still marked stays: see file.unmarked
	}
	g.mu.Unlock()
	// The layer hears first: a reader answered may look at it next.
	f.layer.settled(err)
	answer := uint32(unix.FAN_ALLOW)
	if err != nil {
		answer = denyEIO
	}
	for _, fd := range waiters {
		g.respond(fd, answer) // a filled file's mark went with its write
	}
}

// forget drops f, filled or not, and its mark if it still has one.
func (g *Group) forget(f *file) {
	g.mu.Lock()
	held := g.files[f.key] == f
	if held {
		delete(g.files, f.key)
	}
	unmark := held && !g.closed // a closed group's marks went with it
	if unmark {
		g.unmarking.Add(1) // Close waits for it before the fd goes
	}
	g.mu.Unlock()
	if unmark {
		defer g.unmarking.Done()
		g.unmark(f)
	}
}

// openStub opens f's stub through the exempt clone (opens through any
// other mount would raise events of their own, which this group would
// hold): by its handle, or by its name following no symlink, checked to be
// the file that was marked. timesKept says writes through the descriptor
// leave the stub's times as they are.
func (g *Group) openStub(f *file, flags int) (fd int, timesKept bool, err error) {
	if f.byHandle && g.byHandle.Load() {
		fd, err := openXFSHandle(g.tree, &f.handle, flags)
		switch {
		case err == nil:
			return fd, true, nil
		case errors.Is(err, unix.ESTALE), errors.Is(err, unix.ENOENT): // that inode is no longer the stub
			return -1, false, fmt.Errorf("%s is no longer the stub that was marked: %w", f.rel, err)
		case errors.Is(err, unix.EPERM): // no CAP_SYS_ADMIN: by name from now on
			if g.byHandle.Swap(false) {
				klog.InfoS("Fills open stubs by name: opening by handle is refused", "err", err)
			}
		case !errors.Is(err, errForking): // by name, this once, checked as such
			klog.V(2).InfoS("Opening a stub by its handle; opening it by name", "file", f.rel, "err", err)
		}
	}
	fd, err = fdtree.OpenFileBeneath(g.tree, path.Join(f.layer.dir, f.rel), flags)
	if err != nil {
		return -1, false, err
	}
	if key, err := keyOf(fd); err != nil || key != f.key {
		unix.Close(fd)
		return -1, false, fmt.Errorf("%s is no longer the stub that was marked", f.rel)
	}
	return fd, false, nil
}

// unmark removes f's mark, its stub opened again (gone: nothing to do).
func (g *Group) unmark(f *file) {
	fd, _, err := g.openStub(f, unix.O_RDONLY)
	if err != nil {
		if !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESTALE) {
			klog.V(2).InfoS("Removing the mark of a filled file", "file", f.rel, "err", err)
		}
		return
	}
	defer unix.Close(fd)
	g.removeMark(fd, f)
}

// removeMark removes the mark of f's stub, open as fd.
func (g *Group) removeMark(fd int, f *file) {
	if err := unix.FanotifyMark(g.fd, unix.FAN_MARK_REMOVE, marked, fd, ""); err != nil {
		klog.V(2).InfoS("Removing the mark of a filled file", "file", f.rel, "err", err)
	}
}

// progressWriter fails a fetch that stops writing: a holder that hangs
// must not hold a reader for ever.
type progressWriter struct {
	w     io.WriterAt
	mu    sync.Mutex
	last  time.Time
	timer *time.Timer
	done  bool // the fetch ended: the timer is not armed again
}

func (p *progressWriter) WriteAt(b []byte, off int64) (int, error) {
	n, err := p.w.WriteAt(b, off)
	p.mu.Lock()
	p.last = time.Now()
	p.mu.Unlock()
	return n, err
}

// holeWriter leaves runs of zeros out of a sized file: they stay holes
// (a memFile's are zeros already).
type holeWriter struct{ w io.WriterAt }

func (h holeWriter) WriteAt(b []byte, off int64) (int, error) {
	if allZero(b) {
		return len(b), nil
	}
	return h.w.WriteAt(b, off)
}

func allZero(b []byte) bool {
	if len(b) > 0 && b[0] != 0 {
		return false // most data: not worth a scan
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// watch cancels the fetch once nothing was written for stall, and
// returns the func that stops watching. A timer, not a goroutine: most
// fetches are of small files, done long before it fires.
func (p *progressWriter) watch(cancel context.CancelCauseFunc, stall time.Duration) (stop func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.timer = time.AfterFunc(stall, func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.done {
			return
		}
		if idle := time.Since(p.last); idle < stall {
			p.timer.Reset(stall - idle)
			return
		}
		cancel(fmt.Errorf("no data for %s from any holder", stall))
	})
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.done = true
		p.timer.Stop()
	}
}

// Layer is the stubs of one layer dir being filled from one source.
type Layer struct {
	g *Group
	// dir is the layer's dir below the group's root, slash-separated.
	dir       string
	fetch     FetchFunc
	fetchMany FetchManyFunc
	ctx       context.Context
	cancel    context.CancelCauseFunc

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

// streamNext is how near ahead of its stream's place (in the bytes the
// stream brings first) a file must be for its reader to wait for the
// stream rather than fetch it: what a stream brings in about 10 ms.
const streamNext = 4 << 20

// streamWaitMax bounds a reader's wait for the stream: one that has not
// brought its file by then is stalled, or brings files in another order
// than the stubs' (another holder's), and the file is fetched.
const streamWaitMax = 250 * time.Millisecond

// Streaming says a stream of the whole layer is about to offer its files
// (Offer), those of order (a recorded read order) that are its stubs first
// and then the rest by their places: the order a holder packs them in (the
// stubs came in a walk of the same tree). It returns the names to ask the
// holder for first: none if the order's stubs are the layer's first by
// place (a step that walks the tree in name order), which the stream brings
// first anyway; asking costs the holder a lookup of each by name and a set
// of them to leave out of its walk, 0.1 s of its CPU for 50,000 files.
// Until StreamEnded, a reader of a file the stream brings next waits for
// it: a step that reads the layer in the order the stream brings it (a
// walk, or a recorded read order) would otherwise fetch each file on its
// own, and each fetch holds the stream back (see readersFirst).
func (l *Layer) Streaming(order []string) (first []string) {
	l.mu.Lock()
	var named []*file
	for _, rel := range order {
		if f := l.byRel[rel]; f != nil {
			named = append(named, f)
		}
	}
	// The stubs were added as their makers finished them, not in the
	// stream's order.
	byPlace := slices.Clone(l.files)
	l.mu.Unlock()
	slices.SortFunc(byPlace, func(a, b *file) int { return cmp.Compare(a.place, b.place) })
	if len(named) > len(byPlace) || !slices.Equal(named, byPlace[:len(named)]) {
		for _, f := range named {
			first = append(first, f.rel)
		}
	}
	l.g.mu.Lock() // readers' events look at the places
	defer l.g.mu.Unlock()
	at, bytes := 0, int64(0)
	for _, f := range append(named, byPlace...) {
		if f.streamAt < 0 {
			f.streamAt, f.streamBytes = at, bytes
			at++
			bytes += f.size
		}
	}
	l.streaming, l.streamAt, l.streamBytes = true, 0, 0
	return first
}

// StreamEnded says the stream offers no more files (it ended, or broke
// off): readers waiting for it are fetched for.
func (l *Layer) StreamEnded() {
	l.g.mu.Lock()
	l.streaming = false
	l.g.mu.Unlock()
	for _, f := range l.snapshot() {
		l.fetchStranded(f)
	}
}

// fetchStranded fetches f if readers wait for it and no fill of it runs:
// the stream they waited for did not bring it.
func (l *Layer) fetchStranded(f *file) {
	l.g.mu.Lock()
	if len(f.waiters) == 0 || !claim(f) {
		l.g.mu.Unlock()
		return
	}
	l.urgent++
	l.g.mu.Unlock()
	go func() {
		defer l.urgentEnded()
		l.g.fill(f, f.fetch)
	}()
}

// streamBringsNext says the layer's stream is about to bring f (under the
// group's mu): it is at most streamNext ahead of the stream's place.
func (l *Layer) streamBringsNext(f *file) bool {
	ahead := f.streamBytes - l.streamBytes
	return l.streaming && f.streamAt >= 0 && ahead >= 0 && ahead <= streamNext
}

// FetchManyFunc brings the data of the layer files rels at once, handing
// each to each as it arrives (write writes it into w at its offsets), in
// any order; files it does not bring are fetched one by one.
type FetchManyFunc func(ctx context.Context, rels []string, each func(rel string, write func(w io.WriterAt) error) error) error

// NewLayer starts a layer of stubs under dir (below the group's root),
// whose files fetch brings, one at a time, and fetchMany (if not nil) many
// at a time, for read-ahead.
func (g *Group) NewLayer(dir string, fetch FetchFunc, fetchMany FetchManyFunc) (*Layer, error) {
	rel, err := filepath.Rel(g.root, filepath.Clean(dir))
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") || filepath.IsAbs(rel) {
		return nil, fmt.Errorf("layer dir %s is not below %s", dir, g.root)
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	l := &Layer{g: g, dir: filepath.ToSlash(rel), fetch: fetch, fetchMany: fetchMany, ctx: ctx, cancel: cancel,
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
}

// Add holds readers of the stub s, open as fd (any flags; fd stays the
// caller's). An empty file needs nothing and is not held.
func (l *Layer) Add(fd int, s Stub) error {
	rel, size := s.Rel, s.Size
	if size == 0 {
		return nil
	}
	f := &file{layer: l, key: fileKey{dev: s.Dev, ino: s.Ino}, rel: rel, size: size, times: s.Times[:], place: s.Place, caps: s.Caps, streamAt: -1}
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

// Prefetch fills every file not filled yet in the background, those named
// in order first and the rest as added, workers at a time; readers' files
// jump the queue as they are opened. It returns at once.
func (l *Layer) Prefetch(order []string, workers int) {
	l.mu.Lock()
	queue := make([]*file, 0, len(l.files))
	seen := map[*file]bool{}
	for _, rel := range order {
		if f := l.byRel[rel]; f != nil && !seen[f] {
			seen[f] = true
			queue = append(queue, f)
		}
	}
	for _, f := range l.files {
		if !seen[f] {
			queue = append(queue, f)
		}
	}
	l.mu.Unlock()
	next := make(chan *file)
	for range max(workers, 1) {
		go func() {
			for f := range next {
				l.readersFirst()
				_ = l.g.ensure(f)
			}
		}()
	}
	go func() {
		defer close(next)
		for _, f := range queue {
			select {
			case next <- f:
			case <-l.ctx.Done():
				return
			}
		}
	}()
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
	mine := claim(f)
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
