package driver

import (
	"errors"
	"os"
	"path/filepath"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
)

// recover reconciles what a previous process left, before any RPC is served:
//   - a half-published view is taken down and forgotten (the kubelet will
//     publish it again);
//   - a published view whose target is still mounted is adopted as is, one
//     whose mount went away in this boot is mounted again, one from an
//     earlier boot is left for the kubelet to unpublish (uncaptured);
//   - a capturing view is left for the kubelet's retried unpublish, which
//     completes the capture step by step;
//   - mounts and dirs under the state dir that no view accounts for are
//     removed, and then the store drops half-made volumes and orphan layers.
//
// Nothing a live view pins is touched.
func (n *nodeService) recover() error {
	previousBoot, err := n.store.SwapBoot(n.boot)
	if err != nil {
		return err
	}
	rebooted := previousBoot != "" && previousBoot != n.boot
	views, err := n.store.ListViews()
	if err != nil {
		return err
	}
	var errs []error
	keep := map[string]bool{}
	counts := map[string]int{}
	for _, v := range views {
		switch v.State {
		case cache.ViewPublishing:
			if err := n.discard(v); err != nil {
				errs = append(errs, err)
				keep[n.store.ViewDir(v.VolumeID)] = true
				continue
			}
			counts["dropped"]++
		case cache.ViewPublished:
			keep[n.store.ViewDir(v.VolumeID)] = true
			mounted, err := n.mounter.IsMountPoint(v.Target)
			switch {
			case err != nil:
				errs = append(errs, err)
			case v.Boot != n.boot:
				// Its pod died with the old boot; the kubelet will
				// unpublish it, and it will not be captured.
				counts["fromLastBoot"]++
			case mounted:
				counts["adopted"]++
			case !exists(filepath.Dir(v.Target)):
				// The pod's dir is gone: the kubelet will unpublish.
				counts["orphaned"]++
			default:
				if err := n.ensureMounted(v); err != nil {
					klog.ErrorS(err, "Mounting a step volume again", "volumeID", v.VolumeID)
					counts["orphaned"]++
				} else {
					counts["remounted"]++
				}
			}
		case cache.ViewCapturing:
			keep[n.store.ViewDir(v.VolumeID)] = true
			counts["capturing"]++
		}
	}
	errs = append(errs, n.removeStrays(keep))
	rep, err := n.store.Recover(overlay.RemoveTree, rebooted)
	errs = append(errs, err)
	klog.InfoS("Recovered the state dir", "stateDir", n.store.Dir(), "rebooted", rebooted,
		"viewsFromLastBoot", counts["fromLastBoot"],
		"viewsAdopted", counts["adopted"], "viewsRemounted", counts["remounted"],
		"viewsDropped", counts["dropped"], "viewsCapturing", counts["capturing"], "viewsOrphaned", counts["orphaned"],
		"volumesReady", rep.Ready, "reservationsDropped", rep.DroppedReservations,
		"destroysFinished", rep.FinishedDestroys, "markedFailed", rep.MarkedFailed, "orphansRemoved", rep.RemovedOrphans)
	return errors.Join(errs...)
}

// removeStrays unmounts what a dead process left mounted under the views and
// staging dirs (read-only merges for copies and flattens: a live view's mount
// is at its target, never in there) and trashes view dirs no view owns.
func (n *nodeService) removeStrays(keep map[string]bool) error {
	var errs []error
	for _, dir := range []string{n.store.ViewsDir(), n.store.StagingDir()} {
		mounts, err := overlay.MountsUnder(dir)
		if err != nil {
			return err
		}
		for _, mp := range mounts {
			klog.InfoS("Unmounting a stray mount", "path", mp)
			errs = append(errs, n.mounter.Unmount(mp))
		}
	}
	entries, err := os.ReadDir(n.store.ViewsDir())
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, e := range entries {
		dir := filepath.Join(n.store.ViewsDir(), e.Name())
		if !keep[dir] {
			errs = append(errs, n.store.Trash(dir))
		}
	}
	return errors.Join(errs...)
}

func exists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}
