package driver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/target"
	"github.com/concourse/cowvol/pkg/volume"
)

// nodeService serves inline step volumes on this node.
type nodeService struct {
	csi.UnimplementedNodeServer
	nodeID       string
	flattenDepth int
	store        *cache.Store
	mounter      overlay.Mounter
	backend      overlay.Backend
	metrics      *metrics
	events       podEvents
	inflight     inflight
	layout       target.Layout
	allowSetuid  bool

	// limiter enforces size limits (nil: none can be, for limitsOff);
	// defaultLimit and maxLimit are the node's policy (0: none).
	limiter                overlay.Limiter
	limitsOff              error
	defaultLimit, maxLimit int64
	csiDriver              *csiDriverGuard
	usage                  usageCache
	quarantine             quarantine

	// Background work (trash, sync, usage, flattening) runs under bgCtx, which
	// outlives any one RPC: a kubelet giving up on a call must not abort
	// work a retry will want finished.
	bgCtx    context.Context
	bgCancel context.CancelFunc
	bg       sync.WaitGroup
	janitor  chan struct{}
	syncer   chan struct{}

	// boot is this kernel boot's ID: what survives a reboot is only what
	// was synced before it.
	boot string
}

// bootIDPath names the kernel's boot ID.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

func newNodeService(opts Options, store *cache.Store, m overlay.Mounter, met *metrics, kube kubernetes.Interface) (*nodeService, error) {
	kind := overlay.Kind(opts.Backend)
	if opts.Backend == "auto" {
		var err error
		if kind, err = overlay.Probe(opts.StateDir, m); err != nil {
			return nil, err
		}
		klog.InfoS("Probed the state dir for a COW backend", "stateDir", opts.StateDir, "backend", kind)
	} else if err := overlay.Supports(kind, opts.StateDir, m); err != nil {
		return nil, fmt.Errorf("COW backend %s does not work under %s: %w", kind, opts.StateDir, err)
	}
	limiter, limitsOff := overlay.ProbeLimits(opts.StateDir, kind)
	if limitsOff != nil {
		klog.InfoS("Size limits are off: sizeLimit attributes are refused", "stateDir", opts.StateDir, "backend", kind, "reason", limitsOff)
		if opts.DefaultSizeLimit > 0 {
			return nil, fmt.Errorf("--default-size-limit needs size limits, which this state dir cannot enforce: %w", limitsOff)
		}
	} else {
		klog.InfoS("Size limits are on", "mechanism", limiter.Mechanism(), "default", opts.DefaultSizeLimit, "max", opts.MaxSizeLimit)
	}
	backend, err := overlay.New(kind, m, limiter)
	if err != nil {
		return nil, err
	}
	boot, err := os.ReadFile(opts.bootIDPath())
	if err != nil {
		return nil, fmt.Errorf("reading the boot ID: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	n := &nodeService{
		nodeID: opts.NodeID, flattenDepth: opts.FlattenDepth,
		store: store, mounter: m, backend: backend, metrics: met,
		layout: target.Layout{KubeletDir: opts.KubeletDir}, allowSetuid: opts.AllowSetuid,
		limiter: limiter, limitsOff: limitsOff, defaultLimit: opts.DefaultSizeLimit, maxLimit: opts.MaxSizeLimit,
		usage: usageCache{entries: map[string]*usageEntry{}}, quarantine: quarantine{views: map[string]string{}},
		bgCtx: ctx, bgCancel: cancel, janitor: make(chan struct{}, 1), syncer: make(chan struct{}, 1),
		boot: strings.TrimSpace(string(boot)),
	}
	if kube != nil {
		if n.csiDriver, err = watchCSIDriver(ctx, kube, opts.DriverName); err != nil {
			cancel()
			return nil, err
		}
		sender := newKubeEvents(kube, opts.DriverName, opts.NodeID)
		n.events = sender
		n.goBackground(func() { sender.run(n.bgCtx) })
	} else {
		klog.InfoS("No API server configured (--kubeconfig, or run in a pod): no Kubernetes Events, and the CSIDriver object is not checked")
		n.events = noEvents{}
	}
	met.watchNode(n, string(kind))
	if err := n.recover(); err != nil {
		n.stop()
		return nil, fmt.Errorf("recovering the state dir: %w", err)
	}
	n.onKick(n.janitor, n.tidyRound)
	n.onKick(n.syncer, n.syncRound)
	n.goBackground(n.retryQuarantined)
	n.tidy()
	n.kick(n.syncer)
	return n, nil
}

func (n *nodeService) goBackground(fn func()) {
	n.bg.Add(1)
	go func() {
		defer n.bg.Done()
		fn()
	}()
}

func (n *nodeService) stop() {
	n.bgCancel()
	n.bg.Wait()
}

// kick wakes a background loop; kicks while it runs coalesce into one more
// round.
func (n *nodeService) kick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// tidy asks the janitor to empty the trash and prune replaced layers.
func (n *nodeService) tidy() { n.kick(n.janitor) }

// onKick runs round in the background each time ch is kicked, until the
// node service stops.
func (n *nodeService) onKick(ch chan struct{}, round func()) {
	n.goBackground(func() {
		for {
			select {
			case <-n.bgCtx.Done():
				return
			case <-ch:
			}
			round()
		}
	})
}

// syncRound makes captured volumes durable: one syncfs of the state dir's
// filesystem covers every capture since the last round, off the capture's
// path.
func (n *nodeService) syncRound() {
	refs := n.store.Unsynced()
	if len(refs) == 0 {
		return
	}
	start := time.Now()
	if err := overlay.SyncFS(n.store.Dir()); err != nil {
		klog.ErrorS(err, "Syncing the state dir; will retry on the next capture")
		return
	}
	if err := n.store.MarkSynced(refs); err != nil {
		klog.ErrorS(err, "Recording synced volumes")
		return
	}
	klog.V(4).InfoS("Synced captured volumes", "count", len(refs), "duration", time.Since(start))
}

// tidyRound empties the trash and prunes layers flattening replaced.
func (n *nodeService) tidyRound() {
	if err := n.store.EmptyTrash(overlay.RemoveTree); err != nil {
		klog.ErrorS(err, "Emptying the trash")
	}
	if err := n.store.PruneLayers(overlay.RemoveTree); err != nil {
		klog.ErrorS(err, "Pruning replaced layers")
	}
}

func (n *nodeService) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{
		NodeId:             n.nodeID,
		AccessibleTopology: &csi.Topology{Segments: map[string]string{TopologyKey: n.nodeID}},
	}, nil
}

func (n *nodeService) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{
		Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{
			Type: csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		}},
	}}}, nil
}

// backendOf returns the backend that built a view: a restarted plugin may
// run another one, and must tear each view down the way it was built.
func (n *nodeService) backendOf(v cache.View) (overlay.Backend, error) {
	if overlay.Kind(v.Backend) == n.backend.Kind() {
		return n.backend, nil
	}
	return overlay.New(overlay.Kind(v.Backend), n.mounter, n.limiter)
}

// spec describes a view to its backend, mounted at mountPath (a path
// through the target's open parent dir; empty when nothing is mounted).
func (n *nodeService) spec(v cache.View, mountPath string) overlay.Spec {
	return overlay.Spec{
		Dir: n.store.ViewDir(v.VolumeID), Target: mountPath, Lowers: v.Lowers,
		Attrs: overlay.Attrs{ReadOnly: v.ReadOnly, AllowSetuid: n.allowSetuid},
		Limit: v.SizeLimit, QuotaID: v.QuotaID,
	}
}

// sizeLimit is the limit a request gets: its own, else the node's default.
func (n *nodeService) sizeLimit(vr volumeRequest) (int64, error) {
	if vr.ReadOnly {
		return 0, nil // nothing to write
	}
	limit := vr.SizeLimit
	if limit == 0 {
		limit = n.defaultLimit
	}
	switch {
	case limit == 0:
		return 0, nil
	case n.limiter == nil:
		return 0, status.Errorf(codes.FailedPrecondition,
			"size limits are off on this node (%v): drop the sizeLimit attribute, or see the README on preparing the state dir", n.limitsOff)
	case n.maxLimit > 0 && limit > n.maxLimit:
		return 0, invalid("sizeLimit of %d bytes exceeds this node's maximum of %d bytes", limit, n.maxLimit)
	}
	return limit, nil
}

// storeError maps the engine's answers (the store's, the target's and the
// kernel's) to gRPC codes.
func storeError(err error) error {
	code := codes.Internal
	switch {
	case errors.Is(err, cache.ErrNotFound):
		code = codes.NotFound
	case errors.Is(err, cache.ErrNotReady):
		code = codes.Unavailable // retryable: the capture will finish
	case errors.Is(err, cache.ErrExists):
		code = codes.AlreadyExists
	case errors.Is(err, cache.ErrUnusable), errors.Is(err, cache.ErrInUse),
		errors.Is(err, cache.ErrHasChildren), errors.Is(err, cache.ErrWrongViewState),
		errors.Is(err, target.ErrUnsafe), errors.Is(err, target.ErrGone):
		code = codes.FailedPrecondition
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		code = codes.ResourceExhausted
	}
	return status.Error(code, err.Error())
}

// lock takes the volume's in-flight lock, answering Aborted while another
// call for the volume runs: the kubelet retries, and the retry must not race
// the original.
func (n *nodeService) lock(volumeID string) (release func(), err error) {
	release, ok := n.inflight.tryLock(volumeID)
	if !ok {
		return nil, status.Errorf(codes.Aborted, "an operation on volume %s is already in progress", volume.Quote(volumeID))
	}
	return release, nil
}

// elsewhere answers a call naming a path the volume is not published at.
func elsewhere(v cache.View, path string) error {
	return status.Errorf(codes.NotFound, "volume %s is not published at %s", volume.Quote(v.VolumeID), volume.Quote(path))
}
