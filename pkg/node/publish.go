package node

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/target"
	"github.com/concourse/cowvol/pkg/volume"
)

// PublishRequest is a validated request for a step volume.
type PublishRequest struct {
	VolumeID string
	Target   target.Path
	// Source is the cached volume the step volume starts as, if any.
	Source volume.Ref
	// Capture is the handle, in the pod's namespace, to capture into on
	// teardown; Scope and Properties describe the captured volume.
	Capture    string
	Scope      volume.Scope
	Properties map[string]string
	ReadOnly   bool
	Pod        volume.Pod
	// SizeLimit is the limit asked for (bytes; 0: the node's default).
	SizeLimit int64
	// TTL destroys the captured volume that long after its last use.
	TTL time.Duration
	// Copies is how many nodes should hold the captured volume (0: the
	// node's default, Config.Copies).
	Copies int
	// ReadProfile names, in the pod's namespace, the order the step reads
	// its source in: recorded where the source is pulled lazily, and the
	// order the next lazy pull under that name fetches in.
	ReadProfile string
	// OwnedByController: the captured volume belongs to the object that
	// controls the pod, and goes when that object does (recorded in its
	// properties at publish, while the pod surely exists).
	OwnedByController bool
	// Cache names the cache the volume is a view of (Key empty: none):
	// its source is the key's current version, its capture a new one
	// (caches.go); Source, Capture, Scope and Properties are the engine's.
	Cache volume.Cache
}

// Publish makes a step volume and mounts it at its target: a new one, the
// same one again (idempotent, mounting again if its mount went away), or,
// after a publish that failed half-way, a clean retry.
func (e *Engine) Publish(r PublishRequest) error {
	limit, err := e.sizeLimit(r.SizeLimit, r.ReadOnly)
	if err != nil {
		return err
	}
	adopted := false
	if r.Cache.Key != "" {
		if adopted, err = e.forkCache(&r); err != nil {
			return err
		}
	}
	if err := e.refuseIfFull(r); err != nil {
		return err
	}
	if err := e.refuseIfOutOfService(r); err != nil {
		return err
	}
	// Outside the volume's lock: a pull or a capture takes long, and the
	// kubelet's retries must see its progress, not a busy volume.
	if !r.Source.IsZero() {
		source, err := e.awaitCapture(r)
		if err := e.ensureSource(r, source, err); err != nil {
			return err
		}
	}
	userns, err := e.userNamespace(r)
	if err != nil {
		return err
	}
	if r.Properties, err = e.ownerProperties(r); err != nil {
		return err
	}
	release, err := e.lock(r.VolumeID)
	if err != nil {
		return err
	}
	defer release()

	want := cache.View{
		VolumeID: r.VolumeID, Target: r.Target.Full, Source: r.Source, Capture: r.Capture,
		Scope: r.Scope, Properties: r.Properties, ReadOnly: r.ReadOnly, Pod: r.Pod, SizeLimit: limit, TTL: r.TTL,
		Copies: cmp.Or(r.Copies, e.copies), Backend: string(e.backend.Kind()), Boot: e.boot, UserNamespace: userns, Cache: r.Cache,
	}
	if userns && e.idmapBackend != nil {
		want.Backend = string(e.idmapBackend.Kind())
	}
	if r.Capture == "" {
		want.Scope, want.TTL, want.Copies = "", 0, 0
	}
	if old, err := e.store.GetView(want.VolumeID); err == nil && old.State != cache.ViewPublishing {
		return e.republish(old, want)
	} else if err == nil {
		// A publish that failed and could not be cleaned up then: clean
		// up now and start over.
		if err := e.discard(old, true); err != nil {
			return err
		}
	} else if !errors.Is(err, cache.ErrNotFound) {
		return err
	}
	// A new publish only: one already made stands whatever the budget
	// since.
	if err := e.refuseCopies(r); err != nil {
		return err
	}
	start := time.Now()
	view, staged, err := e.record(want)
	if err != nil {
		return err
	}
	if mounted, err := e.prepare(view, staged); err != nil {
		if rerr := e.discard(view, mounted); rerr != nil {
			klog.ErrorS(rerr, "Cleaning up a failed publish", "volumeID", view.VolumeID)
		}
		return err
	}
	e.puller.NoteReader(view, r.ReadProfile)
	if view.Cache.Key != "" {
		e.forked(view, adopted)
	}
	klog.V(2).InfoS("Published step volume", "volumeID", view.VolumeID, "target", view.Target,
		"source", view.Source, "capture", view.Capture, "layers", len(view.Lowers), "readOnly", view.ReadOnly,
		"sizeLimit", view.SizeLimit, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name), "backend", view.Backend,
		"userNamespace", view.UserNamespace, "madeWhileRecording", staged != nil && staged.mount != nil, "duration", time.Since(start))
	return nil
}

// openTarget opens a view's target dir without following symlinks.
func (e *Engine) openTarget(v cache.View) (*target.Dir, error) {
	tp, err := e.layout.Parse(v.Target)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, target.ErrUnsafe)
	}
	return e.layout.Open(tp)
}

// record records a new view as published. Where the view's backend can
// stage it, the view's target is made and its tree and mount (attached
// nowhere) too meanwhile, from the lowers a read of the store gives: the
// transaction commits in a goroutine of its own, waiting on the disk, while
// this one, already running, works the CPU. The staged mount is kept only if
// the record confirms its lowers; otherwise prepare builds and mounts the
// view after its record, as it does for every view of other backends (whose
// staged is nil).
func (e *Engine) record(want cache.View) (cache.View, *staged, error) {
	b, err := e.backendOf(want)
	stager, ok := b.(overlay.Stager)
	if err != nil || !ok {
		view, err := e.store.Publish(want)
		return view, nil, err
	}
	planned := want
	if planned.Lowers, err = e.store.Lowers(want); err != nil {
		return want, nil, err // refused as the transaction would refuse it
	}
	type recorded struct {
		view cache.View
		err  error
	}
	done := make(chan recorded, 1)
	go func() {
		view, err := e.store.Publish(want)
		done <- recorded{view, err}
	}()
	st := e.stage(stager, planned)
	r := <-done
	view, err := r.view, r.err
	if err != nil {
		// Refused after all (its source went meanwhile, say): nothing
		// has seen the mount, the tree or the target.
		st.undo(e.store.ViewDir(want.VolumeID))
		return view, nil, err
	}
	if st.mount != nil && !slices.Equal(view.Lowers, planned.Lowers) {
		st.mount.Close() // the chain changed (flattened): mount the recorded one
		st.mount = nil
	}
	return view, st, nil
}

// staged is what a publish makes before its record is committed.
type staged struct {
	// target is the view's target, made; nil with targetErr.
	target    *target.Dir
	targetErr error
	// mount is the view's mount, attached nowhere; nil: made after the
	// record.
	mount overlay.Detached
}

// stage makes a view's target, and its tree and mount where the backend
// stages them.
func (e *Engine) stage(stager overlay.Stager, v cache.View) *staged {
	st := &staged{}
	mount, err := stager.Stage(e.spec(v, ""), e.trees)
	e.kick(e.planter)
	if err != nil && !errors.Is(err, overlay.ErrNotStaged) {
		klog.V(2).InfoS("Making a step volume's mount before its record failed; it is made after", "volumeID", v.VolumeID, "err", err)
	}
	st.mount = mount
	st.target, st.targetErr = e.makeTarget(v)
	return st
}

// close lets go of what was staged; an attached mount stays.
func (st *staged) close() {
	if st.mount != nil {
		st.mount.Close()
	}
	if st.target != nil {
		st.target.Close()
	}
}

// undo takes back what was staged for a view that was not recorded.
func (st *staged) undo(viewDir string) {
	if st.mount != nil {
		if err := overlay.RemoveTree(viewDir); err != nil {
			klog.ErrorS(err, "Removing the tree of a refused publish; recovery removes it as a stray", "dir", viewDir)
		}
	}
	if st.target != nil {
		if err := st.target.Remove(); err != nil {
			klog.ErrorS(err, "Removing the target of a refused publish")
		}
	}
	st.close()
}

// afterPublish is how long making the next tree waits after a publish took
// one: not to compete for the CPU with the publish still answering.
const afterPublish = 20 * time.Millisecond

// treesAhead is how many empty view trees are kept made ahead: enough for a
// pod's volumes, which the kubelet publishes at once.
const treesAhead = 8

// plantTrees makes view trees ahead until treesAhead are ready.
func (e *Engine) plantTrees() {
	if err := e.trees.Fill(); err != nil {
		klog.ErrorS(err, "Making step volume trees ahead; publishes make their own meanwhile")
	}
}

// makeTarget opens a view's target and makes its dir.
func (e *Engine) makeTarget(v cache.View) (*target.Dir, error) {
	d, err := e.openTarget(v)
	if err != nil {
		return nil, err
	}
	if err := d.Make(); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// prepare mounts a recorded view at its target, attaching what was staged
// or building the view's tree and mounting it, and says whether anything
// may be mounted there when it fails. The view is recorded as published
// before: a crash from here on leaves a view that recovery and the
// kubelet's retries finish (its tree appears whole or not at all), and
// nothing is written to the store after the mount on the publish's path,
// which keeps a publish at one transaction: the mount's ID is recorded
// later, in the background (noteMount).
func (e *Engine) prepare(view cache.View, st *staged) (mounted bool, err error) {
	if st == nil {
		st = &staged{}
		st.target, st.targetErr = e.makeTarget(view)
	}
	defer st.close()
	if st.targetErr != nil {
		return false, st.targetErr
	}
	d := st.target
	cache.CrashPoint("publish-recorded")
	if st.mount != nil {
		err = st.mount.Attach(d.MountPath())
	} else {
		err = e.build(view, d.MountPath())
	}
	if err != nil {
		return false, errors.Join(err, d.Remove())
	}
	cache.CrashPoint("publish-mounted")
	e.noteMount(view, d)
	return true, nil
}

// build builds a recorded view's tree and mounts it at mountPath.
func (e *Engine) build(view cache.View, mountPath string) error {
	b, err := e.backendOf(view)
	if err != nil {
		return err
	}
	return b.Prepare(e.bgCtx, e.spec(view, mountPath))
}

// madeMounts holds the mounts publishes made until the recorder loop
// writes them, many in one transaction, off the publish's path.
type madeMounts struct {
	mu      sync.Mutex
	pending []cache.MadeMount
}

// noteMount queues the mount a publish just made at a view's target for
// recording. Until it is recorded (or if it never is: a crash), ownsMount
// recognises it by what it holds, which costs a read of the mount table.
func (e *Engine) noteMount(view cache.View, d *target.Dir) {
	st, err := d.Stat()
	if err != nil || !st.Mounted {
		return
	}
	e.madeMounts.mu.Lock()
	e.madeMounts.pending = append(e.madeMounts.pending, cache.MadeMount{
		VolumeID: view.VolumeID, Published: view.CreatedAt, MountID: st.MountID, Root: st.Root})
	e.madeMounts.mu.Unlock()
	e.kick(e.recorder)
}

// recordMountsRound records the mounts publishes made since the last round.
func (e *Engine) recordMountsRound() {
	e.madeMounts.mu.Lock()
	made := e.madeMounts.pending
	e.madeMounts.pending = nil
	e.madeMounts.mu.Unlock()
	if len(made) == 0 {
		return
	}
	if err := e.store.RecordMounts(made); err != nil {
		klog.ErrorS(err, "Recording the mounts of published step volumes; they are recognised by what they hold", "volumes", len(made))
	}
}

// built says whether a view's tree was ever built: one that was not (its
// publish failed or was cut short before) holds nothing a step wrote.
func (e *Engine) built(v cache.View) bool {
	b, err := e.backendOf(v)
	return err != nil || overlay.Built(b, e.spec(v, "")) // an unknown backend: let the caller fail with why
}

// recordMount records the mount cowvol just made at the target: only that
// mount is ever unmounted there.
func (e *Engine) recordMount(view cache.View, d *target.Dir) error {
	st, err := d.Stat()
	if err != nil {
		return err
	}
	if !st.Mounted {
		return fmt.Errorf("no mount appeared at %s", view.Target)
	}
	return e.store.SetMounted(view.VolumeID, st.MountID, st.Root)
}

// ownsMount says whether the mount at a view's target is the one cowvol
// made for it: the same mount, or its copy in this mount namespace (the
// plugin's container restarted; mounts it made propagated here with new
// IDs) by its root. A view whose mount is not recorded (yet: a publish
// records it in the background; or an older plugin kept no root) is checked
// against what the mount holds: the view's own tree.
func (e *Engine) ownsMount(v cache.View, st target.State) bool {
	switch {
	case !st.Mounted:
		return false
	case v.MountID != 0 && st.MountID == v.MountID:
		return true
	case v.MountRoot != "":
		return st.Root == v.MountRoot
	}
	b, err := e.backendOf(v)
	return err == nil && overlay.Holds(b, e.spec(v, ""), v.Target, st.Root)
}

// republish answers a repeated publish of a known volume: the same request
// is a success (mounting again if the mount went away), another one is
// refused.
func (e *Engine) republish(old, want cache.View) error {
	same := old.Target == want.Target && old.Source == want.Source && old.Capture == want.Capture &&
		old.ReadOnly == want.ReadOnly && old.Scope == want.Scope && old.SizeLimit == want.SizeLimit &&
		old.TTL == want.TTL && old.Copies == want.Copies && maps.Equal(old.Properties, want.Properties) && old.Cache == want.Cache
	if !same {
		return fmt.Errorf("volume %s: %w", volume.Quote(old.VolumeID), ErrOtherAttributes)
	}
	if old.State == cache.ViewCapturing {
		return fmt.Errorf("volume %s is being captured: %w", volume.Quote(old.VolumeID), cache.ErrWrongViewState)
	}
	return e.ensureMounted(old)
}

// ensureMounted mounts a published view if its mount went away or was never
// made (a crash cut its publish short; its tree is built then). A mount at
// its target that cowvol did not make is refused, never used.
func (e *Engine) ensureMounted(v cache.View) error {
	d, err := e.openTarget(v)
	if err != nil {
		return err
	}
	defer d.Close()
	st, err := d.Stat()
	switch {
	case err != nil:
		return err
	case e.ownsMount(v, st):
		if st.MountID != v.MountID || st.Root != v.MountRoot { // as this namespace names it
			return e.store.SetMounted(v.VolumeID, st.MountID, st.Root)
		}
		return nil
	case st.Mounted:
		return fmt.Errorf("%s is a mount cowvol did not make: %w", v.Target, target.ErrUnsafe)
	}
	if err := d.Make(); err != nil {
		return err
	}
	if err := e.build(v, d.MountPath()); err != nil {
		return errors.Join(err, d.Remove())
	}
	return e.recordMount(v, d)
}

// takeDown unmounts a view from its target and removes the target dir. Only
// the mount cowvol recorded there is unmounted (or, for a view whose publish
// a crash cut short before the record, the one it made: a publish refuses a
// target that is already a mount point). Whatever else is at the target is
// left alone.
func (e *Engine) takeDown(v cache.View) error {
	spec := e.spec(v, "")
	d, err := e.openTarget(v)
	if errors.Is(err, target.ErrGone) {
		return overlay.Unmount(e.mounter, spec) // no target left; private mounts may be
	}
	if err != nil {
		return err
	}
	defer d.Close()
	st, err := d.Stat()
	if errors.Is(err, target.ErrUnsafe) && !st.Mounted {
		klog.InfoS("Leaving what is at a step volume's target: cowvol did not make it", "volumeID", v.VolumeID, "target", v.Target, "err", err)
		return overlay.Unmount(e.mounter, spec)
	}
	if err != nil {
		return err
	}
	if st.Mounted && !e.ownsMount(v, st) {
		return fmt.Errorf("%s is a mount cowvol did not make (mount %d root %s, cowvol's was %d root %s): not unmounting it: %w",
			v.Target, st.MountID, st.Root, v.MountID, v.MountRoot, target.ErrUnsafe)
	}
	if st.Mounted {
		spec.Target = d.MountPath()
	}
	e.puller.Settle() // the answers to its readers let go of the mount
	if err := overlay.Unmount(e.mounter, spec); err != nil {
		return err
	}
	return d.Remove()
}

// discard takes a view down without capturing it and forgets it. A view
// known never to have been mounted at its target (a publish that failed
// before mounting) leaves the target alone: it may not even be safe to open.
func (e *Engine) discard(v cache.View, mayBeMounted bool) error {
	takeDown := e.takeDown
	if !mayBeMounted {
		takeDown = func(v cache.View) error { return overlay.Unmount(e.mounter, e.spec(v, "")) }
	}
	if err := takeDown(v); err != nil {
		return err
	}
	cache.CrashPoint("discard-unmounted")
	if err := e.store.Trash(e.store.ViewDir(v.VolumeID)); err != nil {
		return err
	}
	reserved, err := e.store.DropView(v.VolumeID)
	if err != nil {
		return err
	}
	e.forget(v)
	if reserved != "" {
		err = overlay.RemoveTree(reserved)
	}
	e.tidy()
	e.kick(e.reaper) // what it pinned may be free to go
	return err
}

// forget drops what the node kept about a view that is gone.
func (e *Engine) forget(v cache.View) {
	e.usage.forget(v.VolumeID)
	if v.QuotaID != 0 && e.limiter != nil {
		if err := e.limiter.Release(v.QuotaID); err != nil {
			klog.ErrorS(err, "Releasing a step volume's size limit", "volumeID", v.VolumeID)
		}
	}
}

// Unpublish tears a step volume down from its target: it is captured into
// its handle if it has one (and its node did not reboot under it),
// discarded otherwise. A volume with no record is done, once nothing of
// cowvol's is left at the target.
func (e *Engine) Unpublish(volumeID string, tp target.Path) error {
	release, err := e.lock(volumeID)
	if err != nil {
		return err
	}
	defer release()

	view, err := e.store.GetView(volumeID)
	if errors.Is(err, cache.ErrNotFound) {
		return e.unpublishUnknown(volumeID, tp)
	}
	if err != nil {
		return err
	}
	if view.Target != tp.Full {
		return elsewhere(view, tp.Full)
	}
	start := time.Now()
	cached := view.Cache.Key != "" && view.Capture != ""
	// Why a cache view earned no version: said once its view is gone, so
	// that a teardown the kubelet retries says it once.
	var cacheDiscard string
	if view.Capture != "" && view.Boot != e.boot {
		// The node rebooted under this step: what it wrote may be torn,
		// so it is not captured. The scheduler sees the output missing.
		klog.InfoS("Not capturing a step volume from before a reboot", "volumeID", view.VolumeID,
			"capture", view.Capture, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name))
		if cached {
			cacheDiscard = discardReboot
		} else {
			e.events.Event(view.Pod, EventWarning, "CaptureSkipped", fmt.Sprintf(
				"Not captured into %q: the node rebooted while the step ran, so what it wrote may be incomplete", view.Capture))
		}
		view.Capture = ""
	}
	if view.Capture != "" && view.InputIncomplete && cached {
		cacheDiscard, view.Capture = discardInputIncomplete, ""
	}
	if view.Capture != "" && view.InputIncomplete {
		klog.InfoS("Not capturing a step volume whose input could not be read whole", "volumeID", view.VolumeID,
			"capture", view.Capture, "source", view.Source, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name))
		what := fmt.Sprintf("source volume %q", view.Source.Handle)
		if view.Source.IsZero() {
			what = "an input volume of the step" // this view is its output
		}
		e.events.Event(view.Pod, EventWarning, "CaptureSkipped", fmt.Sprintf(
			"Not captured into %q: %s could not be fetched whole (its pull failed, or the plugin restarted while it was pulled), so the step may have read missing data",
			view.Capture, what))
		view.Capture = ""
	}
	// A view whose tree was never built ran no step: there is nothing to
	// capture (a capturing view's tree may be gone into its layer).
	ranNot := view.State == cache.ViewPublishing || (view.State == cache.ViewPublished && !e.built(view))
	var props map[string]string
	switch {
	case view.Capture == "":
	case ranNot && cached:
		cacheDiscard = discardNotStarted
	case ranNot:
	case view.State == cache.ViewCapturing:
		// Cut short after its verdict: it completes, as it was judged.
		props = e.stepResult(view.Pod)
	case cached:
		if props, cacheDiscard = e.cacheVerdict(view); cacheDiscard != "" {
			view.Capture = ""
		}
	default:
		props = e.stepResult(view.Pod)
	}
	if view.Capture == "" || ranNot {
		if err := e.discard(view, true); err != nil {
			return err
		}
		if cacheDiscard != "" {
			e.discarded(view, cacheDiscard)
		}
		klog.V(2).InfoS("Unpublished step volume", "volumeID", view.VolumeID, "duration", time.Since(start))
		return nil
	}
	vol, promotion, err := e.capture(view, props)
	if err != nil {
		e.metrics.captures.WithLabelValues("error").Inc()
		klog.ErrorS(err, "Capture failed; the kubelet will retry", "volumeID", view.VolumeID, "capture", view.Capture)
		e.events.Event(view.Pod, EventWarning, "CaptureFailed", fmt.Sprintf(
			"Capturing into %q failed (the kubelet retries): %v", view.Capture, err))
		return err
	}
	e.metrics.captures.WithLabelValues("ok").Inc()
	if view.Cache.Key != "" {
		e.promoted(view, vol, promotion, time.Since(start))
		return nil
	}
	e.events.Event(view.Pod, EventNormal, "VolumeCaptured", capturedMessage(vol, time.Since(start)))
	klog.V(2).InfoS("Captured step volume", "volumeID", view.VolumeID, "volume", vol.Ref(),
		"parent", vol.Parent, "base", vol.Base, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name),
		"duration", time.Since(start))
	return nil
}

// unpublishUnknown answers an unpublish of a volume cowvol has no record of
// (already unpublished, or never published): done, as long as nothing of
// cowvol's is left at the target. An empty target dir is removed; a mount
// cowvol did not record is refused, never unmounted; anything else there
// is not cowvol's and is left alone.
func (e *Engine) unpublishUnknown(volumeID string, tp target.Path) error {
	d, err := e.layout.Open(tp)
	switch {
	case errors.Is(err, target.ErrGone):
		return nil
	case errors.Is(err, target.ErrUnsafe):
		// cowvol never follows a symlink: nothing of its can be there.
		klog.V(2).InfoS("Unpublish of an unknown volume: a symlink is on the way to the target", "volumeID", volumeID, "err", err)
		return nil
	case err != nil:
		return err
	}
	defer d.Close()
	st, err := d.Stat()
	switch {
	case errors.Is(err, target.ErrUnsafe):
		klog.V(2).InfoS("Unpublish of an unknown volume: leaving what is at the target", "volumeID", volumeID, "target", tp.Full, "err", err)
	case err != nil:
		return err
	case st.Mounted:
		return fmt.Errorf("volume %s is unknown to cowvol but %s is a mount point (cowvol unmounts only what it mounted): %w",
			volume.Quote(volumeID), tp.Full, ErrNotCowvols)
	case st.Exists && st.Empty:
		return d.Remove()
	}
	return nil
}

func capturedMessage(vol cache.Volume, took time.Duration) string {
	msg := fmt.Sprintf("Captured into cached volume %q", vol.Handle)
	if !vol.Parent.IsZero() {
		msg += fmt.Sprintf(" (a copy-on-write child of %q)", vol.Parent.Handle)
	}
	msg += fmt.Sprintf(" in %s", took.Round(time.Microsecond))
	switch result := volume.StepResult(vol.Properties[volume.PropertyStepResult]); result {
	case "":
	case volume.StepNotStarted:
		msg += "; the step never started, so it holds its source unchanged"
	default:
		msg += "; the step " + string(result)
	}
	return msg
}

// capture commits a view into its reserved handle, with props (how its
// step ended) among its properties; a cache's view is promoted as it
// commits. Each step is idempotent, so a capture cut short (by a crash,
// or a failure) completes when the kubelet calls again.
func (e *Engine) capture(view cache.View, props map[string]string) (cache.Volume, cache.Promoted, error) {
	var promotion cache.Promoted
	if err := e.store.SetViewState(view.VolumeID, cache.ViewPublished, cache.ViewCapturing); err != nil {
		return cache.Volume{}, promotion, err
	}
	b, err := e.backendOf(view)
	if err != nil {
		return cache.Volume{}, promotion, err
	}
	if err := e.takeDown(view); err != nil {
		return cache.Volume{}, promotion, err
	}
	cache.CrashPoint("capture-unmounted")
	reserved, err := e.store.CaptureTarget(view)
	if err != nil {
		return cache.Volume{}, promotion, err
	}
	spec := e.spec(view, "")
	layer := e.store.DataPath(reserved)
	diff, err := overlay.Commit(b, spec, layer)
	if err != nil {
		return cache.Volume{}, promotion, err
	}
	cache.CrashPoint("capture-renamed")
	sealed, err := overlay.Seal(layer, e.allowSetuid)
	if err != nil {
		return cache.Volume{}, promotion, err
	}
	if sealed.Cleared > 0 || sealed.Removed > 0 {
		klog.InfoS("Made a captured layer safe for other steps", "volumeID", view.VolumeID, "capture", view.Capture,
			"setuidOrCapsCleared", sealed.Cleared, "deviceNodesRemoved", sealed.Removed)
	}
	captured := cache.Captured{Diff: diff, Bytes: sealed.Bytes, Inodes: sealed.Inodes, Properties: props}
	var vol cache.Volume
	if view.Cache.Key != "" {
		cache.CrashPoint("cache-captured")
		vol, promotion, err = e.store.CommitCacheVersion(view.VolumeID, captured,
			cache.Promotion{Key: view.Cache.Key, By: view.Pod.Name, MaxBytes: view.Cache.MaxBytes})
		if err == nil {
			cache.CrashPoint("cache-promoted")
		}
	} else {
		vol, err = e.store.CommitCapture(view.VolumeID, captured)
	}
	if err != nil {
		return cache.Volume{}, promotion, err
	}
	cache.CrashPoint("capture-committed")
	e.kick(e.syncer)
	e.forget(view)
	if err := e.store.Trash(spec.Dir); err != nil {
		klog.ErrorS(err, "Trashing a captured step volume's dir", "volumeID", view.VolumeID)
	}
	e.tidy()
	e.kick(e.reaper)
	if promotion.Refused == "" { // a refused version is destroyed
		e.goBackground(func() { e.afterCapture(vol, true) })
	}
	return vol, promotion, nil
}

// sumLayer computes and keeps a new volume's layer's file sums while its
// bytes are still those its step wrote: what every byte of it a peer sends
// is checked against, so that rot on this node's disk later is caught, not
// spread. Off the capture's path (it reads every byte: about 1.5 GB/s of
// SHA-256 a core here), one layer at a time; a peer that asks first has
// them computed then. The layer is not held for it: a volume destroyed
// meanwhile goes at once, and its sums with its dir.
//
// Where this node is the volume's origin (a capture, an upload), it then
// vouches for the volume with the digests of its files (vouch), which the
// fleet checks every other holder's copy against; a pulled copy keeps
// those its pull was checked against instead. It fails only the vouching.
func (e *Engine) sumLayer(vol cache.Volume, origin bool) error {
	select {
	case e.summing <- struct{}{}:
		defer func() { <-e.summing }()
	case <-e.bgCtx.Done():
		return nil
	}
	v, err := e.store.Get(vol.Ref())
	if err != nil || v.State != volume.StateReady || v.Layer != vol.Layer {
		return nil // gone, or flattened meanwhile: the new layer's are computed when asked
	}
	own, err := e.store.LayerSums(v)
	if err != nil {
		klog.V(2).InfoS("Computing a captured layer's file sums failed; a peer's first pull computes them", "volume", vol.Ref(), "err", err)
		return nil
	}
	if origin && !v.Vouch.Known() {
		err = e.vouch(v, own)
	}
	e.keepStubs(v, own)
	return err
}

// How often, and how long, a volume captured over a base still arriving
// lazily is tried again for its digests (the merged view's tables need
// the base's data).
const (
	vouchRetry    = 5 * time.Second
	vouchPatience = 2 * time.Hour
)

// vouchLater tries sumLayer again until the volume's base is whole.
func (e *Engine) vouchLater(vol cache.Volume) {
	for since := time.Now(); time.Since(since) < vouchPatience; {
		select {
		case <-time.After(vouchRetry):
		case <-e.bgCtx.Done():
			return
		}
		if err := e.sumLayer(vol, true); !errors.Is(err, cache.ErrNotReady) {
			e.vouchFailed(vol, err)
			return
		}
	}
	klog.ErrorS(nil, "A captured volume's base did not arrive whole in time to vouch for it; peers pull it unvouched", "volume", vol.Ref(), "waited", vouchPatience)
}

func (e *Engine) vouchFailed(vol cache.Volume, err error) {
	if err != nil {
		klog.ErrorS(err, "Computing the digests this node vouches for a captured volume with; peers pull it unvouched", "volume", vol.Ref())
	}
}

// vouch computes and keeps the digests of a volume this node made, own
// being its layer's table: of the layer over its base, and of the merged
// view of its chain, from the tables of the chain's layers and the names
// of those above the lowest (no data is read again).
func (e *Engine) vouch(vol cache.Volume, own *filesum.Table) error {
	files := own.Digest()
	d := volume.Digests{Layer: cache.LayerDigest(vol.Base, files), View: volume.Digest(files), FirstHand: true}
	if !vol.Base.IsZero() {
		refs, dirs, release, err := e.holdChain(vol.Ref(), volume.NeedWhole)
		if err != nil {
			return err
		}
		defer release()
		if refs[0] != vol.Ref() || dirs[0] != e.store.DataPath(vol) || len(refs) < 2 {
			return fmt.Errorf("its chain changed meanwhile: %w", cache.ErrUnusable)
		}
		tables := []*filesum.Table{own}
		for i, r := range refs[1:] {
			// The layer the chain was read with: a flatten of r since
			// made another, and the names walked are this one's.
			t, err := e.store.LayerSumsAt(r, dirs[i+1])
			if err != nil {
				return fmt.Errorf("volume %s under it: %w", r, err)
			}
			tables = append(tables, t)
		}
		view, err := overlay.VisibleFiles(e.bgCtx, dirs, tables)
		if err != nil {
			return err
		}
		d.View = volume.Digest(view.Digest())
	}
	return e.store.Vouch(vol.Ref(), vol.Layer, d)
}

// afterCapture vouches for a volume this node made (origin: a capture or
// an upload, not a pull), then flattens its chain if it grew past the
// limit, without blocking a publish: views use the chain as it is until
// the flat layer replaces it.
func (e *Engine) afterCapture(vol cache.Volume, origin bool) {
	if err := e.sumLayer(vol, origin); errors.Is(err, cache.ErrNotReady) {
		e.goBackground(func() { e.vouchLater(vol) }) // (nor can it be flattened yet)
	} else {
		e.vouchFailed(vol, err)
	}
	if vol.Hidden() {
		return // pulled only as the base of what stacks on it: no view is made of it
	}
	chain, err := e.store.Chain(vol.Ref())
	if err != nil {
		klog.ErrorS(err, "Reading a captured volume's chain", "volume", vol.Ref())
		return
	}
	if len(chain) <= e.flattenDepth {
		return
	}
	// Held while it is copied: a flatten of an ancestor finishing
	// meanwhile must not prune the layers this one reads.
	_, chain, release, err := e.holdChain(vol.Ref(), volume.NeedWhole)
	if err != nil {
		klog.ErrorS(err, "Holding a captured volume's chain", "volume", vol.Ref())
		return
	}
	defer release()
	start := time.Now()
	stats, err := e.flatten(vol.Ref(), chain)
	if err != nil {
		e.metrics.flattens.WithLabelValues("error").Inc()
		klog.ErrorS(err, "Flattening a deep chain", "volume", vol.Ref(), "depth", len(chain))
		return
	}
	e.metrics.flattens.WithLabelValues("ok").Inc()
	klog.InfoS("Flattened a deep chain into a root layer", "volume", vol.Ref(), "depth", len(chain),
		"files", stats.Files, "cloned", stats.Cloned, "copied", stats.Copied, "duration", time.Since(start))
}

// flatten copies (reflinking where it can) the merged tree of a chain into a
// new root layer, staged out of sight, then swaps it in with one rename and
// one transaction.
func (e *Engine) flatten(r volume.Ref, chain []string) (overlay.CopyStats, error) {
	work, err := os.MkdirTemp(e.store.StagingDir(), "flatten-")
	if err != nil {
		return overlay.CopyStats{}, err
	}
	defer func() {
		if err := overlay.RemoveTree(work); err != nil {
			klog.ErrorS(err, "Removing flatten staging", "dir", work)
		}
	}()
	tree := filepath.Join(work, "tree")
	stats, err := overlay.CopyLayers(e.bgCtx, e.mounter, chain, filepath.Join(work, "merged"), tree, true)
	if err != nil {
		return stats, err
	}
	// The flat layer replaces synced data: it must be on disk first.
	if err := overlay.SyncFS(tree); err != nil {
		return stats, err
	}
	layer := cache.NewLayerName(cache.LayerFlattened, time.Now())
	dst := e.store.LayerPath(r, layer)
	if err := os.Rename(tree, dst); err != nil {
		return stats, err
	}
	if err := overlay.Sync(filepath.Dir(dst)); err != nil {
		return stats, err
	}
	if err := e.store.ReplaceLayer(r, layer); err != nil {
		return stats, errors.Join(err, overlay.RemoveTree(dst))
	}
	e.tidy()
	return stats, nil
}
