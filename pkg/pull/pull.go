// Package pull brings the sources a node lacks from the peers that hold
// them: whole (eagerly), or lazily, the tree first with its files as stubs
// that hold their readers until their data arrives (package fill), the rest
// streamed behind. It owns the pulls under way (one per source and
// namespace, which publishes join), the lazily pulled layers being filled
// and the holders they are filled from (with failover, over two lanes per
// holder), and the read-order policy (what is recorded, and streamed
// first). It makes the cached volumes a pull brings in the cache, out of
// sight until committed (Receive), and tells the node what happened
// through a Notifier; it never reaches back into the node engine, which
// keeps the publish and its admission.
//
// Its rooms: pull.go the running pulls (joined, waited for, layer by layer
// from one holder after another); lazy.go a lazily pulled layer, from its
// stub tree to its fill behind; index.go a lazily pulled layer made an
// index and mounted, filled by extent, ready as the index once whole;
// wholeindex.go whole indexes mounted again and made plain layers; source.go the holders a lazy layer's files
// come from, failing over, on a bulk lane (the stream) and an urgent one
// (what readers wait for); readorder.go what is recorded of the order
// steps read, and streamed first next time; receive.go a layer made a
// cached volume out of sight; swarm.go a layer's stream (whole, its stub
// tree, its data) pulled as a member of its swarm, from the member before
// and relayed to the one after; mode.go lazy or eager.
package pull

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// DefaultWait is how long a publish waits for a pull before answering with
// its progress: well inside the kubelet's 2-minute call timeout.
const DefaultWait = 20 * time.Second

// DefaultReadOrderRefresh is how old a read profile's record must be
// before a lazy pull under it records the order again.
const DefaultReadOrderRefresh = 10 * time.Minute

// Config lets a node pull the sources it lacks from peers.
type Config struct {
	// Locator says which peers hold a volume ready.
	Locator Locator
	// Dial reaches a peer's --peer-address, checking it is the node named.
	Dial streamer.Dialer
	// Encoding is what layers travel as; Limits bound each one.
	Encoding streamer.Encoding
	Limits   streamer.Limits
	// Wait is how long a publish waits for a pull before it answers with
	// the pull's progress (the kubelet retries, and joins the pull), and
	// how long a reader of a lazily pulled file waits for data from a
	// holder that stopped sending before it gets EIO (0: DefaultWait).
	Wait time.Duration
	// Mode says whether sources arrive lazily ("": auto).
	Mode Mode
	// ReadOrderRefresh is how old a read profile's record must be before
	// a lazy pull under it records it again (0: every time). Recording
	// costs each of a step's opens a notification; a job's steps read
	// much the same way from one build to the next.
	ReadOrderRefresh time.Duration
	// ReadOrders shares the orders this node records with the fleet, and
	// finds another node's where this one has none (nil: none are).
	ReadOrders ReadOrderShare
	// RelayAddress is where this node serves its peers (as they dial
	// it; empty: it serves none): each stream of a layer of at least
	// SwarmMinBytes (0: none) that a pull takes joins the stream's swarm,
	// pulling from the member before it and relaying to the one after
	// (see swarm.go).
	RelayAddress  string
	SwarmMinBytes int64
	// FillKeeper is the socket of the process that keeps the lazy fills'
	// fanotify group (and its held readers) while this plugin restarts
	// ("": none; see fill.Kept).
	FillKeeper string
	// Index has a lazy pull mount an index of the layer in place of a
	// stub per file, where the kernel can (index.go; IndexSupported).
	Index bool
}

// ReadOrderShare is where nodes leave the read orders they record for each
// other: the first lazy pull under a read profile on a node that never ran
// the job reads in the order the job's steps did elsewhere.
type ReadOrderShare interface {
	Share(ctx context.Context, namespace, name string, files []string) error
	// Find answers no files if no node shared an order for namespace under
	// name.
	Find(ctx context.Context, namespace, name string) (files []string, from string, err error)
}

// Locator finds the peers holding a volume ready, best first, what the
// nodes that made volumes vouch for them with (none known: absent), and
// the fleet's newest version of a cache key of a namespace (found false:
// none is known).
type Locator interface {
	Holders(ctx context.Context, namespace string, r volume.Ref) ([]Peer, error)
	Vouched(ctx context.Context, refs []volume.Ref) (map[volume.Ref]volume.Digests, error)
	NewestCacheVersion(ctx context.Context, namespace, key string) (v CacheVersion, found bool, err error)
}

// CacheVersion is a version of a cache key, as the fleet knows it: when it
// became its key's current version, and the pod whose step's view it was.
type CacheVersion struct {
	Ref        volume.Ref
	PromotedAt time.Time
	PromotedBy string
}

// NewestCacheVersion asks the fleet for the newest version of a cache key
// of namespace.
func (pl *Puller) NewestCacheVersion(ctx context.Context, namespace, key string) (CacheVersion, bool, error) {
	return pl.cfg.Locator.NewestCacheVersion(ctx, namespace, key)
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

// Notifier is what a Puller tells the node it pulls for.
type Notifier interface {
	// Event puts an event on a pod that asked for a pull.
	Event(pod volume.Pod, eventType, reason, message string)
	// Committed says a layer arrived and is a ready cached volume; synced
	// says whether its data is on disk yet (else the node's sync round
	// writes it back).
	Committed(vol cache.Volume, synced bool)
	// FillEnded says a lazily pulled layer's fill ended, filled or
	// failed: what held other volumes' data may have let go.
	FillEnded(r volume.Ref)
}

// Event types, as Kubernetes has them.
const (
	EventNormal  = "Normal"
	EventWarning = "Warning"
)

// Deps are what a Puller works with.
type Deps struct {
	Store    *cache.Store
	Backend  overlay.Kind // how the node makes views (and so layer dirs)
	NodeID   string       // this node, which is never asked for a volume
	Notifier Notifier
	Metrics  *Metrics
	// Indexes learn the layouts of the indexes pulled whole, for their
	// plain copies.
	Indexes *WholeIndexes
}

// Puller runs the node's pulls.
type Puller struct {
	cfg     Config
	store   *cache.Store
	kind    overlay.Kind
	nodeID  string
	notify  Notifier
	metrics *Metrics
	indexes *WholeIndexes
	// mode is how sources arrive, and why; lazy holds the layers being
	// filled (nil: the node pulls eagerly).
	mode Mode
	why  string
	lazy *lazyPulls

	ctx    context.Context
	cancel context.CancelFunc
	bg     sync.WaitGroup

	mu      sync.Mutex
	running map[pullKey]*pull

	relays relays
}

// New makes the node's Puller, choosing how sources arrive (ChooseMode)
// and opening the fanotify group a lazy pull's readers wait in.
func New(cfg Config, deps Deps, stateDir string) (*Puller, error) {
	if cfg.Wait <= 0 {
		cfg.Wait = DefaultWait
	}
	ctx, cancel := context.WithCancel(context.Background())
	pl := &Puller{cfg: cfg, store: deps.Store, kind: deps.Backend, nodeID: deps.NodeID, notify: deps.Notifier,
		metrics: deps.Metrics, indexes: deps.Indexes, ctx: ctx, cancel: cancel, running: map[pullKey]*pull{},
		relays: relays{byToken: map[string]*relayed{}}}
	mode, why, err := ChooseMode(cfg.Mode, deps.Backend, stateDir)
	if err == nil {
		err = pl.openLazy(cfg.Mode, mode, why, stateDir)
	}
	if err != nil {
		cancel()
		return nil, err
	}
	klog.InfoS("Pulls of sources this node lacks", "mode", pl.mode, "asked", cfg.Mode, "why", pl.why)
	return pl, nil
}

// Close stops the pulls and fills under way and waits for them: readers of
// what is not filled get EIO now; the volumes stay filling, and the node's
// recovery fails them.
func (pl *Puller) Close() {
	pl.cancel()
	if pl.lazy != nil {
		if err := pl.lazy.group.Close(); err != nil {
			klog.ErrorS(err, "Closing the lazy fills")
		}
	}
	pl.bg.Wait()
}

// Mode says how the node pulls sources it lacks, and why.
func (pl *Puller) Mode() (Mode, string) { return pl.mode, pl.why }

// Label says how the node pulls sources it lacks in a word or two, as
// operators see it: eager, lazy (stubs) or lazy (index).
func (pl *Puller) Label() string {
	switch {
	case pl.lazy == nil:
		return string(pl.mode)
	case pl.lazy.index:
		return string(pl.mode) + " (index)"
	}
	return string(pl.mode) + " (stubs)"
}

func (pl *Puller) goBackground(fn func()) {
	pl.bg.Add(1)
	go func() {
		defer pl.bg.Done()
		fn()
	}()
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

// askers are the pods that asked for p so far, and the read profiles they
// named.
func (pl *Puller) askers(p *pull) ([]volume.Pod, []string) {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	return slices.Clone(p.pods), slices.Clone(p.profiles)
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

// wait waits for a pull to end, at most the configured wait or until ctx
// ends, and then says how far it got.
func (pl *Puller) wait(ctx context.Context, p *pull) error {
	wait := time.NewTimer(pl.cfg.Wait)
	defer wait.Stop()
	select {
	case <-p.done:
		return p.err
	case <-wait.C:
	case <-ctx.Done():
	}
	return p.progress()
}

// Ensure joins the pull of r for a pod of namespace (starting it if none
// runs) and waits for it, at most the configured wait or until ctx ends,
// then says how far it got: nil once r is here, or ErrPulling with the
// pull's progress (the pull goes on; asking again joins it). pod, if any,
// is told how it ends, and a lazy pull fetches first what the read profile
// (if any) says steps read first.
func (pl *Puller) Ensure(ctx context.Context, namespace string, r volume.Ref, pod volume.Pod, profile string) error {
	return pl.wait(ctx, pl.join(pullKey{namespace: namespace, ref: r}, pod, profile, false))
}

// EnsureWhole is Ensure for a reader that needs the volume itself rather
// than a step's view of it (the image registry): every layer arrives
// whole, even where pulls are lazy.
func (pl *Puller) EnsureWhole(ctx context.Context, namespace string, r volume.Ref) error {
	return pl.wait(ctx, pl.join(pullKey{namespace: namespace, ref: r}, volume.Pod{}, "", true))
}

// StartWhole starts a pull of r for namespace, every layer whole, or
// joins the one under way, without waiting for it: a copy the node keeps
// for the fleet, which no reader waits for.
func (pl *Puller) StartWhole(namespace string, r volume.Ref) {
	pl.join(pullKey{namespace: namespace, ref: r}, volume.Pod{}, "", true)
}

// join returns the running pull of key, starting one if none is (whole:
// every layer whole, even where pulls are lazy).
func (pl *Puller) join(key pullKey, pod volume.Pod, profile string, whole bool) *pull {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	p, ok := pl.running[key]
	if !ok {
		p = &pull{id: cache.NewPullID(), key: key, started: time.Now(), done: make(chan struct{}), whole: whole}
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
	pl.running[key] = p
	pl.goBackground(func() {
		err := pl.runPull(p)
		pl.mu.Lock()
		delete(pl.running, key)
		pods := p.pods
		pl.mu.Unlock()
		p.err = err
		close(p.done)
		pl.tellPods(p, pods, err)
	})
	return p
}

// tellPods puts how a pull ended on the pods that waited for it, where
// their owners look.
func (pl *Puller) tellPods(p *pull, pods []volume.Pod, err error) {
	took := time.Since(p.started).Round(time.Millisecond)
	for _, pod := range pods {
		switch {
		case err == nil:
			pl.notify.Event(pod, EventNormal, "VolumePulled", fmt.Sprintf("Pulled source volume %q from %s (%s on the wire) in %s",
				p.key.ref.Handle, p.source(), mib(p.received.Load()), took))
		case errors.Is(err, cache.ErrNotFound), errors.Is(err, ErrPulling):
			// A missing source is the publish's own answer; another
			// pull is still making it.
		default:
			pl.notify.Event(pod, EventWarning, "PullFailed", fmt.Sprintf("Pulling source volume %q failed (the kubelet retries): %v",
				p.key.ref.Handle, err))
		}
	}
}

// runPull brings a source here from the first holder that can deliver it,
// layer by layer. A holder failing mid-way leaves the layers it delivered
// (they are whole cached volumes) and the next holder sends the rest.
func (pl *Puller) runPull(p *pull) error {
	ns, ref := p.key.namespace, p.key.ref
	if err := pl.store.CheckBackoff(ref); err != nil {
		return err // a failed pull's retry waits, asking no one
	}
	holders, err := pl.cfg.Locator.Holders(pl.ctx, ns, ref)
	if err != nil {
		pl.metrics.pulls.WithLabelValues("failed").Inc()
		return fmt.Errorf("finding the nodes that hold %s: %w: %w", ref, ErrPullFailed, err)
	}
	var errs []error
	tried := 0
	for _, h := range holders {
		if h.NodeID == pl.nodeID || h.Address == "" {
			continue
		}
		tried++
		from := h.NodeID
		p.from.Store(&from)
		start := time.Now()
		layers, err := pl.pullFrom(p, h)
		if err == nil {
			pl.metrics.pulls.WithLabelValues("ok").Inc()
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
		if errors.Is(err, filesum.ErrMismatch) {
			// Extracted out of sight: nothing of it was kept.
			pl.metrics.corrupt.WithLabelValues("layer").Inc()
		}
		if !streamer.NotHeld(err) {
			klog.ErrorS(err, "Pulling a source volume from a peer failed; trying the next holder",
				"volume", ref, "namespace", ns, "peer", h.NodeID)
		}
		errs = append(errs, fmt.Errorf("node %s: %w", h.NodeID, err))
	}
	if len(errs) == 0 || allNotHeld(errs) {
		pl.metrics.pulls.WithLabelValues("not_found").Inc()
		return fmt.Errorf("%w (nor on any of the %d peers asked)", cache.NotVisible(ref, ns), tried)
	}
	pl.metrics.pulls.WithLabelValues("failed").Inc()
	if err := pl.store.NoteFailure(ref); err != nil {
		klog.ErrorS(err, "Recording a failed pull", "volume", ref)
	}
	return fmt.Errorf("source volume %s: %w: %w", ref, ErrPullFailed, errors.Join(errs...))
}

// checkVouched says whether a layer that arrived (sum) is what the node
// that made its volume vouches for it with (want; none known: it is taken
// as its holder's sums say): a layer over a base, its files over that
// very base; a root layer, every file the volume shows (a holder may have
// flattened its chain). Checked before the layer is committed, so a
// holder that sends other files with sums to match them, or a chain that
// is not the volume's, leaves nothing behind.
func (pl *Puller) checkVouched(l streamer.Layer, want volume.Digests, sum streamer.Summary) error {
	if !want.Known() {
		pl.metrics.vouches.WithLabelValues("unknown").Inc()
		klog.V(2).InfoS("Pulled a layer no digests are known for yet; its files are checked against its holder's sums only", "volume", l.Ref)
		return nil
	}
	ok := volume.Digest(sum.Files) == want.View
	if !l.Base.IsZero() {
		ok = cache.LayerDigest(l.Base, sum.Files) == want.Layer
	}
	if !ok {
		pl.metrics.vouches.WithLabelValues("mismatched").Inc()
		return fmt.Errorf("%w: its files (%d entries) are not those the node that made it vouches for: %w", streamer.ErrCorrupt, sum.Entries, filesum.ErrMismatch)
	}
	pl.metrics.vouches.WithLabelValues("matched").Inc()
	return nil
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
func (pl *Puller) pullFrom(p *pull, h Peer) (int, error) {
	client, conn, err := pl.cfg.Dial(h.NodeID, h.Address)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	chain, err := client.Chain(pl.ctx, p.key.namespace, p.key.ref)
	if err != nil {
		return 0, err
	}
	if len(chain) == 0 || chain[0].Ref != p.key.ref {
		return 0, fmt.Errorf("the peer described another chain than %s's", p.key.ref)
	}
	var missing []streamer.Layer
	for _, l := range chain {
		v, err := pl.store.Get(l.Ref)
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
	refs := make([]volume.Ref, len(missing))
	for i, l := range missing {
		expected += max(l.SizeBytes, 0)
		refs[i] = l.Ref
	}
	p.expected.Store(expected)
	vouched, err := pl.cfg.Locator.Vouched(pl.ctx, refs)
	if err != nil {
		return 0, err
	}
	// A layer the peer keeps only as a base arrives destroyed, as it is
	// there: held until the layer above it is reserved on it, lest the
	// reaper free it in between.
	for _, l := range missing {
		defer pl.store.Hold(l.Ref, cache.HoldStream)()
	}
	for i := len(missing) - 1; i >= 0; i-- {
		if err := pl.pullLayer(p, client, chain[0], missing[i], vouched[missing[i].Ref]); err != nil {
			return len(missing) - 1 - i, err
		}
	}
	return len(missing), nil
}

// pullLayer pulls one volume's own layer (of top's chain) into the cache,
// checked against the peer's digest, and its files' table against what its
// maker vouches for it with (want; none known: unchecked): whole, or as
// stubs filled behind.
func (pl *Puller) pullLayer(p *pull, client *streamer.Client, top, l streamer.Layer, want volume.Digests) error {
	start := time.Now()
	progress := func(n int64) { p.received.Add(n) }
	var vol cache.Volume
	var err error
	switch {
	case pl.lazy != nil && !p.whole && pl.lazy.index:
		vol, err = pl.pullIndex(p, client, top, l, want, progress)
		if errors.Is(err, index.ErrUnindexable) {
			// Nothing of it was kept: its stub tree is made instead.
			klog.InfoS("Pulling a layer an index cannot say as a stub tree", "volume", l.Ref, "for", p.key.ref, "why", err)
			vol, err = pl.pullStubs(p, client, top, l, want, progress)
		}
	case pl.lazy != nil && !p.whole:
		vol, err = pl.pullStubs(p, client, top, l, want, progress)
	default:
		vol, err = pl.receiveWhole(p, client, top, l, want, progress)
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
	pl.metrics.pulled.Inc()
	klog.V(2).InfoS("Pulled a layer", "volume", vol.Ref(), "base", vol.Base, "state", vol.State, "duration", time.Since(start))
	return nil
}
