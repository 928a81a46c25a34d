package fill

import (
	"context"
	"errors"
	"fmt"
	"io"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/filesum"
)

type fileKey struct{ dev, ino uint64 }

// keyOf is the key of the file open as fd.
func keyOf(fd int) (fileKey, error) {
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	return fileKey{dev: st.Dev, ino: st.Ino}, err
}

// fillState is where a stub's data stands. Only advance changes it, under
// the group's mu.
type fillState uint8

const (
	// stub: no data, and no fill runs.
	stub fillState = iota
	// claimedAhead: a read-ahead's fill runs, and no reader reached the
	// file yet (its first reader grows the dir's read-ahead window).
	claimedAhead
	// filling: a fill runs for a reader, the layer's stream or a fetch.
	filling
	// filledAhead: a read-ahead filled it, and no reader reached it yet
	// (its first reader, which the layer's watcher sees, still grows the
	// window: the read-ahead's hit).
	filledAhead
	// filled: its data is in place.
	filled
	// failed: its data will never be here; readers get EIO.
	failed
)

var fillStateNames = [...]string{"stub", "claimed ahead", "filling", "filled ahead", "filled", "failed"}

func (s fillState) String() string { return fillStateNames[s] }

// ended says the fill is over, one way or the other.
func (s fillState) ended() bool { return s == filledAhead || s == filled || s == failed }

// inPlace says its data is in place.
func (s fillState) inPlace() bool { return s == filledAhead || s == filled }

// ahead says a read-ahead brought (or brings) it and no reader reached it.
func (s fillState) ahead() bool { return s == claimedAhead || s == filledAhead }

// fillEvent is what happens to a stub.
type fillEvent uint8

const (
	// claim: a fill for a reader, the stream or a fetch takes the file.
	claim fillEvent = iota
	// claimAhead: a read-ahead's fill takes it.
	claimAhead
	// reach: a reader opens (or reads) it.
	reach
	// fillOK and fillFailed: how its fill ended (or its layer failed).
	fillOK
	fillFailed
)

var fillEventNames = [...]string{"claim", "claim ahead", "reach", "filled", "failed"}

func (e fillEvent) String() string { return fillEventNames[e] }

// advance is the one transition function: the state event leads to from
// s, and whether the event takes effect there. A claim takes only a stub
// (one fill at a time); a reader reaching a file a read-ahead claimed
// makes it an ordinary fill (or an ordinary filled file); how a fill ended
// is recorded once, from any state before the end (a failing layer fails
// its stubs too).
func advance(s fillState, e fillEvent) (fillState, bool) {
	switch {
	case e == claim && s == stub:
		return filling, true
	case e == claimAhead && s == stub:
		return claimedAhead, true
	case e == reach && s == claimedAhead:
		return filling, true
	case e == reach && s == filledAhead:
		return filled, true
	case e == reach:
		return s, true // noted in file.reached
	case e == fillOK && s == claimedAhead:
		return filledAhead, true
	case e == fillOK && !s.ended():
		return filled, true
	case e == fillFailed && !s.ended():
		return failed, true
	}
	return s, false
}

// markState is what stands between a stub's readers and its data.
type markState uint8

const (
	// markHeld: its pre-content mark holds readers until it is filled.
	markHeld markState = iota
	// markRemoved: its fill removed the mark; readers go straight
	// through, unseen.
	markRemoved
	// markWatched: its fill removed the mark, and the layer's watcher
	// sees its first reader instead (see file.reached).
	markWatched
)

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
	// state is where its data stands (see advance), and mark what stands
	// between its readers and its data: a filled file that must be
	// watched and could not be keeps its mark, and its readers are
	// answered at once.
	state fillState
	mark  markState
	// place is its place among the regular files of the stub tree's
	// stream, the order a stream of the layer's data brings them in.
	place int
	// caps says it may carry file capabilities (see Stub).
	caps bool
	// sum is what its data must hash to, where its layer checks sums.
	sum filesum.Sum
	// handle names its stub where fills open stubs by handle (byHandle).
	handle   xfsHandle
	byHandle bool
	// streamAt is its place in the order the layer's stream brings files
	// in (-1: none, or no stream), and streamBytes what the stream brings
	// before it (both under the group's mu; see Layer.Streaming).
	streamAt    int
	streamBytes int64
	err         error // why it failed
	filling     chan struct{}
	waiters     []event
}

// take makes the caller f's filler (under g.mu) with a claim or a
// claimAhead, unless f is filled or a fill of it is running.
func take(f *file, how fillEvent) bool {
	next, ok := advance(f.state, how)
	if !ok {
		return false
	}
	f.state, f.filling = next, make(chan struct{})
	return true
}

// on records e (under g.mu), where it takes effect.
func (f *file) on(e fillEvent) bool {
	next, ok := advance(f.state, e)
	f.state = next
	return ok
}

// source writes a file's data into w at its offsets.
type source func(ctx context.Context, w io.WriterAt) error

// fetch is f's data as its layer's FetchFunc brings it, failed once it
// writes nothing for the group's stall: a holder that hangs must not hold
// a reader for ever. (A stream's writes are not watched here: the stream
// is its caller's, which breaks it off, and then the file is fetched.)
//
// Where its layer checks sums, what does not hash to f's sum is told to
// the layer (the holder that sent it is dropped) and fetched again, from
// the next holder, until one sends the bytes the volume was captured with
// or none is left; at most maxRefetches times.
func (f *file) fetch(ctx context.Context, w io.WriterAt) error {
	for tries := 0; ; tries++ {
		err := f.fetchOnce(ctx, w)
		if err == nil {
			err = f.check(w)
		}
		if !errors.Is(err, filesum.ErrMismatch) || tries == maxRefetches {
			return err
		}
		if err := f.refuse(w, FromHolder, err); err != nil {
			return err
		}
	}
}

// refuse drops the wrong bytes from fetched into w, after telling the
// layer where they came from.
func (f *file) refuse(w io.WriterAt, from string, wrong error) error {
	f.layer.corrupt(f.rel, from, wrong)
	return w.(fetched).reset()
}

// maxRefetches bounds the fetches of a file again after wrong bytes.
const maxRefetches = 3

// check says whether what was fetched into w is f's data: its sum, where
// f's layer checks sums.
func (f *file) check(w io.WriterAt) error {
	if f.layer.corrupt == nil {
		return nil
	}
	got, err := w.(fetched).sum()
	if err != nil {
		return err
	}
	if got != f.sum {
		return fmt.Errorf("%s: %w", f.rel, filesum.ErrMismatch)
	}
	return nil
}

// fetchOnce brings f's data from its layer's FetchFunc.
func (f *file) fetchOnce(ctx context.Context, w io.WriterAt) error {
	return fetchWatched(ctx, f.layer.g.stall, w, func(ctx context.Context, w io.WriterAt) error {
		return f.layer.fetch(ctx, f.rel, f.size, w)
	})
}

// orFetch is f's data as write (part of a stream of many files) brings
// it, or, if write breaks off, as f's own fetch does; broke, if not nil,
// is told why write broke off (the stream is done for).
func (f *file) orFetch(write func(w io.WriterAt) error, broke *error) source {
	return func(ctx context.Context, w io.WriterAt) error {
		err := write(w)
		if err == nil {
			if err = f.check(w); err == nil {
				return nil
			}
			// The stream goes on; this file comes from a holder.
			if err := f.refuse(w, FromStream, err); err != nil {
				return err
			}
		} else if broke != nil {
			*broke = err
		}
		klog.V(2).InfoS("A file of a stream did not arrive whole; fetching it alone", "file", f.rel, "err", err)
		return f.fetch(ctx, w)
	}
}
