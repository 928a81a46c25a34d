package node

import (
	"fmt"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
)

// usageMaxAge is how old a step volume's measurement may be before a stats
// call asks for a new one. The kubelet asks about once a minute.
const usageMaxAge = 30 * time.Second

// usageCache keeps the last measurement of each step volume's own data, so
// that NodeGetVolumeStats never walks a tree: walks run in the background,
// one per volume at a time.
type usageCache struct {
	mu      sync.Mutex
	entries map[string]*usageEntry
}

type usageEntry struct {
	bytes, inodes int64
	at            time.Time // zero until measured
	measuring     bool
}

// get returns the last measurement of a volume (ok false if none yet), and
// starts a new one through measure if it is stale.
func (c *usageCache) get(volumeID string, measure func(done func(bytes, inodes int64))) (bytes, inodes int64, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[volumeID]
	if e == nil {
		e = &usageEntry{}
		c.entries[volumeID] = e
	}
	if !e.measuring && time.Since(e.at) > usageMaxAge {
		e.measuring = true
		measure(func(bytes, inodes int64) {
			c.mu.Lock()
			defer c.mu.Unlock()
			e.measuring = false
			if bytes >= 0 {
				e.bytes, e.inodes, e.at = bytes, inodes, time.Now()
			}
		})
	}
	return e.bytes, e.inodes, !e.at.IsZero()
}

func (c *usageCache) forget(volumeID string) {
	c.mu.Lock()
	delete(c.entries, volumeID)
	c.mu.Unlock()
}

// Usage is what a step volume holds and has room for, in bytes and inodes.
type Usage struct {
	TotalBytes, AvailableBytes, UsedBytes    int64
	TotalInodes, AvailableInodes, UsedInodes int64
}

// Stats says what a published step volume holds: its room is the state
// dir's filesystem, capped by its size limit; what it uses is its quota's
// count, or the last background measurement of what it wrote. It never walks
// a tree itself.
func (e *Engine) Stats(volumeID, path string) (Usage, error) {
	// The lock keeps a capture from moving the data away mid-answer.
	release, err := e.lock(volumeID)
	if err != nil {
		return Usage{}, err
	}
	defer release()
	view, err := e.store.GetView(volumeID)
	if err != nil {
		return Usage{}, err
	}
	if view.Target != path {
		return Usage{}, elsewhere(view, path)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(e.store.Dir(), &fs); err != nil {
		return Usage{}, fmt.Errorf("reading the state dir's filesystem: %w", err)
	}
	bsize := int64(fs.Bsize)
	u := Usage{TotalBytes: int64(fs.Blocks) * bsize, AvailableBytes: int64(fs.Bavail) * bsize,
		TotalInodes: int64(fs.Files), AvailableInodes: int64(fs.Ffree)}
	if !view.ReadOnly { // a read-only view holds nothing of its own
		u.UsedBytes, u.UsedInodes = e.used(view)
	}
	if view.SizeLimit > 0 {
		u.TotalBytes = view.SizeLimit
		u.AvailableBytes = max(0, min(u.AvailableBytes, view.SizeLimit-u.UsedBytes))
	}
	return u, nil
}

// used is what a view holds of its own: its quota's count where a quota
// limits it, else the last background measurement of its upper dir or tree.
func (e *Engine) used(view cache.View) (bytes, inodes int64) {
	b, err := e.backendOf(view)
	if err != nil {
		klog.ErrorS(err, "Measuring a step volume", "volumeID", view.VolumeID)
		return 0, 0
	}
	content, _ := b.Content(e.spec(view, ""))
	mBytes, mInodes, _ := e.usage.get(view.VolumeID, func(done func(int64, int64)) {
		e.goBackground(func() {
			bytes, inodes, err := overlay.Usage(content)
			if err != nil {
				klog.V(2).InfoS("Measuring a step volume", "volumeID", view.VolumeID, "err", err)
				bytes = -1
			}
			done(bytes, inodes)
		})
	})
	if view.SizeLimit > 0 && e.limiter != nil {
		qBytes, qInodes, err := e.limiter.Used(view.QuotaID, content)
		if err == nil {
			if qInodes < 0 {
				qInodes = mInodes
			}
			return qBytes, qInodes
		}
		klog.ErrorS(err, "Reading a step volume's quota", "volumeID", view.VolumeID)
	}
	return mBytes, mInodes
}
