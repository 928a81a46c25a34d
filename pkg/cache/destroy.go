package cache

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/pkg/volume"
)

// Destroy hides a volume at once (lookups and publishes answer NotFound)
// and leaves its data for Reap, which frees it once nothing holds it. A
// volume being made is destroyed when its capture commits. A missing volume
// counts as destroyed. It works on a full disk: the reserve gives the
// metadata room.
func (s *Store) Destroy(r volume.Ref) error {
	return s.withRoom(func() error { return s.destroy(r) })
}

func (s *Store) destroy(r volume.Ref) error {
	_, err := s.destroyIf(r, nil)
	return err
}

// Why the reaper destroys a volume. Each is checked again as it does
// (DestroyDue): the reaper picks from a scan, and a pin, a publish or a
// use may come between the scan and the destroy.
type Due string

const (
	// DueFailed: the volume failed.
	DueFailed Due = "failed"
	// DueTTL: its TTL ran out, unused and unpinned.
	DueTTL Due = "ttl"
	// DueWatermark: it may be evicted (ready, unpinned, held by nothing),
	// and was not used since the scan saw it.
	DueWatermark Due = "watermark"
)

// DestroyDue destroys the volume a scan saw as seen, as Destroy does, if it
// is still due for why at now, and says whether it did.
func (s *Store) DestroyDue(seen Volume, why Due, now time.Time) (destroyed bool, err error) {
	var still func(tx *bolt.Tx, v Volume) bool
	switch why {
	case DueFailed:
		still = func(_ *bolt.Tx, v Volume) bool { return v.State == volume.StateFailed }
	case DueTTL:
		still = func(_ *bolt.Tx, v Volume) bool { return v.expired(now) }
	case DueWatermark:
		still = func(tx *bolt.Tx, v Volume) bool {
			return v.evictable(s.holdersOf(tx, v.Ref()), now) && !v.LastUsed.After(seen.LastUsed)
		}
	default:
		return false, fmt.Errorf("destroying %s: no reason %q", seen.Ref(), why)
	}
	err = s.withRoom(func() (err error) {
		destroyed, err = s.destroyIf(seen.Ref(), still)
		return err
	})
	return destroyed, err
}

// destroyIf destroys r, if still (nil: always) says so of its record in the
// same transaction, and says whether it did.
func (s *Store) destroyIf(r volume.Ref, still func(tx *bolt.Tx, v Volume) bool) (destroyed bool, err error) {
	err = s.db.Update(func(tx *bolt.Tx) error {
		vols := tx.Bucket(volumesBucket)
		v, ok, err := getJSON[Volume](vols, key(r))
		if err != nil || !ok || v.Hidden() || (still != nil && !still(tx, v)) {
			return err
		}
		if err := v.apply(EventDestroy, Lease{}); err != nil {
			return err
		}
		if err := bump(tx); err != nil {
			return err
		}
		destroyed = true
		return putJSON(vols, key(r), v)
	})
	return destroyed, err
}

// holdersOf says what holds r's data, recorded and live.
func (s *Store) holdersOf(tx *bolt.Tx, r volume.Ref) Holders {
	h := Holders{Views: indexed(tx.Bucket(pinsBucket), r.String()), Images: indexed(tx.Bucket(imagesBucket), r.String())}
	s.live.add(r, &h)
	for _, c := range indexed(tx.Bucket(childrenBucket), r.String()) {
		if ref, err := volume.ParseRef(c); err == nil {
			h.Children = append(h.Children, ref)
		} else {
			h.Children = append(h.Children, volume.Ref{Handle: c})
		}
	}
	return h
}

// Holders says what keeps a volume's data.
func (s *Store) Holders(r volume.Ref) Holders {
	var h Holders
	_ = s.db.View(func(tx *bolt.Tx) error {
		h = s.holdersOf(tx, r)
		return nil
	})
	return h
}

// Reapable lists the destroyed volumes whose data nothing holds any longer.
func (s *Store) Reapable() []Volume {
	var out []Volume
	_ = s.db.View(func(tx *bolt.Tx) error {
		vols, _ := listJSON[Volume](tx.Bucket(volumesBucket))
		for _, v := range vols {
			if v.reapable(s.holdersOf(tx, v.Ref())) {
				out = append(out, v)
			}
		}
		return nil
	})
	return out
}

// WaitingOnLiveHolds says whether a destroyed volume's data waits only on
// holds of this process (streams, fills), which may end at any moment: the
// reaper keeps looking until none does. It reads only the volumes held
// now, a handful.
func (s *Store) WaitingOnLiveHolds() bool {
	held := s.live.refs()
	waiting := false
	_ = s.db.View(func(tx *bolt.Tx) error {
		vols := tx.Bucket(volumesBucket)
		for _, r := range held {
			v, ok, err := getJSON[Volume](vols, key(r))
			if err != nil || !ok || v.State != volume.StateDestroying {
				continue
			}
			if h := s.holdersOf(tx, r); len(h.Views) == 0 && len(h.Images) == 0 && len(h.Children) == 0 {
				waiting = true
				return nil
			}
		}
		return nil
	})
	return waiting
}

// Reap frees a destroyed volume's data and forgets it, unless something
// took hold of it meanwhile (then ErrInUse).
func (s *Store) Reap(r volume.Ref, remove Remover) error {
	var v Volume
	err := s.db.View(func(tx *bolt.Tx) error {
		var ok bool
		var err error
		if v, ok, err = getJSON[Volume](tx.Bucket(volumesBucket), key(r)); err != nil || !ok {
			return err
		}
		if v.State != volume.StateDestroying {
			return fmt.Errorf("volume %s is %s, not destroyed: %w", r, v.State, ErrUnusable)
		}
		if h := s.holdersOf(tx, r); !v.reapable(h) {
			return fmt.Errorf("volume %s is held by %d step volumes, %d images, %d children, %d streams and %d fillers: %w",
				r, len(h.Views), len(h.Images), len(h.Children), h.Streams, h.Fillers, ErrInUse)
		}
		return nil
	})
	if err != nil || v.Handle == "" {
		return err
	}
	return s.remove(v, remove)
}

// remove deletes a volume's data, then its record and its place in the
// children index. Data first: a crash between leaves a record whose data is
// gone, which recovery marks failed and the reaper then forgets; the other
// order would leak the data. Deleting frees space before the transaction
// needs any, so it works on a full disk.
func (s *Store) remove(v Volume, remove Remover) error {
	if err := remove(s.VolumeDir(v.Ref())); err != nil {
		return fmt.Errorf("removing data of %s: %w", v.Ref(), err)
	}
	CrashPoint("reap-data-removed")
	return s.db.Update(func(tx *bolt.Tx) error {
		if !v.Base.IsZero() {
			if err := tx.Bucket(childrenBucket).Delete(indexKey(v.Base.String(), v.Ref().String())); err != nil {
				return err
			}
		}
		return errors.Join(tx.Bucket(volumesBucket).Delete(key(v.Ref())), bump(tx))
	})
}

// Candidates are the volumes eviction may take, least recently used first
// (a cache key's versions by the key's last use, then their own):
// ready or failed, unpinned, held by nothing (a leaf nobody mounts). Taking
// one may make its base a candidate.
func (s *Store) Candidates(now time.Time) []Volume {
	type candidate struct {
		Volume
		key  string    // its cache key's, within its namespace ("": none)
		used time.Time // what it ranks by
	}
	var cands []candidate
	// A cache key's versions are used as one: its last use is the last
	// use of any of them, so that a key in use keeps the versions a step
	// may fall back to, and a cold key goes whole.
	keyUsed := map[string]time.Time{}
	_ = s.db.View(func(tx *bolt.Tx) error {
		vols, _ := listJSON[Volume](tx.Bucket(volumesBucket))
		for _, v := range vols {
			k := cacheKeyOf(v)
			if k != "" && v.LastUsed.After(keyUsed[k]) {
				keyUsed[k] = v.LastUsed
			}
			if v.evictable(s.holdersOf(tx, v.Ref()), now) {
				cands = append(cands, candidate{Volume: v, key: k, used: v.LastUsed})
			}
		}
		return nil
	})
	for i := range cands {
		if cands[i].key != "" {
			cands[i].used = keyUsed[cands[i].key]
		}
	}
	sort.SliceStable(cands, func(i, j int) bool {
		a, b := cands[i], cands[j]
		return a.used.Before(b.used) || a.used.Equal(b.used) && a.LastUsed.Before(b.LastUsed)
	})
	var out []Volume
	for _, c := range cands {
		out = append(out, c.Volume)
	}
	return out
}

// cacheKeyOf names the cache key v is a version of ("": none), within
// its namespace.
func cacheKeyOf(v Volume) string {
	k := v.Properties[volume.PropertyCacheKey]
	if k == "" || !volume.IsCacheHandleOf(v.Handle, k) {
		return ""
	}
	return v.Namespace + "\x00" + k
}

// Due lists, in one scan of the store, the failed volumes (the reaper
// destroys them) and the ones whose TTL ran out by now with no pin
// protecting them; and says when the next TTL may run out (zero: none can
// before the store changes).
func (s *Store) Due(now time.Time) (failed, expired []Volume, next time.Time) {
	for _, v := range s.List() {
		switch {
		case v.State == volume.StateFailed:
			failed = append(failed, v)
		case v.expired(now):
			expired = append(expired, v)
		default:
			if at, ok := v.expiresAt(); ok && (next.IsZero() || at.Before(next)) {
				next = at
			}
		}
	}
	return failed, expired, next
}

// SetPin pins a volume (until, zero: for good) or unpins it.
func (s *Store) SetPin(r volume.Ref, pinned bool, until time.Time) (Volume, error) {
	var out Volume
	err := s.update(r, func(v *Volume) error {
		if v.State == volume.StateDestroying {
			return fmt.Errorf("volume %s: %w", r, ErrNotFound)
		}
		v.Pin = Pin{}
		if pinned {
			v.Pin = Pin{Pinned: true, Until: until}
		}
		out = *v
		return nil
	})
	return out, err
}

// failure is the record of a handle whose volumes keep failing: captures
// into it back off until RetryAfter.
type failure struct {
	Count      int       `json:"count"`
	RetryAfter time.Time `json:"retryAfter"`
}

// Failed volumes' handles back off exponentially, capped.
const (
	firstBackoff = 10 * time.Second
	maxBackoff   = 10 * time.Minute
)

func backoff(count int) time.Duration {
	d := firstBackoff
	for i := 1; i < count && d < maxBackoff; i++ {
		d *= 2
	}
	return min(d, maxBackoff)
}

// MarkFailed marks a volume's data lost: it is never served again, and a
// capture into its handle backs off (10 s, doubling, at most 10 min) while
// failures repeat. The caller destroys it.
func (s *Store) MarkFailed(r volume.Ref) error {
	return s.update(r, func(v *Volume) error { return v.apply(EventFail, Lease{}) },
		func(tx *bolt.Tx, _ *Volume) error {
			if err := markReadersIncomplete(tx, r); err != nil {
				return err
			}
			return noteFailure(tx, r)
		})
}

// markReadersIncomplete marks the step volumes of every pod that mounts r
// incomplete: the pod may have read what is missing (a lazy pull's holes,
// where the plugin died under its reader), so none of its volumes may
// capture a ready output, its outputs least of all (a step reads its
// inputs and writes its outputs, each a volume of its own).
func markReadersIncomplete(tx *bolt.Tx, r volume.Ref) error {
	views := tx.Bucket(viewsBucket)
	readers := map[string]bool{} // view IDs
	podUIDs := map[string]bool{}
	for _, id := range indexed(tx.Bucket(pinsBucket), r.String()) {
		view, ok, err := getJSON[View](views, []byte(id))
		if err != nil || !ok {
			continue // a bad record is reported elsewhere, not fixed here
		}
		readers[id] = true
		if view.Pod.UID != "" {
			podUIDs[view.Pod.UID] = true
		}
	}
	if len(readers) == 0 {
		return nil
	}
	all, _ := listJSON[View](views) // bad records are reported elsewhere
	for _, view := range all {
		if view.InputIncomplete || (!readers[view.VolumeID] && !podUIDs[view.Pod.UID]) {
			continue
		}
		view.InputIncomplete = true
		if err := putJSON(views, []byte(view.VolumeID), view); err != nil {
			return err
		}
	}
	return nil
}

// podReadIncomplete says whether a view of the pod is marked incomplete.
func podReadIncomplete(views *bolt.Bucket, podUID string) bool {
	all, _ := listJSON[View](views) // bad records are reported elsewhere
	for _, view := range all {
		if view.Pod.UID == podUID && view.InputIncomplete {
			return true
		}
	}
	return false
}

// noteFailure counts a failure of the handle and sets when it may be tried
// again.
func noteFailure(tx *bolt.Tx, r volume.Ref) error {
	b := tx.Bucket(failuresBucket)
	f, _, err := getJSON[failure](b, key(r))
	if err != nil {
		f = failure{}
	}
	f.Count++
	f.RetryAfter = time.Now().Add(backoff(f.Count))
	return putJSON(b, key(r), f)
}

// checkBackoff refuses a capture into (or a pull of) a handle that is
// backing off.
func checkBackoff(tx *bolt.Tx, r volume.Ref, now time.Time) error {
	f, ok, err := getJSON[failure](tx.Bucket(failuresBucket), key(r))
	if err != nil || !ok || !now.Before(f.RetryAfter) {
		return nil
	}
	return fmt.Errorf("capture handle %q failed %d times: retry after %s (in %s): %w",
		r.Handle, f.Count, f.RetryAfter.UTC().Format(time.RFC3339), f.RetryAfter.Sub(now).Round(time.Second), ErrBackoff)
}

// reserveSize is the room kept aside for metadata, released when a change
// that frees space (a destroy) finds the disk full.
const reserveSize = 8 << 20

func (s *Store) reservePath() string { return filepath.Join(s.dir, "reserve") }

// Reserve sets the metadata's room aside again if it was used and there is
// space for it; a full disk simply leaves it for later.
func (s *Store) Reserve() error {
	f, err := os.OpenFile(s.reservePath(), os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.Fallocate(int(f.Fd()), 0, 0, reserveSize); err != nil {
		return fmt.Errorf("setting aside room for metadata: %w", err)
	}
	return nil
}

// withRoom runs change, and once more after releasing the reserve if the
// disk was too full for it.
func (s *Store) withRoom(change func() error) error {
	err := change()
	if !errors.Is(err, unix.ENOSPC) {
		return err
	}
	if rerr := os.Remove(s.reservePath()); rerr != nil {
		return errors.Join(err, rerr)
	}
	return change()
}

// Page is one page of a listing, with the holders of each volume.
type Page struct {
	Volumes []Volume
	Holders []Holders
	// Next is the key to list from for the next page ("" on the last).
	Next string
}

// ListPage lists up to limit volumes after the key after ("" from the
// start), in key (namespace/handle) order, under prefix (a namespace's
// "ns/", or ""), keeping those match accepts. One read transaction: a page
// is a consistent view.
func (s *Store) ListPage(prefix, after string, limit int, match func(Volume) bool) (Page, error) {
	var p Page
	err := s.db.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(volumesBucket).Cursor()
		k, raw := c.Seek([]byte(max(prefix, after)))
		if after != "" && string(k) == after {
			k, raw = c.Next()
		}
		for ; k != nil && bytes.HasPrefix(k, []byte(prefix)); k, raw = c.Next() {
			if len(p.Volumes) == limit {
				p.Next = p.Volumes[len(p.Volumes)-1].Ref().String()
				return nil
			}
			var v Volume
			if json.Unmarshal(raw, &v) != nil || !match(v) {
				continue
			}
			p.Volumes = append(p.Volumes, v)
			p.Holders = append(p.Holders, s.holdersOf(tx, v.Ref()))
		}
		return nil
	})
	return p, err
}

// HeldForChildren sums the measured bytes of destroyed volumes whose data
// children still rest on.
func (s *Store) HeldForChildren() int64 {
	var sum int64
	_ = s.db.View(func(tx *bolt.Tx) error {
		vols, _ := listJSON[Volume](tx.Bucket(volumesBucket))
		for _, v := range vols {
			if v.State == volume.StateDestroying && v.SizeBytes > 0 && len(s.holdersOf(tx, v.Ref()).Children) > 0 {
				sum += v.SizeBytes
			}
		}
		return nil
	})
	return sum
}
