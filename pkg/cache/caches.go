package cache

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

// caches.go: a cache key's current version on this node. A key's versions
// are cached volumes of its namespace (handles under
// volume.CacheHandlePrefix); the record here says which of them a step
// naming the key forks. It moves only in the transaction that commits the
// version it names (CommitCacheVersion), so a reader finds the old version
// or the new one, never a version half made.

// cachesBucket maps "namespace\x00key" to a CacheKey.
var cachesBucket = []byte("caches")

// CacheKey is a key's record: its current version here.
type CacheKey struct {
	Namespace string `json:"namespace"`
	Key       string `json:"key"`
	// Current is the current version's handle.
	Current string `json:"current"`
	// PromotedAt is when Current became current, and PromotedBy the pod
	// whose step's view it was.
	PromotedAt time.Time `json:"promotedAt"`
	PromotedBy string    `json:"promotedBy"`
	// Promotions counts the versions made current here.
	Promotions uint64 `json:"promotions"`
	// ClearedAt is when the key was last cleared: Current is empty then,
	// and a view published before it is never promoted (it forked what
	// the clear was meant to drop).
	ClearedAt time.Time `json:"clearedAt,omitzero"`
}

// CurrentRef is the current version's volume.
func (k CacheKey) CurrentRef() volume.Ref {
	return volume.Ref{Namespace: k.Namespace, Handle: k.Current}
}

func cacheRecordKey(namespace, key string) []byte { return []byte(namespace + "\x00" + key) }

// CacheCurrent is a key's record (Current empty after a clear),
// ErrNotFound if no version of it was ever made current here.
func (s *Store) CacheCurrent(namespace, key string) (CacheKey, error) {
	return getOne[CacheKey](s, cachesBucket, cacheRecordKey(namespace, key), "cache key")
}

// Caches lists the keys of a namespace ("": of every namespace).
func (s *Store) Caches(namespace string) []CacheKey {
	var out []CacheKey
	_ = s.db.View(func(tx *bolt.Tx) error {
		all, _ := listJSON[CacheKey](tx.Bucket(cachesBucket))
		for _, k := range all {
			if namespace == "" || k.Namespace == namespace {
				out = append(out, k)
			}
		}
		return nil
	})
	return out
}

// CacheVersions lists a key's versions here, whatever their state.
func (s *Store) CacheVersions(namespace, key string) []Volume {
	var out []Volume
	prefix := []byte(namespace + "/" + volume.CacheHandlePrefix + volume.CacheKeyHash(key) + ".")
	_ = s.db.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(volumesBucket).Cursor()
		for k, raw := c.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, raw = c.Next() {
			var v Volume
			if json.Unmarshal(raw, &v) == nil && v.Properties[volume.PropertyCacheKey] == key {
				out = append(out, v)
			}
		}
		return nil
	})
	return out
}

// ClearCache forgets a key's current version, so that the next step
// naming the key starts empty, and refuses the promotion of every view
// published before now. It returns the record as it was. The versions stay
// for the caller to destroy (a step reading one keeps it until it ends).
func (s *Store) ClearCache(namespace, key string) (CacheKey, error) {
	var rec CacheKey
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(cachesBucket)
		var err error
		if rec, _, err = getJSON[CacheKey](b, cacheRecordKey(namespace, key)); err != nil {
			return err
		}
		cleared := rec
		cleared.Namespace, cleared.Key, cleared.Current, cleared.PromotedBy = namespace, key, "", ""
		cleared.PromotedAt, cleared.ClearedAt = time.Time{}, time.Now()
		return errors.Join(putJSON(b, cacheRecordKey(namespace, key), cleared), bump(tx))
	})
	return rec, err
}

// currentVersion is the version a publish of key in namespace forks: the
// record's current version, if it may still be mounted (zero: the step
// starts empty).
func currentVersion(tx *bolt.Tx, namespace, cacheKey string) (volume.Ref, error) {
	rec, ok, err := getJSON[CacheKey](tx.Bucket(cachesBucket), cacheRecordKey(namespace, cacheKey))
	if err != nil || !ok || rec.Current == "" {
		return volume.Ref{}, err
	}
	v, ok, err := getJSON[Volume](tx.Bucket(volumesBucket), key(rec.CurrentRef()))
	if err != nil || !ok || v.mountable(namespace) != nil {
		return volume.Ref{}, err
	}
	return v.Ref(), nil
}

// AdoptCacheVersion makes a version of cacheKey that this node pulled (a
// cached volume of namespace here) the key's current version, as of when
// the node that made it promoted it: only forward, never past a version
// promoted here later, nor past a clear here after it was promoted. It
// says whether the record moved.
func (s *Store) AdoptCacheVersion(namespace, cacheKey, handle string, promotedAt time.Time, by string) (bool, error) {
	if !volume.IsCacheHandleOf(handle, cacheKey) {
		return false, fmt.Errorf("%s is not a version of cache %s: %w", volume.Quote(handle), volume.Quote(cacheKey), ErrNotFound)
	}
	moved := false
	err := s.db.Update(func(tx *bolt.Tx) error {
		caches := tx.Bucket(cachesBucket)
		rec, _, err := getJSON[CacheKey](caches, cacheRecordKey(namespace, cacheKey))
		if err != nil || !promotedAt.After(rec.PromotedAt) || !promotedAt.After(rec.ClearedAt) {
			return err
		}
		v, ok, err := getJSON[Volume](tx.Bucket(volumesBucket), key(volume.Ref{Namespace: namespace, Handle: handle}))
		switch {
		case err != nil:
			return err
		case !ok:
			return fmt.Errorf("cache version %s is not here: %w", volume.Quote(handle), ErrNotFound)
		case v.Properties[volume.PropertyCacheKey] != cacheKey:
			return fmt.Errorf("%s is not a version of cache %s: %w", volume.Quote(handle), volume.Quote(cacheKey), ErrNotFound)
		}
		if err := v.mountable(namespace); err != nil {
			return err
		}
		moved = true
		next := CacheKey{Namespace: namespace, Key: cacheKey, Current: handle, PromotedAt: promotedAt, PromotedBy: by,
			Promotions: rec.Promotions, ClearedAt: rec.ClearedAt}
		return errors.Join(putJSON(caches, cacheRecordKey(namespace, cacheKey), next), bump(tx))
	})
	return moved, err
}

// Promotion asks CommitCacheVersion to make the committed version its
// key's current one.
type Promotion struct {
	Key string
	// By is the pod whose step's view the version is.
	By string
	// MaxBytes refuses a version whose chain holds more (0: no cap).
	MaxBytes int64
}

// Refusal says why a version was not made current.
type Refusal string

const (
	// RefusedOverCap: the version held more than the promotion's cap.
	RefusedOverCap Refusal = "over-cap"
	// RefusedCleared: the key was cleared after the view was published,
	// or the version was destroyed while the step made it.
	RefusedCleared Refusal = "cleared"
)

// Promoted is what a promotion did.
type Promoted struct {
	// Refused says why the version was not made current (empty: it
	// was): it was destroyed as it committed, and the key kept Previous.
	Refused Refusal
	// Bytes is what the version's chain holds (layers whose size is not
	// known yet count nothing).
	Bytes int64
	// Previous is the record before (zero Current: none).
	Previous CacheKey
}

// CommitCacheVersion commits a capturing view into its reserved version,
// as CommitCapture does, and in the same transaction makes it its key's
// current version: a step that publishes the key after finds the new
// version whole, one before it the old one. A version whose chain holds
// more than p.MaxBytes, or forked before the key was cleared, commits
// destroyed, and the key keeps its version. The last promotion to commit
// wins.
func (s *Store) CommitCacheVersion(volumeID string, c Captured, p Promotion) (Volume, Promoted, error) {
	var out Volume
	var res Promoted
	err := s.db.Update(func(tx *bolt.Tx) error {
		vols, caches := tx.Bucket(volumesBucket), tx.Bucket(cachesBucket)
		view, _, err := getJSON[View](tx.Bucket(viewsBucket), []byte(volumeID))
		if err != nil {
			return err
		}
		rec, _, err := getJSON[CacheKey](caches, cacheRecordKey(view.Pod.Namespace, p.Key))
		if err != nil {
			return err
		}
		res.Previous = rec
		now := time.Now()
		if !now.After(rec.PromotedAt) {
			now = rec.PromotedAt.Add(time.Nanosecond) // current never moves back
		}
		judge := func(v *Volume) error {
			res.Bytes = c.Bytes + chainBytes(vols, v.Base)
			switch {
			case view.CreatedAt.Before(rec.ClearedAt), v.DestroyOnCommit:
				// Destroyed while it was made: what clears a key on
				// the nodes that were making a version of it.
				res.Refused = RefusedCleared
			case p.MaxBytes > 0 && res.Bytes > p.MaxBytes:
				res.Refused = RefusedOverCap
			default:
				// Said on the version itself, for those who see it
				// elsewhere (the controller, a peer that pulls it).
				v.Properties[volume.PropertyCachePromotedAt] = now.UTC().Format(time.RFC3339Nano)
				v.Properties[volume.PropertyCachePromotedBy] = p.By
			}
			v.DestroyOnCommit = v.DestroyOnCommit || res.Refused != ""
			return nil
		}
		if out, err = commitCapture(tx, volumeID, c, judge); err != nil || res.Refused != "" {
			return err
		}
		next := CacheKey{Namespace: out.Namespace, Key: p.Key, Current: out.Handle, PromotedAt: now, PromotedBy: p.By,
			Promotions: rec.Promotions + 1, ClearedAt: rec.ClearedAt}
		return putJSON(caches, cacheRecordKey(out.Namespace, p.Key), next)
	})
	return out, res, err
}

// ChainBytes is what the chain from r down holds here (sizes not yet
// known count nothing).
func (s *Store) ChainBytes(r volume.Ref) int64 {
	var total int64
	_ = s.db.View(func(tx *bolt.Tx) error {
		total = chainBytes(tx.Bucket(volumesBucket), r)
		return nil
	})
	return total
}

// chainBytes is what the chain from r down holds (unknown sizes: 0).
func chainBytes(vols *bolt.Bucket, r volume.Ref) int64 {
	var total int64
	_ = walkChain(vols, r, func(v Volume, _ bool) error {
		total += max(v.SizeBytes, 0)
		return nil
	})
	return total
}
