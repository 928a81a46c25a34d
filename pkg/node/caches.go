package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/pull"
	"github.com/concourse/cowvol/pkg/volume"
)

// caches.go: cache volumes (volume.Cache). A publish of a key forks its
// current version here (the store picks it as it records the view, so a
// promotion racing the publish is seen whole or not at all) into a view
// captured, at teardown, into a new version of the key; the version
// becomes current only if the step earned it (cacheVerdict), in the
// transaction that commits it. The node keeps the newest versions of each
// key (DefaultCacheVersions), a version a step still reads until it ends.

// DefaultCacheVersions is how many versions of a key a node keeps, the
// current one among them, where Config.CacheVersions is 0.
const DefaultCacheVersions = 2

// forkCache fills in a cache publish's capture: a new version of the key,
// under a handle of its own, or, repeated, the one the first publish
// chose. A read-only view captures nothing. Either forks the key's
// current version here, which catchUp first moves to the fleet's newest;
// adopted says it did.
func (e *Engine) forkCache(r *PublishRequest) (adopted bool, err error) {
	if old, err := e.store.GetView(r.VolumeID); err == nil && old.Cache == r.Cache {
		r.Source, r.Capture, r.Properties, r.Scope = old.Source, old.Capture, old.Properties, old.Scope
		return false, nil
	}
	if adopted, err = e.catchUp(r.Pod, r.Cache); err != nil {
		return false, err
	}
	if r.ReadOnly {
		return adopted, nil
	}
	handle, err := volume.NewCacheHandle(r.Cache.Key)
	if err != nil {
		return false, err
	}
	r.Capture, r.Scope = handle, volume.ScopeNamespace
	r.Properties = map[string]string{volume.PropertyCacheKey: r.Cache.Key}
	return adopted, nil
}

// catchUp makes the fleet's newest version of a key, where it is newer
// than the node's current one, the node's current one, pulling it if the
// node lacks it: the pull's progress (pull.ErrPulling) while it arrives,
// which the kubelet's retry joins. A cache is a head start, never a
// reason to fail a step: where the fleet cannot say (no controller, or
// one that does not answer in time) or its version cannot be pulled, the
// step forks the node's own. A volume asking for the node's own
// (FromNode) gets it where there is one.
func (e *Engine) catchUp(pod volume.Pod, c volume.Cache) (adopted bool, err error) {
	if e.puller == nil {
		return false, nil
	}
	ns := pod.Namespace
	rec, err := e.store.CacheCurrent(ns, c.Key)
	if c.FromNode && err == nil && rec.Current != "" {
		return false, nil
	}
	newest, found, err := e.puller.NewestCacheVersion(context.Background(), ns, c.Key)
	if err != nil {
		e.metrics.cacheLookupErrors.Inc()
		klog.ErrorS(err, "Forking the node's own version of a cache: the fleet's newest could not be told", "key", c.Key, "pod", klog.KRef(ns, pod.Name))
		return false, nil
	}
	if !found || newest.Ref.Handle == rec.Current || !newest.PromotedAt.After(rec.PromotedAt) || !newest.PromotedAt.After(rec.ClearedAt) {
		return false, nil
	}
	if v, err := e.store.Get(newest.Ref); errors.Is(err, cache.ErrNotFound) || err == nil && v.BeingPulled() {
		if err := e.puller.Ensure(context.Background(), ns, newest.Ref, pod, ""); errors.Is(err, pull.ErrPulling) {
			return false, err
		} else if err != nil {
			klog.ErrorS(err, "Forking the node's own version of a cache: the fleet's newest could not be pulled", "key", c.Key,
				"version", newest.Ref.Handle, "pod", klog.KRef(ns, pod.Name))
			return false, nil
		}
	}
	moved, err := e.store.AdoptCacheVersion(ns, c.Key, newest.Ref.Handle, newest.PromotedAt, newest.PromotedBy)
	if err != nil {
		klog.ErrorS(err, "Forking the node's own version of a cache: the fleet's newest could not be made current here", "key", c.Key,
			"version", newest.Ref.Handle, "pod", klog.KRef(ns, pod.Name))
		return false, nil
	}
	if moved {
		klog.V(2).InfoS("Made the fleet's newest version of a cache current here", "key", c.Key, "version", newest.Ref.Handle,
			"promotedAt", newest.PromotedAt, "promotedBy", newest.PromotedBy, "was", rec.Current, "pod", klog.KRef(ns, pod.Name))
		e.pruneCache(ns, c.Key)
	}
	return moved, nil
}

// forked counts a cache publish by what it found: the node's own version,
// the fleet's (adopted), or none.
func (e *Engine) forked(v cache.View, adopted bool) {
	found := "none"
	switch {
	case v.Source.IsZero():
	case adopted:
		found = "pulled"
	default:
		found = "local"
	}
	e.metrics.cacheForks.WithLabelValues(found).Inc()
}

// Why a cache view's step earned no promotion.
const (
	discardFailed          = "failed"
	discardNotStarted      = "not-started"
	discardUnknown         = "result-unknown"
	discardReboot          = "reboot"
	discardInputIncomplete = "input-incomplete"
)

// cacheVerdict reads how a cache view's step ended: the properties its
// version would carry, and why it is discarded ("" if it is promoted). A
// step that never started wrote nothing; one whose result is unknown is
// promoted only where the volume asked to promote always.
func (e *Engine) cacheVerdict(view cache.View) (props map[string]string, discard string) {
	props = e.stepResult(view.Pod)
	switch volume.StepResult(props[volume.PropertyStepResult]) {
	case volume.StepSucceeded:
		return props, ""
	case volume.StepNotStarted:
		return props, discardNotStarted
	case volume.StepFailed:
		if !view.Cache.PromoteAlways {
			return props, discardFailed
		}
	case "":
		if !view.Cache.PromoteAlways {
			return props, discardUnknown
		}
	}
	return props, ""
}

// discarded says a cache view was not made a version, and why.
func (e *Engine) discarded(view cache.View, reason string) {
	e.metrics.cacheDiscards.WithLabelValues(reason).Inc()
	klog.InfoS("Discarded a cache's step volume: the key keeps its version", "volumeID", view.VolumeID, "key", view.Cache.Key,
		"reason", reason, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name))
	e.events.Event(view.Pod, EventNormal, "CacheDiscarded", fmt.Sprintf(
		"Cache %q keeps its version: what the step wrote was discarded (%s)", view.Cache.Key, discardMessages[reason]))
}

var discardMessages = map[string]string{
	discardFailed:          "the step failed; cachePromote: always promotes whatever the result",
	discardNotStarted:      "the step never started",
	discardUnknown:         "how the step ended could not be told; cachePromote: always promotes whatever the result",
	discardReboot:          "the node rebooted while the step ran",
	discardInputIncomplete: "the version it forked could not be read whole",
}

// promoted reports a version's commit, and prunes the key's versions.
func (e *Engine) promoted(view cache.View, vol cache.Volume, res cache.Promoted, took time.Duration) {
	if res.Refused != "" {
		e.metrics.cacheRefusals.WithLabelValues(string(res.Refused)).Inc()
		msg := fmt.Sprintf("Cache %q keeps its version: the step's %s was not promoted ", view.Cache.Key, vol.Handle)
		if res.Refused == cache.RefusedOverCap {
			msg += fmt.Sprintf("because it would hold %d bytes, over the volume's cacheMaxSize (%d)", res.Bytes, view.Cache.MaxBytes)
		} else {
			msg += "because the key was cleared while the step ran"
		}
		klog.InfoS("Refused a cache promotion", "volumeID", view.VolumeID, "key", view.Cache.Key, "version", vol.Handle,
			"reason", res.Refused, "bytes", res.Bytes, "maxBytes", view.Cache.MaxBytes, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name))
		e.events.Event(view.Pod, EventWarning, "CachePromotionRefused", msg)
		e.kick(e.reaper)
		return
	}
	e.metrics.cachePromotions.Inc()
	klog.V(2).InfoS("Promoted a cache version", "volumeID", view.VolumeID, "key", view.Cache.Key, "version", vol.Handle,
		"previous", res.Previous.Current, "bytes", res.Bytes, "pod", klog.KRef(view.Pod.Namespace, view.Pod.Name), "duration", took)
	e.events.Event(view.Pod, EventNormal, "CachePromoted", fmt.Sprintf(
		"Cache %q is now the step's version %s (%d bytes) in %s", view.Cache.Key, vol.Handle, res.Bytes, took.Round(time.Microsecond)))
	e.pruneCache(vol.Namespace, view.Cache.Key)
}

// pruneCache destroys a key's versions beyond the newest e.cacheVersions
// (the current one is kept whatever its age). A destroyed version a step
// still reads, or a newer version is built on, keeps its data until
// nothing does.
func (e *Engine) pruneCache(namespace, key string) {
	rec, err := e.store.CacheCurrent(namespace, key)
	if err != nil {
		return
	}
	var ready []cache.Volume
	for _, v := range e.store.CacheVersions(namespace, key) {
		if v.State == volume.StateReady && !v.Hidden() && v.Handle != rec.Current {
			ready = append(ready, v)
		}
	}
	slices.SortFunc(ready, func(a, b cache.Volume) int { return b.CreatedAt.Compare(a.CreatedAt) })
	keep := max(e.cacheVersions-1, 0) // besides the current one
	if rec.Current == "" {
		keep = 0 // cleared: none of them is current, none is forked again
	}
	for _, v := range ready[min(keep, len(ready)):] {
		if err := e.store.Destroy(v.Ref()); err != nil {
			klog.ErrorS(err, "Destroying an old cache version", "volume", v.Ref(), "key", key)
			continue
		}
		klog.V(2).InfoS("Destroyed an old cache version", "volume", v.Ref(), "key", key)
	}
	e.kick(e.reaper)
}

// currentVersionOf is the key whose current version here is r ("": r is
// none's).
func (e *Engine) currentVersionOf(r volume.Ref) string {
	if !volume.IsCacheHandle(r.Handle) {
		return ""
	}
	v, err := e.store.Get(r)
	if err != nil {
		return ""
	}
	key := v.Properties[volume.PropertyCacheKey]
	if rec, err := e.store.CacheCurrent(r.Namespace, key); err != nil || rec.Current != r.Handle {
		return ""
	}
	return key
}

// CacheInfo is a key as this node holds it.
type CacheInfo struct {
	cache.CacheKey
	// Versions are the key's versions here (being made, ready, or
	// destroyed and still held).
	Versions int
	// Bytes is what the current version's chain holds.
	Bytes int64
}

// Caches lists namespace's cache keys here ("": every namespace's).
func (e *Engine) Caches(namespace string) []CacheInfo {
	var out []CacheInfo
	for _, k := range e.store.Caches(namespace) {
		info := CacheInfo{CacheKey: k, Versions: len(e.store.CacheVersions(k.Namespace, k.Key))}
		if k.Current != "" {
			info.Bytes = e.store.ChainBytes(k.CurrentRef())
		}
		out = append(out, info)
	}
	return out
}

// ClearCache drops a key's current version, so that the next step naming
// it starts empty, and destroys its versions; a step reading one keeps it
// until it ends, and none running now is promoted. Clearing a key that
// is not here is done.
func (e *Engine) ClearCache(namespace, key string) (cache.CacheKey, error) {
	if err := volume.ValidateCacheKey(key); err != nil {
		return cache.CacheKey{}, err
	}
	rec, err := e.store.ClearCache(namespace, key)
	if err != nil {
		return rec, err
	}
	e.pruneCache(namespace, key)
	klog.InfoS("Cleared a cache key", "namespace", namespace, "key", key, "was", rec.Current)
	return rec, nil
}
