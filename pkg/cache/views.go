package cache

import (
	"errors"
	"fmt"
	"maps"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

// ViewState is the life-cycle state of a published step volume.
type ViewState string

const (
	// ViewPublishing: recorded, not yet (fully) mounted, by a plugin from
	// before publishes were recorded as published at once. Recovery drops
	// such a view; the kubelet publishes it again.
	ViewPublishing ViewState = "publishing"
	// ViewPublished: published to the kubelet, recorded before its tree is
	// built and mounted (one transaction a publish). Its tree may not be
	// built yet, or its mount may be missing (a crash cut its publish
	// short, or a reboot took the mount): the kubelet's retry, or
	// recovery, makes them.
	ViewPublished ViewState = "published"
	// ViewCapturing: being torn down into its capture handle.
	ViewCapturing ViewState = "capturing"
)

// View is the metadata of one published step volume.
type View struct {
	VolumeID string `json:"volumeID"`
	Target   string `json:"target"`
	// Source is the cached volume the view starts as, if any.
	Source volume.Ref `json:"source,omitzero"`
	// Capture is the handle, in the pod's namespace, the view is captured
	// into on teardown, if any.
	Capture    string            `json:"capture,omitempty"`
	Scope      volume.Scope      `json:"scope,omitempty"`
	Properties map[string]string `json:"properties,omitempty"`
	ReadOnly   bool              `json:"readOnly,omitempty"`
	Pod        volume.Pod        `json:"pod"`
	// UserNamespace says the pod runs in a user namespace of its own: the
	// runtime idmaps the view's mount, so the view is a plain tree, never
	// an overlay mount (which cannot be idmapped).
	UserNamespace bool `json:"userNamespace,omitempty"`
	// TTL and Copies are given to the captured volume.
	TTL    time.Duration `json:"ttl,omitempty"`
	Copies int           `json:"copies,omitempty"`
	// InputIncomplete says a layer the view mounts failed while it was
	// mounted (its data missing, or never fetched whole): what the step
	// wrote is not captured.
	InputIncomplete bool `json:"inputIncomplete,omitempty"`
	// SizeLimit caps what the step may write (bytes; 0: none), and
	// QuotaID is the project quota enforcing it where project quotas do.
	SizeLimit int64  `json:"sizeLimit,omitempty"`
	QuotaID   uint32 `json:"quotaID,omitempty"`
	// MountID is the unique ID of the mount cowvol made at Target, and
	// MountRoot its root ("dev:ino"): an unpublish unmounts that mount and
	// no other. The root names it from a restarted plugin container too,
	// where the propagated mount has another ID.
	MountID   uint64 `json:"mountID,omitempty"`
	MountRoot string `json:"mountRoot,omitempty"`
	// Backend is the COW backend that built the view; a restarted plugin
	// may run another one and must still tear this view down its way.
	Backend string `json:"backend"`
	// Lowers are the source's data dirs, top first, as mounted.
	Lowers []string `json:"lowers,omitempty"`
	// Pins are the source chain: in use while the view lives.
	Pins  []volume.Ref `json:"pins,omitempty"`
	State ViewState    `json:"state"`
	// Cache is the cache the view is of (Key empty: none): its source is
	// the key's current version when it was published (zero: none), its
	// capture a new version, made current if the step succeeds.
	Cache volume.Cache `json:"cache,omitzero"`
	// Boot is the kernel boot the view was published in: a view from an
	// earlier boot lost whatever had not reached the disk.
	Boot      string    `json:"boot,omitempty"`
	CreatedAt time.Time `json:"createdAt"`
}

// CaptureRef is the volume the view is captured into (zero if none).
func (v View) CaptureRef() volume.Ref {
	if v.Capture == "" {
		return volume.Ref{}
	}
	return volume.Ref{Namespace: v.Pod.Namespace, Handle: v.Capture}
}

// GetView returns the step volume with the ID.
func (s *Store) GetView(volumeID string) (View, error) {
	return getOne[View](s, viewsBucket, []byte(volumeID), "step volume")
}

// ListViews returns every step volume.
func (s *Store) ListViews() []View { return listAll[View](s, viewsBucket) }

// CountViews counts the recorded step volumes without decoding them.
func (s *Store) CountViews() int {
	n := 0
	_ = s.db.View(func(tx *bolt.Tx) error {
		n = tx.Bucket(viewsBucket).Stats().KeyN
		return nil
	})
	return n
}

// Publish records a new step volume in one transaction: the source must be
// mountable (ready or filling) and readable by the pod's namespace (its chain is pinned), and the
// capture handle, if any, must be free in the pod's namespace (it is
// reserved there). The view is recorded as published: the caller builds and
// mounts it next. The returned view carries the lowers to mount. A view
// with a size limit gets a fresh quota ID.
func (s *Store) Publish(v View) (View, error) {
	now := time.Now()
	err := s.db.Update(func(tx *bolt.Tx) error {
		vols, views := tx.Bucket(volumesBucket), tx.Bucket(viewsBucket)
		if _, ok, err := getJSON[View](views, []byte(v.VolumeID)); err != nil {
			return err
		} else if ok {
			return fmt.Errorf("step volume %q: %w", v.VolumeID, ErrExists)
		}
		v.Lowers, v.Pins = nil, nil
		if v.Cache.Key != "" {
			var err error
			if v.Source, err = currentVersion(tx, v.Pod.Namespace, v.Cache.Key); err != nil {
				return err
			}
		}
		if !v.Source.IsZero() {
			src, pins, lowers, err := s.sourceOf(vols, v)
			if err != nil {
				return err
			}
			v.Pins, v.Lowers = pins, lowers
			for _, p := range v.Pins {
				if err := tx.Bucket(pinsBucket).Put(indexKey(p.String(), v.VolumeID), nil); err != nil {
					return err
				}
			}
			src.LastUsed = now
			if err := putJSON(vols, key(v.Source), src); err != nil {
				return err
			}
		}
		if c := v.CaptureRef(); !c.IsZero() {
			if err := checkBackoff(tx, c, now); err != nil {
				return err
			}
			if old, ok, err := getJSON[Volume](vols, key(c)); err != nil {
				return err
			} else if ok {
				return fmt.Errorf("capture handle %q is taken in namespace %q (volume is %s): %w", c.Handle, c.Namespace, old.State, ErrExists)
			}
			reserved := Volume{
				Namespace: c.Namespace, Handle: c.Handle, Parent: v.Source, Layer: NewLayerName(LayerCaptured, now),
				State: volume.StateCreating, Scope: v.Scope, Properties: v.Properties, TTL: v.TTL,
				SizeBytes: -1, Inodes: -1, CreatedAt: now, LastUsed: now, Lease: viewLease(v.VolumeID), Copies: v.Copies,
			}
			if err := putJSON(vols, key(c), reserved); err != nil {
				return err
			}
		}
		if v.SizeLimit > 0 {
			seq, err := views.NextSequence()
			if err != nil {
				return err
			}
			v.QuotaID = quotaIDBase + uint32(seq%quotaIDSpan)
		}
		// A view joining a pod whose other views read a layer that failed
		// is incomplete from the start: the step, which starts once all
		// its volumes are there, may read that layer's holes.
		if v.Pod.UID != "" && !v.InputIncomplete {
			v.InputIncomplete = podReadIncomplete(views, v.Pod.UID)
		}
		v.State = ViewPublished
		v.CreatedAt = now
		if err := bump(tx); err != nil {
			return err
		}
		return putJSON(views, []byte(v.VolumeID), v)
	})
	return v, err
}

// sourceOf checks that a view's source may be mounted by its pod's
// namespace and returns it with its chain: the volumes the view pins and
// the layer dirs it mounts, top first.
func (s *Store) sourceOf(vols *bolt.Bucket, v View) (src Volume, pins []volume.Ref, lowers []string, err error) {
	src, ok, err := getJSON[Volume](vols, key(v.Source))
	if err != nil {
		return src, nil, nil, err
	}
	if !ok {
		return src, nil, nil, NotVisible(v.Source, v.Pod.Namespace)
	}
	if err := src.mountable(v.Pod.Namespace); err != nil {
		return src, nil, nil, err
	}
	// A view that is a copy of its chain (a tree for a user namespace)
	// needs all of its data; an overlay reads through.
	usable := Volume.layerMountable
	if v.UserNamespace {
		usable = Volume.layerComplete
	}
	pins, lowers, err = s.chain(vols, v.Source, usable)
	return src, pins, lowers, err
}

// Lowers answers, without writing, what Publish would mount for v now (its
// source's layer dirs, top first; none without a source), refusing a source
// as Publish would. A publish stages its mount from it while its
// transaction commits; the transaction checks again, and its Lowers are the
// ones that count.
func (s *Store) Lowers(v View) (lowers []string, err error) {
	if v.Source.IsZero() {
		return nil, nil
	}
	err = s.db.View(func(tx *bolt.Tx) error {
		_, _, lowers, err = s.sourceOf(tx.Bucket(volumesBucket), v)
		return err
	})
	return lowers, err
}

// unpin drops a step volume's pins from the index.
func unpin(tx *bolt.Tx, v View) error {
	for _, p := range v.Pins {
		if err := tx.Bucket(pinsBucket).Delete(indexKey(p.String(), v.VolumeID)); err != nil {
			return err
		}
	}
	return nil
}

// Project quota IDs cowvol hands out: a range of its own, clear of the small
// IDs operators give their own projects.
const (
	quotaIDBase = 0x636f0000 // "co"
	quotaIDSpan = 1 << 24
)

// updateView changes a recorded step volume in one transaction.
func (s *Store) updateView(volumeID string, change func(*View) error) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		views := tx.Bucket(viewsBucket)
		v, ok, err := getJSON[View](views, []byte(volumeID))
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("step volume %q: %w", volumeID, ErrNotFound)
		}
		if err := change(&v); err != nil {
			return err
		}
		return putJSON(views, []byte(volumeID), v)
	})
}

// SetViewState moves a step volume from one state to another.
func (s *Store) SetViewState(volumeID string, from, to ViewState) error {
	return s.updateView(volumeID, func(v *View) error {
		if v.State == to || v.State == from {
			v.State = to
			return nil
		}
		return fmt.Errorf("step volume %q is %s, not %s: %w", volumeID, v.State, from, ErrWrongViewState)
	})
}

// SetMounted records that a step volume is mounted at its target, as the
// mount with the given ID and root, and so published.
func (s *Store) SetMounted(volumeID string, mountID uint64, root string) error {
	return s.updateView(volumeID, func(v *View) error {
		if v.State == ViewCapturing {
			return fmt.Errorf("step volume %q is capturing: %w", volumeID, ErrWrongViewState)
		}
		v.MountID, v.MountRoot, v.State = mountID, root, ViewPublished
		return nil
	})
}

// MadeMount is a mount a publish made at a view's target, to be recorded
// after the publish returned. Published names the view it was made for (its
// CreatedAt): a view published again under the same ID is another one.
type MadeMount struct {
	VolumeID  string
	Published time.Time
	MountID   uint64
	Root      string
}

// RecordMounts records, in one transaction, the mounts publishes made, each
// only on the view it was made for while that view is published and has
// none recorded: a view since taken down, published again or mounted again
// (whose mount ensureMounted recorded) keeps what it has.
func (s *Store) RecordMounts(made []MadeMount) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		views := tx.Bucket(viewsBucket)
		for _, m := range made {
			v, ok, err := getJSON[View](views, []byte(m.VolumeID))
			if err != nil {
				return err
			}
			if !ok || v.State != ViewPublished || !v.CreatedAt.Equal(m.Published) || v.MountID != 0 || v.MountRoot != "" {
				continue
			}
			v.MountID, v.MountRoot = m.MountID, m.Root
			if err := putJSON(views, []byte(m.VolumeID), v); err != nil {
				return err
			}
		}
		return nil
	})
}

// CaptureTarget returns the reserved volume a capturing view commits into.
func (s *Store) CaptureTarget(view View) (Volume, error) {
	v, err := s.Get(view.CaptureRef())
	if err != nil {
		return v, err
	}
	if !v.ReservedBy(viewLease(view.VolumeID)) {
		return v, fmt.Errorf("capture handle %q is %s and not reserved by %q: %w", view.Capture, v.State, view.VolumeID, ErrExists)
	}
	return v, nil
}

// Captured is what a capture found of the layer it commits.
type Captured struct {
	// Diff says the layer is an overlay upper dir over the view's source
	// (so the source becomes its base).
	Diff bool
	// Bytes and Inodes are the layer's usage.
	Bytes, Inodes int64
	// Properties are added to the view's (how the step ended).
	Properties map[string]string
}

// CommitCapture turns a capturing view's reservation into a ready volume and
// forgets the view, in one transaction.
func (s *Store) CommitCapture(volumeID string, c Captured) (Volume, error) {
	var out Volume
	err := s.db.Update(func(tx *bolt.Tx) error {
		var err error
		out, err = commitCapture(tx, volumeID, c, nil)
		return err
	})
	return out, err
}

// commitCapture is CommitCapture in tx; beforeCommit, if any, may change
// the volume (its base set) before it commits.
func commitCapture(tx *bolt.Tx, volumeID string, c Captured, beforeCommit func(*Volume) error) (Volume, error) {
	vols, views := tx.Bucket(volumesBucket), tx.Bucket(viewsBucket)
	view, ok, err := getJSON[View](views, []byte(volumeID))
	if err != nil {
		return Volume{}, err
	}
	if !ok || view.State != ViewCapturing {
		return Volume{}, fmt.Errorf("step volume %q is not capturing: %w", volumeID, ErrWrongViewState)
	}
	ref := view.CaptureRef()
	vol, ok, err := getJSON[Volume](vols, key(ref))
	if err != nil {
		return Volume{}, err
	}
	if !ok || !vol.ReservedBy(viewLease(volumeID)) {
		return Volume{}, fmt.Errorf("capture handle %q is not reserved by %q: %w", view.Capture, volumeID, ErrExists)
	}
	if c.Diff {
		vol.Base = view.Source
		if err := tx.Bucket(childrenBucket).Put(indexKey(vol.Base.String(), ref.String()), nil); err != nil {
			return Volume{}, err
		}
	}
	vol.SizeBytes, vol.Inodes = c.Bytes, c.Inodes
	if vol.Properties == nil { // (decoded above: the map is this call's own)
		vol.Properties = map[string]string{}
	}
	maps.Copy(vol.Properties, c.Properties)
	if beforeCommit != nil {
		if err := beforeCommit(&vol); err != nil {
			return Volume{}, err
		}
	}
	if err := vol.apply(EventCommit, viewLease(volumeID)); err != nil {
		return Volume{}, err
	}
	now := time.Now()
	vol.CreatedAt, vol.LastUsed = now, now
	if err := putJSON(vols, key(ref), vol); err != nil {
		return Volume{}, err
	}
	if err := errors.Join(unpin(tx, view), bump(tx), tx.Bucket(failuresBucket).Delete(key(ref))); err != nil {
		return Volume{}, err
	}
	return vol, views.Delete([]byte(volumeID))
}

// DropView forgets a step volume that is not being captured, releasing its
// capture reservation. It returns the reserved volume's dir that the caller
// must remove, if any.
func (s *Store) DropView(volumeID string) (reservedDir string, err error) {
	err = s.db.Update(func(tx *bolt.Tx) error {
		vols, views := tx.Bucket(volumesBucket), tx.Bucket(viewsBucket)
		view, ok, err := getJSON[View](views, []byte(volumeID))
		if err != nil || !ok {
			return err
		}
		if c := view.CaptureRef(); !c.IsZero() {
			vol, found, err := getJSON[Volume](vols, key(c))
			if err != nil {
				return err
			}
			if found && vol.ReservedBy(viewLease(volumeID)) {
				reservedDir = s.VolumeDir(c)
				if err := vols.Delete(key(c)); err != nil {
					return err
				}
			}
		}
		if err := errors.Join(unpin(tx, view), bump(tx)); err != nil {
			return err
		}
		return views.Delete([]byte(volumeID))
	})
	return reservedDir, err
}
