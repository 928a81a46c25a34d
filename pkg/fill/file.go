package fill

import (
	"context"
	"errors"
	"io"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

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

// claim makes the caller f's filler (under g.mu), unless f is filled or
// a fill of it is running.
func claim(f *file) bool {
	if f.done || f.filling != nil {
		return false
	}
	f.filling = make(chan struct{})
	return true
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
