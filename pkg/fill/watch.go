package fill

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"path"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/fdtree"
)

// atHandleFID asks name_to_handle_at for the handle fanotify reports a
// file by (linux/fcntl.h; kernel 6.5 and later).
const atHandleFID = 0x200

// watcher is a layer's notification group, which sees the first reader of
// a file filled before any reader came, where that reader must be seen
// (see file.reached). It marks the file's dir, once, for the opens of the
// files in it (FAN_EVENT_ON_CHILD), as the file's pre-content mark goes:
// a mark per file cost each fill two calls more. Its events
// report the dir's handle and the name opened (FAN_REPORT_DFID_NAME), not
// a descriptor, so a reader's open costs no open of the file in the
// plugin, nor an fstat, a close or a mark removal there; and an event pins
// no mount, so a step's volume unmounts whether its readers' events are
// read yet or not. The marks stay until the layer is released: closing
// the group drops them all at once.
//
// Nothing waits on the group's descriptor: its events are read every
// watchEvery, and where they must be read at once (see drain). A waiter
// would be woken by each event, and a reader opening file after file
// would then cost the node a switch to it and back per file, which nearly
// doubled the CPU a step's reading of 20,000 small files took.
//
// A layer's watched and held readers are seen in two groups, so their
// order is kept where it is read: a held reader's event is handled only
// after the watcher's queue is read (see drain), which holds the events
// of every open that returned before the held one began.
type watcher struct {
	l    *Layer
	stop chan struct{} // closed when close begins
	done chan struct{} // closed when run returns
	// mu is held while events are read and handled, and over the rest.
	mu sync.Mutex
	fd int // -1 once closed
	// dirs are the marked dirs (below the layer's dir) by handleKey, and
	// marked the same by name.
	dirs   map[string]string
	marked map[string]bool
	buf    []byte
	// unseen counts the watched files no reader reached yet (none: no
	// event queued would count). It changes under the group's mu.
	unseen atomic.Int64
}

// watchEvery is how often a watcher reads the events it gathered: often
// enough that they never take much memory.
const watchEvery = 50 * time.Millisecond

// newWatcher makes l's watcher (it reads events from its first mark on).
// The opens the fills make, through the group's clone, are no reader's:
// they raise no event.
func newWatcher(l *Layer) (*watcher, error) {
	fd, err := unix.FanotifyInit(unix.FAN_CLASS_NOTIF|unix.FAN_REPORT_DFID_NAME|unix.FAN_CLOEXEC|unix.FAN_NONBLOCK|unix.FAN_UNLIMITED_QUEUE|unix.FAN_UNLIMITED_MARKS, unix.O_RDONLY)
	if err != nil {
		return nil, fmt.Errorf("making a fanotify group reporting file handles: %w", err)
	}
	err = unix.FanotifyMark(fd, unix.FAN_MARK_ADD|unix.FAN_MARK_MOUNT|unix.FAN_MARK_IGNORED_MASK|unix.FAN_MARK_IGNORED_SURV_MODIFY, unix.FAN_OPEN, l.g.tree, "")
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("exempting the fills' mount from a lazy layer's open notifications: %w", err)
	}
	w := &watcher{l: l, stop: make(chan struct{}), done: make(chan struct{}), fd: fd,
		dirs: map[string]string{}, marked: map[string]bool{}, buf: make([]byte, 64<<10)}
	return w, nil
}

// run reads events every watchEvery until the watcher is closed. It
// starts with the first mark: a layer whose readers need not be seen
// costs no wake-ups.
func (w *watcher) run() {
	defer close(w.done)
	tick := time.NewTicker(watchEvery)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			w.mu.Lock()
			w.readLocked()
			w.mu.Unlock()
		case <-w.stop:
			return
		}
	}
}

// watch has the opens of f (filled) seen: its dir is marked, unless it is
// already.
func (w *watcher) watch(f *file) error {
	dir := path.Dir(f.rel)
	w.mu.Lock()
	defer w.mu.Unlock()
	select {
	case <-w.stop:
		return errors.New("the layer's watcher is closed")
	default:
	}
	if w.marked[dir] {
		return nil
	}
	return w.markDir(dir)
}

// markDir marks the layer's dir dir for its files' opens (under mu).
func (w *watcher) markDir(dir string) error {
	fd, err := fdtree.OpenBeneath(w.l.g.tree, path.Join(w.l.dir, dir))
	if err != nil {
		return fmt.Errorf("opening the stub's dir: %w", err)
	}
	defer unix.Close(fd)
	h, _, err := unix.NameToHandleAt(fd, "", unix.AT_EMPTY_PATH|atHandleFID)
	if err != nil {
		return fmt.Errorf("the stub dir's handle: %w", err)
	}
	if err := unix.FanotifyMark(w.fd, unix.FAN_MARK_ADD, unix.FAN_OPEN|unix.FAN_EVENT_ON_CHILD, fd, ""); err != nil {
		return err
	}
	if len(w.marked) == 0 {
		go w.run()
	}
	w.dirs[handleKey(h.Type(), h.Bytes())], w.marked[dir] = dir, true
	return nil
}

// drain handles the events queued so far (none if every watched file was
// reached: nothing queued would count).
func (w *watcher) drain() {
	if w.unseen.Load() == 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.readLocked()
}

// readLocked reads and handles events until none is queued (under w.mu):
// each names a file of the layer a reader opened, which that reaches (a
// file not filled yet was reached when its reader was held).
func (w *watcher) readLocked() {
	if w.fd < 0 {
		return
	}
	var opened []string
	for {
		n, err := unix.Read(w.fd, w.buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			if !errors.Is(err, unix.EAGAIN) {
				klog.ErrorS(err, "Reading a lazy layer's open notifications")
			}
			break
		}
		for off := 0; off+unix.FAN_EVENT_METADATA_LEN <= n; {
			md := (*unix.FanotifyEventMetadata)(unsafe.Pointer(&w.buf[off]))
			if md.Event_len < unix.FAN_EVENT_METADATA_LEN || off+int(md.Event_len) > n ||
				md.Metadata_len < unix.FAN_EVENT_METADATA_LEN || uint32(md.Metadata_len) > md.Event_len {
				klog.ErrorS(nil, "A malformed fanotify event", "length", md.Event_len)
				break
			}
			if md.Mask&unix.FAN_Q_OVERFLOW != 0 {
				klog.ErrorS(nil, "A lazy layer's open notifications overflowed; some readers were not seen")
			}
			if dirKey, name, ok := eventDirName(w.buf[off+int(md.Metadata_len) : off+int(md.Event_len)]); ok {
				if dir, ok := w.dirs[string(dirKey)]; ok {
					opened = append(opened, path.Join(dir, name))
				}
			}
			off += int(md.Event_len)
		}
	}
	if len(opened) == 0 {
		return
	}
	files := make([]*file, 0, len(opened))
	w.l.mu.Lock()
	for _, rel := range opened {
		if f := w.l.byRel[rel]; f != nil {
			files = append(files, f)
		}
	}
	w.l.mu.Unlock()
	w.l.g.mu.Lock()
	defer w.l.g.mu.Unlock()
	for _, f := range files {
		w.l.reach(f)
	}
}

// close closes the group, which drops its marks, and waits for run.
func (w *watcher) close() {
	close(w.stop)
	w.mu.Lock()
	running := len(w.marked) > 0 // no mark is made once stop is closed
	w.mu.Unlock()
	if running {
		<-w.done
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := unix.Close(w.fd); err != nil {
		klog.ErrorS(err, "Closing a lazy layer's open notifications")
	}
	w.fd = -1
}

// Layout of a FAN_REPORT_DFID_NAME event's info record
// (linux/fanotify.h): a header (type, pad, length), the fsid, a struct
// file_handle (bytes, type, the handle) of the dir, then the name,
// NUL-terminated.
const (
	fidHeaderLen  = 4
	fidFsidLen    = 8
	fidHandleAt   = fidHeaderLen + fidFsidLen
	fidHandleHead = 8 // handle_bytes, handle_type
)

// eventDirName is the handleKey of the dir and the name an event's info
// records report, found in a FAN_EVENT_INFO_TYPE_DFID_NAME record (the key
// aliases info).
func eventDirName(info []byte) (dirKey []byte, name string, ok bool) {
	for len(info) >= fidHeaderLen {
		typ, length := info[0], int(binary.NativeEndian.Uint16(info[2:4]))
		if length < fidHeaderLen || length > len(info) {
			return nil, "", false
		}
		rec := info[:length]
		info = info[length:]
		if typ != unix.FAN_EVENT_INFO_TYPE_DFID_NAME || len(rec) < fidHandleAt+fidHandleHead {
			continue
		}
		size := int(binary.NativeEndian.Uint32(rec[fidHandleAt:]))
		if size > len(rec)-fidHandleAt-fidHandleHead {
			return nil, "", false
		}
		end := fidHandleAt + fidHandleHead + size
		name, _, terminated := bytes.Cut(rec[end:], []byte{0})
		if !terminated || len(name) == 0 || bytes.IndexByte(name, '/') >= 0 || string(name) == "." || string(name) == ".." {
			return nil, "", false
		}
		// handle_type then the handle: handleKey's layout.
		return rec[fidHandleAt+4 : end], string(name), true
	}
	return nil, "", false
}

// handleKey is a file handle's type and bytes, as one map key.
func handleKey(typ int32, handle []byte) string {
	b := binary.NativeEndian.AppendUint32(make([]byte, 0, 4+len(handle)), uint32(typ))
	return string(append(b, handle...))
}
