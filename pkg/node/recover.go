package node

import (
	"errors"
	"os"
	"path/filepath"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/target"
)

// recover reconciles what a previous process left, before any RPC is served:
//   - a ready volume's whole index whose mount is gone (a reboot, a new
//     mount namespace) is mounted again first, before a view is made over
//     it (one that cannot be is failed);
//   - a half-published view an older plugin recorded as publishing is taken
//     down and forgotten (the kubelet will publish it again);
//   - a published view whose target is still mounted is adopted as is, one
//     whose mount went away in this boot is mounted again, one whose tree
//     a crash kept from being built is left for the kubelet's retried
//     publish (or its unpublish, which discards it), one from an earlier
//     boot is left for the kubelet to unpublish (uncaptured);
//   - a capturing view is left for the kubelet's retried unpublish, which
//     completes the capture step by step;
//   - mounts and dirs under the state dir that no view accounts for are
//     removed, and then the store drops half-made volumes and orphan layers.
//
// Nothing a live view pins is touched. A view that cannot be settled is
// quarantined (retried in the background) and anything else that fails is
// logged: one bad entry never keeps the node from serving the rest. Only a
// store that cannot be written stops it.
func (e *Engine) recover() error {
	previousBoot, err := e.store.SwapBoot(e.boot)
	if err != nil {
		return err
	}
	rebooted := previousBoot != "" && previousBoot != e.boot
	remounted := e.indexes.Remount()
	keep := map[string]bool{}
	counts := map[string]int{}
	for _, v := range e.store.ListViews() {
		outcome, err := e.settle(v)
		if err != nil {
			e.quarantine.add(v.VolumeID, err)
			outcome = "quarantined"
		}
		counts[outcome]++
		if outcome != "dropped" {
			keep[e.store.ViewDir(v.VolumeID)] = true
		}
	}
	if err := e.removeStrays(keep); err != nil {
		klog.ErrorS(err, "Removing what dead step volumes left; going on")
	}
	rep, err := e.store.Recover(overlay.RemoveTree, rebooted)
	if err != nil {
		klog.ErrorS(err, "Reconciling cached volumes with the disk; going on with what could be")
	}
	for _, bad := range rep.BadRecords {
		klog.ErrorS(nil, "A metadata record does not decode: it is left alone and never served", "record", bad)
	}
	klog.InfoS("Recovered the state dir", "stateDir", e.store.Dir(), "rebooted", rebooted, "indexesRemounted", remounted,
		"viewsFromLastBoot", counts["fromLastBoot"],
		"viewsAdopted", counts["adopted"], "viewsRemounted", counts["remounted"],
		"viewsDropped", counts["dropped"], "viewsCapturing", counts["capturing"], "viewsOrphaned", counts["orphaned"], "viewsUnbuilt", counts["unbuilt"],
		"viewsQuarantined", counts["quarantined"],
		"volumesReady", rep.Ready, "reservationsDropped", rep.DroppedReservations,
		"volumesDestroying", rep.Destroying, "markedFailed", rep.MarkedFailed, "orphansRemoved", rep.RemovedOrphans,
		"badRecords", len(rep.BadRecords))
	return nil
}

// settle brings one view a previous process left to a state the kubelet can
// work with, saying what it did.
func (e *Engine) settle(v cache.View) (string, error) {
	switch v.State {
	case cache.ViewPublishing:
		return "dropped", e.discard(v, true)
	case cache.ViewCapturing:
		return "capturing", nil
	}
	if v.Boot != e.boot {
		// Its pod died with the old boot; the kubelet will unpublish
		// it, and it will not be captured.
		return "fromLastBoot", nil
	}
	d, err := e.openTarget(v)
	if errors.Is(err, target.ErrGone) {
		return "orphaned", nil // the pod's dir is gone: the kubelet will unpublish
	}
	if err != nil {
		return "", err
	}
	st, err := d.Stat()
	d.Close()
	if err != nil {
		return "", err
	}
	switch {
	case e.ownsMount(v, st):
		if st.MountID != v.MountID || st.Root != v.MountRoot {
			return "adopted", e.ensureMounted(v) // records the mount as this namespace names it
		}
		return "adopted", nil
	case !st.Mounted && !e.built(v):
		return "unbuilt", nil
	}
	return "remounted", e.ensureMounted(v)
}

// removeStrays unmounts what a dead process left mounted under the views and
// staging dirs (read-only merges for copies and flattens: a live view's mount
// is at its target, never in there) and trashes view dirs no view owns.
func (e *Engine) removeStrays(keep map[string]bool) error {
	var errs []error
	for _, dir := range []string{e.store.ViewsDir(), e.store.StagingDir()} {
		mounts, err := overlay.MountsUnder(dir)
		if err != nil {
			return err
		}
		for _, mp := range mounts {
			klog.InfoS("Unmounting a stray mount", "path", mp)
			errs = append(errs, e.mounter.Unmount(mp))
		}
	}
	entries, err := os.ReadDir(e.store.ViewsDir())
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, ent := range entries {
		dir := filepath.Join(e.store.ViewsDir(), ent.Name())
		if !keep[dir] {
			errs = append(errs, e.store.Trash(dir))
		}
	}
	return errors.Join(errs...)
}

// quarantine holds the step volumes recovery could not settle (a target
// that stays busy, a mount that cannot be made again): the node serves
// everything else while they are retried in the background.
type quarantine struct {
	mu    sync.Mutex
	views map[string]string // volume ID → why
}

func (q *quarantine) add(volumeID string, err error) {
	klog.ErrorS(err, "Quarantined a step volume that cannot be settled; retrying it in the background", "volumeID", volumeID)
	q.mu.Lock()
	q.views[volumeID] = err.Error()
	q.mu.Unlock()
}

func (q *quarantine) ids() []string {
	q.mu.Lock()
	defer q.mu.Unlock()
	var out []string
	for id := range q.views {
		out = append(out, id)
	}
	return out
}

func (q *quarantine) size() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.views)
}

func (q *quarantine) release(volumeID string) {
	q.mu.Lock()
	delete(q.views, volumeID)
	q.mu.Unlock()
}

// Quarantined views are retried with exponential backoff.
const (
	quarantineFirstRetry = time.Second
	quarantineMaxRetry   = 2 * time.Minute
)

// retryQuarantined settles quarantined views until none is left or the
// node stops. A view the kubelet settled meanwhile (unpublished) is done.
func (e *Engine) retryQuarantined() {
	wait := quarantineFirstRetry
	for {
		select {
		case <-e.bgCtx.Done():
			return
		case <-time.After(wait):
		}
		for _, id := range e.quarantine.ids() {
			e.retryOne(id)
		}
		if e.quarantine.size() == 0 {
			wait = quarantineFirstRetry
		} else {
			wait = min(2*wait, quarantineMaxRetry)
		}
	}
}

func (e *Engine) retryOne(volumeID string) {
	release, ok := e.inflight.tryLock(volumeID)
	if !ok {
		return // the kubelet is at it
	}
	defer release()
	v, err := e.store.GetView(volumeID)
	if errors.Is(err, cache.ErrNotFound) {
		e.quarantine.release(volumeID)
		return
	}
	if err == nil {
		_, err = e.settle(v)
	}
	if err != nil {
		klog.V(2).InfoS("A quarantined step volume is still unsettled", "volumeID", volumeID, "err", err)
		return
	}
	klog.InfoS("Settled a quarantined step volume", "volumeID", volumeID)
	e.quarantine.release(volumeID)
}
