package fill

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// atHandleFID asks name_to_handle_at for the handle fanotify reports a
// file by (linux/fcntl.h; kernel 6.5 and later).
const atHandleFID = 0x200

// watcher is a layer's notification group, which sees the first reader of
// a file filled before any reader came, where that reader must be seen
// (see file.reached): the file is marked in it for FAN_OPEN as its
// pre-content mark goes. Its events report files by handle
// (FAN_REPORT_FID), not by a descriptor, so a reader's open costs no open
// of the file in the plugin, nor an fstat, a close or a mark removal
// there; and an event pins no mount, so a step's volume unmounts whether
// its readers' events are read yet or not. A watched file keeps its mark
// until the layer is released: closing the group drops them all at once.
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
	g    *Group
	stop chan struct{} // closed when close begins
	done chan struct{} // closed when run returns
	// mu is held while events are read and handled, and over fd and
	// files.
	mu    sync.Mutex
	fd    int              // -1 once closed
	files map[string]*file // the watched files no reader reached yet, by handleKey
	buf   []byte
}

// watchEvery is how often a watcher reads the events it gathered: often
// enough that they never take much memory.
const watchEvery = 50 * time.Millisecond

// newWatcher makes a layer's watcher and starts reading its events.
func (g *Group) newWatcher() (*watcher, error) {
	fd, err := unix.FanotifyInit(unix.FAN_CLASS_NOTIF|unix.FAN_REPORT_FID|unix.FAN_CLOEXEC|unix.FAN_NONBLOCK|unix.FAN_UNLIMITED_QUEUE|unix.FAN_UNLIMITED_MARKS, unix.O_RDONLY)
	if err != nil {
		return nil, fmt.Errorf("making a fanotify group reporting file handles: %w", err)
	}
	w := &watcher{g: g, stop: make(chan struct{}), done: make(chan struct{}), fd: fd, files: map[string]*file{}, buf: make([]byte, 64<<10)}
	go w.run()
	return w, nil
}

// run reads events every watchEvery until the watcher is closed.
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

// watch marks f (filled, its stub open as fd) so that its first reader is
// seen.
func (w *watcher) watch(f *file, fd int) error {
	h, _, err := unix.NameToHandleAt(fd, "", unix.AT_EMPTY_PATH|atHandleFID)
	if err != nil {
		return fmt.Errorf("the stub's file handle: %w", err)
	}
	key := handleKey(h.Type(), h.Bytes())
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fd < 0 {
		return errors.New("the layer's watcher is closed")
	}
	if err := unix.FanotifyMark(w.fd, unix.FAN_MARK_ADD, unix.FAN_OPEN, fd, ""); err != nil {
		return err
	}
	w.files[key] = f // its first event is read under mu, after this
	return nil
}

// drain handles the events queued so far (none if no file is watched
// unreached: nothing queued would count).
func (w *watcher) drain() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.files) > 0 {
		w.readLocked()
	}
}

// readLocked reads and handles events until none is queued (under w.mu):
// a watched file's first reader reaches it, and it is watched no more (its
// mark stays, its later events find nothing).
func (w *watcher) readLocked() {
	if w.fd < 0 {
		return
	}
	var reached []*file
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
			if key, ok := eventHandle(w.buf[off+int(md.Metadata_len) : off+int(md.Event_len)]); ok {
				if f := w.files[string(key)]; f != nil {
					delete(w.files, string(key))
					reached = append(reached, f)
				}
			}
			off += int(md.Event_len)
		}
	}
	if len(reached) == 0 {
		return
	}
	w.g.mu.Lock()
	defer w.g.mu.Unlock()
	for _, f := range reached {
		f.layer.reach(f)
	}
}

// close closes the group, which drops its marks, and waits for run.
func (w *watcher) close() {
	close(w.stop)
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := unix.Close(w.fd); err != nil {
		klog.ErrorS(err, "Closing a lazy layer's open notifications")
	}
	w.fd = -1
}

// Layout of a FAN_REPORT_FID event's info record (linux/fanotify.h): a
// header (type, pad, length), the fsid, then a struct file_handle (bytes,
// type, the handle).
const (
	fidHeaderLen  = 4
	fidFsidLen    = 8
	fidHandleAt   = fidHeaderLen + fidFsidLen
	fidHandleHead = 8 // handle_bytes, handle_type
)

// eventHandle is the handleKey of the file an event's info records
// report, found in a FAN_EVENT_INFO_TYPE_FID record, and it aliases info.
func eventHandle(info []byte) ([]byte, bool) {
	for len(info) >= fidHeaderLen {
		typ, length := info[0], int(binary.NativeEndian.Uint16(info[2:4]))
		if length < fidHeaderLen || length > len(info) {
			return nil, false
		}
		rec := info[:length]
		info = info[length:]
		if typ != unix.FAN_EVENT_INFO_TYPE_FID || len(rec) < fidHandleAt+fidHandleHead {
			continue
		}
		size := int(binary.NativeEndian.Uint32(rec[fidHandleAt:]))
		if size > len(rec)-fidHandleAt-fidHandleHead {
			return nil, false
		}
		// handle_type then the handle: handleKey's layout.
		return rec[fidHandleAt+4 : fidHandleAt+fidHandleHead+size], true
	}
	return nil, false
}

// handleKey is a file handle's type and bytes, as one map key.
func handleKey(typ int32, handle []byte) string {
	b := binary.NativeEndian.AppendUint32(make([]byte, 0, 4+len(handle)), uint32(typ))
	return string(append(b, handle...))
}
