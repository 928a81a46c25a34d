// Package cache owns cowvol's node-local volume store: the metadata of every
// cached volume (handle, lineage, state, owner, properties, size) and of every
// step volume ("view") published from one, kept in a single bbolt file so that
// each change is one fsynced transaction, plus the layout of the state dir.
//
// It decides what may happen (find-or-create, who may read what, what is in
// use, what is an orphan) but never mounts anything and never reads or writes
// volume contents: the copy-on-write mechanics live in package overlay and the
// CSI surface in package driver. Deleting trees is done through a Remover the
// caller supplies, because only the caller knows how (a btrfs subvolume is not
// a plain directory).
package cache

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"
)

// State is the life-cycle state of a cached volume.
type State string

const (
	// StateCreating marks a handle reserved by a step volume that will be
	// captured into it; it is never usable as a source.
	StateCreating State = "creating"
	// StateReady marks an immutable cached volume that steps may use.
	StateReady State = "ready"
	// StateFailed marks a volume whose data was found damaged or missing.
	StateFailed State = "failed"
	// StateDestroying marks a volume whose data is being removed.
	StateDestroying State = "destroying"
)

// Scope says who may use a cached volume as a source.
type Scope string

const (
	// ScopeNamespace limits use to pods of the namespace that captured it.
	ScopeNamespace Scope = "namespace"
	// ScopeCluster allows any pod on the node.
	ScopeCluster Scope = "cluster"
)

// Volume is the metadata of one cached volume.
type Volume struct {
	Handle string `json:"handle"`
	// Parent is the source the volume was captured from (lineage), if any.
	Parent string `json:"parent,omitempty"`
	// Base is the volume whose data this volume's layer is a diff over
	// (overlay capture); empty for a root layer holding a whole tree.
	Base string `json:"base,omitempty"`
	// Layer names the data dir under layers/<handle>/ that is current.
	Layer string `json:"layer"`
	// OldLayers are data dirs replaced by flattening, kept until no view
	// mounts them.
	OldLayers  []string          `json:"oldLayers,omitempty"`
	State      State             `json:"state"`
	Namespace  string            `json:"namespace,omitempty"`
	Scope      Scope             `json:"scope"`
	Properties map[string]string `json:"properties,omitempty"`
	// SizeBytes and Inodes are what the layer itself holds on disk; -1
	// until measured (measuring walks the tree, so it runs after commit).
	SizeBytes int64     `json:"sizeBytes"`
	Inodes    int64     `json:"inodes"`
	CreatedAt time.Time `json:"createdAt"`
	LastUsed  time.Time `json:"lastUsed"`
	// Owner is the step volume that will be captured into this handle,
	// while the volume is creating.
	Owner string `json:"owner,omitempty"`
	// Synced says the volume's data has reached the disk (a syncfs after
	// its capture). A ready volume that a reboot caught unsynced may be
	// torn, and is marked failed.
	Synced bool `json:"synced,omitempty"`
}

// ViewState is the life-cycle state of a published step volume.
type ViewState string

const (
	// ViewPublishing: recorded, not yet (fully) mounted.
	ViewPublishing ViewState = "publishing"
	// ViewPublished: mounted at its target.
	ViewPublished ViewState = "published"
	// ViewCapturing: being torn down into its capture handle.
	ViewCapturing ViewState = "capturing"
)

// PodInfo identifies the pod a step volume was published for.
type PodInfo struct {
	Name      string `json:"name,omitempty"`
	Namespace string `json:"namespace,omitempty"`
	UID       string `json:"uid,omitempty"`
}

// View is the metadata of one published step volume.
type View struct {
	VolumeID   string            `json:"volumeID"`
	Target     string            `json:"target"`
	Source     string            `json:"source,omitempty"`
	Capture    string            `json:"capture,omitempty"`
	Scope      Scope             `json:"scope,omitempty"`
	Properties map[string]string `json:"properties,omitempty"`
	ReadOnly   bool              `json:"readOnly,omitempty"`
	Pod        PodInfo           `json:"pod"`
	// Backend is the COW backend that built the view; a restarted plugin
	// may run another one and must still tear this view down its way.
	Backend string `json:"backend"`
	// Lowers are the source's data dirs, top first, as mounted.
	Lowers []string `json:"lowers,omitempty"`
	// Pins are the handles of the source chain: in use while the view lives.
	Pins  []string  `json:"pins,omitempty"`
	State ViewState `json:"state"`
	// Boot is the kernel boot the view was published in: a view from an
	// earlier boot lost whatever had not reached the disk.
	Boot      string    `json:"boot,omitempty"`
	CreatedAt time.Time `json:"createdAt"`
}

// Errors the store answers with; callers map them to their own codes.
var (
	ErrNotFound       = errors.New("not found")
	ErrNotReady       = errors.New("not ready")
	ErrUnusable       = errors.New("failed or being destroyed")
	ErrExists         = errors.New("already exists")
	ErrPermission     = errors.New("permission denied")
	ErrInUse          = errors.New("in use")
	ErrHasChildren    = errors.New("has children")
	ErrWrongViewState = errors.New("step volume is in the wrong state")
)

// Remover deletes a tree from disk; it must treat a missing path as done.
type Remover func(path string) error

var (
	volumesBucket = []byte("volumes")
	viewsBucket   = []byte("views")
	metaBucket    = []byte("meta")
	bootKey       = []byte("boot")
)

// Store is the node's volume store. It is safe for concurrent use; bbolt
// serialises writers.
type Store struct {
	dir string
	db  *bolt.DB
	now func() time.Time
}

// Open opens (creating if needed) the store under dir.
func Open(dir string) (*Store, error) {
	for _, d := range []string{dir, filepath.Join(dir, "layers"), filepath.Join(dir, "views"),
		filepath.Join(dir, "staging"), filepath.Join(dir, "trash")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("creating state dir: %w", err)
		}
	}
	db, err := bolt.Open(filepath.Join(dir, "meta.db"), 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("opening metadata (is another plugin using %s?): %w", dir, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{volumesBucket, viewsBucket, metaBucket} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, err
	}
	return &Store{dir: dir, db: db, now: time.Now}, nil
}

// Close closes the metadata file.
func (s *Store) Close() error { return s.db.Close() }

// Dir is the state dir.
func (s *Store) Dir() string { return s.dir }

// LayerPath is where a volume's data dir named layer lives.
func (s *Store) LayerPath(handle, layer string) string {
	return filepath.Join(s.dir, "layers", handle, layer)
}

// DataPath is where a volume's current data lives.
func (s *Store) DataPath(v Volume) string { return s.LayerPath(v.Handle, v.Layer) }

// ViewDir is the private dir of a step volume. Volume IDs come from the
// caller, so the dir is named by a digest, never by the ID itself.
func (s *Store) ViewDir(volumeID string) string {
	sum := sha256.Sum256([]byte(volumeID))
	return filepath.Join(s.ViewsDir(), hex.EncodeToString(sum[:16]))
}

// ViewsDir holds the private dirs of step volumes.
func (s *Store) ViewsDir() string { return filepath.Join(s.dir, "views") }

// StagingDir holds half-made trees (flattening); it is emptied at start-up.
func (s *Store) StagingDir() string { return filepath.Join(s.dir, "staging") }

// TrashDir holds trees renamed away for deletion in the background.
func (s *Store) TrashDir() string { return filepath.Join(s.dir, "trash") }

func getJSON[T any](b *bolt.Bucket, key string) (T, bool, error) {
	var v T
	raw := b.Get([]byte(key))
	if raw == nil {
		return v, false, nil
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return v, false, fmt.Errorf("decoding %q: %w", key, err)
	}
	return v, true, nil
}

func putJSON(b *bolt.Bucket, key string, v any) error {
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return b.Put([]byte(key), raw)
}

func listJSON[T any](b *bolt.Bucket) ([]T, error) {
	var out []T
	err := b.ForEach(func(k, raw []byte) error {
		var v T
		if err := json.Unmarshal(raw, &v); err != nil {
			return fmt.Errorf("decoding %q: %w", k, err)
		}
		out = append(out, v)
		return nil
	})
	return out, err
}

// getOne reads one record, answering ErrNotFound (naming what) if absent.
func getOne[T any](s *Store, bucket []byte, key, what string) (T, error) {
	var v T
	err := s.db.View(func(tx *bolt.Tx) error {
		var ok bool
		var err error
		v, ok, err = getJSON[T](tx.Bucket(bucket), key)
		if err == nil && !ok {
			err = fmt.Errorf("%s %q: %w", what, key, ErrNotFound)
		}
		return err
	})
	return v, err
}

// listAll reads every record of a bucket, in key order.
func listAll[T any](s *Store, bucket []byte) ([]T, error) {
	var out []T
	err := s.db.View(func(tx *bolt.Tx) error {
		var err error
		out, err = listJSON[T](tx.Bucket(bucket))
		return err
	})
	return out, err
}

// Get returns the volume with the handle.
func (s *Store) Get(handle string) (Volume, error) {
	return getOne[Volume](s, volumesBucket, handle, "volume")
}

// List returns every volume, sorted by handle.
func (s *Store) List() ([]Volume, error) { return listAll[Volume](s, volumesBucket) }

// FindByProperties returns the ready volumes carrying every given property.
func (s *Store) FindByProperties(props map[string]string) ([]Volume, error) {
	all, err := s.List()
	if err != nil {
		return nil, err
	}
	var out []Volume
	for _, v := range all {
		if v.State != StateReady {
			continue
		}
		match := true
		for k, want := range props {
			if got, ok := v.Properties[k]; !ok || got != want {
				match = false
				break
			}
		}
		if match {
			out = append(out, v)
		}
	}
	return out, nil
}

// GetView returns the step volume with the ID.
func (s *Store) GetView(volumeID string) (View, error) {
	return getOne[View](s, viewsBucket, volumeID, "step volume")
}

// ListViews returns every step volume.
func (s *Store) ListViews() ([]View, error) { return listAll[View](s, viewsBucket) }

// chain walks from handle down its Base links, returning handles and data
// dirs top first. Every volume on it must be ready.
func (s *Store) chain(vols *bolt.Bucket, handle string) (handles, dirs []string, err error) {
	for h := handle; h != ""; {
		v, ok, err := getJSON[Volume](vols, h)
		if err != nil {
			return nil, nil, err
		}
		if !ok {
			return nil, nil, fmt.Errorf("volume %q (in the chain of %q): %w", h, handle, ErrNotFound)
		}
		if v.State != StateReady {
			return nil, nil, fmt.Errorf("volume %q (in the chain of %q) is %s: %w", h, handle, v.State, ErrUnusable)
		}
		handles = append(handles, h)
		dirs = append(dirs, s.DataPath(v))
		if len(handles) > 10000 {
			return nil, nil, fmt.Errorf("chain of %q loops", handle)
		}
		h = v.Base
	}
	return handles, dirs, nil
}

// Chain returns a ready volume's data dirs, top first.
func (s *Store) Chain(handle string) ([]string, error) {
	var dirs []string
	err := s.db.View(func(tx *bolt.Tx) error {
		var err error
		_, dirs, err = s.chain(tx.Bucket(volumesBucket), handle)
		return err
	})
	return dirs, err
}

// CanRead says whether a pod of namespace may use v as a source.
func CanRead(v Volume, namespace string) bool {
	return v.Scope == ScopeCluster || v.Namespace == namespace
}

// Publish records a new step volume in one transaction: the source must be
// ready and readable by the pod's namespace (its chain is pinned), and the
// capture handle, if any, must be free (it is reserved). The returned view
// carries the lowers to mount.
func (s *Store) Publish(v View) (View, error) {
	now := s.now()
	err := s.db.Update(func(tx *bolt.Tx) error {
		vols, views := tx.Bucket(volumesBucket), tx.Bucket(viewsBucket)
		if _, ok, err := getJSON[View](views, v.VolumeID); err != nil {
			return err
		} else if ok {
			return fmt.Errorf("step volume %q: %w", v.VolumeID, ErrExists)
		}
		v.Lowers, v.Pins = nil, nil
		if v.Source != "" {
			src, ok, err := getJSON[Volume](vols, v.Source)
			if err != nil {
				return err
			}
			switch {
			case !ok:
				return fmt.Errorf("source volume %q is not cached on this node: %w", v.Source, ErrNotFound)
			case src.State == StateCreating:
				return fmt.Errorf("source volume %q is still being captured: %w", v.Source, ErrNotReady)
			case src.State != StateReady:
				return fmt.Errorf("source volume %q is %s: %w", v.Source, src.State, ErrUnusable)
			case !CanRead(src, v.Pod.Namespace):
				return fmt.Errorf("source volume %q belongs to namespace %q and is not cluster-scoped: %w",
					v.Source, src.Namespace, ErrPermission)
			}
			if v.Pins, v.Lowers, err = s.chain(vols, v.Source); err != nil {
				return err
			}
			src.LastUsed = now
			if err := putJSON(vols, src.Handle, src); err != nil {
				return err
			}
		}
		if v.Capture != "" {
			if old, ok, err := getJSON[Volume](vols, v.Capture); err != nil {
				return err
			} else if ok {
				return fmt.Errorf("capture handle %q is taken (volume is %s): %w", v.Capture, old.State, ErrExists)
			}
			reserved := Volume{
				Handle: v.Capture, Parent: v.Source, Layer: fmt.Sprintf("l%x", now.UnixNano()),
				State: StateCreating, Namespace: v.Pod.Namespace, Scope: v.Scope, Properties: v.Properties,
				SizeBytes: -1, Inodes: -1, CreatedAt: now, LastUsed: now, Owner: v.VolumeID,
			}
			if err := putJSON(vols, v.Capture, reserved); err != nil {
				return err
			}
		}
		v.State = ViewPublishing
		v.CreatedAt = now
		return putJSON(views, v.VolumeID, v)
	})
	return v, err
}

// SetViewState moves a step volume from one state to another.
func (s *Store) SetViewState(volumeID string, from, to ViewState) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		views := tx.Bucket(viewsBucket)
		v, ok, err := getJSON[View](views, volumeID)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("step volume %q: %w", volumeID, ErrNotFound)
		}
		if v.State == to {
			return nil
		}
		if v.State != from {
			return fmt.Errorf("step volume %q is %s, not %s: %w", volumeID, v.State, from, ErrWrongViewState)
		}
		v.State = to
		return putJSON(views, volumeID, v)
	})
}

// CaptureTarget returns the reserved volume a capturing view commits into.
func (s *Store) CaptureTarget(view View) (Volume, error) {
	v, err := s.Get(view.Capture)
	if err != nil {
		return v, err
	}
	if v.State != StateCreating || v.Owner != view.VolumeID {
		return v, fmt.Errorf("capture handle %q is %s and not reserved by %q: %w", view.Capture, v.State, view.VolumeID, ErrExists)
	}
	return v, nil
}

// CommitCapture turns a capturing view's reservation into a ready volume and
// forgets the view, in one transaction. diff says the layer is an overlay
// upper dir over the view's source (so the source becomes its base).
func (s *Store) CommitCapture(volumeID string, diff bool) (Volume, error) {
	var out Volume
	err := s.db.Update(func(tx *bolt.Tx) error {
		vols, views := tx.Bucket(volumesBucket), tx.Bucket(viewsBucket)
		view, ok, err := getJSON[View](views, volumeID)
		if err != nil {
			return err
		}
		if !ok || view.State != ViewCapturing {
			return fmt.Errorf("step volume %q is not capturing: %w", volumeID, ErrWrongViewState)
		}
		vol, ok, err := getJSON[Volume](vols, view.Capture)
		if err != nil {
			return err
		}
		if !ok || vol.State != StateCreating || vol.Owner != volumeID {
			return fmt.Errorf("capture handle %q is not reserved by %q: %w", view.Capture, volumeID, ErrExists)
		}
		if diff {
			vol.Base = view.Source
		}
		now := s.now()
		vol.State, vol.Owner, vol.CreatedAt, vol.LastUsed = StateReady, "", now, now
		if err := putJSON(vols, vol.Handle, vol); err != nil {
			return err
		}
		out = vol
		return views.Delete([]byte(volumeID))
	})
	return out, err
}

// DropView forgets a step volume that is not being captured, releasing its
// capture reservation. It returns the dropped view (ok false if there was
// none) and the reserved volume's dir that the caller must remove, if any.
func (s *Store) DropView(volumeID string) (view View, ok bool, reservedDir string, err error) {
	err = s.db.Update(func(tx *bolt.Tx) error {
		vols, views := tx.Bucket(volumesBucket), tx.Bucket(viewsBucket)
		var err error
		view, ok, err = getJSON[View](views, volumeID)
		if err != nil || !ok {
			return err
		}
		if view.Capture != "" {
			vol, found, err := getJSON[Volume](vols, view.Capture)
			if err != nil {
				return err
			}
			if found && vol.State == StateCreating && vol.Owner == volumeID {
				reservedDir = filepath.Dir(s.DataPath(vol))
				if err := vols.Delete([]byte(vol.Handle)); err != nil {
					return err
				}
			}
		}
		return views.Delete([]byte(volumeID))
	})
	return view, ok, reservedDir, err
}

// SetUsage records what a volume's layer holds on disk.
func (s *Store) SetUsage(handle string, bytes, inodes int64) error {
	return s.update(handle, func(v *Volume) error {
		v.SizeBytes, v.Inodes = bytes, inodes
		return nil
	})
}

// ReplaceLayer makes layer (already in place under the volume's dir) the
// volume's data, as a root layer; the old one is kept until unused.
func (s *Store) ReplaceLayer(handle, layer string) error {
	return s.update(handle, func(v *Volume) error {
		if v.State != StateReady {
			return fmt.Errorf("volume %q is %s: %w", handle, v.State, ErrUnusable)
		}
		v.OldLayers = append(v.OldLayers, v.Layer)
		v.Layer, v.Base = layer, ""
		return nil
	})
}

func (s *Store) update(handle string, change func(*Volume) error) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		vols := tx.Bucket(volumesBucket)
		v, ok, err := getJSON[Volume](vols, handle)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("volume %q: %w", handle, ErrNotFound)
		}
		if err := change(&v); err != nil {
			return err
		}
		return putJSON(vols, handle, v)
	})
}

// SwapBoot records the current kernel boot ID and returns the one recorded
// before ("" on a new store).
func (s *Store) SwapBoot(current string) (previous string, err error) {
	err = s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(metaBucket)
		previous = string(b.Get(bootKey))
		return b.Put(bootKey, []byte(current))
	})
	return previous, err
}

// Unsynced returns the ready volumes whose data may not be on disk yet.
func (s *Store) Unsynced() ([]string, error) {
	vols, err := s.List()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, v := range vols {
		if v.State == StateReady && !v.Synced {
			out = append(out, v.Handle)
		}
	}
	return out, nil
}

// MarkSynced records that the volumes' data reached the disk. Volumes gone
// since are skipped.
func (s *Store) MarkSynced(handles []string) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		vols := tx.Bucket(volumesBucket)
		for _, h := range handles {
			v, ok, err := getJSON[Volume](vols, h)
			if err != nil {
				return err
			}
			if !ok || v.Synced {
				continue
			}
			v.Synced = true
			if err := putJSON(vols, h, v); err != nil {
				return err
			}
		}
		return nil
	})
}

// usersOf says why a volume may not go: its children and the views pinning it.
func usersOf(tx *bolt.Tx, handle string) error {
	vols, err := listJSON[Volume](tx.Bucket(volumesBucket))
	if err != nil {
		return err
	}
	for _, c := range vols {
		if c.Parent == handle || c.Base == handle {
			return fmt.Errorf("volume %q has child %q: %w", handle, c.Handle, ErrHasChildren)
		}
	}
	views, err := listJSON[View](tx.Bucket(viewsBucket))
	if err != nil {
		return err
	}
	for _, v := range views {
		if slices.Contains(v.Pins, handle) {
			return fmt.Errorf("volume %q is mounted by step volume %q: %w", handle, v.VolumeID, ErrInUse)
		}
	}
	return nil
}

// Destroy removes a volume and its data. It refuses while the volume has
// children or is in use, and a missing volume counts as destroyed.
func (s *Store) Destroy(handle string, remove Remover) error {
	var doomed Volume
	err := s.db.Update(func(tx *bolt.Tx) error {
		vols := tx.Bucket(volumesBucket)
		v, ok, err := getJSON[Volume](vols, handle)
		if err != nil || !ok {
			return err
		}
		if v.State == StateCreating {
			return fmt.Errorf("volume %q is being captured by %q: %w", handle, v.Owner, ErrInUse)
		}
		if err := usersOf(tx, handle); err != nil {
			return err
		}
		v.State = StateDestroying
		doomed = v
		return putJSON(vols, handle, v)
	})
	if err != nil || doomed.Handle == "" {
		return err
	}
	return s.finishDestroy(doomed, remove)
}

func (s *Store) finishDestroy(v Volume, remove Remover) error {
	if err := remove(filepath.Dir(s.DataPath(v))); err != nil {
		return fmt.Errorf("removing data of %q: %w", v.Handle, err)
	}
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(volumesBucket).Delete([]byte(v.Handle))
	})
}

// PruneLayers removes data dirs that flattening replaced and that no view
// mounts any longer.
func (s *Store) PruneLayers(remove Remover) error {
	views, err := s.ListViews()
	if err != nil {
		return err
	}
	mounted := map[string]bool{}
	for _, v := range views {
		for _, l := range v.Lowers {
			mounted[l] = true
		}
	}
	vols, err := s.List()
	if err != nil {
		return err
	}
	var errs []error
	for _, v := range vols {
		var gone []string
		for _, old := range v.OldLayers {
			p := s.LayerPath(v.Handle, old)
			if mounted[p] {
				continue
			}
			if err := remove(p); err != nil {
				errs = append(errs, err)
				continue
			}
			gone = append(gone, old)
		}
		if len(gone) == 0 {
			continue
		}
		errs = append(errs, s.update(v.Handle, func(cur *Volume) error {
			cur.OldLayers = slices.DeleteFunc(cur.OldLayers, func(l string) bool { return slices.Contains(gone, l) })
			return nil
		}))
	}
	return errors.Join(errs...)
}

// RecoveryReport says what Recover found and did.
type RecoveryReport struct {
	Ready, DroppedReservations, FinishedDestroys, MarkedFailed, RemovedOrphans int
}

// Recover reconciles the volume metadata with the disk after a restart. It
// must run after the caller has settled the views (dropping the ones that
// were half-published), so that a reservation whose view is gone is known to
// be half-made. Half-made volumes and orphan dirs are removed; a ready
// volume whose data is missing, or that a reboot caught unsynced, is marked
// failed, never silently dropped or served torn.
func (s *Store) Recover(remove Remover, rebooted bool) (RecoveryReport, error) {
	var rep RecoveryReport
	views, err := s.ListViews()
	if err != nil {
		return rep, err
	}
	live := map[string]bool{}
	for _, v := range views {
		live[v.VolumeID] = true
	}
	vols, err := s.List()
	if err != nil {
		return rep, err
	}
	var errs []error
	known := map[string]Volume{}
	for _, v := range vols {
		switch {
		case v.State == StateCreating && !live[v.Owner]:
			errs = append(errs, s.finishDestroy(v, remove))
			rep.DroppedReservations++
			continue
		case v.State == StateDestroying:
			errs = append(errs, s.finishDestroy(v, remove))
			rep.FinishedDestroys++
			continue
		case v.State == StateReady:
			_, statErr := os.Lstat(s.DataPath(v))
			if statErr != nil || (rebooted && !v.Synced) {
				errs = append(errs, s.update(v.Handle, func(cur *Volume) error {
					cur.State = StateFailed
					return nil
				}))
				rep.MarkedFailed++
			} else {
				rep.Ready++
			}
		}
		known[v.Handle] = v
	}
	// Dirs on disk that the metadata does not name are leftovers of a
	// capture or flatten cut short: they were never visible, so they go.
	layersDir := filepath.Join(s.dir, "layers")
	entries, err := os.ReadDir(layersDir)
	if err != nil {
		return rep, err
	}
	for _, e := range entries {
		v, ok := known[e.Name()]
		if !ok {
			errs = append(errs, remove(filepath.Join(layersDir, e.Name())))
			rep.RemovedOrphans++
			continue
		}
		inner, err := os.ReadDir(filepath.Join(layersDir, e.Name()))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, l := range inner {
			if l.Name() == v.Layer || slices.Contains(v.OldLayers, l.Name()) {
				continue
			}
			errs = append(errs, remove(s.LayerPath(v.Handle, l.Name())))
			rep.RemovedOrphans++
		}
	}
	staged, err := os.ReadDir(s.StagingDir())
	if err != nil {
		return rep, err
	}
	for _, e := range staged {
		errs = append(errs, remove(filepath.Join(s.StagingDir(), e.Name())))
		rep.RemovedOrphans++
	}
	errs = append(errs, s.PruneLayers(remove))
	return rep, errors.Join(errs...)
}
