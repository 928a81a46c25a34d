package fill

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
)

// blob.go fills the blob of a mounted index (pkg/index) on demand. A read
// of a file of the index's mount makes the kernel read the blob, its extra
// device, at the file's extent; the blob is marked for pre-content events
// in a group of its own, each event says the range the kernel reads, and
// the reader waits while every extent that range touches is fetched whole,
// checked against its sum and written in place. Unlike a stub's, a
// mapping of a file of the index raises events too: EROFS reads its blob
// through the kernel's read path, page faults included, so files are
// filled by extent, not on open. (The process holding a Blob must not
// fault on a mapping of its index itself: a Go thread held in a page fault
// stalls the collector's stop of the world, and the answer with it.)
//
// What a Blob does not do yet, and a pull needs before it mounts one
// under a step: outlive its process (a group closed lets its held readers
// read the blob's holes, which is why stubs' group has a keeper), and
// take its extents from a stream in the background.

// BlobFetch brings extent e's bytes whole: it writes them through w at
// their offsets in the file (0 to e.Size), and may leave runs of zeros
// unwritten.
type BlobFetch func(ctx context.Context, e index.Extent, w io.WriterAt) error

// Blob holds the readers of an index's blob until the extents their reads
// touch are in place.
type Blob struct {
	events *os.File // the group: read events, write answers
	fd     int      // events' descriptor, for marks
	// clone is a detached clone of the mount of the blob's dir, exempt
	// from the group's events, and file the blob opened through it: the
	// fills write and check through it.
	clone  int
	file   fdtree.File
	layout *index.Layout
	fetch  BlobFetch
	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex
	state  []extentState
	left   int   // extents neither in place nor failed
	err    error // the first failure
	closed bool  // failed: no fill starts
	done   chan struct{}
	loop   sync.WaitGroup
	fills  sync.WaitGroup

	closeOnce sync.Once
	closeErr  error
}

type extentState struct {
	state   uint8
	waiters []*blobReader
}

const (
	extentMissing uint8 = iota
	extentFetching
	extentInPlace
	extentFailed
)

// blobReader is a held read of the blob: its event's descriptor, and the
// extents it waits for.
type blobReader struct {
	fd       int32
	pending  int
	answered bool
}

// OpenBlob holds the readers of the blob name in dir, whose extents layout
// says, from now on: every extent that carries its data (Extent.Data) is
// written in place at once, and every other one is fetched with fetch when
// a read first touches it. dir is the caller's, made by it.
func OpenBlob(dir, name string, layout *index.Layout, fetch BlobFetch) (*Blob, error) {
	fd, err := unix.FanotifyInit(unix.FAN_CLASS_PRE_CONTENT|unix.FAN_CLOEXEC|unix.FAN_NONBLOCK|unix.FAN_UNLIMITED_QUEUE,
		unix.O_RDONLY|unix.O_LARGEFILE)
	if err != nil {
		return nil, fmt.Errorf("making a fanotify pre-content group: %w", err)
	}
	b := &Blob{fd: fd, clone: -1, file: -1, layout: layout, fetch: fetch, state: make([]extentState, len(layout.Extents)),
		left: len(layout.Extents), done: make(chan struct{})}
	if err := b.open(dir, name); err != nil {
		for _, c := range []int{int(b.file), b.clone, fd} {
			if c >= 0 {
				unix.Close(c)
			}
		}
		return nil, err
	}
	b.events = os.NewFile(uintptr(fd), "fanotify")
	b.ctx, b.cancel = context.WithCancel(context.Background())
	b.loop.Add(1)
	go b.run()
	return b, nil
}

// open clones dir's mount, exempts the clone from the group's events,
// opens the blob through it, writes the extents that carry their data and
// marks the blob for the rest.
func (b *Blob) open(dir, name string) error {
	var err error
	// The clone is dissolved with the fd open_tree gives; a mark takes no
	// O_PATH fd, so it and the open use a real fd of the clone's root.
	if b.clone, err = unix.OpenTree(unix.AT_FDCWD, dir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC); err != nil {
		return fmt.Errorf("cloning the mount of %s: %w", dir, err)
	}
	root, err := unix.Openat(b.clone, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(root)
	if err := unix.FanotifyMark(b.fd, unix.FAN_MARK_ADD|unix.FAN_MARK_MOUNT|unix.FAN_MARK_IGNORED_MASK|unix.FAN_MARK_IGNORED_SURV_MODIFY,
		unix.FAN_PRE_ACCESS, root, ""); err != nil {
		return fmt.Errorf("exempting the clone of %s from events: %w", dir, err)
	}
	file, err := unix.Openat(root, name, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("the blob %s: %w", name, err)
	}
	b.file = fdtree.File(file)
	var st unix.Stat_t
	if err := unix.Fstat(file, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != b.layout.Size {
		return fmt.Errorf("the blob %s: mode %o, %d bytes: want a regular file of %d", name, st.Mode, st.Size, b.layout.Size)
	}
	for i, e := range b.layout.Extents {
		if e.Data == nil {
			continue
		}
		if _, err := b.file.WriteAt(e.Data, e.Offset); err != nil {
			return fmt.Errorf("%s: %w", e.Path, err)
		}
		b.state[i].state = extentInPlace
		b.left--
	}
	if b.left == 0 {
		close(b.done)
		return nil
	}
	if err := unix.FanotifyMark(b.fd, unix.FAN_MARK_ADD, unix.FAN_PRE_ACCESS, file, ""); err != nil {
		return fmt.Errorf("marking the blob for pre-content events: %w", err)
	}
	return nil
}

// Done is closed once every extent is in place or failed.
func (b *Blob) Done() <-chan struct{} { return b.done }

// Err is the first extent's failure (nil: none yet).
func (b *Blob) Err() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.err
}

// run reads events until the group is closed.
func (b *Blob) run() {
	defer b.loop.Done()
	if err := readEvents(b.events, func(buf []byte) { eachRangeEvent(buf, b.dispatch) }); err != nil {
		klog.ErrorS(err, "Reading the fanotify events of an index's blob; its fills stop")
	}
}

// eachRangeEvent calls fn with the descriptor and the range of each
// event read into buf (an event without a range info record, which a
// pre-content event always has, covers the whole file).
func eachRangeEvent(buf []byte, fn func(fd int32, off, n int64)) {
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
		at, n := int64(0), int64(-1)
		// Each info record: type (1 byte), pad (1), length (2), then its
		// body; a range's is pad (4), offset (8), count (8).
		for len(info) >= 4 {
			kind, size := info[0], int(binary.NativeEndian.Uint16(info[2:]))
			if size < 4 || size > len(info) {
				break
			}
			if kind == unix.FAN_EVENT_INFO_TYPE_RANGE && size >= 24 {
				at, n = int64(binary.NativeEndian.Uint64(info[8:])), int64(binary.NativeEndian.Uint64(info[16:]))
			}
			info = info[size:]
		}
		fn(md.Fd, at, n)
	}
}

// dispatch answers a read of n bytes of the blob at off (n < 0: all of
// it) once every extent it touches is in place, EIO if one failed.
func (b *Blob) dispatch(fd int32, off, n int64) {
	if n < 0 || off < 0 || n > b.layout.Size {
		off, n = 0, b.layout.Size
	}
	r := &blobReader{fd: fd}
	b.mu.Lock()
	first, end := b.layout.Touching(off, n)
	failed := b.closed
	for i := first; i < end && !failed; i++ {
		s := &b.state[i]
		switch s.state {
		case extentInPlace:
			continue
		case extentFailed:
			failed = true
			continue
		case extentMissing:
			s.state = extentFetching
			b.fills.Add(1)
			go b.fill(i)
		}
		s.waiters = append(s.waiters, r)
		r.pending++
	}
	switch {
	case failed:
		r.answered = true
		b.mu.Unlock()
		b.respond(fd, denyEIO)
	case r.pending == 0:
		r.answered = true
		b.mu.Unlock()
		b.respond(fd, unix.FAN_ALLOW)
	default:
		b.mu.Unlock()
	}
}

// fill fetches extent i whole, checks it and answers its waiters.
func (b *Blob) fill(i int) {
	defer b.fills.Done()
	e := b.layout.Extents[i]
	err := b.fetch(b.ctx, e, extentWriter{file: b.file, extent: e})
	if err == nil && e.Sum != (filesum.Sum{}) {
		// As written, read back through the clone: a wrong byte never
		// reaches a reader.
		err = filesum.Check(io.NewSectionReader(b.file, e.Offset, e.Size), e.Sum)
	}
	if err != nil {
		err = fmt.Errorf("%s: %w", e.Path, err)
	}
	b.finish(i, err)
}

// finish records how extent i's fill ended and answers the readers it
// was the last one of, or fails those it was one of.
func (b *Blob) finish(i int, err error) {
	b.mu.Lock()
	s := &b.state[i]
	waiters := s.waiters
	s.waiters = nil
	s.state = extentInPlace
	if err != nil {
		s.state = extentFailed
		if b.err == nil {
			b.err = err
		}
		klog.ErrorS(err, "Filling an extent of an index's blob failed; its readers get EIO")
	}
	var allow, deny []int32
	for _, r := range waiters {
		r.pending--
		switch {
		case r.answered:
		case err != nil:
			r.answered = true
			deny = append(deny, r.fd)
		case r.pending == 0:
			r.answered = true
			allow = append(allow, r.fd)
		}
	}
	// Once all are in place, readers need not wait for this process; a
	// failed extent keeps the mark, which answers its readers EIO.
	if b.left--; b.left == 0 && b.err == nil {
		if merr := unix.FanotifyMark(b.fd, unix.FAN_MARK_REMOVE, unix.FAN_PRE_ACCESS, int(b.file), ""); merr != nil {
			klog.ErrorS(merr, "Unmarking a filled index's blob")
		}
	}
	if b.left == 0 {
		close(b.done)
	}
	b.mu.Unlock()
	for _, fd := range allow {
		b.respond(fd, unix.FAN_ALLOW)
	}
	for _, fd := range deny {
		b.respond(fd, denyEIO)
	}
}

func (b *Blob) respond(fd int32, answer uint32) {
	resp := unix.FanotifyResponse{Fd: fd, Response: answer}
	if _, err := b.events.Write((*[unsafe.Sizeof(resp)]byte)(unsafe.Pointer(&resp))[:]); err != nil && !errors.Is(err, os.ErrClosed) {
		klog.ErrorS(err, "Answering a held reader of an index's blob")
	}
	unix.Close(int(fd))
}

// Fail stops the fills under way and answers every held reader EIO, and
// every later reader of an extent not in place. The group stays: its
// readers are held (and failed) until Close.
func (b *Blob) Fail() {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	b.cancel()
	b.fills.Wait() // each failed, its readers answered
}

// Close fails the blob and closes the group. The index is to be unmounted
// and its files closed before: once the group is closed, a read of the
// blob is no longer held, and reads its holes. A second Close returns the
// first's error.
func (b *Blob) Close() error {
	b.closeOnce.Do(func() {
		b.Fail()
		err := b.events.Close()
		b.loop.Wait()
		b.closeErr = errors.Join(err, unix.Close(int(b.file)), unix.Close(b.clone))
	})
	return b.closeErr
}

// extentWriter writes an extent's bytes into the blob, at offsets in its
// file, and refuses any past its end.
type extentWriter struct {
	file   fdtree.File
	extent index.Extent
}

func (w extentWriter) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off > w.extent.Size || int64(len(p)) > w.extent.Size-off {
		return 0, fmt.Errorf("%d bytes at %d of a file of %d: %w", len(p), off, w.extent.Size, unix.EINVAL)
	}
	return w.file.WriteAt(p, w.extent.Offset+off)
}
