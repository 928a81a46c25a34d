package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/fill"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// PullConfig lets a node pull the sources it lacks from peers.
type PullConfig struct {
	// Locator says which peers hold a volume ready.
	Locator Locator
	// Dial reaches a peer's --peer-address.
	Dial func(address string) (*streamer.Client, io.Closer, error)
	// Encoding is what layers travel as; Limits bound each one.
	Encoding streamer.Encoding
	Limits   streamer.Limits
	// Wait is how long a publish waits for a pull before it answers with
	// the pull's progress (the kubelet retries, and joins the pull), and
	// how long a reader of a lazily pulled file waits for data from a
	// holder that stopped sending before it gets EIO.
	Wait time.Duration
	// Mode says whether sources arrive lazily ("": auto).
	Mode PullMode
	// ReadOrderRefresh is how old a read profile's record must be before
	// a lazy pull under it records it again (0: every time). Recording
	// costs each of a step's opens a notification; a job's steps read
	// much the same way from one build to the next.
	ReadOrderRefresh time.Duration
}

// Locator finds the peers holding a volume ready, best first.
type Locator interface {
	Holders(ctx context.Context, namespace string, r volume.Ref) ([]Peer, error)
}

// Peer is a node that serves its volumes to pulls.
type Peer struct{ NodeID, Address string }

// Errors a publish answers while a source is pulled.
var (
	// ErrPulling: the source is on its way from a peer; retry.
	ErrPulling = errors.New("the source volume is being pulled from a peer")
	// ErrPullFailed: no peer could deliver the source.
	ErrPullFailed = errors.New("pulling the source volume from peers failed")
)

// pulls are the pulls under way, one per source and namespace asking: a
// publish joins a running pull of its source instead of starting another.
type pulls struct {
	cfg     PullConfig
	mu      sync.Mutex
	running map[pullKey]*pull
}

type pullKey struct {
	namespace string
	ref       volume.Ref
}

// pull is one source on its way here.
type pull struct {
	id      string
	key     pullKey
	started time.Time
	done    chan struct{}
	err     error // set before done closes
	// received counts wire bytes, expected the layers' size on the peer.
	received, expected atomic.Int64
	from               atomic.Pointer[string]
	// pods are the pods that asked for it, and profiles the read profiles
	// they named (under pulls.mu).
	pods     []volume.Pod
	profiles []string
	// whole brings every layer whole even where pulls are lazy: for a
	// reader that needs the volume ready, not a view of it.
	whole bool
}

// source says where the pull is coming from.
func (p *pull) source() string {
	if f := p.from.Load(); f != nil {
		return "node " + *f
	}
	return "a peer"
}

// layerName names a layer of the pulled chain in what the pod's namespace
// is told: a volume of another namespace it may not use itself is one the
// source stacks on, never named.
func (p *pull) layerName(l streamer.Layer) string {
	if l.Ref == p.key.ref || l.ReadableBy(p.key.namespace) {
		return l.Ref.String()
	}
	return "a volume " + p.key.ref.String() + " stacks on"
}

func (p *pull) progress() error {
	msg := fmt.Sprintf("%s from %s: %s received", p.key.ref, p.source(), mib(p.received.Load()))
	if exp := p.expected.Load(); exp > 0 {
		msg += " of about " + mib(exp)
	}
	return fmt.Errorf("source volume %s, %s in %s; retry: %w", volume.Quote(p.key.ref.Handle), msg,
		time.Since(p.started).Round(time.Second), ErrPulling)
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// ensureSource makes sure a publish's source is here, pulling it from a
// peer if the node lacks it. It returns once the source is here (or the
// node has it in some state the publish will answer for), or with the
// pull's progress after the configured wait.
func (e *Engine) ensureSource(r PublishRequest) error {
	if e.pulls == nil || r.Source.IsZero() {
		return nil
	}
	v, err := e.store.Get(r.Source)
	if err == nil && !v.ReadableBy(r.Pod.Namespace) {
		err = hiddenHere(r.Source, r.Pod.Namespace)
	}
	pulling := err == nil && v.BeingPulled()
	if !pulling && !errors.Is(err, cache.ErrNotFound) {
		return nil // here, in a state the publish answers for
	}
	if _, err := e.store.GetView(r.VolumeID); err == nil {
		return nil // published already: a repeat needs no source
	}
	p := e.pulls.join(e, pullKey{namespace: r.Pod.Namespace, ref: r.Source}, r.Pod, r.ReadProfile, false)
	return e.pulls.wait(context.Background(), p)
}

// Fetch brings a ready volume namespace may read here, pulled whole from a
// peer if the node lacks it, for readers that need the volume itself (the
// image registry) rather than a step's view of it. It returns once the
// volume is here, or with ErrPulling and the pull's progress after the
// configured wait or when ctx ends (the pull goes on; asking again joins
// it). A volume no peer holds for namespace fails wrapping
// cache.ErrNotFound.
func (e *Engine) Fetch(ctx context.Context, namespace string, r volume.Ref) error {
	if e.pulls == nil {
		return cache.NotVisible(r, namespace)
	}
	v, err := e.store.Get(r)
	if err == nil && !v.ReadableBy(namespace) {
		err = hiddenHere(r, namespace)
	}
	switch {
	case err == nil && v.State == volume.StateFilling:
		return fmt.Errorf("%s is arriving lazily from a peer; retry: %w", r, ErrPulling)
	case err == nil && !v.BeingPulled():
		return nil // here, in a state the reader answers for
	case err != nil && !errors.Is(err, cache.ErrNotFound):
		return err
	}
	return e.pulls.wait(ctx, e.pulls.join(e, pullKey{namespace: namespace, ref: r}, volume.Pod{}, "", true))
}

// hiddenHere is what a volume held here that namespace may not read is to
// it: one that is not here. It goes the way a missing one does, asking the
// peers (who hold it for namespace no more than this node does), so that
// neither the answer nor its time tells another namespace's volumes from
// none.
func hiddenHere(r volume.Ref, namespace string) error {
	return cache.NotVisible(r, namespace)
}

// wait waits for a pull to end, at most the configured wait or until ctx
// ends, and then says how far it got.
func (ps *pulls) wait(ctx context.Context, p *pull) error {
	wait := time.NewTimer(ps.cfg.Wait)
	defer wait.Stop()
	select {
	case <-p.done:
		return p.err
	case <-wait.C:
	case <-ctx.Done():
	}
	return p.progress()
}

// join returns the running pull of key, starting one if none is (whole:
// every layer whole, even where pulls are lazy); pod, if any, is told how
// it ends, and a lazy pull fetches first what the read profile (if any)
// says steps read first.
func (ps *pulls) join(e *Engine, key pullKey, pod volume.Pod, profile string, whole bool) *pull {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	p, ok := ps.running[key]
	if !ok {
		p = &pull{id: newLeaseID(), key: key, started: time.Now(), done: make(chan struct{}), whole: whole}
	}
	if pod != (volume.Pod{}) && !slices.Contains(p.pods, pod) {
		p.pods = append(p.pods, pod)
	}
	if profile != "" && !slices.Contains(p.profiles, profile) {
		p.profiles = append(p.profiles, profile)
	}
	if ok {
		return p
	}
	ps.running[key] = p
	e.goBackground(func() {
		err := e.runPull(p)
		ps.mu.Lock()
		delete(ps.running, key)
		pods := p.pods
		ps.mu.Unlock()
		p.err = err
		close(p.done)
		e.tellPods(p, pods, err)
	})
	return p
}

// tellPods puts how a pull ended on the pods that waited for it, where
// their owners look.
func (e *Engine) tellPods(p *pull, pods []volume.Pod, err error) {
	took := time.Since(p.started).Round(time.Millisecond)
	for _, pod := range pods {
		switch {
		case err == nil:
			e.events.Event(pod, EventNormal, "VolumePulled", fmt.Sprintf("Pulled source volume %q from %s (%s on the wire) in %s",
				p.key.ref.Handle, p.source(), mib(p.received.Load()), took))
		case errors.Is(err, cache.ErrNotFound), errors.Is(err, ErrPulling):
			// A missing source is the publish's own answer; another
			// pull is still making it.
		default:
			e.events.Event(pod, EventWarning, "PullFailed", fmt.Sprintf("Pulling source volume %q failed (the kubelet retries): %v",
				p.key.ref.Handle, err))
		}
	}
}

// runPull brings a source here from the first holder that can deliver it,
// layer by layer. A holder failing mid-way leaves the layers it delivered
// (they are whole cached volumes) and the next holder sends the rest.
func (e *Engine) runPull(p *pull) error {
	ns, ref := p.key.namespace, p.key.ref
	if err := e.store.CheckBackoff(ref); err != nil {
		return err // a failed pull's retry waits, asking no one
	}
	holders, err := e.pulls.cfg.Locator.Holders(e.bgCtx, ns, ref)
	if err != nil {
		e.metrics.pulls.WithLabelValues("failed").Inc()
		return fmt.Errorf("finding the nodes that hold %s: %w: %w", ref, ErrPullFailed, err)
	}
	var errs []error
	tried := 0
	for _, h := range holders {
		if h.NodeID == e.nodeID || h.Address == "" {
			continue
		}
		tried++
		from := h.NodeID
		p.from.Store(&from)
		start := time.Now()
		layers, err := e.pullFrom(p, h)
		if err == nil {
			e.metrics.pulls.WithLabelValues("ok").Inc()
			klog.InfoS("Pulled a source volume from a peer", "volume", ref, "namespace", ns, "peer", h.NodeID,
				"layers", layers, "wireBytes", p.received.Load(), "duration", time.Since(start))
			return nil
		}
		if errors.Is(err, ErrPulling) || errors.Is(err, cache.ErrBackoff) {
			return err // another pull is making it, or a failure is fresh
		}
		if local(err) {
			errs = append(errs, err)
			break // another holder would fail here the same way
		}
		if !streamer.NotHeld(err) {
			klog.ErrorS(err, "Pulling a source volume from a peer failed; trying the next holder",
				"volume", ref, "namespace", ns, "peer", h.NodeID)
		}
		errs = append(errs, fmt.Errorf("node %s: %w", h.NodeID, err))
	}
	if len(errs) == 0 || allNotHeld(errs) {
		e.metrics.pulls.WithLabelValues("not_found").Inc()
		return fmt.Errorf("%w (nor on any of the %d peers asked)", cache.NotVisible(ref, ns), tried)
	}
	e.metrics.pulls.WithLabelValues("failed").Inc()
	if err := e.store.NoteFailure(ref); err != nil {
		klog.ErrorS(err, "Recording a failed pull", "volume", ref)
	}
	return fmt.Errorf("source volume %s: %w: %w", ref, ErrPullFailed, errors.Join(errs...))
}

// hiddenLayerError is a failure to pull a layer the pod's namespace may
// not name (another namespace's private volume under its source): its
// words name neither the layer nor what the peer said of it (the node's log
// does), and it unwraps to the cause, so that the pull still tells a full
// disk, a layer gone and a corrupt stream apart.
type hiddenLayerError struct {
	layer string
	err   error
}

func (h hiddenLayerError) Error() string {
	why := "failed (the node plugin's log says why)"
	var errno syscall.Errno
	switch {
	case errors.As(h.err, &errno) && local(h.err):
		why = errno.Error()
	case streamer.NotHeld(h.err):
		why = "its holder no longer has it"
	case errors.Is(h.err, streamer.ErrCorrupt):
		why = streamer.ErrCorrupt.Error()
	}
	return "pulling " + h.layer + ": " + why
}

func (h hiddenLayerError) Unwrap() error { return h.err }

// local says a pull failed for want of room here, not for its holder.
func local(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)
}

func allNotHeld(errs []error) bool {
	for _, err := range errs {
		if !streamer.NotHeld(err) {
			return false
		}
	}
	return true
}

// pullFrom pulls, from one peer, the layers of the source's chain this node
// lacks, bottom first, and says how many it pulled.
func (e *Engine) pullFrom(p *pull, h Peer) (int, error) {
	client, conn, err := e.pulls.cfg.Dial(h.Address)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	chain, err := client.Chain(e.bgCtx, p.key.namespace, p.key.ref)
	if err != nil {
		return 0, err
	}
	if len(chain) == 0 || chain[0].Ref != p.key.ref {
		return 0, fmt.Errorf("the peer described another chain than %s's", p.key.ref)
	}
	var missing []streamer.Layer
	for _, l := range chain {
		v, err := e.store.Get(l.Ref)
		if err == nil && (v.State == volume.StateReady || v.State == volume.StateFilling) {
			break // the rest of the chain is here, or arriving
		}
		if err == nil {
			if v.BeingPulled() {
				return 0, fmt.Errorf("%s is being pulled for another namespace's pod: %w", p.layerName(l), ErrPulling)
			}
			return 0, fmt.Errorf("%s, which %s stacks on, is %s here: %w", p.layerName(l), p.key.ref, v.State, cache.ErrUnusable)
		}
		if !errors.Is(err, cache.ErrNotFound) {
			return 0, err
		}
		missing = append(missing, l)
	}
	var expected int64
	for _, l := range missing {
		expected += max(l.SizeBytes, 0)
	}
	p.expected.Store(expected)
	for i := len(missing) - 1; i >= 0; i-- {
		if err := e.pullLayer(p, client, missing[i]); err != nil {
			return len(missing) - 1 - i, err
		}
	}
	return len(missing), nil
}

// pullLayer pulls one volume's own layer into the cache, checked against
// the peer's digest: whole, or as stubs filled behind.
func (e *Engine) pullLayer(p *pull, client *streamer.Client, l streamer.Layer) error {
	start := time.Now()
	progress := func(n int64) { p.received.Add(n) }
	var vol cache.Volume
	var err error
	if e.lazy != nil && !p.whole {
		vol, err = e.pullStubs(p, client, l, progress)
	} else {
		vol, err = e.receiveLayer(l, p.id, func(tree, _ string) (streamer.Summary, error) {
			return client.PullLayer(e.bgCtx, p.key.namespace, l.Ref, p.key.ref, e.pulls.cfg.Encoding, tree, e.pulls.cfg.Limits, progress)
		}, e.commitPulled(l), syncBehind)
	}
	if errors.Is(err, cache.ErrExists) {
		return fmt.Errorf("%s is being made here meanwhile: %w", p.layerName(l), ErrPulling)
	}
	if err != nil {
		klog.ErrorS(err, "Pulling a layer failed", "volume", l.Ref, "for", p.key.ref, "namespace", p.key.namespace)
		if !l.ReadableBy(p.key.namespace) {
			return hiddenLayerError{layer: p.layerName(l), err: err}
		}
		return fmt.Errorf("pulling %s: %w", l.Ref, err)
	}
	e.metrics.pulled.Inc()
	klog.V(2).InfoS("Pulled a layer", "volume", vol.Ref(), "base", vol.Base, "state", vol.State, "duration", time.Since(start))
	return nil
}

// commitFunc commits a received layer, in place at data, under the lease
// id; synced says whether its data is on disk yet.
type commitFunc func(v cache.Volume, id, data string, synced bool) (cache.Volume, error)

// commitPulled makes a layer that arrived whole ready, and wakes the sync
// round if its data is not on disk yet.
func (e *Engine) commitPulled(l streamer.Layer) commitFunc {
	return func(v cache.Volume, id, _ string, synced bool) (cache.Volume, error) {
		vol, err := e.store.CommitPull(v.Ref(), id, l.SizeBytes, -1, synced)
		if err != nil {
			return vol, err
		}
		if !synced {
			e.kick(e.syncer)
		}
		e.goBackground(func() { e.afterCapture(vol) })
		return vol, nil
	}
}

// durability says when a received layer's data must reach the disk.
type durability bool

const (
	// syncBefore: before it is committed. An upload is the only copy,
	// and its sender is told it is made.
	syncBefore durability = false
	// syncBehind: later, off the step's path. A pulled layer is a copy
	// of a peer's: the next sync round writes it back, as it does a
	// capture, and a reboot that comes first marks it failed, to be
	// pulled again; its step does not wait for the node to write a
	// gigabyte back, which took a fifth of a pull's time. A stub tree is
	// synced with its data once filled (a restart fails a volume still
	// filling, synced or not).
	syncBehind durability = true
)

// pullStubs pulls a layer's tree with its files as stubs (but the small
// ones it carries whole: stubInline), each marked as it is made so that
// its readers wait for its data, and makes it a filling
// volume whose data is fetched behind. The layer is mountable only once
// every mark is in place.
func (e *Engine) pullStubs(p *pull, client *streamer.Client, l streamer.Layer, progress func(int64)) (cache.Volume, error) {
	src := &lazySource{e: e, namespace: p.key.namespace, layer: l.Ref, via: p.key.ref}
	var layer *fill.Layer
	vol, err := e.receiveLayer(l, p.id, func(tree, data string) (streamer.Summary, error) {
		var mark streamer.StubFunc
		var err error
		if layer, mark, err = e.stubMarker(src, data); err != nil {
			return streamer.Summary{}, err
		}
		sum, err := client.PullLayerStubs(e.bgCtx, p.key.namespace, l.Ref, p.key.ref, e.pulls.cfg.Encoding, tree, e.pulls.cfg.Limits, stubInline, progress, mark)
		if sum.Inlined != "" {
			src.inlined = streamer.Inline{Max: stubInline.Max, Through: sum.Inlined}
		}
		return sum, err
	}, func(v cache.Volume, id, _ string, _ bool) (cache.Volume, error) {
		layer.Seal()
		return e.store.CommitPullFilling(v.Ref(), id, l.SizeBytes)
	}, syncBehind)
	if err != nil {
		if layer != nil {
			layer.Release()
		}
		return cache.Volume{}, err
	}
	e.pulls.mu.Lock()
	pods, profiles := slices.Clone(p.pods), slices.Clone(p.profiles)
	e.pulls.mu.Unlock()
	e.fillInBackground(vol.Ref(), layer, src, p.key.namespace, pods, profiles)
	return vol, nil
}

// receiveLayer makes a cached volume of a layer that arrives from
// elsewhere (a pull, an upload): reserved under the lease id, filled by fill
// in staging out of sight (tree; data is where it will live), synced as
// when says, moved into place and committed in one transaction. Anything
// short of that leaves no trace: the reservation and the staging go (and a
// crash leaves them to recovery).
func (e *Engine) receiveLayer(l streamer.Layer, id string, fill func(tree, data string) (streamer.Summary, error), commit commitFunc,
	when durability) (vol cache.Volume, err error) {
	v, err := e.store.ReservePull(cache.Volume{
		Namespace: l.Ref.Namespace, Handle: l.Ref.Handle, Parent: l.Parent, Base: l.Base, Scope: l.Scope,
		Properties: l.Properties, TTL: l.TTL, DestroyOnCommit: l.Destroyed,
	}, id)
	if err != nil {
		return cache.Volume{}, err
	}
	defer func() {
		if err != nil {
			if aerr := e.store.AbortPull(v.Ref(), id, overlay.RemoveTree); aerr != nil {
				klog.ErrorS(aerr, "Dropping a reservation of a layer that did not arrive; recovery will", "volume", v.Ref())
			}
		}
	}()
	stage, err := os.MkdirTemp(e.store.StagingDir(), "receive-")
	if err != nil {
		return cache.Volume{}, err
	}
	defer func() {
		if rerr := overlay.RemoveTree(stage); rerr != nil {
			klog.ErrorS(rerr, "Removing a received layer's staging", "dir", stage)
		}
	}()
	tree := filepath.Join(stage, "layer")
	if err := overlay.NewLayerDir(e.backend.Kind(), tree); err != nil {
		return cache.Volume{}, err
	}
	data := e.store.DataPath(v)
	sum, err := fill(tree, data)
	if err != nil {
		return cache.Volume{}, err
	}
	cache.CrashPoint("pull-extracted")
	// A reboot must not find a torn volume ready: it is on disk before
	// it is committed, or committed unsynced (and failed by a reboot
	// that comes before the sync round).
	if when == syncBefore {
		if err := overlay.SyncFS(tree); err != nil {
			return cache.Volume{}, err
		}
	}
	if err := os.MkdirAll(filepath.Dir(data), 0o700); err != nil {
		return cache.Volume{}, err
	}
	if err := os.Rename(tree, data); err != nil {
		return cache.Volume{}, err
	}
	if when == syncBefore {
		if err := overlay.SyncDir(filepath.Dir(data)); err != nil {
			return cache.Volume{}, err
		}
	}
	cache.CrashPoint("pull-renamed")
	if vol, err = commit(v, id, data, when == syncBefore); err != nil {
		return cache.Volume{}, err
	}
	klog.V(2).InfoS("Received a layer", "volume", vol.Ref(), "state", vol.State, "tarBytes", sum.Bytes, "entries", sum.Entries, "digest", sum.Digest)
	return vol, nil
}
