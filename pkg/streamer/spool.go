package streamer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
)

// Spool is a puller's copy of a layer's wire stream as it arrives, kept so
// that the next member of its swarm reads it as it grows (the puller relays
// the layer). It lives in an unnamed file (O_TMPFILE) in the node's staging
// dir, which no crash leaves behind, and what its one reader has read is
// punched out as it goes: a relay holds about as much as its reader lags,
// and at most maxSpoolBacklog (a spool its reader lags further behind, or
// that no reader came for, fails, and its reader goes to the holder): what
// a relay costs its node's disk stays small, whoever is slow.
type Spool struct {
	enc Encoding
	f   *os.File
	// onClose is told once the file is closed (its registry forgets it).
	onClose func()

	mu sync.Mutex
	// changed is closed and replaced whenever the spool grows or ends.
	changed chan struct{}
	size    int64
	read    int64    // how far the reader has read
	end     *Summary // the stream ended whole, and arrived as sent
	err     error    // the stream (or the spool's disk) failed
	taken   bool     // a reader has it
	done    bool     // the reader let go
	retired bool     // the pull that fills it ended
	closed  bool
}

// punchEvery is how far a reader gets before what it read is punched out.
const punchEvery = 16 << 20

// maxSpoolBacklog is the most a spool holds that its reader has not read:
// in a chain of equal links the next member trails by a few flow-control
// windows (8 MiB each).
var maxSpoolBacklog int64 = 64 << 20

// Errors a spool's reader gets.
var (
	// ErrSpoolTaken: a spool has one reader, the member after its puller.
	ErrSpoolTaken = errors.New("the relayed stream is read by another puller")
	// ErrSpoolBacklog: the reader fell too far behind (or never came).
	ErrSpoolBacklog = errors.New("the next puller fell too far behind the relayed stream")
)

// NewSpool makes an empty spool in dir for a stream encoded as enc;
// onClose (if any) is called once its file is closed.
func NewSpool(dir string, enc Encoding, onClose func()) (*Spool, error) {
	f, err := fdtree.Unnamed(dir, "a spool")
	if err != nil {
		return nil, err
	}
	return &Spool{enc: enc, f: f, onClose: onClose, changed: make(chan struct{})}, nil
}

// Encoding is what the spooled stream is encoded as.
func (s *Spool) Encoding() Encoding { return s.enc }

// wake tells a waiting reader something changed (under mu).
func (s *Spool) wake() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// Append adds wire bytes as they arrive. A write that fails (a full disk)
// fails the spool, and its reader, never the pull that tees into it.
func (s *Spool) Append(p []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil || s.end != nil || s.closed {
		return
	}
	if s.size+int64(len(p))-s.read > maxSpoolBacklog {
		s.err = ErrSpoolBacklog
	} else if _, err := s.f.WriteAt(p, s.size); err != nil {
		s.err = fmt.Errorf("spooling the stream: %w", err)
	} else {
		s.size += int64(len(p))
	}
	s.wake()
}

// End says the stream ended and arrived as its sender's trailer says.
func (s *Spool) End(sum Summary) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil && s.end == nil {
		s.end = &sum
		s.wake()
	}
}

// Fail says the stream will not end whole: its reader fails too.
func (s *Spool) Fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil && s.end == nil {
		s.err = err
		s.wake()
	}
}

// Retire says the pull that fills the spool ended (ended or failed it):
// the file goes once its reader lets go, or after grace if none comes.
func (s *Spool) Retire(grace time.Duration) {
	s.Fail(errors.New("the relaying pull stopped"))
	s.mu.Lock()
	s.retired = true
	closeNow := s.done || (!s.taken && grace <= 0)
	s.mu.Unlock()
	switch {
	case closeNow:
		s.close()
	case !s.taken:
		time.AfterFunc(grace, func() {
			s.mu.Lock()
			untaken := !s.taken
			s.mu.Unlock()
			if untaken {
				s.close()
			}
		})
	}
}

func (s *Spool) close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	if s.err == nil && s.end == nil {
		s.err = errors.New("the spool is closed")
	}
	s.wake()
	s.mu.Unlock()
	_ = s.f.Close()
	if s.onClose != nil {
		s.onClose()
	}
}

// Take makes the spool's one reader.
func (s *Spool) Take() (*SpoolReader, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.taken || s.closed {
		return nil, ErrSpoolTaken
	}
	s.taken = true
	return &SpoolReader{s: s}, nil
}

// SpoolReader reads a spool from its start, waiting for it to grow.
type SpoolReader struct {
	s        *Spool
	off      int64
	punched  int64
	released bool
}

// Next reads the next bytes into buf, waiting for them until ctx ends; at
// the stream's end it answers io.EOF and the trailer's summary, and a
// stream that failed, what failed it.
func (r *SpoolReader) Next(ctx context.Context, buf []byte) (int, *Summary, error) {
	s := r.s
	for {
		s.mu.Lock()
		size, end, err, changed := s.size, s.end, s.err, s.changed
		s.mu.Unlock()
		switch {
		case r.off < size:
			n, rerr := s.f.ReadAt(buf[:min(int64(len(buf)), size-r.off)], r.off)
			r.off += int64(n)
			s.mu.Lock()
			s.read = r.off
			s.mu.Unlock()
			if rerr != nil && !errors.Is(rerr, io.EOF) {
				return n, nil, rerr
			}
			r.punch()
			return n, nil, nil
		case end != nil:
			return 0, end, io.EOF
		case err != nil:
			return 0, nil, err
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return 0, nil, ctx.Err()
		}
	}
}

// punch frees what the reader has read: no one reads it again.
func (r *SpoolReader) punch() {
	if r.off-r.punched < punchEvery {
		return
	}
	// Best effort: a filesystem that cannot punch keeps the bytes until
	// the spool closes.
	_ = unix.Fallocate(int(r.s.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, r.off)
	r.punched = r.off
}

// Close lets the spool go: its file closes once its pull has ended too.
func (r *SpoolReader) Close() {
	if r.released {
		return
	}
	r.released = true
	s := r.s
	s.mu.Lock()
	s.done = true
	retired := s.retired
	s.mu.Unlock()
	if retired {
		s.close()
	}
}
