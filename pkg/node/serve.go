package node

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// holdChain holds every volume of a volume's chain present as need says,
// so that none of its layers is pruned or freed, and returns the chain's
// volumes and their data dirs, top first, and the release. The chain is
// read again once held: one read before may have been flattened since.
func (e *Engine) holdChain(r volume.Ref, need volume.Need) (chain []volume.Ref, dirs []string, release func(), err error) {
	refs, _, err := e.store.ChainOf(r, need)
	if err != nil {
		return nil, nil, nil, err
	}
	releases := make([]func(), 0, len(refs))
	for _, ref := range refs {
		releases = append(releases, e.store.Hold(ref, cache.HoldStream))
	}
	release = func() {
		for _, rel := range releases {
			rel()
		}
		e.streamEnded(refs...)
	}
	if chain, dirs, err = e.store.ChainOf(r, need); err != nil {
		release()
		return nil, nil, nil, err
	}
	return chain, dirs, release, nil
}

// PeerHolder is what the node serves its peers: its ready volumes, to pulls
// made for pods that may read them.
func (e *Engine) PeerHolder() streamer.Holder { return peerHolder{e} }

type peerHolder struct{ e *Engine }

// notHeld is the answer for a volume this node lacks or will not serve to
// namespace, the same words for both.
func notHeld(r volume.Ref, namespace string) error {
	return fmt.Errorf("volume %s is not held here for namespace %q: %w", r, namespace, streamer.ErrNotHeld)
}

// Chain describes a ready volume namespace may read, and the volumes its
// layer is a diff over, whoever owns them: a pod of namespace mounts that
// whole chain on this node, so a pull for it brings the whole chain. (It
// sees a volume under its own only merged, as here.)
func (h peerHolder) Chain(namespace string, r volume.Ref) ([]streamer.Layer, error) {
	v, err := h.e.readable(namespace, r, volume.NeedWhole)
	if err != nil {
		return nil, err
	}
	var out []streamer.Layer
	for seen := 0; ; seen++ {
		if seen > overlay.MaxLayers {
			return nil, fmt.Errorf("volume %s: a chain deeper than %d layers", r, overlay.MaxLayers)
		}
		out = append(out, streamer.Layer{Ref: v.Ref(), Parent: v.Parent, Base: v.Base, Scope: v.Scope,
			Properties: v.Properties, TTL: v.TTL, SizeBytes: v.SizeBytes, Destroyed: v.State == volume.StateDestroying})
		if v.Base.IsZero() {
			return out, nil
		}
		if v, err = h.e.store.Get(v.Base); err != nil {
			return nil, fmt.Errorf("volume %s: reading its chain: %w", r, err)
		}
		if !v.Servable(h.e.store.Holders(v.Ref())) {
			return nil, notHeld(r, namespace) // a layer below is not all here
		}
	}
}

// inChainOf says whether r is a layer of via's chain, via being a ready
// volume namespace may read: what a pull for a pod that uses via may take.
func (h peerHolder) inChainOf(namespace string, r, via volume.Ref) bool {
	if _, err := h.e.readable(namespace, via, volume.NeedWhole); err != nil {
		return false
	}
	refs, _, err := h.e.store.ChainOf(via, volume.NeedWhole) // via's own first
	return err == nil && slices.Contains(refs[1:], r)
}

// OpenLayer holds a volume's own layer for a stream: one namespace may
// read, or one in the chain of via, which it may read. A destroyed volume
// is served only while it is the base of others (a puller of those needs
// it).
//
// The layer's file sums go with it: kept since its capture (or its pull),
// or computed now, held, if this is the first a peer asks for them; and
// where its stub tree is kept, if it is (keepStubs), or is kept once a
// pull of its stubs has walked it.
func (h peerHolder) OpenLayer(namespace string, r, via volume.Ref) (streamer.LayerFiles, func(), error) {
	// Hold first, then look: the reaper looks at holds after the state,
	// so a volume seen servable here cannot be freed under the stream.
	release := h.e.store.Hold(r, cache.HoldStream)
	v, err := h.e.store.Get(r)
	readable := err == nil && (v.ReadableBy(namespace) || (!via.IsZero() && h.inChainOf(namespace, r, via)))
	servable := readable && v.Servable(h.e.store.Holders(r))
	if errors.Is(err, cache.ErrNotFound) || (err == nil && !servable) {
		err = notHeld(r, namespace)
	}
	var sums *filesum.Table
	if err == nil {
		if sums, err = h.e.store.LayerSums(v); err != nil {
			err = fmt.Errorf("volume %s: its files' sums: %w", r, err)
		}
	}
	if err != nil {
		release()
		return streamer.LayerFiles{}, nil, err
	}
	layer := streamer.LayerFiles{Dir: h.e.store.DataPath(v), Sums: sums, Kept: h.e.store.StubsPath(v)}
	if keepsStubs(sums) {
		// A layer whose tree was not kept after it was made (made
		// before trees were kept, flattened, or its kept tree removed),
		// or was kept as records a pull received, is kept once a pull
		// of its stubs has walked it.
		layer.Walked = func() { h.e.goBackground(func() { h.e.keepWalked(v) }) }
	}
	return layer, func() {
		release()
		h.e.streamEnded(r)
	}, nil
}

// Rotten fails a volume whose layer's bytes on this node are no longer
// those it was captured with (a peer's stream found it): it is served no
// more, the controller learns from the next report that the node does not
// hold it, its local readers' outputs capture nothing ready (they may
// have read the wrong bytes), and the operator is told.
func (h peerHolder) Rotten(r volume.Ref, err error) {
	h.e.metrics.rotten.Inc()
	klog.ErrorS(err, "A cached volume's bytes on this node's disk are not what it was captured with: it is marked failed and served no more", "volume", r)
	h.e.events.NodeEvent(EventWarning, "VolumeRotten", fmt.Sprintf("Cached volume %s: its bytes on this node's disk are not what it was "+
		"captured with (%v); it is marked failed and served to no peer. Check the node's disk.", r, err))
	if merr := h.e.store.MarkFailed(r); merr != nil {
		klog.ErrorS(merr, "Marking a rotten volume failed", "volume", r)
	}
	h.e.kick(h.e.reaper)
}

// Relay serves a peer this node's copy of a layer's stream it is pulling
// as a member of the layer's swarm (none where the node pulls nothing).
func (h peerHolder) Relay(namespace string, r, via volume.Ref, token string) (*streamer.Spool, error) {
	if h.e.puller == nil {
		return nil, notHeld(r, namespace)
	}
	sp, err := h.e.puller.Relay(namespace, r, via, token)
	if errors.Is(err, streamer.ErrNotHeld) {
		return nil, notHeld(r, namespace)
	}
	return sp, err
}

// streamEnded wakes what a stream's hold of refs may have kept waiting,
// and only that: a lazy puller's reads come as thousands of requests, and
// each round woken scans the whole store.
func (e *Engine) streamEnded(refs ...volume.Ref) {
	over, _ := e.pressureNow()
	var reap, tidy bool
	for _, r := range refs {
		v, err := e.store.Get(r)
		vReap, vTidy := wakeAfterStream(v, err, over)
		reap, tidy = reap || vReap, tidy || vTidy
	}
	if reap {
		e.kick(e.reaper)
	}
	if tidy {
		e.tidy()
	}
}

// wakeAfterStream says whether the end of a stream's hold of v (as read
// after it, err the read's error) wakes the reaper (v was destroyed or
// failed meanwhile, and its data goes once nothing holds it; the node is
// over its high watermark, and a held volume was not evicted) and the
// janitor (v has layers a flatten replaced, which go once nothing reads
// them). The reaper's own round catches anything else within reapInterval.
func wakeAfterStream(v cache.Volume, err error, overHigh bool) (reap, tidy bool) {
	if err != nil {
		return true, true // unsure: a round too many costs a scan
	}
	return v.State != volume.StateReady || overHigh, len(v.OldLayers) > 0
}

// keepsStubs says whether the stub tree of a layer whose file sums are
// sums is kept (streamer.KeepsStubs).
func keepsStubs(sums *filesum.Table) bool { return streamer.KeepsStubs(sums.Len()) }

// keepWalked keeps v's stub tree once a pull of its stubs walked the
// layer, nothing kept serving it: records a pull of it received
// (streamer.KeptReceived), which serve no StubTar, are replaced by the
// tree kept whole.
func (e *Engine) keepWalked(v cache.Volume) {
	if path := e.store.StubsPath(v); streamer.KeptReceived(path) {
		if err := os.Remove(path); err != nil {
			klog.ErrorS(err, "Removing a layer's stub records kept as received, to keep its tree whole", "volume", v.Ref())
			return
		}
	}
	_ = e.sumLayer(v, false)
}

// keepStubs keeps the stub tree of v's layer (whose file sums are sums) as
// a stream beside it, if it is big enough and not kept yet: what the pulls
// of its stubs (lazy and index pulls) are served from, without the walk
// that was most of their publish. The layer is held while it is read.
func (e *Engine) keepStubs(v cache.Volume, sums *filesum.Table) {
	path := e.store.StubsPath(v)
	if !keepsStubs(sums) {
		return
	}
	if _, err := os.Stat(path); err == nil {
		klog.V(4).InfoS("A layer's stub tree is kept already", "volume", v.Ref())
		return
	}
	release := e.store.Hold(v.Ref(), cache.HoldStream)
	defer func() {
		release()
		e.streamEnded(v.Ref())
	}()
	if cur, err := e.store.Get(v.Ref()); err != nil || cur.State != volume.StateReady || cur.Layer != v.Layer {
		return // destroyed, failed or flattened meanwhile
	}
	start := time.Now()
	sum, err := streamer.KeepStubs(e.bgCtx, streamer.LayerFiles{Dir: e.store.DataPath(v), Sums: sums}, streamer.StubInline, path)
	switch {
	case errors.Is(err, streamer.ErrRotten):
		peerHolder{e}.Rotten(v.Ref(), err)
	case e.bgCtx.Err() != nil:
		// Stopping: the next start keeps it, once a pull walks it.
	case err != nil:
		klog.ErrorS(err, "Keeping a layer's stub tree failed; pulls of its stubs walk the layer", "volume", v.Ref())
	default:
		st, _ := os.Stat(path)
		var kept int64
		if st != nil {
			kept = st.Size()
		}
		klog.V(2).InfoS("Kept a layer's stub tree", "volume", v.Ref(), "entries", sum.Entries, "tarBytes", sum.Bytes, "keptBytes", kept,
			"duration", time.Since(start))
	}
}
