package pull

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/fill"
	"github.com/concourse/cowvol/pkg/index"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// lazySource fetches a lazily pulled layer's files from the peers holding
// the volume it was pulled for, moving to another when one fails. It
// reaches the holder over two connections: the stream of the whole layer
// fills one's socket buffers and flow-control window, and what a reader
// waits for must not queue behind megabytes of that.
type lazySource struct {
	pl        *Puller
	namespace string
	// layer is the layer being filled, top the volume it was pulled for
	// (its chain's top).
	layer, top streamer.Layer
	// inlined is what the stub tree carried whole (Through: the last),
	// which the stream of the rest leaves out.
	inlined streamer.Inline

	mu      sync.Mutex
	peer    string // the holder fetched from ("": none yet)
	address string
	lanes   [2]lane
	// failed are the holders never asked again (they sent wrong bytes);
	// lost those that could not be reached or stopped sending, since
	// when: asked again while the locator still lists them (a plugin
	// restarting, not a node gone) for up to the pull's wait.
	failed map[string]bool
	lost   map[string]time.Time
	// pods are those the pull was made for, told of wrong bytes.
	pods []volume.Pod

	// ended is done once the fill the source serves ended (close): what
	// a stream still under way then fails of is not its holder's or
	// relay's doing.
	ended context.Context
	end   context.CancelFunc
}

// newLazySource is the source of layer l of top's chain, pulled for
// namespace.
func newLazySource(pl *Puller, namespace string, l, top streamer.Layer) *lazySource {
	s := &lazySource{pl: pl, namespace: namespace, layer: l, top: top}
	s.ended, s.end = context.WithCancel(context.Background())
	return s
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

// holderRetry is how often a source whose holders are all lost dials
// them again.
const holderRetry = 250 * time.Millisecond

// current returns the holder to fetch from and a client on its lane,
// dialling the next holder not yet failed if there is none. When every
// holder is lost, those the locator still lists are dialled again every
// holderRetry until one answers or the pull's wait since it was lost
// passes: a holder's plugin that restarts (an upgrade rolls every node's)
// is back within seconds, and its readers here wait for it rather than
// get EIO.
func (s *lazySource) current(ctx context.Context, which int) (*streamer.Client, string, error) {
	for {
		client, peer, wait, err := s.tryCurrent(ctx, which)
		if !wait {
			return client, peer, err
		}
		select {
		case <-ctx.Done():
			return nil, "", context.Cause(ctx)
		case <-time.After(holderRetry):
		}
	}
}

// tryCurrent is one round of current: wait says that every holder is
// lost and some may be back soon.
func (s *lazySource) tryCurrent(ctx context.Context, which int) (_ *streamer.Client, _ string, wait bool, _ error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ln := &s.lanes[which]
	if ln.client != nil {
		return ln.client, s.peer, false, nil
	}
	dial := s.pl.cfg.Dial
	if s.peer != "" {
		client, conn, err := dial(s.peer, s.address)
		if err == nil {
			ln.client, ln.conn = client, conn
			return client, s.peer, false, nil
		}
		klog.ErrorS(err, "Dialling the holder of a lazily pulled layer again failed; trying another holder", "volume", s.layer.Ref, "peer", s.peer)
		s.loseLocked(s.peer)
	}
	holders, err := s.pl.cfg.Locator.Holders(ctx, s.namespace, s.top.Ref)
	if err != nil {
		return nil, "", false, fmt.Errorf("finding the nodes that hold %s: %w", s.top.Ref, err)
	}
	// Those not lost first, then those lost within the wait.
	var errs []error
	now := time.Now()
	for _, retrying := range []bool{false, true} {
		for _, h := range holders {
			since, lost := s.lost[h.NodeID]
			if h.NodeID == s.pl.nodeID || h.Address == "" || s.failed[h.NodeID] || lost != retrying ||
				(lost && now.Sub(since) > s.pl.cfg.Wait) {
				continue
			}
			client, conn, err := dial(h.NodeID, h.Address)
			if err != nil {
				errs = append(errs, err)
				wait = wait || lost
				continue
			}
			ln.client, ln.conn = client, conn
			s.peer, s.address = h.NodeID, h.Address
			return client, h.NodeID, false, nil
		}
	}
	return nil, "", wait, fmt.Errorf("no peer left that holds %s: %w", s.top.Ref, errors.Join(append(errs, ErrPullFailed)...))
}

// lose moves on from peer, which could not be reached or stopped sending:
// asked again once no other holder is left, within the pull's wait from
// when it was first lost. It says whether peer was lost already (it
// failed again as soon as it was asked again).
func (s *lazySource) lose(peer string) (again bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loseLocked(peer)
}

func (s *lazySource) loseLocked(peer string) (again bool) {
	if s.lost == nil {
		s.lost = map[string]time.Time{}
	}
	if _, again = s.lost[peer]; !again {
		s.lost[peer] = time.Now()
	}
	s.leaveLocked(peer)
	return again
}

// reached: peer sent data, and is no longer lost.
func (s *lazySource) reached(peer string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.lost, peer)
}

// fail moves on from peer for good: it sent wrong bytes.
func (s *lazySource) fail(peer string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failed == nil {
		s.failed = map[string]bool{}
	}
	s.failed[peer] = true
	s.leaveLocked(peer)
}

// leaveLocked stops fetching from peer (under mu).
func (s *lazySource) leaveLocked(peer string) {
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
		n, err := client.ReadLayerFile(ctx, s.namespace, s.layer.Ref, s.top.Ref, rel, done, size-done, w)
		done += n
		s.pl.metrics.fillBytes.Add(float64(n))
		if n > 0 {
			s.reached(peer)
		}
		if err == nil && done < size {
			err = fmt.Errorf("%s ended at %d of %d bytes", rel, done, size)
		}
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
			return err
		}
		if errors.Is(err, streamer.ErrCorrupt) {
			// Caught by the wire's own checksum, before any sum: bytes
			// not the volume's all the same.
			s.pl.metrics.corrupt.WithLabelValues(fill.FromHolder).Inc()
		}
		klog.ErrorS(err, "Fetching a lazily pulled file failed; trying another holder", "volume", s.layer.Ref, "file", rel, "peer", peer)
		if s.lose(peer) { // asked again, and failed again: not at once once more
			select {
			case <-ctx.Done():
				return context.Cause(ctx)
			case <-time.After(holderRetry):
			}
		}
	}
	return nil
}

// fetchExtent writes extent e of an index's blob whole (a fill.BlobFetch):
// its file's data, as fetch does.
func (s *lazySource) fetchExtent(ctx context.Context, e index.Extent, w io.WriterAt) error {
	return s.fetch(ctx, e.Path, e.Size, w)
}

// stream offers the layer's files to offer (a stub layer's or an index's
// blob's Offer), from one stream of the whole layer from the current
// holder (or the member before this node in the stream's swarm), first
// those first names in that order; files readers are filling already are
// skipped. A stream that breaks off moves on from its holder; one that a
// relay broke off does not (the rest comes file by file).
//
// In a swarm, with no read order, the stream is the one an eager pull
// takes (the whole layer in the walk's order, the small files the stub
// tree carried too): one swarm for the layer whatever its members' pull
// modes, so that the holder sends it once, for about 120 bytes an entry of
// metadata more and the small files again. A read order keeps a stream of
// its own (an eager puller cannot take files before their dirs): the
// order is what its readers wait on.
func (s *lazySource) stream(ctx context.Context, offer func(rel string, write func(w io.WriterAt) error) error, first []string) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(s.ended, cancel)()
	client, peer, err := s.current(ctx, bulkLane)
	if err != nil {
		return err
	}
	cfg := s.pl.cfg
	ls := streamer.LayerStream{Namespace: s.namespace, Ref: s.layer.Ref, Via: s.top.Ref, Encoding: cfg.Encoding, Shape: streamer.DataTar,
		Inline: s.inlined, First: first}
	if len(first) == 0 && s.pl.swarms(s.layer) {
		ls.Shape, ls.Inline = streamer.SparseTar, streamer.Inline{}
	}
	err = s.pl.inSwarm(ctx, client, ls, s.top, s.layer, false, func(from *streamer.Client, sw streamer.Swarmed, done func(streamer.Summary) error) error {
		sum, err := from.PullLayerFiles(ctx, ls, sw, nil, cfg.Limits, s.counted(offer))
		if err == nil {
			err = done(sum)
		}
		return err
	})
	if err != nil && !errors.Is(err, errRelayFailed) && ctx.Err() == nil {
		s.lose(peer)
	}
	return err
}

// fetchMany brings the files rels in one stream from the current holder
// (a reader's read-ahead). What it does not bring is fetched file by file,
// and those fetches move on from a holder that failed.
func (s *lazySource) fetchMany(ctx context.Context, rels []string, each func(rel string, write func(w io.WriterAt) error) error) error {
	client, _, err := s.current(ctx, urgentLane)
	if err != nil {
		return err
	}
	cfg := s.pl.cfg
	ls := streamer.LayerStream{Namespace: s.namespace, Ref: s.layer.Ref, Via: s.top.Ref, Encoding: cfg.Encoding, Shape: streamer.DataTar}
	_, err = client.PullLayerFiles(ctx, ls, streamer.Swarmed{}, rels, cfg.Limits, s.counted(each))
	return err
}

// counted counts the data each file brings as it is written.
func (s *lazySource) counted(each func(rel string, write func(w io.WriterAt) error) error) func(string, int64, func(io.WriterAt) error) error {
	return func(name string, size int64, write func(w io.WriterAt) error) error {
		return each(name, func(w io.WriterAt) error {
			s.pl.metrics.fillBytes.Add(float64(size))
			return write(w)
		})
	}
}

// tell has the pods the pull was made for told of the wrong bytes peers
// send.
func (s *lazySource) tell(pods []volume.Pod) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pods = pods
}

// corrupt is told that a file's bytes from a peer were not the volume's
// (a fill.CorruptFunc): counted, said, and where the current holder sent
// them, it is dropped, so that the file comes from the next holder. Bytes
// a stream brought wrong come from the holder next; a holder whose disk
// rotted is caught there.
func (s *lazySource) corrupt(rel, from string, err error) {
	s.mu.Lock()
	peer, pods := s.peer, s.pods
	s.mu.Unlock()
	s.pl.metrics.corrupt.WithLabelValues(from).Inc()
	klog.ErrorS(err, "A peer sent a file of a lazily pulled volume that is not what it was captured with; fetching it again",
		"volume", s.layer.Ref, "file", rel, "from", from, "holder", peer)
	for _, pod := range pods {
		s.pl.notify.Event(pod, EventWarning, "CorruptData", fmt.Sprintf("A peer (%s %s) sent a file of source volume %q that is not "+
			"what it was captured with; it was fetched again, and no reader saw it", from, peer, s.top.Ref.Handle))
	}
	if from == fill.FromHolder && peer != "" {
		s.fail(peer)
	}
}

// close lets go of the source's connections, once the fill it serves
// ended: a stream under way is cancelled first, so that it does not count
// its connection's close against the relay it came from (it may be
// checking its whole stream against the holder's digest).
func (s *lazySource) close() {
	s.end()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closeLanes()
}
