package fill

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/bufpool"
	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
)

// ensure fills f unless it is filled, waiting for a fill already running.
func (g *Group) ensure(f *file) error {
	g.mu.Lock()
	mine, running := take(f, claim), f.filling
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
	watch := !f.reached && (f.state == claimedAhead || f.layer.recording.Load()) // see file.reached
	g.mu.Unlock()
	if watch {
		if err := f.layer.watchFilled(f); err != nil {
			klog.V(2).InfoS("Watching a filled file; its readers are held instead", "file", f.rel, "err", err)
			return nil
		}
	}
	g.mu.Lock()
	f.mark = markRemoved
	if watch && !f.reached {
		f.mark = markWatched
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
	ended := fillOK
	if err != nil {
		ended = fillFailed
	}
	if !f.on(ended) {
		g.mu.Unlock()
		return // recorded already
	}
	f.err = err
	waiters := f.waiters
	f.waiters = nil
	if f.filling != nil {
		close(f.filling)
	}
	if err == nil && f.mark != markHeld {
		delete(g.files, f.key) // one still marked stays: see file.mark
	}
	g.mu.Unlock()
	// The layer hears first: a reader answered may look at it next.
	f.layer.settled(err)
	answer := uint32(unix.FAN_ALLOW)
	if err != nil {
		answer = denyEIO
	}
	for _, ev := range waiters {
		g.respond(ev, answer) // a filled file's mark went with its write
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
type holeWriter struct{ f *os.File }

func (h holeWriter) WriteAt(b []byte, off int64) (int, error) {
	if allZero(b) {
		return len(b), nil
	}
	return h.f.WriteAt(b, off)
}

// fetched is what a fill writes a file's data into (a memFile, a
// holeWriter): readable back for its sum, and emptied for another try.
type fetched interface {
	io.WriterAt
	sum() (filesum.Sum, error)
	reset() error
}

func (m *memFile) sum() (filesum.Sum, error) { return filesum.Of(bytes.NewReader(m.b)) }
func (m *memFile) reset() error              { clear(m.b); return nil }

func (h holeWriter) sum() (filesum.Sum, error) {
	st, err := h.f.Stat()
	if err != nil {
		return filesum.Sum{}, err
	}
	return filesum.Of(io.NewSectionReader(h.f, 0, st.Size()))
}

// reset makes the file all holes again, at its size.
func (h holeWriter) reset() error {
	st, err := h.f.Stat()
	if err == nil {
		err = h.f.Truncate(0)
	}
	if err == nil {
		err = h.f.Truncate(st.Size())
	}
	return err
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

// fetchWatched runs fetch writing through w, failed once it writes
// nothing for stall (then with that as its error): a holder that hangs,
// or a dial of one that never answers, holds no reader for longer.
func fetchWatched(ctx context.Context, stall time.Duration, w io.WriterAt, fetch func(ctx context.Context, w io.WriterAt) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	pw := &progressWriter{w: w, last: time.Now()}
	defer pw.watch(cancel, stall)()
	if err := fetch(ctx, pw); err != nil {
		if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
			return cause
		}
		return err
	}
	return nil
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
