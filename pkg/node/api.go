package node

import (
	"errors"
	"fmt"
	"strings"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/pull"
	"github.com/concourse/cowvol/pkg/volume"
)

// VolumeInfo is a cached volume and what holds its data.
type VolumeInfo struct {
	cache.Volume
	Holders cache.Holders
}

// Volume returns a cached volume. A destroyed one is not found: it is
// hidden from the moment it is destroyed.
func (e *Engine) Volume(r volume.Ref) (VolumeInfo, error) {
	v, err := e.store.Get(r)
	if err == nil && v.State == volume.StateDestroying {
		err = fmt.Errorf("volume %s was destroyed: %w", r, cache.ErrNotFound)
	}
	if err != nil {
		return VolumeInfo{}, err
	}
	return VolumeInfo{Volume: v, Holders: e.store.Holders(r)}, nil
}

// Query selects volumes for a listing.
type Query struct {
	Namespace string
	// Selector keeps volumes carrying every one of these properties.
	Selector map[string]string
	// After is the last key of the previous page ("" for the first).
	After            string
	Limit            int
	IncludeDestroyed bool
}

// Volumes lists a page of cached volumes in (namespace, handle) order, with
// the key to list the next page after ("" on the last) and the store's
// revision.
func (e *Engine) Volumes(q Query) (vols []VolumeInfo, next string, revision uint64, err error) {
	prefix := ""
	if q.Namespace != "" {
		prefix = q.Namespace + "/"
	}
	if q.After != "" && !strings.HasPrefix(q.After, prefix) {
		return nil, "", 0, fmt.Errorf("the page token belongs to another listing: %w", ErrBadPageToken)
	}
	revision = e.store.Revision()
	page, err := e.store.ListPage(prefix, q.After, q.Limit, func(v cache.Volume) bool {
		if v.State == volume.StateDestroying && !q.IncludeDestroyed {
			return false
		}
		for k, want := range q.Selector {
			if got, ok := v.Properties[k]; !ok || got != want {
				return false
			}
		}
		return true
	})
	if err != nil {
		return nil, "", 0, err
	}
	for i, v := range page.Volumes {
		vols = append(vols, VolumeInfo{Volume: v, Holders: page.Holders[i]})
	}
	return vols, page.Next, revision, nil
}

// ErrBadPageToken: a page token that no listing like this one handed out.
var ErrBadPageToken = fmt.Errorf("invalid page token")

// Fullness is how full the node's cache is, measured now without reading
// a volume's record: cheap enough for every heartbeat to say it.
type Fullness struct {
	BytesTotal, BytesFree   int64
	InodesTotal, InodesFree int64
	UsedPercent             int
	Watermarks              Watermarks
	OverHighWatermark       bool
	// StepVolumes are published now.
	StepVolumes int
}

// NodeInfo is who the node is and how full its cache is.
type NodeInfo struct {
	NodeID, StoreID, Backend, SizeLimits string
	Fullness
	BytesHeldForChildren int64
	Revision             uint64
	Volumes              int
	// CapturesRefused says why new captures are refused ("": they are not).
	CapturesRefused string
	// PullMode is how sources are pulled ("": never), and PullModeWhy why.
	PullMode    pull.Mode
	PullModeWhy string
}

// Fullness measures how full the node's cache is.
func (e *Engine) Fullness() (Fullness, error) {
	full, _, err := e.fullness()
	return full, err
}

// fullness is Fullness with why the node is over its high watermark, read
// with the flag in one go.
func (e *Engine) fullness() (Fullness, string, error) {
	d, err := measureDisk(e.store.Dir())
	if err != nil {
		return Fullness{}, "", err
	}
	over, cause := e.pressureNow()
	return Fullness{
		BytesTotal: d.totalBytes, BytesFree: d.freeBytes, InodesTotal: d.totalInodes, InodesFree: d.freeInodes,
		UsedPercent: d.pct, Watermarks: e.watermarks, OverHighWatermark: over, StepVolumes: e.store.CountViews(),
	}, cause, nil
}

// Info says who the node is and how full its cache is, measured now. It
// reads every volume's record (to count them): the node API's answer, not
// a heartbeat's.
func (e *Engine) Info() (NodeInfo, error) {
	full, cause, err := e.fullness()
	if err != nil {
		return NodeInfo{}, err
	}
	limits := "off"
	if e.limiter != nil {
		limits = e.limiter.Mechanism()
	}
	refused := ""
	if full.OverHighWatermark {
		refused = cause
	}
	if why := e.refusal.Load(); why != nil && *why != "" {
		refused = *why
	}
	count := 0
	for _, v := range e.store.List() {
		if v.State != volume.StateDestroying {
			count++
		}
	}
	mode, why := e.PullMode()
	return NodeInfo{
		NodeID: e.nodeID, StoreID: e.store.ID(), Backend: string(e.backend.Kind()), SizeLimits: limits, Fullness: full,
		BytesHeldForChildren: e.store.HeldForChildren(), Revision: e.store.Revision(), Volumes: count,
		CapturesRefused: refused, PullMode: mode, PullModeWhy: why,
	}, nil
}

// RefuseCaptures makes the node refuse new captures, saying why (the
// controller took it out of service), or accept them again ("").
func (e *Engine) RefuseCaptures(why string) {
	if old := e.refusal.Swap(&why); old == nil || *old != why {
		if why != "" {
			klog.InfoS("Refusing new captures", "why", why)
		} else if old != nil {
			klog.InfoS("Accepting captures again")
		}
	}
}

// ErrOutOfService: the node was taken out of service and takes no captures.
var ErrOutOfService = errors.New("the node takes no new captures")

func (e *Engine) refuseIfOutOfService(r PublishRequest) error {
	if why := e.refusal.Load(); r.Capture != "" && why != nil && *why != "" {
		return fmt.Errorf("%s: %w", *why, ErrOutOfService)
	}
	return nil
}

// copyLimits are what the controller grants captures that ask for copies:
// at most max nodes, and no more than one in the namespaces whose budget
// is spent.
type copyLimits struct {
	max   int
	spent map[string]bool
}

// LimitCopies takes the controller's copy limits (maxCopies 0: it said
// none), which publishes that ask for more copies are refused against.
func (e *Engine) LimitCopies(maxCopies int, spent []string) {
	if maxCopies == 0 {
		e.copyLimits.Store(nil)
		return
	}
	l := &copyLimits{max: maxCopies, spent: make(map[string]bool, len(spent))}
	for _, ns := range spent {
		l.spent[ns] = true
	}
	e.copyLimits.Store(l)
}

// Publishes that ask for more copies than the controller grants.
var (
	ErrTooManyCopies = errors.New("more copies than this cluster keeps")
	ErrCopiesSpent   = errors.New("the namespace's budget of copies is spent")
)

// refuseCopies refuses a capture whose copies attribute asks for more than
// the controller would grant: it says so at once rather than capture a
// volume that is kept on fewer nodes than the step asked. (A node's own
// default, --output-copies, is not refused: the controller grants what it
// can.)
func (e *Engine) refuseCopies(r PublishRequest) error {
	l := e.copyLimits.Load()
	if r.Capture == "" || r.Copies <= 1 || l == nil {
		return nil
	}
	if r.Copies > l.max {
		return fmt.Errorf("copies %d: volumes are kept on at most %d nodes here (the controller's --max-copies): %w", r.Copies, l.max, ErrTooManyCopies)
	}
	if l.spent[r.Pod.Namespace] {
		return fmt.Errorf("copies %d: namespace %s has spent its budget of extra copies (the controller's --namespace-copies): ask for 1 or destroy volumes that have copies: %w",
			r.Copies, r.Pod.Namespace, ErrCopiesSpent)
	}
	return nil
}

// Revision is the store's: it grows with every change to the volumes.
func (e *Engine) Revision() uint64 { return e.store.Revision() }
