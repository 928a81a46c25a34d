package driver

import (
	"context"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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

func (n *nodeService) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if req.GetVolumePath() == "" {
		return nil, invalid("volume path is required")
	}
	// The lock keeps a capture from moving the data away mid-answer.
	release, err := n.lock(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()
	view, err := n.store.GetView(req.GetVolumeId())
	if err != nil {
		return nil, storeError(err)
	}
	if view.Target != req.GetVolumePath() {
		return nil, elsewhere(view, req.GetVolumePath())
	}
	// The volume's room is the state dir's filesystem, capped by its limit.
	var fs unix.Statfs_t
	if err := unix.Statfs(n.store.Dir(), &fs); err != nil {
		return nil, status.Errorf(codes.Internal, "reading the state dir's filesystem: %v", err)
	}
	bsize := int64(fs.Bsize)
	bytes := &csi.VolumeUsage{Unit: csi.VolumeUsage_BYTES, Total: int64(fs.Blocks) * bsize, Available: int64(fs.Bavail) * bsize}
	inodes := &csi.VolumeUsage{Unit: csi.VolumeUsage_INODES, Total: int64(fs.Files), Available: int64(fs.Ffree)}
	if !view.ReadOnly { // a read-only view holds nothing of its own
		bytes.Used, inodes.Used = n.used(view)
	}
	if view.SizeLimit > 0 {
		bytes.Total = view.SizeLimit
		bytes.Available = max(0, min(bytes.Available, view.SizeLimit-bytes.Used))
	}
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{bytes, inodes}}, nil
}

// used is what a view holds of its own: its quota's count where a quota
// limits it, else the last background measurement of its upper dir or tree.
func (n *nodeService) used(view cache.View) (bytes, inodes int64) {
	b, err := n.backendOf(view)
	if err != nil {
		klog.ErrorS(err, "Measuring a step volume", "volumeID", view.VolumeID)
		return 0, 0
	}
	content, _ := b.Content(n.spec(view, ""))
	mBytes, mInodes, _ := n.usage.get(view.VolumeID, func(done func(int64, int64)) {
		n.goBackground(func() {
			bytes, inodes, err := overlay.Usage(content)
			if err != nil {
				klog.V(2).InfoS("Measuring a step volume", "volumeID", view.VolumeID, "err", err)
				bytes = -1
			}
			done(bytes, inodes)
		})
	})
	if view.SizeLimit > 0 && n.limiter != nil {
		qBytes, qInodes, err := n.limiter.Used(view.QuotaID, content)
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
