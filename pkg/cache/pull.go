package cache

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

// LeasePull: a pull from a peer (by pull ID) is making the volume. A pull
// lives in the process that runs it, so recovery always drops its
// reservation: a restarted node pulls again when asked.
const LeasePull LeaseKind = "pull"

func pullLease(pullID string) Lease { return Lease{Kind: LeasePull, ID: pullID} }

// NewPullID names a pull or an upload that will own a volume it makes.
func NewPullID() string {
	id := make([]byte, 8)
	_, _ = rand.Read(id)
	return hex.EncodeToString(id)
}

// ReservePull records a volume a pull will fill: creating, owned by the
// pull, with the peer's metadata (lineage, scope, properties, TTL). A base
// must be here already (ready, filling, or destroyed and still holding its
// data), and is held (as a child's base is) from now on. The returned volume names the layer dir to fill. A volume marked
// DestroyOnCommit (kept by the peer only as a base) commits destroyed.
func (s *Store) ReservePull(v Volume, pullID string) (Volume, error) {
	now := time.Now()
	err := s.db.Update(func(tx *bolt.Tx) error {
		vols := tx.Bucket(volumesBucket)
		if err := checkBackoff(tx, v.Ref(), now); err != nil {
			return err
		}
		if old, ok, err := getJSON[Volume](vols, key(v.Ref())); err != nil {
			return err
		} else if ok {
			return fmt.Errorf("volume %s is already here (%s): %w", v.Ref(), old.State, ErrExists)
		}
		if !v.Base.IsZero() {
			base, ok, err := getJSON[Volume](vols, key(v.Base))
			if err != nil {
				return err
			}
			// A base the peer keeps only for what stacks on it was
			// pulled destroyed, as the peer has it, just before: its
			// data stays for this child (the puller holds it until
			// then; the child's index entry holds it from now on).
			if !ok || !base.layerMountable(false) {
				return fmt.Errorf("base %s of %s is not ready here: %w", v.Base, v.Ref(), ErrNotReady)
			}
			if err := tx.Bucket(childrenBucket).Put(indexKey(v.Base.String(), v.Ref().String()), nil); err != nil {
				return err
			}
		}
		v.Layer = NewLayerName(LayerPulled, now)
		v.State, v.Lease = volume.StateCreating, pullLease(pullID)
		v.SizeBytes, v.Inodes, v.CreatedAt, v.LastUsed = -1, -1, now, now
		v.OldLayers, v.Pin, v.Synced = nil, Pin{}, false
		return errors.Join(bump(tx), putJSON(vols, key(v.Ref()), v))
	})
	return v, err
}

// CommitPull makes a pulled volume ready, its layer in place; synced says
// whether its data is on disk yet (if not, a sync round marks it so, as it
// does a capture). A volume destroyed while it was pulled commits straight
// to destroying.
func (s *Store) CommitPull(r volume.Ref, pullID string, bytes, inodes int64, synced bool) (Volume, error) {
	var out Volume
	err := s.update(r, func(v *Volume) error {
		if err := v.apply(EventCommit, pullLease(pullID)); err != nil {
			return err
		}
		v.Synced, v.LastUsed = synced, time.Now()
		v.SizeBytes, v.Inodes = bytes, inodes
		out = *v
		return nil
	}, func(tx *bolt.Tx, _ *Volume) error { return tx.Bucket(failuresBucket).Delete(key(r)) })
	return out, err
}

// CommitPullFilling makes a lazily pulled volume filling: its tree is in
// place with every file a stub, and a filler brings the data. Steps here
// may mount it; it is never served or evicted until Filled.
func (s *Store) CommitPullFilling(r volume.Ref, pullID string, bytes int64) (Volume, error) {
	var out Volume
	err := s.update(r, func(v *Volume) error {
		if err := v.apply(EventCommitFilling, pullLease(pullID)); err != nil {
			return err
		}
		v.LastUsed, v.SizeBytes = time.Now(), bytes
		out = *v
		return nil
	})
	return out, err
}

// Filled makes a filling volume ready (destroying if it was destroyed
// meanwhile), its data synced by the caller, where it is: a volume pulled
// as an index is ready as its index, mounted (the node remounts it after a
// reboot), until SwapLayer puts a plain copy in its place.
func (s *Store) Filled(r volume.Ref) (Volume, error) {
	var out Volume
	err := s.update(r, func(v *Volume) error {
		if err := v.apply(EventFilled, Lease{}); err != nil {
			return err
		}
		v.Synced = true
		out = *v
		return nil
	}, func(tx *bolt.Tx, _ *Volume) error { return tx.Bucket(failuresBucket).Delete(key(r)) })
	return out, err
}

// SwapLayer makes layer (in place under the volume's dir, synced) the
// data of the ready volume r in place of from, which holds the same files
// in another form (a whole index's plain copy): its base stays, and from
// is pruned once no view mounts it. A volume whose layer is no longer
// from (flattened, swapped already), or that is not ready, is left alone:
// ErrUnusable.
func (s *Store) SwapLayer(r volume.Ref, from, layer string) error {
	return s.update(r, func(v *Volume) error {
		if v.State != volume.StateReady || v.Layer != from {
			return fmt.Errorf("volume %s is %s with layer %q, not ready with %q: %w", r, v.State, v.Layer, from, ErrUnusable)
		}
		v.OldLayers = append(v.OldLayers, v.Layer)
		v.Layer = layer
		return nil
	})
}

// AbortPull forgets a volume a pull could not finish, and its data. A
// volume no longer this pull's is left alone.
func (s *Store) AbortPull(r volume.Ref, pullID string, remove Remover) error {
	v, err := s.Get(r)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if !v.ReservedBy(pullLease(pullID)) {
		return nil
	}
	return s.remove(v, remove)
}

// NoteFailure makes a handle back off as a failed volume's does: no peer
// could deliver it.
func (s *Store) NoteFailure(r volume.Ref) error {
	return s.db.Update(func(tx *bolt.Tx) error { return noteFailure(tx, r) })
}

// CheckBackoff says whether the handle is backing off after failures
// (ErrBackoff), without a transaction that writes.
func (s *Store) CheckBackoff(r volume.Ref) error {
	return s.db.View(func(tx *bolt.Tx) error { return checkBackoff(tx, r, time.Now()) })
}
