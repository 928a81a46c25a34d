package driver

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/target"
	"github.com/concourse/cowvol/pkg/volume"
)

// parseTarget checks a target path: absolute, clean, and of the kubelet's
// inline-volume layout.
func (n *nodeService) parseTarget(p string) (target.Path, error) {
	if err := validatePath("target path", p); err != nil {
		return target.Path{}, err
	}
	tp, err := n.layout.Parse(p)
	if err != nil {
		return tp, invalid("%v", err)
	}
	return tp, nil
}

func (n *nodeService) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	tp, err := n.parseTarget(req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	capReadOnly, err := validateCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	if problem := n.csiDriver.problem(); problem != "" {
		return nil, status.Errorf(codes.FailedPrecondition, "refusing to publish: %s", problem)
	}
	vr, err := parseVolumeContext(req.GetVolumeContext())
	if err != nil {
		return nil, err
	}
	if tp.PodUID != vr.Pod.UID {
		return nil, invalid("target path %s is not a volume of pod %s", volume.Quote(tp.Full), vr.Pod.UID)
	}
	vr.ReadOnly = req.GetReadonly() || capReadOnly
	if vr.ReadOnly && vr.Capture != "" {
		return nil, invalid("a read-only volume cannot be captured: drop capture or readOnly")
	}
	limit, err := n.sizeLimit(vr)
	if err != nil {
		return nil, err
	}
	release, err := n.lock(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()

	want := cache.View{
		VolumeID: req.GetVolumeId(), Target: tp.Full, Source: vr.Source, Capture: vr.Capture,
		Scope: vr.Scope, Properties: vr.Properties, ReadOnly: vr.ReadOnly, Pod: vr.Pod, SizeLimit: limit,
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
		if err := n.discard(old, true); err != nil {
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
	if mounted, err := n.prepare(view); err != nil {
		if rerr := n.discard(view, mounted); rerr != nil {
			klog.ErrorS(rerr, "Cleaning up a failed publish", "volumeID", view.VolumeID)
		}
		return nil, storeError(err)
	}
	klog.V(2).InfoS("Published step volume", "volumeID", view.VolumeID, "target", view.Target,
		"source", view.Source, "capture", view.Capture, "layers", len(view.Lowers), "readOnly", view.ReadOnly,
		"sizeLimit", view.SizeLimit, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name), "backend", view.Backend,
		"duration", time.Since(start))
	return &csi.NodePublishVolumeResponse{}, nil
}

// openTarget opens a view's target dir without following symlinks.
func (n *nodeService) openTarget(v cache.View) (*target.Dir, error) {
	tp, err := n.layout.Parse(v.Target)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, target.ErrUnsafe)
	}
	return n.layout.Open(tp)
}

// prepare makes the view's tree and mounts it at the target, saying whether
// anything may be mounted there when it fails.
func (n *nodeService) prepare(view cache.View) (mounted bool, err error) {
	d, err := n.openTarget(view)
	if err != nil {
		return false, err
	}
	defer d.Close()
	if err := d.Make(); err != nil {
		return false, err
	}
	crashPoint("publish-recorded")
	if err := n.backend.Prepare(n.bgCtx, n.spec(view, d.MountPath())); err != nil {
		return false, errors.Join(err, d.Remove())
	}
	crashPoint("publish-mounted")
	return true, n.recordMount(view, d)
}

// recordMount records the mount cowvol just made at the target: only that
// mount is ever unmounted there.
func (n *nodeService) recordMount(view cache.View, d *target.Dir) error {
	st, err := d.Stat()
	if err != nil {
		return err
	}
	if !st.Mounted {
		return fmt.Errorf("no mount appeared at %s", view.Target)
	}
	return n.store.SetMounted(view.VolumeID, st.MountID)
}

// republish answers a repeated publish of a known volume: the same request
// is a success (mounting again if the mount went away), another one is
// refused.
func (n *nodeService) republish(old, want cache.View) (*csi.NodePublishVolumeResponse, error) {
	same := old.Target == want.Target && old.Source == want.Source && old.Capture == want.Capture &&
		old.ReadOnly == want.ReadOnly && old.Scope == want.Scope && old.SizeLimit == want.SizeLimit &&
		maps.Equal(old.Properties, want.Properties)
	if !same {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s is already published with other attributes", volume.Quote(old.VolumeID))
	}
	if old.State == cache.ViewCapturing {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is being captured", volume.Quote(old.VolumeID))
	}
	if err := n.ensureMounted(old); err != nil {
		return nil, storeError(err)
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// ensureMounted mounts a published view again if its mount went away. A
// mount at its target that cowvol did not make is refused, never used.
func (n *nodeService) ensureMounted(v cache.View) error {
	d, err := n.openTarget(v)
	if err != nil {
		return err
	}
	defer d.Close()
	st, err := d.Stat()
	switch {
	case err != nil:
		return err
	case st.Mounted && (st.MountID == v.MountID || v.MountID == 0):
		if v.MountID == 0 { // recorded by a plugin that kept no mount IDs
			return n.store.SetMounted(v.VolumeID, st.MountID)
		}
		return nil
	case st.Mounted:
		return fmt.Errorf("%s is a mount cowvol did not make: %w", v.Target, target.ErrUnsafe)
	}
	b, err := n.backendOf(v)
	if err != nil {
		return err
	}
	if err := d.Make(); err != nil {
		return err
	}
	if err := b.Remount(n.spec(v, d.MountPath())); err != nil {
		return err
	}
	return n.recordMount(v, d)
}

// takeDown unmounts a view from its target and removes the target dir. Only
// the mount cowvol recorded there is unmounted (or, for a view whose publish
// a crash cut short before the record, the one it made: a publish refuses a
// target that is already a mount point). Whatever else is at the target is
// left alone.
func (n *nodeService) takeDown(v cache.View) error {
	spec := n.spec(v, "")
	d, err := n.openTarget(v)
	if errors.Is(err, target.ErrGone) {
		return overlay.Unmount(n.mounter, spec) // no target left; private mounts may be
	}
	if err != nil {
		return err
	}
	defer d.Close()
	st, err := d.Stat()
	if errors.Is(err, target.ErrUnsafe) && !st.Mounted {
		klog.InfoS("Leaving what is at a step volume's target: cowvol did not make it", "volumeID", v.VolumeID, "target", v.Target, "err", err)
		return overlay.Unmount(n.mounter, spec)
	}
	if err != nil {
		return err
	}
	if st.Mounted && v.MountID != 0 && st.MountID != v.MountID {
		return fmt.Errorf("%s is a mount cowvol did not make (mount %d, cowvol's was %d): not unmounting it: %w",
			v.Target, st.MountID, v.MountID, target.ErrUnsafe)
	}
	if st.Mounted {
		spec.Target = d.MountPath()
	}
	if err := overlay.Unmount(n.mounter, spec); err != nil {
		return err
	}
	return d.Remove()
}

// discard takes a view down without capturing it and forgets it. A view
// known never to have been mounted at its target (a publish that failed
// before mounting) leaves the target alone: it may not even be safe to open.
func (n *nodeService) discard(v cache.View, mayBeMounted bool) error {
	takeDown := n.takeDown
	if !mayBeMounted {
		takeDown = func(v cache.View) error { return overlay.Unmount(n.mounter, n.spec(v, "")) }
	}
	if err := takeDown(v); err != nil {
		return err
	}
	crashPoint("discard-unmounted")
	if err := n.store.Trash(n.store.ViewDir(v.VolumeID)); err != nil {
		return err
	}
	reserved, err := n.store.DropView(v.VolumeID)
	if err != nil {
		return err
	}
	n.forget(v)
	if reserved != "" {
		err = overlay.RemoveTree(reserved)
	}
	n.tidy()
	return err
}

// forget drops what the node kept about a view that is gone.
func (n *nodeService) forget(v cache.View) {
	n.usage.forget(v.VolumeID)
	if v.QuotaID != 0 && n.limiter != nil {
		if err := n.limiter.Release(v.QuotaID); err != nil {
			klog.ErrorS(err, "Releasing a step volume's size limit", "volumeID", v.VolumeID)
		}
	}
}

func (n *nodeService) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	tp, err := n.parseTarget(req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	release, err := n.lock(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()

	view, err := n.store.GetView(req.GetVolumeId())
	if errors.Is(err, cache.ErrNotFound) {
		return n.unpublishUnknown(req.GetVolumeId(), tp)
	}
	if err != nil {
		return nil, storeError(err)
	}
	if view.Target != tp.Full {
		return nil, elsewhere(view, tp.Full)
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
		if err := n.discard(view, true); err != nil {
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
	klog.V(2).InfoS("Captured step volume", "volumeID", view.VolumeID, "volume", vol.Ref(),
		"parent", vol.Parent, "base", vol.Base, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name),
		"duration", time.Since(start))
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// unpublishUnknown answers an unpublish of a volume cowvol has no record of
// (already unpublished, or never published): done, as long as nothing of
// cowvol's is left at the target. An empty target dir is removed; a mount
// cowvol did not record is refused, never unmounted; anything else there
// is not cowvol's and is left alone.
func (n *nodeService) unpublishUnknown(volumeID string, tp target.Path) (*csi.NodeUnpublishVolumeResponse, error) {
	d, err := n.layout.Open(tp)
	switch {
	case errors.Is(err, target.ErrGone):
		return &csi.NodeUnpublishVolumeResponse{}, nil
	case errors.Is(err, target.ErrUnsafe):
		// cowvol never follows a symlink: nothing of its can be there.
		klog.V(2).InfoS("Unpublish of an unknown volume: a symlink is on the way to the target", "volumeID", volumeID, "err", err)
		return &csi.NodeUnpublishVolumeResponse{}, nil
	case err != nil:
		return nil, storeError(err)
	}
	defer d.Close()
	st, err := d.Stat()
	switch {
	case errors.Is(err, target.ErrUnsafe):
		klog.V(2).InfoS("Unpublish of an unknown volume: leaving what is at the target", "volumeID", volumeID, "target", tp.Full, "err", err)
	case err != nil:
		return nil, storeError(err)
	case st.Mounted:
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is unknown to cowvol but %s is a mount point: cowvol unmounts only what it mounted", volume.Quote(volumeID), tp.Full)
	case st.Exists && st.Empty:
		if err := d.Remove(); err != nil {
			return nil, storeError(err)
		}
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func capturedMessage(vol cache.Volume, took time.Duration) string {
	msg := fmt.Sprintf("Captured into cached volume %q", vol.Handle)
	if !vol.Parent.IsZero() {
		msg += fmt.Sprintf(" (a copy-on-write child of %q)", vol.Parent.Handle)
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
	b, err := n.backendOf(view)
	if err != nil {
		return cache.Volume{}, err
	}
	if err := n.takeDown(view); err != nil {
		return cache.Volume{}, err
	}
	crashPoint("capture-unmounted")
	reserved, err := n.store.CaptureTarget(view)
	if err != nil {
		return cache.Volume{}, err
	}
	spec := n.spec(view, "")
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
	n.forget(view)
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
		klog.ErrorS(err, "Measuring a captured volume", "volume", vol.Ref())
	} else if err := n.store.SetUsage(vol.Ref(), bytes, inodes); err != nil {
		klog.ErrorS(err, "Recording a captured volume's size", "volume", vol.Ref())
	}
	chain, err := n.store.Chain(vol.Ref())
	if err != nil {
		klog.ErrorS(err, "Reading a captured volume's chain", "volume", vol.Ref())
		return
	}
	if len(chain) <= n.flattenDepth {
		return
	}
	start := time.Now()
	stats, err := n.flatten(vol.Ref(), chain)
	if err != nil {
		n.metrics.flattens.WithLabelValues("error").Inc()
		klog.ErrorS(err, "Flattening a deep chain", "volume", vol.Ref(), "depth", len(chain))
		return
	}
	n.metrics.flattens.WithLabelValues("ok").Inc()
	klog.InfoS("Flattened a deep chain into a root layer", "volume", vol.Ref(), "depth", len(chain),
		"files", stats.Files, "cloned", stats.Cloned, "copied", stats.Copied, "duration", time.Since(start))
}

// flattenedLayerPrefix starts the names of root layers flattening makes.
const flattenedLayerPrefix = "f"

// flatten copies (reflinking where it can) the merged tree of a chain into a
// new root layer, staged out of sight, then swaps it in with one rename and
// one transaction.
func (n *nodeService) flatten(r volume.Ref, chain []string) (overlay.CopyStats, error) {
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
	layer := fmt.Sprintf("%s%x", flattenedLayerPrefix, time.Now().UnixNano())
	dst := n.store.LayerPath(r, layer)
	if err := os.Rename(tree, dst); err != nil {
		return stats, err
	}
	if err := overlay.SyncDir(filepath.Dir(dst)); err != nil {
		return stats, err
	}
	if err := n.store.ReplaceLayer(r, layer); err != nil {
		return stats, errors.Join(err, overlay.RemoveTree(dst))
	}
	n.tidy()
	return stats, nil
}
