package fleet

import (
	"slices"
	"strings"
	"time"

	"github.com/concourse/cowvol/pkg/volume"
)

// caches.go: cache keys across the fleet. A key's versions are volumes of
// its namespace under handles of the key's own (volume.CacheHandlePrefix,
// then the key's hash), which sit together in the ordered tree; each node
// says which of them it made current in the version's properties
// (volume.PropertyCachePromotedAt). The fleet's current version of a key
// is the one promoted last that a live node holds ready: the last step to
// succeed wins, wherever it ran.

// CacheLocation is a cache key across the live nodes.
type CacheLocation struct {
	Namespace, Key string
	// Found: some live node holds ready a version that was made current.
	Found bool
	// Version is the newest such version, by PromotedAt; PromotedBy is the
	// pod whose step's view it was.
	Version    Location
	PromotedAt time.Time
	PromotedBy string
	// Versions counts the key's promoted versions live nodes hold ready.
	Versions int
	// Bytes is what Version holds: its layer and those of the versions
	// it was forked from, as far as the view knows them.
	Bytes int64
}

// Caches says, for each key of namespace, its newest version the live
// nodes hold ready, naming the first maxNodes of its nodes (all: 0); with
// no keys, every key of namespace that has one, sorted by key.
func (v *View) Caches(namespace string, keys []string, maxNodes int, now time.Time) []CacheLocation {
	v.mu.RLock()
	defer v.mu.RUnlock()
	f := v.flags(now)
	if len(keys) > 0 {
		out := make([]CacheLocation, len(keys))
		for i, k := range keys {
			out[i] = v.newest(volume.CacheRef{Namespace: namespace, Key: k}, maxNodes, f, now)
			v.addChainBytes(&out[i])
		}
		return out
	}
	byKey := map[string]*CacheLocation{}
	v.cacheVersions(namespace, volume.CacheHandlePrefix, maxNodes, f, now, func(key string, c CacheLocation) {
		if byKey[key] == nil {
			byKey[key] = &CacheLocation{Namespace: namespace, Key: key}
		}
		newer(byKey[key], c)
	})
	out := make([]CacheLocation, 0, len(byKey))
	for _, c := range byKey {
		v.addChainBytes(c)
		out = append(out, *c)
	}
	slices.SortFunc(out, func(a, b CacheLocation) int { return strings.Compare(a.Key, b.Key) })
	return out
}

// CacheInputs are the newest versions of caches that live nodes hold, for
// a step naming them: what placement counts as its inputs. A key of a
// namespace not visible (nil: all are) counts none.
func (v *View) CacheInputs(caches []volume.CacheRef, visible func(namespace string) bool, now time.Time) []volume.Ref {
	v.mu.RLock()
	defer v.mu.RUnlock()
	f := v.flags(now)
	var out []volume.Ref
	for _, c := range caches {
		if visible != nil && !visible(c.Namespace) {
			continue
		}
		if loc := v.newest(c, 1, f, now); loc.Found {
			out = append(out, loc.Version.Ref)
		}
	}
	return out
}

// newest is a key's newest version. The caller holds the lock.
func (v *View) newest(c volume.CacheRef, maxNodes int, f nodeFlags, now time.Time) CacheLocation {
	out := CacheLocation{Namespace: c.Namespace, Key: c.Key}
	v.cacheVersions(c.Namespace, volume.CacheHandlePrefix+volume.CacheKeyHash(c.Key)+".", maxNodes, f, now, func(key string, loc CacheLocation) {
		if key == c.Key {
			newer(&out, loc)
		}
	})
	return out
}

// newer counts version c of a key into its location so far, which it
// becomes if it was promoted later.
func newer(loc *CacheLocation, c CacheLocation) {
	versions := loc.Versions + 1
	if !loc.Found || c.PromotedAt.After(loc.PromotedAt) {
		c.Namespace, c.Key, c.Found = loc.Namespace, loc.Key, true
		*loc = c
	}
	loc.Versions = versions
}

// maxPromotionSkew is how far in the future a version's promotion may be
// dated by its node's clock: one dated later is passed over, lest a node
// whose clock is wrong (or that lies) pin a key to its version for good.
const maxPromotionSkew = 5 * time.Minute

// cacheVersions calls fn with each promoted version of a key of namespace
// some live node holds ready, among the volumes whose handles start with
// prefix, and the key it is a version of. The caller holds the lock.
func (v *View) cacheVersions(namespace, prefix string, maxNodes int, f nodeFlags, now time.Time, fn func(key string, c CacheLocation)) {
	from := &entry{ref: volume.Ref{Namespace: namespace, Handle: prefix}}
	v.ordered.AscendGreaterOrEqual(from, func(e *entry) bool {
		if e.ref.Namespace != namespace || !strings.HasPrefix(e.ref.Handle, prefix) {
			return false
		}
		props := e.properties()
		key := props[volume.PropertyCacheKey]
		at, err := time.Parse(time.RFC3339Nano, props[volume.PropertyCachePromotedAt])
		if key == "" || err != nil || !volume.IsCacheHandleOf(e.ref.Handle, key) || at.After(now.Add(maxPromotionSkew)) {
			return true // never made current, not a version of a key, or dated ahead
		}
		loc := v.location(e, maxNodes, f)
		if loc.NodeCount == 0 {
			return true
		}
		fn(key, CacheLocation{Version: loc, PromotedAt: at, PromotedBy: props[volume.PropertyCachePromotedBy]})
		return true
	})
}

// addChainBytes fills in what a key's newest version holds: the walk down
// its chain is made for the version answered, not for every one compared.
// The caller holds the lock.
func (v *View) addChainBytes(loc *CacheLocation) {
	if e := v.find(loc.Version.Ref); loc.Found && e != nil {
		loc.Bytes = v.chainBytes(e, loc.Version)
	}
}

// chainBytes is what a volume's chain holds: its size (loc's), and its
// ancestors' as their holders report them, as deep as the view knows
// them. The caller holds the lock.
func (v *View) chainBytes(e *entry, loc Location) int64 {
	total := max(loc.SizeBytes, 0)
	for i := 0; e.parent != nil && i < maxChain; i++ {
		if e = v.find(*e.parent); e == nil {
			break
		}
		var size int64
		for _, h := range e.holders {
			size = max(size, h.rec.size)
		}
		total += size
	}
	return total
}

// maxChain bounds a walk down a chain of parents (a node flattens long
// before).
const maxChain = 1000

// ClearCache destroys every version of a key that some node reports, in
// any state, on any node, and says which nodes were told. It remembers the
// clear for clearsKeptFor: a version promoted before now that a node
// reports later (one it had not reported yet, or a copy it pulled before
// it heard) is destroyed when it does, and never counts as the key's.
func (v *View) ClearCache(c volume.CacheRef, now time.Time) []VolumeNodes {
	v.mu.Lock()
	defer v.mu.Unlock()
	for k, at := range v.clears {
		if now.Sub(at) > clearsKeptFor {
			delete(v.clears, k)
		}
	}
	v.clears[c] = now
	var refs []volume.Ref
	prefix := volume.CacheHandlePrefix + volume.CacheKeyHash(c.Key) + "."
	v.ordered.AscendGreaterOrEqual(&entry{ref: volume.Ref{Namespace: c.Namespace, Handle: prefix}}, func(e *entry) bool {
		if e.ref.Namespace != c.Namespace || !strings.HasPrefix(e.ref.Handle, prefix) {
			return false
		}
		if e.properties()[volume.PropertyCacheKey] == c.Key {
			refs = append(refs, e.ref)
		}
		return true
	})
	return v.commandLocked(refs, destroyOn)
}

// clearsKeptFor is how long the view remembers a key's clear: a node
// silent for longer brings back its versions as they were, and a new
// leader knows no clear at all. Either way a node that heard the clear
// never forks a version promoted before it (pkg/node's catch-up).
const clearsKeptFor = 7 * 24 * time.Hour

// clearedBefore says e is a version of a key that was cleared after it was
// promoted. The caller holds the lock.
func (v *View) clearedBefore(e *entry) bool {
	if len(v.clears) == 0 || !strings.HasPrefix(e.ref.Handle, volume.CacheHandlePrefix) {
		return false
	}
	props := e.properties()
	key := props[volume.PropertyCacheKey]
	cleared, ok := v.clears[volume.CacheRef{Namespace: e.ref.Namespace, Key: key}]
	if !ok || !volume.IsCacheHandleOf(e.ref.Handle, key) {
		return false
	}
	at, err := time.Parse(time.RFC3339Nano, props[volume.PropertyCachePromotedAt])
	return err == nil && at.Before(cleared)
}
