// Package node is cowvol's node engine: everything a node does with volumes,
// whether a pod asked or not. It publishes step volumes at the kubelet's
// targets and captures or discards them on teardown, flattens deep chains,
// makes captures durable, measures what step volumes hold, pulls the
// sources it lacks from peers (eagerly, or lazily: the tree first, each
// file's data when it is opened), and recovers (quarantining what it
// cannot settle) after a restart.
//
// It speaks no gRPC and no CSI: callers validate requests (package driver
// does for the kubelet) and map the errors it returns, which wrap the
// sentinels of this package and of packages cache and target. It builds on
// package cache (metadata and the lifecycle of cached volumes), package
// overlay (copy-on-write mechanics), package fill (holding readers of lazy
// layers), package streamer (the peer wire) and package target (the
// kubelet's dirs), asks the cluster about step pods only through the Pods
// it is given, and never imports package driver.
package node

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/pull"
	"github.com/concourse/cowvol/pkg/target"
	"github.com/concourse/cowvol/pkg/volume"
)

// Errors the engine answers with, besides those of packages cache and
// target.
var (
	// ErrBusy: another call for the same volume is in flight.
	ErrBusy = errors.New("an operation on the volume is already in progress")
	// ErrElsewhere: the volume is published at another path.
	ErrElsewhere = errors.New("the volume is published elsewhere")
	// ErrOtherAttributes: the volume is published with other attributes.
	ErrOtherAttributes = errors.New("the volume is already published with other attributes")
	// ErrLimitsOff: a size limit was asked for where none can be enforced.
	ErrLimitsOff = errors.New("size limits are off on this node")
	// ErrLimitTooLarge: a size limit above the node's maximum.
	ErrLimitTooLarge = errors.New("the size limit exceeds this node's maximum")
	// ErrNotCowvols: a mount at a target cowvol has no record of.
	ErrNotCowvols = errors.New("not cowvol's")
)

// Config is the engine's part of the plugin's options, validated by the
// caller.
type Config struct {
	NodeID string
	// StateDir holds the store; the backend is probed there.
	StateDir string
	// Backend is "auto" or an overlay.Kind.
	Backend      string
	FlattenDepth int
	KubeletDir   string
	// DefaultSizeLimit caps a writable step volume that names no limit,
	// MaxSizeLimit any (bytes; 0: none).
	DefaultSizeLimit, MaxSizeLimit int64
	// AllowSetuid keeps setuid/setgid bits, file capabilities and device
	// nodes in captures (Seal), and mounts without nosuid.
	AllowSetuid bool
	// Watermarks bound the state dir's filesystem's fill (percent).
	Watermarks Watermarks
	// Copies is how many nodes a captured volume that names no copies
	// should be kept on (0 or 1: the one that captured it).
	Copies int
	// BootIDFile names the kernel's boot ID (default: the kernel's own);
	// tests point it elsewhere to pretend a reboot.
	BootIDFile string
	// Pulls, if set, pulls the sources the node lacks from peers.
	Pulls *pull.Config
	// Pods answers what the API server knows of step pods (nil: none).
	Pods Pods
	// CacheVersions is how many versions of a cache key the node keeps,
	// the current one among them (0: DefaultCacheVersions).
	CacheVersions int
	// CaptureWait is how long a publish waits for its source, a step's
	// output on this node still being captured, to be ready before it
	// answers Unavailable (0: DefaultCaptureWait).
	CaptureWait time.Duration
}

// DefaultCaptureWait is as long as a publish waits for a pull (the kubelet's
// call has two minutes).
const DefaultCaptureWait = 20 * time.Second

// DefaultWatermarks bound a state dir's fill where none are configured.
var DefaultWatermarks = Watermarks{High: 90, Low: 80, Grace: 5 * time.Minute}

// bootIDPath names the kernel's boot ID.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

// Engine runs a node's volumes.
type Engine struct {
	// summing admits one layer's file sums computed at a time (sumLayer).
	summing      chan struct{}
	captureWait  time.Duration
	nodeID       string
	flattenDepth int
	store        *cache.Store
	mounter      overlay.Mounter
	backend      overlay.Backend
	// idmapBackend builds the views of pods with a user namespace of their
	// own where backend would mount an overlay, which the runtime cannot
	// idmap: reflink clones where the state dir has them; nil elsewhere.
	idmapBackend overlay.Backend
	pods         Pods
	metrics      *metrics
	events       PodEvents
	inflight     inflight
	layout       target.Layout
	allowSetuid  bool

	// limiter enforces size limits (nil: none can be, for limitsOff);
	// defaultLimit and maxLimit are the node's policy (0: none).
	limiter                overlay.Limiter
	limitsOff              error
	defaultLimit, maxLimit int64
	usage                  usageCache
	quarantine             quarantine
	watermarks             Watermarks
	copies                 int // Config.Copies
	cacheVersions          int // Config.CacheVersions
	pressure               pressure
	reaping                sync.Mutex
	swept                  sweep // guarded by reaping
	// puller brings the sources the node lacks from its peers (nil: it
	// pulls nothing), and pullMetrics count what it does.
	puller      *pull.Puller
	pullMetrics *pull.Metrics
	// indexes are the volumes ready as whole indexes (indexes.go), and
	// indexCopier is kicked to make the idle ones plain layers.
	indexes           *pull.WholeIndexes
	indexCopier       chan struct{}
	indexCopyFailures indexCopyFailures
	// refusal says why captures are refused ("" or nil: they are not).
	refusal atomic.Pointer[string]
	// copyLimits are the controller's last word on copies (nil: none yet).
	copyLimits atomic.Pointer[copyLimits]

	// Background work (trash, sync, usage, flattening) runs under bgCtx, which
	// outlives any one call: a kubelet giving up on a call must not abort
	// work a retry will want finished.
	bgCtx    context.Context
	bgCancel context.CancelFunc
	bg       sync.WaitGroup
	janitor  chan struct{}
	syncer   chan struct{}
	reaper   chan struct{}
	// madeMounts are the mounts publishes made, which the recorder loop
	// writes to the store after the publishes returned.
	madeMounts madeMounts
	recorder   chan struct{}
	// trees are empty view trees made ahead, for backends that stage
	// views (nil: none); planter makes more after publishes take them.
	trees   *overlay.Trees
	planter chan struct{}

	// boot is this kernel boot's ID: what survives a reboot is only what
	// was synced before it.
	boot string
}

// New starts an engine on an open store: it picks the COW backend and the
// size limiter by probing the state dir, and recovers whatever a previous
// process left before returning.
func New(cfg Config, store *cache.Store, m overlay.Mounter, events PodEvents) (*Engine, error) {
	kind := overlay.Kind(cfg.Backend)
	if cfg.Backend == "auto" {
		var err error
		if kind, err = overlay.Probe(cfg.StateDir, m); err != nil {
			return nil, err
		}
		klog.InfoS("Probed the state dir for a COW backend", "stateDir", cfg.StateDir, "backend", kind)
	} else if err := overlay.Supports(kind, cfg.StateDir, m); err != nil {
		return nil, fmt.Errorf("COW backend %s does not work under %s: %w", kind, cfg.StateDir, err)
	}
	if cfg.Watermarks.High == 0 {
		cfg.Watermarks = DefaultWatermarks
	}
	klog.InfoS("Opened the node's store", "stateDir", cfg.StateDir, "storeID", store.ID(),
		"highWatermark", cfg.Watermarks.High, "lowWatermark", cfg.Watermarks.Low, "evictionGrace", cfg.Watermarks.Grace)
	limiter, limitsOff := overlay.ProbeLimits(cfg.StateDir, kind)
	if limitsOff != nil {
		klog.InfoS("Size limits are off: sizeLimit attributes are refused", "stateDir", cfg.StateDir, "backend", kind, "reason", limitsOff)
		if cfg.DefaultSizeLimit > 0 {
			return nil, fmt.Errorf("--default-size-limit needs size limits, which this state dir cannot enforce: %w", limitsOff)
		}
	} else {
		klog.InfoS("Size limits are on", "mechanism", limiter.Mechanism(), "default", cfg.DefaultSizeLimit, "max", cfg.MaxSizeLimit)
	}
	backend, err := overlay.New(kind, m, limiter)
	if err != nil {
		return nil, err
	}
	idmapBackend, err := idmapBackendFor(kind, cfg.StateDir, m, limiter)
	if err != nil {
		return nil, err
	}
	bootFile := cfg.BootIDFile
	if bootFile == "" {
		bootFile = bootIDPath
	}
	boot, err := os.ReadFile(bootFile)
	if err != nil {
		return nil, fmt.Errorf("reading the boot ID: %w", err)
	}
	if events == nil {
		events = NoEvents{}
	}
	var trees *overlay.Trees
	if _, ok := backend.(overlay.Stager); ok {
		// Leftovers it cannot remove never keep the node from starting.
		if trees, err = overlay.OpenTrees(store.TreesDir(), treesAhead); err != nil {
			klog.ErrorS(err, "Making step volume trees ahead; publishes make their own where none is ready")
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &Engine{
		nodeID: cfg.NodeID, flattenDepth: cfg.FlattenDepth, captureWait: cmp.Or(cfg.CaptureWait, DefaultCaptureWait),
		store: store, mounter: m, backend: backend, idmapBackend: idmapBackend, pods: cfg.Pods, events: events,
		layout: target.Layout{KubeletDir: cfg.KubeletDir}, allowSetuid: cfg.AllowSetuid,
		limiter: limiter, limitsOff: limitsOff, defaultLimit: cfg.DefaultSizeLimit, maxLimit: cfg.MaxSizeLimit,
		usage: usageCache{entries: map[string]*usageEntry{}}, quarantine: quarantine{views: map[string]string{}},
		bgCtx: ctx, bgCancel: cancel, janitor: make(chan struct{}, 1), syncer: make(chan struct{}, 1), summing: make(chan struct{}, 1),
		reaper: make(chan struct{}, 1), indexCopier: make(chan struct{}, 1), indexes: pull.NewWholeIndexes(store), recorder: make(chan struct{}, 1), trees: trees, planter: make(chan struct{}, 1), boot: strings.TrimSpace(string(boot)), watermarks: cfg.Watermarks, copies: cfg.Copies,
		cacheVersions: cmp.Or(cfg.CacheVersions, DefaultCacheVersions),
	}
	e.metrics = newMetrics(e, string(kind))
	e.pullMetrics = pull.NewMetrics()
	if cfg.Pulls != nil {
		if e.puller, err = pull.New(*cfg.Pulls, pull.Deps{Store: store, Backend: kind, NodeID: cfg.NodeID,
			Notifier: e.notifier(), Metrics: e.pullMetrics, Indexes: e.indexes}, cfg.StateDir); err != nil {
			return nil, err
		}
	}
	if err := e.recover(); err != nil {
		e.Close()
		return nil, fmt.Errorf("recovering the state dir: %w", err)
	}
	e.onKick(e.janitor, e.tidyRound)
	e.onKick(e.syncer, e.syncRound)
	e.onKick(e.recorder, e.recordMountsRound)
	e.onKickAfter(e.indexCopier, indexCopyDelay, e.copyIdleIndexes)
	if e.trees != nil {
		e.onKickAfter(e.planter, afterPublish, e.plantTrees)
		e.kick(e.planter)
	}
	e.goBackground(e.retryQuarantined)
	e.goBackground(func() { e.reapLoop(e.bgCtx) })
	e.tidy()
	e.kick(e.syncer)
	return e, nil
}

// Close stops background work and waits for it, and detaches the whole
// indexes it mounted (the views over them keep theirs); the store stays
// open.
func (e *Engine) Close() {
	e.bgCancel()
	if e.puller != nil {
		e.puller.Close()
	}
	e.bg.Wait()
	if n := e.indexes.Unmount(); n > 0 {
		klog.InfoS("Detached the whole indexes of ready volumes; the next start mounts them again", "count", n)
	}
}

// StoreID is the identity of the node's store: a wiped state dir has a new
// one.
func (e *Engine) StoreID() string { return e.store.ID() }

// Backend says which COW backend the engine runs.
func (e *Engine) Backend() overlay.Kind { return e.backend.Kind() }

// Layout is the kubelet's dir layout the engine accepts targets in.
func (e *Engine) Layout() target.Layout { return e.layout }

// Collectors are the engine's Prometheus metrics.
func (e *Engine) Collectors() []prometheus.Collector {
	return append(e.metrics.collectors(), e.pullMetrics.Collectors()...)
}

// PullMode says how the node pulls sources it lacks ("" where it pulls
// none), and why.
func (e *Engine) PullMode() (pull.Mode, string) {
	if e.puller == nil {
		return "", ""
	}
	return e.puller.Mode()
}

// PullLabel says how the node pulls sources it lacks in a word or two
// ("" where it pulls none): see pull.Puller.Label.
func (e *Engine) PullLabel() string {
	if e.puller == nil {
		return ""
	}
	return e.puller.Label()
}

// goBackground runs fn in the background; Close cancels e.bgCtx, which fn
// watches, and waits for it to return.
func (e *Engine) goBackground(fn func()) {
	e.bg.Add(1)
	go func() {
		defer e.bg.Done()
		fn()
	}()
}

// kick wakes a background loop; kicks while it runs coalesce into one more
// round.
func (e *Engine) kick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// tidy asks the janitor to empty the trash and prune replaced layers.
func (e *Engine) tidy() { e.kick(e.janitor) }

// onKick runs round in the background each time ch is kicked, until the
// engine stops.
func (e *Engine) onKick(ch chan struct{}, round func()) { e.onKickAfter(ch, 0, round) }

// onKickAfter is onKick for work that waits a while after its kick, so as
// not to compete for the CPU with the call that kicked it (a publish still
// answering the kubelet), and so that a burst of kicks is one round.
func (e *Engine) onKickAfter(ch chan struct{}, delay time.Duration, round func()) {
	e.goBackground(func() {
		for {
			select {
			case <-e.bgCtx.Done():
				return
			case <-ch:
			}
			if delay > 0 {
				select {
				case <-e.bgCtx.Done():
					return
				case <-time.After(delay):
				}
				select { // kicks meanwhile are this round's
				case <-ch:
				default:
				}
			}
			round()
		}
	})
}

// syncRound makes captured and pulled volumes durable: one syncfs of the
// state dir's filesystem covers every one since the last round, off the
// capture's or the pull's path.
func (e *Engine) syncRound() {
	refs := e.store.Unsynced()
	if len(refs) == 0 {
		return
	}
	start := time.Now()
	if err := overlay.SyncFS(e.store.Dir()); err != nil {
		klog.ErrorS(err, "Syncing the state dir; will retry on the next capture")
		return
	}
	if err := e.store.MarkSynced(refs); err != nil {
		klog.ErrorS(err, "Recording synced volumes")
		return
	}
	klog.V(4).InfoS("Synced volumes", "count", len(refs), "duration", time.Since(start))
}

// tidyRound empties the trash, prunes layers flattening replaced, and sets
// the metadata's reserve aside again once there is room.
func (e *Engine) tidyRound() {
	if err := e.store.Reserve(); err != nil {
		klog.V(2).InfoS("No room yet to set the metadata reserve aside", "err", err)
	}
	if err := e.store.EmptyTrash(overlay.RemoveTree); err != nil {
		klog.ErrorS(err, "Emptying the trash")
	}
	if err := e.store.PruneLayers(overlay.RemoveTree); err != nil {
		klog.ErrorS(err, "Pruning replaced layers")
	}
	e.kick(e.indexCopier) // a view gone may leave a whole index idle
}

// backendOf returns the backend that built a view: a restarted plugin may
// run another one, and must tear each view down the way it was built.
func (e *Engine) backendOf(v cache.View) (overlay.Backend, error) {
	if overlay.Kind(v.Backend) == e.backend.Kind() {
		return e.backend, nil
	}
	return overlay.New(overlay.Kind(v.Backend), e.mounter, e.limiter)
}

// spec describes a view to its backend, mounted at mountPath (a path
// through the target's open parent dir; empty when nothing is mounted).
func (e *Engine) spec(v cache.View, mountPath string) overlay.Spec {
	return overlay.Spec{
		Dir: e.store.ViewDir(v.VolumeID), Target: mountPath, Lowers: v.Lowers,
		Attrs: overlay.Attrs{ReadOnly: v.ReadOnly, AllowSetuid: e.allowSetuid}, Idmapped: v.UserNamespace,
		Limit: v.SizeLimit, QuotaID: v.QuotaID,
	}
}

// idmapBackendFor picks the backend for the views of pods with a user
// namespace of their own. Only the overlay backend needs another: its views
// are overlay mounts, which cannot be idmapped; the others' are binds of
// plain trees (read-only chains included, see overlay.Spec.Idmapped).
// Reflink clones cost O(files), not O(bytes); a state dir without them
// refuses such views of layered volumes (FailedPrecondition).
func idmapBackendFor(kind overlay.Kind, stateDir string, m overlay.Mounter, lim overlay.Limiter) (overlay.Backend, error) {
	if kind != overlay.KindOverlay {
		return nil, nil
	}
	if err := overlay.Supports(overlay.KindReflink, stateDir, m); err != nil {
		klog.InfoS("Pods with a user namespace of their own (hostUsers: false) get no writable view of a cached volume "+
			"on this node, nor a read-only one of a chain: overlay mounts cannot be idmapped, and the state dir has no reflink clones",
			"stateDir", stateDir, "reason", err)
		return nil, nil
	}
	klog.InfoS("Pods with a user namespace of their own (hostUsers: false) get reflink clones: overlay mounts cannot be idmapped", "stateDir", stateDir)
	return overlay.New(overlay.KindReflink, m, lim)
}

// sizeLimit is the limit a step volume gets: the one asked for, else the
// node's default; none for a read-only volume, which cannot be written.
func (e *Engine) sizeLimit(asked int64, readOnly bool) (int64, error) {
	if readOnly {
		return 0, nil
	}
	limit := asked
	if limit == 0 {
		limit = e.defaultLimit
	}
	switch {
	case limit == 0:
		return 0, nil
	case e.limiter == nil:
		return 0, fmt.Errorf("%w (%v): drop the sizeLimit attribute, or see the README on preparing the state dir", ErrLimitsOff, e.limitsOff)
	case e.maxLimit > 0 && limit > e.maxLimit:
		return 0, fmt.Errorf("a sizeLimit of %d bytes: %w of %d bytes", limit, ErrLimitTooLarge, e.maxLimit)
	}
	return limit, nil
}

// lock takes the volume's in-flight lock: the kubelet retries, and the
// retry must not race the original.
func (e *Engine) lock(volumeID string) (release func(), err error) {
	release, ok := e.inflight.tryLock(volumeID)
	if !ok {
		return nil, fmt.Errorf("volume %s: %w", volume.Quote(volumeID), ErrBusy)
	}
	return release, nil
}

// elsewhere answers a call naming a path the volume is not published at.
func elsewhere(v cache.View, path string) error {
	return fmt.Errorf("volume %s is not published at %s: %w", volume.Quote(v.VolumeID), volume.Quote(path), ErrElsewhere)
}

// inflight refuses a second call for a volume while one is running.
type inflight struct {
	mu   sync.Mutex
	busy map[string]bool
}

func (f *inflight) tryLock(key string) (release func(), ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.busy == nil {
		f.busy = map[string]bool{}
	}
	if f.busy[key] {
		return nil, false
	}
	f.busy[key] = true
	return func() {
		f.mu.Lock()
		delete(f.busy, key)
		f.mu.Unlock()
	}, true
}
