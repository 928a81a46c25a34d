package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/fill"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// PullMode is how a node pulls the sources it lacks.
type PullMode string

const (
	// PullAuto: lazily where the node supports it, else eagerly.
	PullAuto PullMode = "auto"
	// PullLazy: a source's tree arrives first, its files as stubs, and
	// the step starts; each file's data arrives when it is first opened,
	// the rest behind it.
	PullLazy PullMode = "lazy"
	// PullEager: all of a source's data arrives before the step starts.
	PullEager PullMode = "eager"
)

// ParsePullMode checks a --pull-mode value.
func ParsePullMode(s string) (PullMode, error) {
	switch m := PullMode(s); m {
	case PullAuto, PullLazy, PullEager:
		return m, nil
	}
	return "", fmt.Errorf("pull mode %q: want auto, lazy or eager", s)
}

// prefetchWorkers is how many files a lazy layer's prefetch fetches at
// once: enough to keep a link busy with small files.
const prefetchWorkers = 8

// stubInline is which small files a lazy pull's stub tree carries whole:
// those of at most 8 KiB, in the walk's order, 16 MiB of them at most. A
// file that small costs a node less CPU to receive whole than to make as a
// stub, mark, and fill later (about 20 us a file here, the time 8 KiB take
// on the wire), and it is there before the step starts; the budget keeps
// the publish flat in the size (16 MiB is some 40 ms of a publish here).
var stubInline = streamer.Inline{Max: 8 << 10, Budget: 16 << 20}

// lazyPulls are the layers being filled, and the group holding their
// readers (nil: the node pulls eagerly).
type lazyPulls struct {
	group  *fill.Group
	mu     sync.Mutex
	layers map[volume.Ref]*lazyFill
}

// lazyFill is a layer being filled, and who mounts it meanwhile (under
// lazyPulls.mu): the namespaces of their pods, and the read profiles they
// named, under which the order its readers reach its files is recorded.
type lazyFill struct {
	layer      *fill.Layer
	namespaces map[string]bool
	profiles   map[string]bool
}

// ChoosePullMode decides how a node whose views are made by backend, on
// stateDir, pulls the sources it lacks when asked, and says why: lazily
// only where views read through to the layers (the overlay backend: a
// clone or a snapshot of a stub would hold its holes) and the kernel and
// the state dir's filesystem have fanotify pre-content events. It opens
// nothing; asked lazy where that cannot work, it fails.
func ChoosePullMode(asked PullMode, backend overlay.Kind, stateDir string) (PullMode, string, error) {
	if asked == PullEager {
		return PullEager, "--pull-mode=eager", nil
	}
	why := ""
	if backend != overlay.KindOverlay {
		why = fmt.Sprintf("the %s backend's views copy their layers (a clone or a snapshot of a stub holds its holes)", backend)
	} else if err := fill.Supported(stateDir); err != nil {
		why = err.Error()
	}
	if why == "" {
		return PullLazy, "fanotify pre-content events hold readers of stub files under " + stateDir, nil
	}
	if asked == PullLazy {
		return "", "", fmt.Errorf("--pull-mode=lazy: %s", why)
	}
	return PullEager, why, nil
}

// openLazyPulls opens the fanotify group a lazy pull's readers wait in,
// where the mode chosen is lazy; a group that cannot be opened makes an
// auto node eager (and fails one asked to be lazy). It says the mode in
// force and why.
func (e *Engine) openLazyPulls(asked, mode PullMode, why, stateDir string, stall time.Duration) (PullMode, string, error) {
	if mode != PullLazy {
		return mode, why, nil
	}
	g, err := fill.Open(stateDir, stall)
	if err != nil {
		if asked == PullLazy {
			return "", "", fmt.Errorf("--pull-mode=lazy: %w", err)
		}
		return PullEager, err.Error(), nil
	}
	e.lazy = &lazyPulls{group: g, layers: map[volume.Ref]*lazyFill{}}
	return PullLazy, why, nil
}

// PullMode says how the node pulls sources it lacks ("" where it pulls
// none), and why: lazily exactly where it holds a fanotify group.
func (e *Engine) PullMode() (PullMode, string) {
	switch {
	case e.pulls == nil:
		return "", ""
	case e.lazy != nil:
		return PullLazy, e.pullModeWhy
	}
	return PullEager, e.pullModeWhy
}

// stubMarker starts the layer of stubs a lazy pull makes at data (its dir
// in place) and returns the func that marks each stub as the extraction
// makes it, so that its readers wait for its data, which src fetches. The
// data to come is bounded as an eager pull's stream is: by the sizes the
// holder gave the stubs.
func (e *Engine) stubMarker(src *lazySource, data string) (*fill.Layer, streamer.StubFunc, error) {
	layer, err := e.lazy.group.NewLayer(data, src.fetch, src.fetchMany)
	if err != nil {
		return nil, nil, err
	}
	var total atomic.Int64
	limit := e.pulls.cfg.Limits.Bytes
	return layer, func(s streamer.Stub) error {
		if total.Add(s.Size) > limit {
			return fmt.Errorf("%s: its files hold more than the stream size limit (%d bytes): %w", src.layer, limit, streamer.ErrRefused)
		}
		return layer.Add(s.FD, fill.Stub{Rel: s.Name, Size: s.Size, Place: s.Place, Caps: s.Caps,
			Dev: s.Dev, Ino: s.Ino, Times: [2]unix.Timespec{s.Mtime, s.Mtime}}) // a stream's entries' atime is their mtime
	}, nil
}

// fillInBackground fetches a filling volume's data, first the files read
// in the order recorded under the pods' read profiles in namespace (how
// steps read it before), and records how that ended: ready once
// all of it is here and synced, failed if any of it could not be fetched
// (its readers got EIO; a step over it captures nothing ready). If the pods
// that asked for it name read profiles, the order their readers reach
// files in is recorded from the first fill.
func (e *Engine) fillInBackground(r volume.Ref, layer *fill.Layer, src *lazySource, namespace string, pods []volume.Pod, profiles []string) {
	release := e.store.Hold(r, cache.HoldFill)
	fl := &lazyFill{layer: layer, namespaces: map[string]bool{}, profiles: map[string]bool{}}
	if e.recordsReadOrder(namespace, profiles...) {
		layer.RecordReaches() // before the first fill: the pods that asked read from the start
	}
	e.lazy.mu.Lock()
	e.lazy.layers[r] = fl
	e.lazy.mu.Unlock()
	start := time.Now()
	e.goBackground(func() {
		// One stream of the whole layer fills what no reader asked for
		// at the speed of an eager pull; what it did not fill (a holder
		// gone mid-way) is fetched file by file, from any holder. The
		// recorded order is read here, off the publish's path: up to
		// 50,000 names to decode.
		order := e.readOrder(namespace, profiles)
		first := layer.Streaming(order)
		err := src.stream(e.bgCtx, layer, first)
		layer.StreamEnded()
		if err != nil && e.bgCtx.Err() == nil {
			klog.InfoS("Streaming a lazily pulled layer stopped; fetching the rest file by file", "volume", r, "err", err)
		}
		layer.Prefetch(order, prefetchWorkers)
	})
	e.goBackground(func() {
		defer release()
		defer src.close()
		select {
		case <-layer.Done():
		case <-e.bgCtx.Done():
			return // the group's Close fails what is left; recovery fails the volume
		}
		// Before it is served: a peer's pull of it must not count as
		// its readers'.
		e.recordReadOrder(r, fl)
		err := layer.Err()
		if err == nil {
			if err = overlay.SyncFS(e.store.VolumeDir(r)); err == nil {
				_, err = e.store.Filled(r)
			}
		}
		if err == nil {
			e.releaseFill(r)
			e.metrics.fills.WithLabelValues("ok").Inc()
			klog.InfoS("Filled a lazily pulled volume", "volume", r, "duration", time.Since(start))
			e.kick(e.reaper)
			return
		}
		e.metrics.fills.WithLabelValues("failed").Inc()
		klog.ErrorS(err, "Filling a lazily pulled volume failed; it is marked failed", "volume", r)
		if merr := e.store.MarkFailed(r); merr != nil {
			klog.ErrorS(merr, "Marking a volume that could not be filled failed", "volume", r)
		}
		for _, pod := range pods {
			e.events.Event(pod, EventWarning, "FillFailed", fmt.Sprintf("Source volume %q could not be fetched whole "+
				"(its readers got EIO and the step captures nothing ready): %v", r.Handle, err))
		}
		e.kick(e.reaper)
	})
}

// releaseFill forgets a layer's fill: it is ready, or its data is gone.
func (e *Engine) releaseFill(r volume.Ref) {
	if e.lazy == nil {
		return
	}
	e.lazy.mu.Lock()
	fl := e.lazy.layers[r]
	delete(e.lazy.layers, r)
	e.lazy.mu.Unlock()
	if fl != nil {
		fl.layer.Release()
	}
}

// noteLazyReader notes, on each layer of view's source that is being
// filled, the namespace of the pod that mounts it and the read profile it
// named (if any).
func (e *Engine) noteLazyReader(view cache.View, profile string) {
	if e.lazy == nil {
		return
	}
	e.lazy.mu.Lock()
	defer e.lazy.mu.Unlock()
	for _, r := range view.Pins {
		if fl := e.lazy.layers[r]; fl != nil {
			fl.namespaces[view.Pod.Namespace] = true
			if profile != "" {
				fl.profiles[profile] = true
				if e.recordsReadOrder(view.Pod.Namespace, profile) {
					fl.layer.RecordReaches()
				}
			}
		}
	}
}

// recordsReadOrder says whether a lazy pull read under profiles records
// the order its readers reach files in: where one of them has no record,
// or one older than ReadOrderRefresh.
func (e *Engine) recordsReadOrder(namespace string, profiles ...string) bool {
	for _, name := range profiles {
		at, ok := e.store.ReadOrderRecorded(namespace, name)
		if !ok || time.Since(at) >= e.pulls.cfg.ReadOrderRefresh {
			return true
		}
	}
	return false
}

// recordReadOrder records the order fl's readers reached its files in,
// under each profile its readers named. Only where the readers were all of
// one namespace: a record under one namespace's name must tell nothing of
// what another's steps read.
func (e *Engine) recordReadOrder(r volume.Ref, fl *lazyFill) {
	if !fl.layer.Recording() {
		return // every record is fresh: what was reached is only what readers waited for
	}
	reached := fl.layer.Reached()
	e.lazy.mu.Lock()
	var namespace string
	for ns := range fl.namespaces {
		namespace = ns
	}
	mixed, profiles := len(fl.namespaces) > 1, slices.Sorted(maps.Keys(fl.profiles))
	e.lazy.mu.Unlock()
	if len(reached) == 0 || len(profiles) == 0 {
		return
	}
	if mixed {
		klog.V(2).InfoS("Not recording the read order of a layer pods of several namespaces read", "volume", r)
		return
	}
	for _, name := range profiles {
		if err := e.store.RecordReadOrder(namespace, name, reached); err != nil {
			klog.ErrorS(err, "Recording a read order", "volume", r, "namespace", namespace, "readProfile", name)
			continue
		}
		klog.V(2).InfoS("Recorded a read order", "volume", r, "namespace", namespace, "readProfile", name, "files", len(reached))
	}
}

// readOrder is the order recorded under the read profiles of namespace, one
// after the other.
func (e *Engine) readOrder(namespace string, profiles []string) []string {
	var order []string
	for _, name := range profiles {
		order = append(order, e.store.ReadOrder(namespace, name)...)
	}
	return order
}

// lazySource fetches a lazily pulled layer's files from the peers holding
// the volume it was pulled for, moving to another when one fails. It
// reaches the holder over two connections: the stream of the whole layer
// fills one's socket buffers and flow-control window, and what a reader
// waits for must not queue behind megabytes of that.
type lazySource struct {
	e          *Engine
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
	dial := s.e.pulls.cfg.Dial
	if s.peer != "" {
		client, conn, err := dial(s.address)
		if err == nil {
			ln.client, ln.conn = client, conn
			return client, s.peer, nil
		}
		klog.ErrorS(err, "Dialling the holder of a lazily pulled layer again failed; trying another holder", "volume", s.layer, "peer", s.peer)
		s.dropLocked(s.peer)
	}
	holders, err := s.e.pulls.cfg.Locator.Holders(ctx, s.namespace, s.via)
	if err != nil {
		return nil, "", fmt.Errorf("finding the nodes that hold %s: %w", s.via, err)
	}
	var errs []error
	for _, h := range holders {
		if h.NodeID == s.e.nodeID || h.Address == "" || s.failed[h.NodeID] {
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
		s.e.metrics.fillBytes.Add(float64(n))
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
	cfg := s.e.pulls.cfg
	_, err = client.PullLayerFiles(ctx, s.namespace, s.layer, s.via, cfg.Encoding, cfg.Limits, rels, first, inlined,
		func(name string, size int64, write func(w io.WriterAt) error) error {
			return each(name, func(w io.WriterAt) error {
				s.e.metrics.fillBytes.Add(float64(size))
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
