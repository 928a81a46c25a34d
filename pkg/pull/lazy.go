package pull

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/fill"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// prefetchWorkers is how many files a lazy layer's prefetch fetches at
// once: enough to keep a link busy with small files.
const prefetchWorkers = 8

// lazyPulls are the layers being filled, and the group holding their
// readers (nil: the node pulls eagerly).
type lazyPulls struct {
	group *fill.Group
	// index: layers arrive as indexes, not stub trees (Config.Index, where
	// the kernel can).
	index  bool
	mu     sync.Mutex
	layers map[volume.Ref]*lazyFill
}

// lazyFill is a layer being filled (its stubs, or the blob of its index),
// and who mounts it meanwhile (under lazyPulls.mu): the namespaces of
// their pods, and the read profiles they named, under which the order its
// readers reach its files is recorded (by reaches: the layer or the blob).
type lazyFill struct {
	layer      *fill.Layer
	blob       *fill.Blob
	reaches    reachRecorder
	namespaces map[string]bool
	profiles   map[string]bool
}

// stubMarker starts the layer of stubs a lazy pull makes at data (its dir
// in place) and returns the func that marks each stub as the extraction
// makes it, so that its readers wait for its data, which src fetches. The
// data to come is bounded as an eager pull's stream is: by the sizes the
// holder gave the stubs.
func (pl *Puller) stubMarker(src *lazySource, data string) (*fill.Layer, streamer.StubFunc, error) {
	layer, err := pl.lazy.group.NewLayer(data, src.fetch, src.fetchMany)
	if err != nil {
		return nil, nil, err
	}
	layer.CheckSums(src.corrupt)
	var total atomic.Int64
	limit := pl.cfg.Limits.Bytes
	return layer, func(s streamer.Stub) error {
		if total.Add(s.Size) > limit {
			return overLimit(src.layer.Ref, limit)
		}
		return layer.Add(s.FD, fill.Stub{Rel: s.Name, Size: s.Size, Place: s.Place, Caps: s.Caps,
			Dev: s.Dev, Ino: s.Ino, Times: [2]unix.Timespec{s.Mtime, s.Mtime}, // a stream's entries' atime is their mtime
			Sum: s.Sum})
	}, nil
}

// overLimit refuses a lazy pull of layer r, whose files hold more data
// than limit (the stream size limit) bytes.
func overLimit(r volume.Ref, limit int64) error {
	return fmt.Errorf("%s: its files hold more than the stream size limit (%d bytes): %w", r, limit, streamer.ErrRefused)
}

// fillInBackground fetches a filling volume's stubs' data, first the
// files read in the order recorded under the pods' read profiles in
// namespace (how steps read it before), and records how that ended (see
// fillBehind): ready once all of it is here and synced, with the file sums
// its stubs were checked against kept as its own (files: their table's
// digest).
func (pl *Puller) fillInBackground(r volume.Ref, layer *fill.Layer, files filesum.Sum, src *lazySource, namespace string, pods []volume.Pod,
	profiles []string) {
	fl := &lazyFill{layer: layer, reaches: layer, namespaces: map[string]bool{}, profiles: map[string]bool{}}
	pl.fillBehind(r, fl, src, namespace, pods, profiles, layer.Done(), func(order []string) {
		// One stream of the whole layer fills what no reader asked for
		// at the speed of an eager pull; what it did not fill (a holder
		// gone mid-way) is fetched file by file, from any holder.
		first := layer.Streaming(order)
		err := src.stream(pl.ctx, layer.Offer, first)
		layer.StreamEnded()
		if err != nil && pl.ctx.Err() == nil {
			klog.InfoS("Streaming a lazily pulled layer stopped; fetching the rest file by file", "volume", r, "err", err)
		}
		layer.Prefetch(order, prefetchWorkers)
	}, func() (cache.Volume, error) {
		if err := layer.Err(); err != nil {
			return cache.Volume{}, err
		}
		if err := overlay.SyncFS(pl.store.VolumeDir(r)); err != nil {
			return cache.Volume{}, err
		}
		v, err := pl.store.Get(r)
		if err != nil {
			return cache.Volume{}, err
		}
		data := pl.store.DataPath(v)
		if err := keepLayerSums(pl.ctx, data, layer.Sum, files, cache.SumsFile(data)); err != nil {
			return cache.Volume{}, err
		}
		return pl.store.Filled(r)
	})
}

// fillBehind fills a lazily pulled volume in the background: fetch brings
// its data (first the files of the order recorded under the pods' read
// profiles in namespace, which it is given: read here, off the publish's
// path, up to 50,000 names to decode), and once done is closed, filled
// makes it ready, or it is failed (fillEnded). If the pods that asked for
// it name read profiles, the order their readers reach files in is
// recorded from the first fill.
func (pl *Puller) fillBehind(r volume.Ref, fl *lazyFill, src *lazySource, namespace string, pods []volume.Pod, profiles []string,
	done <-chan struct{}, fetch func(order []string), filled func() (cache.Volume, error)) {
	release := pl.store.Hold(r, cache.HoldFill)
	if pl.recordsReadOrder(namespace, profiles...) {
		fl.reaches.RecordReaches() // before the first fill: the pods that asked read from the start
	}
	pl.lazy.mu.Lock()
	pl.lazy.layers[r] = fl
	pl.lazy.mu.Unlock()
	src.tell(pods)
	start := time.Now()
	pl.goBackground(func() { fetch(pl.readOrder(namespace, profiles)) })
	pl.goBackground(func() {
		defer src.close()
		select {
		case <-done:
		case <-pl.ctx.Done():
			release()
			return // the group's Close fails what is left; recovery fails the volume
		}
		pl.fillEnded(r, fl, pods, start, filled)
		// Let go before waking the reaper: a round woken first finds the
		// data of a volume destroyed while it filled still held.
		release()
		pl.notify.FillEnded(r)
	})
}

// fillEnded records how a fill ended: a volume that filled makes itself
// ready (filled: its data synced, it is recorded ready), one that could
// not be filled is failed (and its pods are told).
func (pl *Puller) fillEnded(r volume.Ref, fl *lazyFill, pods []volume.Pod, start time.Time, filled func() (cache.Volume, error)) {
	// Before it is served: a peer's pull of it must not count as its
	// readers'.
	pl.recordReadOrder(r, fl)
	_, err := filled()
	if err == nil {
		pl.Release(r)
		pl.metrics.fills.WithLabelValues("ok").Inc()
		klog.InfoS("Filled a lazily pulled volume", "volume", r, "duration", time.Since(start))
		return
	}
	pl.metrics.fills.WithLabelValues("failed").Inc()
	klog.ErrorS(err, "Filling a lazily pulled volume failed; it is marked failed", "volume", r)
	if merr := pl.store.MarkFailed(r); merr != nil {
		klog.ErrorS(merr, "Marking a volume that could not be filled failed", "volume", r)
	}
	for _, pod := range pods {
		pl.notify.Event(pod, EventWarning, "FillFailed", fmt.Sprintf("Source volume %q could not be fetched whole "+
			"(its readers got EIO and the step captures nothing ready): %v", r.Handle, err))
	}
}

// Release forgets a layer's fill: it is ready, or its data is gone.
// A node that pulls nothing (nil) has nothing to release.
func (pl *Puller) Release(r volume.Ref) {
	if pl == nil || pl.lazy == nil {
		return
	}
	pl.lazy.mu.Lock()
	fl := pl.lazy.layers[r]
	delete(pl.lazy.layers, r)
	pl.lazy.mu.Unlock()
	switch {
	case fl == nil:
	case fl.blob != nil:
		if err := fl.blob.Close(); err != nil {
			klog.ErrorS(err, "Letting go of the blob of an index", "volume", r)
		}
	default:
		fl.layer.Release()
	}
}

// NoteReader notes, on each layer of view's source that is being filled,
// the namespace of the pod that mounts it and the read profile it named
// (if any).
// A node that pulls nothing (nil) notes nothing.
func (pl *Puller) NoteReader(view cache.View, profile string) {
	if pl == nil || pl.lazy == nil {
		return
	}
	pl.lazy.mu.Lock()
	defer pl.lazy.mu.Unlock()
	for _, r := range view.Pins {
		if fl := pl.lazy.layers[r]; fl != nil {
			fl.namespaces[view.Pod.Namespace] = true
			if profile != "" {
				fl.profiles[profile] = true
				if pl.recordsReadOrder(view.Pod.Namespace, profile) {
					fl.reaches.RecordReaches()
				}
			}
		}
	}
}

// pullStubs pulls a layer's tree with its files as stubs (but the small
// ones it carries whole: streamer.StubInline), each marked as it is made so that
// its readers wait for its data, and makes it a filling
// volume whose data is fetched behind. The layer is mountable only once
// every mark is in place.
func (pl *Puller) pullStubs(p *pull, client *streamer.Client, top, l streamer.Layer, want volume.Digests, progress func(int64)) (cache.Volume, error) {
	src := newLazySource(pl, p.key.namespace, l, top)
	s := streamer.LayerStream{Namespace: p.key.namespace, Ref: l.Ref, Via: p.key.ref, Encoding: pl.cfg.Encoding, Shape: streamer.StubTar,
		Inline: streamer.StubInline}
	var layer *fill.Layer
	var files filesum.Sum // the digest of the layer's table, as its stub tree said
	var vol cache.Volume
	err := pl.inSwarm(pl.ctx, client, s, top, l, true, func(from *streamer.Client, sw streamer.Swarmed, done func(streamer.Summary) error) (err error) {
		vol, err = Receive(pl.store, pl.kind, l, want, p.id, func(tree, data string) (streamer.Summary, error) {
			var mark streamer.StubFunc
			var err error
			if layer, mark, err = pl.stubMarker(src, data); err != nil {
				return streamer.Summary{}, err
			}
			sum, err := from.PullLayerStubs(pl.ctx, s, sw, tree, pl.cfg.Limits, progress, mark)
			if err == nil {
				err = pl.checkVouched(l, want, sum)
			}
			if err == nil {
				err = done(sum)
			}
			files = sum.Files
			if sum.Inlined != "" {
				src.inlined = streamer.Inline{Max: streamer.StubInline.Max, Through: sum.Inlined}
			}
			return sum, err
		}, func(v cache.Volume, id, _ string, _ bool) (cache.Volume, error) {
			layer.Seal()
			return pl.store.CommitPullFilling(v.Ref(), id, l.SizeBytes)
		}, SyncBehind)
		if err != nil && layer != nil {
			layer.Release()
			layer = nil
		}
		return err
	})
	if err != nil {
		return cache.Volume{}, err
	}
	pods, profiles := pl.askers(p)
	pl.fillInBackground(vol.Ref(), layer, files, src, p.key.namespace, pods, profiles)
	return vol, nil
}

// Settle waits until the answers under way to readers of lazily pulled
// files have let go of the mounts they opened the files through.
// A node that pulls nothing (nil) has none.
func (pl *Puller) Settle() {
	if pl != nil && pl.lazy != nil {
		pl.lazy.group.Settle()
	}
}
