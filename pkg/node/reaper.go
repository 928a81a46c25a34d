package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/volume"
)

// The reaper frees destroyed volumes' data once nothing holds it, at most
// reapParallelism at a time (a hung delete never wedges the rest), and
// looks at failed volumes, TTLs and the disk every reapInterval, and
// whenever something may have changed.
const (
	reapParallelism = 3
	reapInterval    = 10 * time.Second
)

// Destroy hides volumes at once (NotFound to new publishes) and frees their
// data in the background as soon as nothing holds it. It never blocks on
// the deletion, and a volume already gone counts as destroyed. Destroying
// a cache key's current version clears the key (ClearCache): the next step
// starts empty, not from an older version, and no step running now is
// promoted (how kubectl cowvol caches clear reaches every node).
func (e *Engine) Destroy(refs ...volume.Ref) error {
	var errs []error
	for _, r := range refs {
		key := e.currentVersionOf(r)
		if err := e.store.Destroy(r); err != nil {
			errs = append(errs, err)
			continue
		}
		klog.V(2).InfoS("Destroyed a cached volume; its data goes once nothing holds it", "volume", r)
		if key != "" {
			if _, err := e.ClearCache(r.Namespace, key); err != nil {
				errs = append(errs, err)
			}
		}
	}
	e.kick(e.reaper)
	return errors.Join(errs...)
}

// DestroyIfOwned destroys a volume if its record names the owner whose UID
// is ownerUID (captured with owner: controller), saying whether it did. The
// controller's owner sweep asks, on the word of whichever node reported
// the volume last; this node's own record confirms that word or not. A
// volume pinned here since the sweep read the view is kept, as the sweep
// keeps one pinned before.
func (e *Engine) DestroyIfOwned(r volume.Ref, ownerUID string) (bool, error) {
	v, err := e.store.Get(r)
	switch {
	case errors.Is(err, cache.ErrNotFound):
		return false, nil
	case err != nil:
		return false, err
	}
	if o, ok := volume.OwnerOf(v.Properties); !ok || o.UID != ownerUID || v.Pin.Active(time.Now()) {
		return false, nil
	}
	return true, e.Destroy(r)
}

// Pin protects a volume from TTL expiry and eviction, until until (zero:
// for good). Idempotent.
func (e *Engine) Pin(r volume.Ref, until time.Time) (VolumeInfo, error) {
	return e.setPin(r, true, until)
}

// Unpin lifts a volume's pin. Idempotent.
func (e *Engine) Unpin(r volume.Ref) (VolumeInfo, error) {
	info, err := e.setPin(r, false, time.Time{})
	if err == nil {
		e.kick(e.reaper)
	}
	return info, err
}

// setPin pins or unpins a volume, answering the record the change left:
// read again, it could already be destroyed by the reaper the unpin
// wakes (in CI, an unpin that had worked answered NotFound so).
func (e *Engine) setPin(r volume.Ref, pinned bool, until time.Time) (VolumeInfo, error) {
	v, err := e.store.SetPin(r, pinned, until)
	if err != nil {
		return VolumeInfo{}, err
	}
	return VolumeInfo{Volume: v, Holders: e.store.Holders(r)}, nil
}

// reapRound does the reaper's work once: failed and expired volumes are
// destroyed, the disk is brought under its low watermark if it went over
// its high one, and destroyed volumes nothing holds are freed.
func (e *Engine) reapRound() {
	e.reaping.Lock() // one round at a time: two would evict twice
	defer e.reaping.Unlock()
	now := time.Now()
	// Read before the scans: a change made during them makes the next
	// tick scan again.
	rev := e.store.Revision()
	failed, expired, next := e.store.Due(now)
	for _, v := range failed {
		e.destroyFor(cache.DueFailed, v, now)
	}
	for _, v := range expired {
		e.destroyFor(cache.DueTTL, v, now)
	}
	e.relievePressure(now)
	left := e.freeReapable()
	e.swept = sweep{revision: rev, nextExpiry: next, leftToFree: left, at: now}
}

// sweep is what the reaper's last full round left: the store's revision
// when it scanned, when a TTL may next run out, and whether data it could
// not free waits for another try.
type sweep struct {
	revision   uint64
	nextExpiry time.Time
	leftToFree bool
	at         time.Time
}

// rescanEvery bounds how long ticks may go without a full round, however
// idle the node.
const rescanEvery = 5 * time.Minute

// reapTick is the reaper's periodic round. On an idle node (the store as
// the last full round scanned it, nothing left to free, no TTL running out)
// it only watches the disk: a round's scans read every volume's record,
// which on a node of 10,000 volumes is most of what an idle node would do.
func (e *Engine) reapTick() {
	now := time.Now()
	e.reaping.Lock()
	sw := e.swept
	idle := !sw.at.IsZero() && !sw.leftToFree && now.Sub(sw.at) < rescanEvery &&
		(sw.nextExpiry.IsZero() || now.Before(sw.nextExpiry)) && e.store.Revision() == sw.revision
	if idle {
		e.relievePressure(now)
	}
	e.reaping.Unlock()
	if !idle {
		e.reapRound()
	}
}

// destroyFor destroys v, which a scan at now found due for why, if it
// still is, and says whether it did.
func (e *Engine) destroyFor(why cache.Due, v cache.Volume, now time.Time) bool {
	destroyed, err := e.store.DestroyDue(v, why, now)
	if err != nil {
		klog.ErrorS(err, "Destroying a cached volume", "volume", v.Ref(), "reason", why)
		return false
	}
	if !destroyed {
		klog.V(2).InfoS("Not destroying a cached volume: pinned, used or changed since the scan", "volume", v.Ref(), "reason", why)
		return false
	}
	e.metrics.evictions.WithLabelValues(string(why)).Inc()
	klog.InfoS("Destroying a cached volume", "volume", v.Ref(), "reason", why)
	return true
}

// freeReapable deletes the data of every destroyed volume nothing holds,
// children before the bases they free, and says whether some is left for
// the next tick: a delete failed, or a destroyed volume waits only on a
// stream or a fill, whose end wakes the reaper but may come just after a
// round woken for something else looked (and a tick on an idle node looks
// at nothing).
func (e *Engine) freeReapable() (left bool) {
	for {
		doomed := e.store.Reapable()
		if len(doomed) == 0 || e.bgCtx.Err() != nil {
			return len(doomed) > 0 || e.store.WaitingOnLiveHolds()
		}
		g := errgroup.Group{}
		g.SetLimit(reapParallelism)
		var mu sync.Mutex
		progress := false
		for _, v := range doomed {
			g.Go(func() error {
				err := e.store.Reap(v.Ref(), overlay.RemoveTree)
				if err != nil {
					e.metrics.destroys.WithLabelValues("error").Inc()
					klog.ErrorS(err, "Freeing a destroyed volume's data; retrying later", "volume", v.Ref())
					return nil
				}
				e.puller.Release(v.Ref())
				e.metrics.destroys.WithLabelValues("ok").Inc()
				if v.SizeBytes > 0 {
					e.metrics.reclaimed.Add(float64(v.SizeBytes))
				}
				mu.Lock()
				progress = true
				mu.Unlock()
				return nil
			})
		}
		_ = g.Wait()
		if !progress {
			return true
		}
	}
}

// Watermarks are the disk pressure policy, in percent of the state dir's
// filesystem bytes and inodes, whichever is fuller. Grace spares a volume
// used (captured, pulled, mounted) more recently than that: a step's
// output is there for the next step of its build, or for its scheduler to
// pin, however full the disk, and the node refuses captures meanwhile
// rather than destroy what was just made.
type Watermarks struct {
	High, Low int
	Grace     time.Duration
}

// pressure is the state dir's filesystem's fill, and whether the node is
// refusing new data because it is over its high watermark.
type pressure struct {
	mu        sync.Mutex
	over      bool
	usedPct   int
	cause     string
	lastCheck time.Time
}

// diskFill is how full the filesystem under dir is, in percent (bytes or
// inodes, whichever is fuller), with what it amounts to.
type diskFill struct {
	pct                     int
	usedBytes, totalBytes   int64
	usedInodes, totalInodes int64
	freeBytes, freeInodes   int64
}

func measureDisk(dir string) (diskFill, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return diskFill{}, err
	}
	d := diskFill{
		totalBytes: int64(fs.Blocks) * int64(fs.Bsize), freeBytes: int64(fs.Bavail) * int64(fs.Bsize),
		totalInodes: int64(fs.Files), freeInodes: int64(fs.Ffree),
	}
	d.usedBytes = d.totalBytes - int64(fs.Bfree)*int64(fs.Bsize)
	d.usedInodes = d.totalInodes - d.freeInodes
	pct := func(used, total int64) int {
		if total <= 0 {
			return 0
		}
		return int((100*used + total - 1) / total)
	}
	d.pct = max(pct(d.usedBytes, d.totalBytes), pct(d.usedInodes, d.totalInodes))
	return d, nil
}

// relievePressure evicts unpinned, unused cached volumes, least recently
// used first (leaves before the bases they sit on), once the disk is over
// its high watermark, until it is under its low one; then it says whether
// the node is still over.
func (e *Engine) relievePressure(now time.Time) {
	d, err := measureDisk(e.store.Dir())
	if err != nil {
		klog.ErrorS(err, "Measuring the state dir's filesystem")
		return
	}
	e.metrics.setDisk(d)
	if d.pct >= e.watermarks.High {
		// Freed space shows late on some filesystems (btrfs deletes
		// subvolumes in the background): count what each eviction frees
		// from its measured size, and stop once that brings the disk
		// under the low mark.
		needBytes := d.usedBytes - d.totalBytes*int64(e.watermarks.Low)/100
		needInodes := d.usedInodes - d.totalInodes*int64(e.watermarks.Low)/100
		// Candidates are listed once per batch (a scan of the store), not
		// once per eviction; a batch done, the bases it freed are next.
		for needBytes > 0 || needInodes > 0 {
			cands := slices.DeleteFunc(e.store.Candidates(now), func(v cache.Volume) bool {
				return now.Sub(v.LastUsed) < e.watermarks.Grace
			})
			destroyed := false
			for _, v := range cands {
				if needBytes <= 0 && needInodes <= 0 {
					break
				}
				if !e.destroyFor(cache.DueWatermark, v, now) {
					continue
				}
				destroyed = true
				if err := e.store.Reap(v.Ref(), overlay.RemoveTree); err != nil {
					klog.ErrorS(err, "Freeing an evicted volume's data", "volume", v.Ref())
					continue
				}
				needBytes -= max(v.SizeBytes, 0)
				needInodes -= max(v.Inodes, 0)
				e.metrics.destroys.WithLabelValues("ok").Inc()
				e.metrics.reclaimed.Add(float64(max(v.SizeBytes, 0)))
			}
			if !destroyed { // none left, or none still evictable: the next round looks again
				break
			}
		}
		if d, err = measureDisk(e.store.Dir()); err != nil {
			return
		}
		e.metrics.setDisk(d)
	}
	e.setPressure(d)
}

// setPressure records whether the disk is over its high watermark, and
// tells the node's people when that changes.
func (e *Engine) setPressure(d diskFill) {
	e.pressure.mu.Lock()
	was := e.pressure.over
	e.pressure.over = d.pct >= e.watermarks.High
	e.pressure.usedPct = d.pct
	e.pressure.cause = fmt.Sprintf("the state dir's filesystem is %d%% full (bytes or inodes; high watermark %d%%) "+
		"and nothing more can be evicted: every cached volume left is pinned, in use, or used in the last %s", d.pct, e.watermarks.High, e.watermarks.Grace)
	e.pressure.lastCheck = time.Now()
	now := e.pressure.over
	e.pressure.mu.Unlock()
	e.metrics.overHigh.Set(map[bool]float64{true: 1, false: 0}[now])
	switch {
	case now && !was:
		klog.ErrorS(nil, "Over the high watermark: refusing new captures and empty volumes", "usedPercent", d.pct, "high", e.watermarks.High)
		e.events.NodeEvent(EventWarning, "CacheFull", "cowvol refuses new captures and empty volumes: "+e.pressure.cause)
	case was && !now:
		klog.InfoS("Back under the high watermark: accepting captures again", "usedPercent", d.pct, "high", e.watermarks.High)
		e.events.NodeEvent(EventNormal, "CacheRecovered", fmt.Sprintf("cowvol accepts captures again: the state dir's filesystem is %d%% full", d.pct))
	}
}

// pressureNow says whether the node is over its high watermark, and why.
func (e *Engine) pressureNow() (over bool, cause string) {
	e.pressure.mu.Lock()
	defer e.pressure.mu.Unlock()
	return e.pressure.over, e.pressure.cause
}

// refuseIfFull refuses a step volume that would add data while the disk is
// over its high watermark: a capture or an empty volume. A view of a cached
// volume adds little until written, and is what lets a pipeline finish.
func (e *Engine) refuseIfFull(r PublishRequest) error {
	if r.Capture == "" && !r.Source.IsZero() {
		return nil
	}
	e.pressure.mu.Lock()
	stale := time.Since(e.pressure.lastCheck) > reapInterval
	e.pressure.mu.Unlock()
	if stale {
		e.kick(e.reaper)
	}
	e.pressure.mu.Lock()
	defer e.pressure.mu.Unlock()
	if e.pressure.over {
		return fmt.Errorf("%s: %w", e.pressure.cause, ErrNodeFull)
	}
	return nil
}

// ErrNodeFull: the node is over its high watermark and cannot evict enough.
var ErrNodeFull = errors.New("the node's cache is full")

// reapLoop runs a full round at start and whenever kicked, and reapTick
// every reapInterval.
func (e *Engine) reapLoop(ctx context.Context) {
	tick := time.NewTicker(reapInterval)
	defer tick.Stop()
	e.reapRound()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			e.reapTick()
		case <-e.reaper:
			e.reapRound()
		}
	}
}
