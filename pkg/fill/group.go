package fill

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// marked are the events a stub is marked for: every way a process can
// reach its data (an exec opens with FAN_OPEN_EXEC_PERM; a read of a file
// opened before the mark raises FAN_PRE_ACCESS).
const marked = unix.FAN_OPEN_PERM | unix.FAN_OPEN_EXEC_PERM | unix.FAN_PRE_ACCESS

// denyEIO answers a waiting reader with EIO (pre-content groups may give
// an errno, kernel 6.14 and later).
const denyEIO = unix.FAN_DENY | uint32(unix.EIO)<<unix.FAN_ERRNO_SHIFT

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
	// keeper reads the group's events and hands them here, and keeps the
	// group when this process dies (keeper.go); nil: this process reads
	// them (no keeper, or it went).
	keeper atomic.Pointer[keeperConn]
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

	mu    sync.Mutex
	files map[fileKey]*file
	// stale are the files of the layers a previous process did not finish
	// filling, found when it took the group over: their marks outlived
	// it, and their readers get EIO.
	stale  map[fileKey]struct{}
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
	// blobs are the index blobs whose readers are held, by key.
	blobs map[fileKey]*Blob
}

var errStopping = errors.New("the plugin is stopping")

// Open makes the group for stubs on the filesystem mounted at (or holding)
// root, for this process alone. A fill that writes nothing for stall
// fails, so a reader waits at most about that long for a holder that
// stopped sending.
func Open(root string, stall time.Duration) (*Group, error) { return OpenKept(root, stall, Kept{}) }

// Kept has the group outlive this process: the keeper at Socket (""
// none) keeps it and its held readers (keeper.go), and the next process
// takes them back. Unfinished lists the dirs of the layers a previous
// process may have left stubs in that no one will fill (every volume not
// known whole): the readers of a marked file in them get EIO; of any other
// file no layer of this process knows (one filled before its volume was
// recorded whole), they go through.
type Kept struct {
	Socket     string
	Unfinished func() []string
}

// OpenKept is Open with the group kept by k's keeper: the one it kept
// already (a previous plugin's, with its marks), or a new one it is given.
func OpenKept(root string, stall time.Duration, k Kept) (*Group, error) {
	fd, kc := -1, (*keeperConn)(nil)
	if k.Socket != "" {
		var err error
		if kc, fd, err = dialKeeper(k.Socket); err != nil {
			return nil, err
		}
	}
	inherited := fd >= 0
	if fd < 0 {
		var err error
		fd, err = unix.FanotifyInit(unix.FAN_CLASS_PRE_CONTENT|unix.FAN_CLOEXEC|unix.FAN_NONBLOCK|unix.FAN_UNLIMITED_QUEUE|unix.FAN_UNLIMITED_MARKS,
			unix.O_RDONLY|unix.O_LARGEFILE)
		if err != nil {
			if kc != nil {
				kc.c.Close()
			}
			return nil, fmt.Errorf("making a fanotify pre-content group: %w", err)
		}
	}
	if kc != nil && !inherited {
		if err := kc.put(fd); err != nil {
			kc.c.Close()
			unix.Close(fd)
			return nil, fmt.Errorf("handing the fanotify group to the fill keeper: %w", err)
		}
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
		if kc != nil {
			kc.c.Close()
		}
		return nil, err
	}
	g := &Group{events: os.NewFile(uintptr(fd), "fanotify"), fd: fd, clone: clone, tree: tree, root: filepath.Clean(root), stall: stall,
		files: map[fileKey]*file{}, stale: map[fileKey]struct{}{}, putSlots: make(chan struct{}, runtime.GOMAXPROCS(0)), layers: map[*Layer]bool{},
		blobs: map[fileKey]*Blob{}}
	if inherited && k.Unfinished != nil {
		g.stale = filesIn(k.Unfinished())
	}
	var fs unix.Statfs_t
	g.byHandle.Store(unix.Fstatfs(tree, &fs) == nil && fs.Type == unix.XFS_SUPER_MAGIC)
	g.loop.Add(1)
	if kc != nil {
		g.keeper.Store(kc)
		klog.InfoS("The fanotify group of lazy fills is kept across restarts", "keeper", k.Socket, "takenBack", inherited)
		go g.runKept(kc)
	} else {
		go g.run()
	}
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
	layers, blobs := g.layers, g.blobs
	g.layers, g.blobs = nil, nil
	g.mu.Unlock()
	for _, b := range blobs {
		b.Fail()
	}
	for _, f := range open {
		f.layer.cancel(errStopping)
		g.finish(f, errStopping)
	}
	for l := range layers {
		l.closeWatcher()
	}
	if kc := g.keeper.Load(); kc != nil {
		// Its readers' answers are sent: the keeper keeps the group, and
		// holds the readers of stubs not filled for the next plugin.
		kc.c.Close()
	}
	err := g.events.Close()
	g.loop.Wait()
	g.unmarking.Wait()
	g.putting.Wait()
	return errors.Join(err, unix.Close(g.tree), unix.Close(g.clone))
}

// event is a held reader: fd is this process's descriptor of the file it
// reached, id how the group knows the event (fd itself where this process
// reads the group; the keeper's descriptor where the keeper does), and off
// and n the range it reads (n < 0: the whole file; an open's event has
// none).
type event struct {
	fd, id int32
	off, n int64
}

// runKept dispatches the events the keeper hands over until the group is
// closed. Should the keeper go, this process reads the group itself from
// then on (the events the keeper read are answered by their IDs, which
// the group knows them by).
func (g *Group) runKept(kc *keeperConn) {
	for {
		op, fields, fd, err := readPacket(kc.c)
		switch {
		case err != nil:
			g.mu.Lock()
			closed := g.closed
			g.mu.Unlock()
			if closed {
				g.loop.Done()
				return
			}
			klog.ErrorS(err, "The fill keeper went: this process reads the fanotify group itself (a restart of the plugin now lets its readers go)")
			g.keeper.Store(nil)
			kc.c.Close()
			g.run()
			return
		case op == opEvent && len(fields) == 3 && fd >= 0:
			g.dispatch(event{fd: int32(fd), id: int32(uint32(fields[0])), off: int64(fields[1]), n: int64(fields[2])})
		case op == opSync && len(fields) == 1:
			select {
			case kc.synced <- fields[0]:
			default:
			}
		default:
			if fd >= 0 {
				unix.Close(fd)
			}
		}
	}
}

// run reads events until the group is closed, and answers each at once or
// hands it to the file's fill: it never blocks on a fetch.
func (g *Group) run() {
	defer g.loop.Done()
	if err := readEvents(g.events, func(buf []byte) {
		eachEvent(buf, func(ev event) { g.dispatch(ev) })
	}); err != nil {
		klog.ErrorS(err, "Reading fanotify events; lazy fills stop")
	}
}

// readEvents hands each read of a fanotify group's events to handle until
// the group is closed (nil) or a read fails.
func readEvents(events *os.File, handle func(buf []byte)) error {
	buf := make([]byte, 64<<10)
	for {
		n, err := events.Read(buf)
		if errors.Is(err, os.ErrClosed) {
			return nil
		}
		if err != nil {
			return err
		}
		handle(buf[:n])
	}
}

// eachEvent calls fn with each event read into buf: its descriptor (the
// group knows it by it) and the range it reads, if it has a range info
// record, as a pre-content event does (else the whole file). Events
// without a descriptor, a queue overflow's, are skipped.
func eachEvent(buf []byte, fn func(ev event)) {
	for off := 0; off+unix.FAN_EVENT_METADATA_LEN <= len(buf); {
		md := (*unix.FanotifyEventMetadata)(unsafe.Pointer(&buf[off]))
		if md.Event_len < unix.FAN_EVENT_METADATA_LEN || off+int(md.Event_len) > len(buf) || uint32(md.Metadata_len) > md.Event_len {
			klog.ErrorS(nil, "A malformed fanotify event", "length", md.Event_len)
			return
		}
		info := buf[off+int(md.Metadata_len) : off+int(md.Event_len)]
		off += int(md.Event_len)
		if md.Fd < 0 {
			continue
		}
		ev := event{fd: md.Fd, id: md.Fd, n: -1}
		// Each info record: type (1 byte), pad (1), length (2), then its
		// body; a range's is pad (4), offset (8), count (8).
		for len(info) >= 4 {
			kind, size := info[0], int(binary.NativeEndian.Uint16(info[2:]))
			if size < 4 || size > len(info) {
				break
			}
			if kind == unix.FAN_EVENT_INFO_TYPE_RANGE && size >= 24 {
				ev.off, ev.n = int64(binary.NativeEndian.Uint64(info[8:])), int64(binary.NativeEndian.Uint64(info[16:]))
			}
			info = info[size:]
		}
		fn(ev)
	}
}

// dispatch answers ev: at once if its file is filled or not one of ours,
// else when its fill ends.
func (g *Group) dispatch(ev event) {
	key, err := keyOf(int(ev.fd))
	if err != nil {
		g.respond(ev, denyEIO)
		return
	}
	g.mu.Lock()
	if b := g.blobs[key]; b != nil {
		g.mu.Unlock()
		b.dispatch(ev)
		return
	}
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
		g.unknown(ev, key)
		return
	}
	f.layer.reach(f)
	switch {
	case f.state.inPlace(): // filled before a reader came
		delete(g.files, f.key)
		g.unmarking.Add(1)
		g.mu.Unlock()
		g.respond(ev, unix.FAN_ALLOW)
		go func() { // off the loop: the next reader's event waits for it
			defer g.unmarking.Done()
			g.unmark(f)
		}()
		return
	case f.state == failed:
		g.mu.Unlock()
		g.respond(ev, denyEIO) // its data will never be here
		return
	}
	f.waiters = append(f.waiters, ev)
	if f.layer.streamBringsNext(f) {
		g.mu.Unlock()
		time.AfterFunc(streamWaitMax, func() { f.layer.fetchStranded(f) })
		return // the stream's fill of it answers it
	}
	if !take(f, claim) {
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

// unknown answers an event on a marked file no layer here knows: a stub a
// previous process marked and no one will fill (EIO, and its mark stays
// for its next reader), or a file filled (its mark being removed raced
// the reader, or a previous process filled it): let through.
func (g *Group) unknown(ev event, key fileKey) {
	g.mu.Lock()
	_, stale := g.stale[key]
	g.mu.Unlock()
	if stale {
		g.respond(ev, denyEIO)
		return
	}
	// Its next readers need not wait for this process.
	_ = unix.FanotifyMark(g.fd, unix.FAN_MARK_REMOVE, marked, int(ev.fd), "")
	g.respond(ev, unix.FAN_ALLOW)
}

// filesIn are the regular files under dirs (by key), following no
// symlink and staying on each dir's filesystem (a layer's index is mounted
// at its dir: its files are the index's, never marked); a dir that cannot
// be read adds what was read of it.
func filesIn(dirs []string) map[fileKey]struct{} {
	out := map[fileKey]struct{}{}
	for _, d := range dirs {
		var root unix.Stat_t
		var sfs unix.Statfs_t
		if unix.Lstat(d, &root) != nil || unix.Statfs(d, &sfs) != nil || sfs.Type == unix.EROFS_SUPER_MAGIC_V1 {
			continue // (an index mounted at the dir)
		}
		_ = filepath.WalkDir(d, func(_ string, e fs.DirEntry, err error) error {
			if err != nil || (!e.Type().IsRegular() && !e.IsDir()) {
				return nil
			}
			info, err := e.Info()
			if err != nil {
				return nil
			}
			st, ok := info.Sys().(*syscall.Stat_t)
			switch {
			case !ok:
			case st.Dev != root.Dev:
				if e.IsDir() {
					return filepath.SkipDir
				}
			case e.Type().IsRegular():
				out[fileKey{dev: st.Dev, ino: st.Ino}] = struct{}{}
			}
			return nil
		})
	}
	return out
}

func (g *Group) respond(ev event, answer uint32) {
	g.answering.RLock()
	defer g.answering.RUnlock()
	if kc := g.keeper.Load(); kc != nil && kc.answer(ev.id, answer) == nil {
		unix.Close(int(ev.fd))
		return
	}
	// The group knows the event by its ID, whoever read it.
	resp := unix.FanotifyResponse{Fd: ev.id, Response: answer}
	if _, err := g.events.Write((*[unsafe.Sizeof(resp)]byte)(unsafe.Pointer(&resp))[:]); err != nil && !errors.Is(err, os.ErrClosed) {
		klog.ErrorS(err, "Answering a held reader")
	}
	unix.Close(int(ev.fd))
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
	if kc := g.keeper.Load(); kc != nil {
		kc.sync() // the keeper's descriptors of the events too
	}
}
