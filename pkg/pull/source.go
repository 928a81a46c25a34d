package pull

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/fill"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// lazySource fetches a lazily pulled layer's files from the peers holding
// the volume it was pulled for, moving to another when one fails. It
// reaches the holder over two connections: the stream of the whole layer
// fills one's socket buffers and flow-control window, and what a reader
// waits for must not queue behind megabytes of that.
type lazySource struct {
	pl         *Puller
	namespace  string
	layer, via volume.Ref
	// inlined is what the stub tree carried whole (Through: the last),
	// which the stream of the rest leaves out.
	inlined streamer.Inline

	mu      sync.Mutex
	peer    string // the holder fetched from ("": none yet)
	address string
	lanes   [2]lane
	failed  map[string]bool
}

// A lane is one connection to the holder.
type lane struct {
	client *streamer.Client
	conn   io.Closer
}

const (
	bulkLane   = 0 // the stream of the whole layer
	urgentLane = 1 // fetches and read-aheads readers wait for
)

// current returns the holder to fetch from and a client on its lane,
// dialling the next holder not yet failed if there is none.
func (s *lazySource) current(ctx context.Context, which int) (*streamer.Client, string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ln := &s.lanes[which]
	if ln.client != nil {
		return ln.client, s.peer, nil
	}
	dial := s.pl.cfg.Dial
	if s.peer != "" {
		client, conn, err := dial(s.address)
		if err == nil {
			ln.client, ln.conn = client, conn
			return client, s.peer, nil
		}
		klog.ErrorS(err, "Dialling the holder of a lazily pulled layer again failed; trying another holder", "volume", s.layer, "peer", s.peer)
		s.dropLocked(s.peer)
	}
	holders, err := s.pl.cfg.Locator.Holders(ctx, s.namespace, s.via)
	if err != nil {
		return nil, "", fmt.Errorf("finding the nodes that hold %s: %w", s.via, err)
	}
	var errs []error
	for _, h := range holders {
		if h.NodeID == s.pl.nodeID || h.Address == "" || s.failed[h.NodeID] {
			continue
		}
		client, conn, err := dial(h.Address)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		ln.client, ln.conn = client, conn
		s.peer, s.address = h.NodeID, h.Address
		return client, h.NodeID, nil
	}
	return nil, "", fmt.Errorf("no peer left that holds %s: %w", s.via, errors.Join(append(errs, ErrPullFailed)...))
}

// drop moves on from peer, which failed.
func (s *lazySource) drop(peer string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dropLocked(peer)
}

func (s *lazySource) dropLocked(peer string) {
	if s.failed == nil {
		s.failed = map[string]bool{}
	}
	s.failed[peer] = true
	if s.peer == peer {
		s.closeLanes()
		s.peer, s.address = "", ""
	}
}

// closeLanes lets go of the connections (under mu).
func (s *lazySource) closeLanes() {
	for i := range s.lanes {
		if ln := &s.lanes[i]; ln.conn != nil {
			_ = ln.conn.Close()
			*ln = lane{}
		}
	}
}

// fetch writes the file rel whole, from the current holder; what a holder
// that fails mid-way did not send comes from the next one.
func (s *lazySource) fetch(ctx context.Context, rel string, size int64, w io.WriterAt) error {
	var done int64
	for done < size {
		client, peer, err := s.current(ctx, urgentLane)
		if err != nil {
			return err
		}
		n, err := client.ReadLayerFile(ctx, s.namespace, s.layer, s.via, rel, done, size-done, w)
		done += n
		s.pl.metrics.fillBytes.Add(float64(n))
		if err == nil && done < size {
			err = fmt.Errorf("%s ended at %d of %d bytes", rel, done, size)
		}
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
			return err
		}
		klog.ErrorS(err, "Fetching a lazily pulled file failed; trying another holder", "volume", s.layer, "file", rel, "peer", peer)
		s.drop(peer)
	}
	return nil
}

// stream fills the layer's files from one stream of the whole layer from
// the current holder, first those first names in that order; files readers
// are filling already are skipped. A stream that breaks off moves on from
// its holder.
func (s *lazySource) stream(ctx context.Context, layer *fill.Layer, first []string) error {
	peer, err := s.pullFiles(ctx, bulkLane, nil, first, s.inlined, layer.Offer)
	if err != nil && peer != "" && ctx.Err() == nil {
		s.drop(peer)
	}
	return err
}

// fetchMany brings the files rels in one stream from the current holder
// (a reader's read-ahead). What it does not bring is fetched file by file,
// and those fetches move on from a holder that failed.
func (s *lazySource) fetchMany(ctx context.Context, rels []string, each func(rel string, write func(w io.WriterAt) error) error) error {
	_, err := s.pullFiles(ctx, urgentLane, rels, nil, streamer.Inline{}, each)
	return err
}

// pullFiles streams the files rels of the layer (nil: all of them, first
// those first, but those the stub tree carried, inlined) from the current
// holder, which it names, handing each to each; the data written is
// counted.
func (s *lazySource) pullFiles(ctx context.Context, which int, rels, first []string, inlined streamer.Inline,
	each func(rel string, write func(w io.WriterAt) error) error) (string, error) {
	client, peer, err := s.current(ctx, which)
	if err != nil {
		return "", err
	}
	cfg := s.pl.cfg
	_, err = client.PullLayerFiles(ctx, s.namespace, s.layer, s.via, cfg.Encoding, cfg.Limits, rels, first, inlined,
		func(name string, size int64, write func(w io.WriterAt) error) error {
			return each(name, func(w io.WriterAt) error {
				s.pl.metrics.fillBytes.Add(float64(size))
				return write(w)
			})
		})
	return peer, err
}

// close lets go of the source's connections.
func (s *lazySource) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closeLanes()
}
