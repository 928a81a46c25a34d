package driver

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
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

// bootIDPath names the kernel's boot ID; tests point it elsewhere to
// pretend a reboot.
var bootIDPath = "/proc/sys/kernel/random/boot_id"

func newNodeService(opts Options, store *cache.Store, m overlay.Mounter, met *metrics) (*nodeService, error) {
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
	backend, err := overlay.New(kind, m)
	if err != nil {
		return nil, err
	}
	events, sender, err := newPodEvents(opts.Kubeconfig, opts.NodeID)
	if err != nil {
		return nil, err
	}
	boot, err := os.ReadFile(bootIDPath)
	if err != nil {
		return nil, fmt.Errorf("reading the boot ID: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	n := &nodeService{
		nodeID: opts.NodeID, flattenDepth: opts.FlattenDepth,
		store: store, mounter: m, backend: backend, metrics: met, events: events,
		bgCtx: ctx, bgCancel: cancel, janitor: make(chan struct{}, 1), syncer: make(chan struct{}, 1),
		boot: strings.TrimSpace(string(boot)),
	}
	if err := n.recover(); err != nil {
		cancel()
		return nil, fmt.Errorf("recovering the state dir: %w", err)
	}
	n.onKick(n.janitor, n.tidyRound)
	n.onKick(n.syncer, n.syncRound)
	if sender != nil {
		n.goBackground(func() { sender.run(n.bgCtx) })
	}
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
	handles, err := n.store.Unsynced()
	if err != nil {
		klog.ErrorS(err, "Listing unsynced volumes")
		return
	}
	if len(handles) == 0 {
		return
	}
	start := time.Now()
	if err := overlay.SyncFS(n.store.Dir()); err != nil {
		klog.ErrorS(err, "Syncing the state dir; will retry on the next capture")
		return
	}
	if err := n.store.MarkSynced(handles); err != nil {
		klog.ErrorS(err, "Recording synced volumes")
		return
	}
	klog.V(4).InfoS("Synced captured volumes", "count", len(handles), "duration", time.Since(start))
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
	return overlay.New(overlay.Kind(v.Backend), n.mounter)
}

func (n *nodeService) spec(v cache.View) overlay.Spec {
	return overlay.Spec{Dir: n.store.ViewDir(v.VolumeID), Target: v.Target, Lowers: v.Lowers, ReadOnly: v.ReadOnly}
}

// storeError maps the store's answers to gRPC codes.
func storeError(err error) error {
	code := codes.Internal
	switch {
	case errors.Is(err, cache.ErrNotFound):
		code = codes.NotFound
	case errors.Is(err, cache.ErrNotReady):
		code = codes.Unavailable // retryable: the capture will finish
	case errors.Is(err, cache.ErrPermission):
		code = codes.PermissionDenied
	case errors.Is(err, cache.ErrExists):
		code = codes.AlreadyExists
	case errors.Is(err, cache.ErrUnusable), errors.Is(err, cache.ErrInUse),
		errors.Is(err, cache.ErrHasChildren), errors.Is(err, cache.ErrWrongViewState):
		code = codes.FailedPrecondition
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		code = codes.ResourceExhausted
	}
	return status.Error(code, err.Error())
}

func (n *nodeService) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if err := validatePath("target path", req.GetTargetPath()); err != nil {
		return nil, err
	}
	capReadOnly, err := validateCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	vr, err := parseVolumeContext(req.GetVolumeContext())
	if err != nil {
		return nil, err
	}
	vr.ReadOnly = req.GetReadonly() || capReadOnly
	if vr.ReadOnly && vr.Capture != "" {
		return nil, invalid("a read-only volume cannot be captured: drop capture or readOnly")
	}
	release, ok := n.inflight.tryLock(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.Aborted, "an operation on volume %q is already in progress", req.GetVolumeId())
	}
	defer release()

	want := cache.View{
		VolumeID: req.GetVolumeId(), Target: req.GetTargetPath(), Source: vr.Source, Capture: vr.Capture,
		Scope: vr.Scope, Properties: vr.Properties, ReadOnly: vr.ReadOnly, Pod: vr.Pod,
		Backend: string(n.backend.Kind()), Boot: n.boot,
	}
	if vr.Capture == "" {
		want.Scope = ""
	}
	if old, err := n.store.GetView(want.VolumeID); err == nil && old.State != cache.ViewPublishing {
		return n.republish(old, want)
	} else if err == nil {
		// A publish that failed and could not be cleaned up then: clean
		// up now and start over.
		if err := n.discard(old); err != nil {
			return nil, storeError(err)
		}
	} else if !errors.Is(err, cache.ErrNotFound) {
		return nil, storeError(err)
	}
	start := time.Now()
	view, err := n.store.Publish(want)
	if err != nil {
		return nil, storeError(err)
	}
	if err := n.prepare(view); err != nil {
		if rerr := n.discard(view); rerr != nil {
			klog.ErrorS(rerr, "Cleaning up a failed publish", "volumeID", view.VolumeID)
		}
		return nil, storeError(err)
	}
	klog.V(2).InfoS("Published step volume", "volumeID", view.VolumeID, "target", view.Target,
		"source", view.Source, "capture", view.Capture, "layers", len(view.Lowers), "readOnly", view.ReadOnly,
		"pod", klog.KRef(view.Pod.Namespace, view.Pod.Name), "backend", view.Backend, "duration", time.Since(start))
	return &csi.NodePublishVolumeResponse{}, nil
}

func (n *nodeService) prepare(view cache.View) error {
	if err := os.MkdirAll(view.Target, 0o750); err != nil {
		return fmt.Errorf("creating target: %w", err)
	}
	crashPoint("publish-recorded")
	if err := n.backend.Prepare(n.bgCtx, n.spec(view)); err != nil {
		return err
	}
	crashPoint("publish-mounted")
	return n.store.SetViewState(view.VolumeID, cache.ViewPublishing, cache.ViewPublished)
}

// republish answers a repeated publish of a known volume: the same request
// is a success (mounting again if the mount went away), another one is
// refused.
func (n *nodeService) republish(old, want cache.View) (*csi.NodePublishVolumeResponse, error) {
	same := old.Target == want.Target && old.Source == want.Source && old.Capture == want.Capture &&
		old.ReadOnly == want.ReadOnly && old.Scope == want.Scope && maps.Equal(old.Properties, want.Properties)
	if !same {
		return nil, status.Errorf(codes.AlreadyExists,
			"volume %q is already published at %q with other attributes", old.VolumeID, old.Target)
	}
	if old.State == cache.ViewCapturing {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %q is being captured", old.VolumeID)
	}
	if err := n.ensureMounted(old); err != nil {
		return nil, storeError(err)
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (n *nodeService) ensureMounted(v cache.View) error {
	if mp, err := n.mounter.IsMountPoint(v.Target); err != nil {
		return err
	} else if mp {
		return nil
	}
	b, err := n.backendOf(v)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(v.Target, 0o750); err != nil {
		return err
	}
	return b.Remount(n.spec(v))
}

// discard takes a view down without capturing it and forgets it.
func (n *nodeService) discard(v cache.View) error {
	spec := n.spec(v)
	if err := overlay.Unmount(n.mounter, spec); err != nil {
		return err
	}
	crashPoint("discard-unmounted")
	if err := removeTarget(v.Target); err != nil {
		return err
	}
	if err := n.store.Trash(spec.Dir); err != nil {
		return err
	}
	_, _, reserved, err := n.store.DropView(v.VolumeID)
	if err != nil {
		return err
	}
	if reserved != "" {
		err = overlay.RemoveTree(reserved)
	}
	n.tidy()
	return err
}

// removeTarget deletes the target dir the plugin created; CSI wants it gone
// after unpublish. A target that is still a mount point or not empty is
// left alone and reported.
func removeTarget(target string) error {
	err := os.Remove(target)
	if err == nil || errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return fmt.Errorf("removing target %s: %w", target, err)
}

func (n *nodeService) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if err := validatePath("target path", req.GetTargetPath()); err != nil {
		return nil, err
	}
	release, ok := n.inflight.tryLock(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.Aborted, "an operation on volume %q is already in progress", req.GetVolumeId())
	}
	defer release()

	view, err := n.store.GetView(req.GetVolumeId())
	if errors.Is(err, cache.ErrNotFound) {
		// Already unpublished (or never published): done, as long as
		// nothing is left at the target.
		if mp, merr := n.mounter.IsMountPoint(req.GetTargetPath()); merr == nil && mp {
			return nil, status.Errorf(codes.FailedPrecondition,
				"volume %q is unknown to cowvol but %s is a mount point", req.GetVolumeId(), req.GetTargetPath())
		}
		if err := removeTarget(req.GetTargetPath()); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, storeError(err)
	}
	if view.Target != req.GetTargetPath() {
		return nil, status.Errorf(codes.NotFound, "volume %q is published at %q, not %q",
			view.VolumeID, view.Target, req.GetTargetPath())
	}
	start := time.Now()
	if view.Capture != "" && view.Boot != n.boot {
		// The node rebooted under this step: what it wrote may be torn,
		// so it is not captured. The scheduler sees the output missing.
		klog.InfoS("Not capturing a step volume from before a reboot", "volumeID", view.VolumeID,
			"capture", view.Capture, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name))
		n.events.event(view.Pod, corev1.EventTypeWarning, "CaptureSkipped", fmt.Sprintf(
			"Not captured into %q: the node rebooted while the step ran, so what it wrote may be incomplete", view.Capture))
		view.Capture = ""
	}
	if view.Capture == "" || view.State == cache.ViewPublishing {
		if err := n.discard(view); err != nil {
			return nil, storeError(err)
		}
		klog.V(2).InfoS("Unpublished step volume", "volumeID", view.VolumeID, "duration", time.Since(start))
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	vol, err := n.capture(view)
	if err != nil {
		n.metrics.captures.WithLabelValues("error").Inc()
		klog.ErrorS(err, "Capture failed; the kubelet will retry", "volumeID", view.VolumeID, "capture", view.Capture)
		n.events.event(view.Pod, corev1.EventTypeWarning, "CaptureFailed", fmt.Sprintf(
			"Capturing into %q failed (the kubelet retries): %v", view.Capture, err))
		return nil, storeError(err)
	}
	n.metrics.captures.WithLabelValues("ok").Inc()
	n.events.event(view.Pod, corev1.EventTypeNormal, "VolumeCaptured", capturedMessage(vol, time.Since(start)))
	klog.V(2).InfoS("Captured step volume", "volumeID", view.VolumeID, "handle", vol.Handle,
		"parent", vol.Parent, "base", vol.Base, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name),
		"duration", time.Since(start))
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func capturedMessage(vol cache.Volume, took time.Duration) string {
	msg := fmt.Sprintf("Captured into cached volume %q", vol.Handle)
	if vol.Parent != "" {
		msg += fmt.Sprintf(" (a copy-on-write child of %q)", vol.Parent)
	}
	return msg + fmt.Sprintf(" in %s", took.Round(time.Microsecond))
}

// capture commits a view into its reserved handle. Each step is idempotent,
// so a capture cut short (by a crash, or a failure) completes when the
// kubelet calls again.
func (n *nodeService) capture(view cache.View) (cache.Volume, error) {
	if err := n.store.SetViewState(view.VolumeID, cache.ViewPublished, cache.ViewCapturing); err != nil {
		return cache.Volume{}, err
	}
	spec := n.spec(view)
	b, err := n.backendOf(view)
	if err != nil {
		return cache.Volume{}, err
	}
	if err := overlay.Unmount(n.mounter, spec); err != nil {
		return cache.Volume{}, err
	}
	crashPoint("capture-unmounted")
	if err := removeTarget(view.Target); err != nil {
		return cache.Volume{}, err
	}
	reserved, err := n.store.CaptureTarget(view)
	if err != nil {
		return cache.Volume{}, err
	}
	diff, err := overlay.Commit(b, spec, n.store.DataPath(reserved))
	if err != nil {
		return cache.Volume{}, err
	}
	crashPoint("capture-renamed")
	vol, err := n.store.CommitCapture(view.VolumeID, diff)
	if err != nil {
		return cache.Volume{}, err
	}
	crashPoint("capture-committed")
	n.kick(n.syncer)
	if err := n.store.Trash(spec.Dir); err != nil {
		klog.ErrorS(err, "Trashing a captured step volume's dir", "volumeID", view.VolumeID)
	}
	n.tidy()
	n.goBackground(func() { n.afterCapture(vol) })
	return vol, nil
}

// afterCapture measures a new volume and flattens its chain if it grew past
// the limit. Neither blocks a publish: views use the chain as it is until the
// flat layer replaces it.
func (n *nodeService) afterCapture(vol cache.Volume) {
	if bytes, inodes, err := overlay.Usage(n.store.DataPath(vol)); err != nil {
		klog.ErrorS(err, "Measuring a captured volume", "handle", vol.Handle)
	} else if err := n.store.SetUsage(vol.Handle, bytes, inodes); err != nil {
		klog.ErrorS(err, "Recording a captured volume's size", "handle", vol.Handle)
	}
	chain, err := n.store.Chain(vol.Handle)
	if err != nil || len(chain) <= n.flattenDepth {
		return
	}
	start := time.Now()
	stats, err := n.flatten(vol.Handle, chain)
	if err != nil {
		n.metrics.flattens.WithLabelValues("error").Inc()
		klog.ErrorS(err, "Flattening a deep chain", "handle", vol.Handle, "depth", len(chain))
		return
	}
	n.metrics.flattens.WithLabelValues("ok").Inc()
	klog.InfoS("Flattened a deep chain into a root layer", "handle", vol.Handle, "depth", len(chain),
		"files", stats.Files, "cloned", stats.Cloned, "copied", stats.Copied, "duration", time.Since(start))
}

// flatten copies (reflinking where it can) the merged tree of a chain into a
// new root layer, staged out of sight, then swaps it in with one rename and
// one transaction.
func (n *nodeService) flatten(handle string, chain []string) (overlay.CopyStats, error) {
	work, err := os.MkdirTemp(n.store.StagingDir(), "flatten-")
	if err != nil {
		return overlay.CopyStats{}, err
	}
	defer func() {
		if err := overlay.RemoveTree(work); err != nil {
			klog.ErrorS(err, "Removing flatten staging", "dir", work)
		}
	}()
	tree := filepath.Join(work, "tree")
	stats, err := overlay.CopyLayers(n.bgCtx, n.mounter, chain, filepath.Join(work, "merged"), tree, true)
	if err != nil {
		return stats, err
	}
	// The flat layer replaces synced data: it must be on disk first.
	if err := overlay.SyncFS(tree); err != nil {
		return stats, err
	}
	layer := fmt.Sprintf("f%x", time.Now().UnixNano())
	dst := n.store.LayerPath(handle, layer)
	if err := os.Rename(tree, dst); err != nil {
		return stats, err
	}
	if err := overlay.SyncDir(filepath.Dir(dst)); err != nil {
		return stats, err
	}
	if err := n.store.ReplaceLayer(handle, layer); err != nil {
		return stats, errors.Join(err, overlay.RemoveTree(dst))
	}
	n.tidy()
	return stats, nil
}

func (n *nodeService) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if req.GetVolumePath() == "" {
		return nil, invalid("volume path is required")
	}
	view, err := n.store.GetView(req.GetVolumeId())
	if err != nil {
		return nil, storeError(err)
	}
	if view.Target != req.GetVolumePath() {
		return nil, status.Errorf(codes.NotFound, "volume %q is published at %q, not %q",
			view.VolumeID, view.Target, req.GetVolumePath())
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(view.Target, &fs); err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %q: %v", view.VolumeID, err)
	}
	// Used is what this step volume holds of its own: its upper dir or
	// tree. A read-only view holds nothing of its own.
	var usedBytes, usedInodes int64
	if !view.ReadOnly {
		b, err := n.backendOf(view)
		if err != nil {
			return nil, storeError(err)
		}
		content, _ := b.Content(n.spec(view))
		if usedBytes, usedInodes, err = overlay.Usage(content); err != nil {
			return nil, status.Errorf(codes.Internal, "measuring volume %q: %v", view.VolumeID, err)
		}
	}
	bsize := int64(fs.Bsize)
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(fs.Blocks) * bsize, Available: int64(fs.Bavail) * bsize, Used: usedBytes},
		{Unit: csi.VolumeUsage_INODES, Total: int64(fs.Files), Available: int64(fs.Ffree), Used: usedInodes},
	}}, nil
}
