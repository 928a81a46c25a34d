// Package cache owns cowvol's node-local volume store: the metadata of every
// cached volume (namespace and handle, lineage, state, properties, size, pin,
// TTL) and of every step volume ("view") published from one, kept in a
// single bbolt file so that each change is one fsynced transaction, with
// indexes of what holds each volume's data, plus the layout of the state dir
// and, per namespace, the order steps read lazily pulled inputs in (a hint
// for the next lazy pull, readorder.go).
//
// It decides what may happen (find-or-create, who may read what, what is in
// use, what may be evicted, what is an orphan) but never mounts anything and
// never reads or writes volume contents: the copy-on-write mechanics live in
// package overlay, the pipelines in package node. Deleting trees is done
// through a Remover the caller supplies, because only the caller knows how (a
// btrfs subvolume is not a plain directory).
package cache

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

// Volume is the metadata of one cached volume. Its identity is its
// namespace (the capturing pod's) and its handle.
type Volume struct {
	Namespace string `json:"namespace"`
	Handle    string `json:"handle"`
	// Parent is the source the volume was captured from (lineage), if any;
	// it may be another namespace's cluster-scoped volume.
	Parent volume.Ref `json:"parent,omitzero"`
	// Base is the volume whose data this volume's layer is a diff over
	// (overlay capture); zero for a root layer holding a whole tree.
	Base volume.Ref `json:"base,omitzero"`
	// Layer names the data dir under layers/<handle>/ that is current.
	Layer string `json:"layer"`
	// OldLayers are data dirs replaced by flattening, kept until no view
	// mounts them.
	OldLayers  []string          `json:"oldLayers,omitempty"`
	State      volume.State      `json:"state"`
	Scope      volume.Scope      `json:"scope"`
	Properties map[string]string `json:"properties,omitempty"`
	// SizeBytes and Inodes are what the layer itself holds on disk; -1
	// until measured (measuring walks the tree, so it runs after commit).
	SizeBytes int64     `json:"sizeBytes"`
	Inodes    int64     `json:"inodes"`
	CreatedAt time.Time `json:"createdAt"`
	LastUsed  time.Time `json:"lastUsed"`
	// Lease owns a creating volume: what will make it (a step volume to be
	// captured into it). Recovery drops a reservation whose owner is gone.
	Lease Lease `json:"lease,omitzero"`
	// DestroyOnCommit marks a creating volume destroyed while it was
	// being made: it commits straight to destroying.
	DestroyOnCommit bool `json:"destroyOnCommit,omitempty"`
	// TTL destroys the volume that long after its last use (0: never).
	TTL time.Duration `json:"ttl,omitempty"`
	// Pin protects the volume from TTL expiry and eviction.
	Pin Pin `json:"pin,omitzero"`
	// Synced says the volume's data has reached the disk (a syncfs after
	// its capture or its pull). A ready volume that a reboot caught
	// unsynced may be torn, and is marked failed.
	Synced bool `json:"synced,omitempty"`
}

// Ref is the volume's identity.
func (v Volume) Ref() volume.Ref { return volume.Ref{Namespace: v.Namespace, Handle: v.Handle} }

// LeaseKind names what owns a reservation.
type LeaseKind string

// LeaseView: a step volume (by volume ID) will be captured into it.
const LeaseView LeaseKind = "view"

// Lease names the owner of a volume being made.
type Lease struct {
	Kind LeaseKind `json:"kind"`
	ID   string    `json:"id"`
}

func viewLease(volumeID string) Lease { return Lease{Kind: LeaseView, ID: volumeID} }

// Pin protects a volume from TTL expiry and eviction, until Until (zero:
// for good).
type Pin struct {
	Pinned bool      `json:"pinned,omitempty"`
	Until  time.Time `json:"until,omitzero"`
}

// Active says whether the pin protects the volume at now.
func (p Pin) Active(now time.Time) bool { return p.Pinned && (p.Until.IsZero() || now.Before(p.Until)) }

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
	// TTL is given to the captured volume.
	TTL time.Duration `json:"ttl,omitempty"`
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
	// ErrBackoff: captures into the handle failed lately; retry later.
	ErrBackoff = errors.New("backing off")
)

// Remover deletes a tree from disk; it must treat a missing path as done.
type Remover func(path string) error

var (
	volumesBucket = []byte("volumes")
	viewsBucket   = []byte("views")
	metaBucket    = []byte("meta")
	// childrenBucket indexes base → child (key "base\x00child"), and
	// pinsBucket pinned volume → step volume ("volume\x00volumeID"), so
	// that whether a volume may go is a prefix scan, not a scan of all.
	childrenBucket = []byte("children")
	pinsBucket     = []byte("pins")
	// failuresBucket counts a handle's failed volumes, for backoff.
	failuresBucket = []byte("failures")
	// imagesBucket indexes held volume → the container runtime's snapshot
	// that runs on it ("volume\x00snapshot"), as pinsBucket does views.
	imagesBucket = []byte("images")
	bootKey      = []byte("boot")
	schemaKey    = []byte("schema")
	storeIDKey   = []byte("storeID")
	revisionKey  = []byte("revision")
)

var allBuckets = [][]byte{volumesBucket, viewsBucket, metaBucket, childrenBucket, pinsBucket, failuresBucket, readOrdersBucket, imagesBucket}

// Store is the node's volume store. It is safe for concurrent use; bbolt
// serialises writers.
type Store struct {
	dir  string
	db   *bolt.DB
	id   string
	live liveHolds
}

// Open opens (creating if needed) the store under dir, migrating metadata
// and data written by an older schema.
func Open(dir string) (*Store, error) {
	for _, d := range []string{dir, filepath.Join(dir, "volumes"), filepath.Join(dir, "views"),
		filepath.Join(dir, "staging"), filepath.Join(dir, "trash")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("creating state dir: %w", err)
		}
	}
	// The free list is not written at each commit but rebuilt from the
	// pages at open (as etcd does): a commit writes one page fewer, about
	// a fifth of a publish's transaction, and the store is small.
	db, err := bolt.Open(filepath.Join(dir, "meta.db"), 0o600, &bolt.Options{
		NoFreelistSync: true, FreelistType: bolt.FreelistMapType, Timeout: 5 * time.Second,
	})
	if err != nil {
		return nil, fmt.Errorf("opening metadata (is another plugin using %s?): %w", dir, err)
	}
	s := &Store{dir: dir, db: db}
	fresh := false
	err = db.Update(func(tx *bolt.Tx) error {
		fresh = tx.Bucket(volumesBucket) == nil
		for _, b := range allBuckets {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		meta := tx.Bucket(metaBucket)
		if id := meta.Get(storeIDKey); id != nil {
			s.id = string(id)
		} else {
			// Made on first use: a wiped state dir gets a new one, which
			// tells a controller it holds nothing it held before.
			var b [16]byte
			if _, err := rand.Read(b[:]); err != nil {
				return err
			}
			s.id = hex.EncodeToString(b[:])
			if err := meta.Put(storeIDKey, []byte(s.id)); err != nil {
				return err
			}
		}
		if fresh {
			return meta.Put(schemaKey, []byte(schemaVersion))
		}
		return nil
	})
	if err == nil && !fresh {
		err = s.migrate()
	}
	if err != nil {
		db.Close()
		return nil, err
	}
	return s, nil
}

// Close closes the metadata file.
func (s *Store) Close() error { return s.db.Close() }

// Dir is the state dir.
func (s *Store) Dir() string { return s.dir }

// ID is the store's identity: random, made when the state dir was first
// used.
func (s *Store) ID() string { return s.id }

// Revision counts the changes to the volumes: it grows with every one.
func (s *Store) Revision() uint64 {
	var rev uint64
	_ = s.db.View(func(tx *bolt.Tx) error {
		if raw := tx.Bucket(metaBucket).Get(revisionKey); len(raw) == 8 {
			rev = binary.BigEndian.Uint64(raw)
		}
		return nil
	})
	return rev
}

// bump records one more change to the volumes.
func bump(tx *bolt.Tx) error {
	meta := tx.Bucket(metaBucket)
	var rev uint64
	if raw := meta.Get(revisionKey); len(raw) == 8 {
		rev = binary.BigEndian.Uint64(raw)
	}
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], rev+1)
	return meta.Put(revisionKey, b[:])
}

// indexKey is "from\x00to": handles, namespaces and volume IDs hold no NUL.
func indexKey(from, to string) []byte { return []byte(from + "\x00" + to) }

// indexed lists what an index holds for from.
func indexed(b *bolt.Bucket, from string) []string {
	var out []string
	prefix := []byte(from + "\x00")
	c := b.Cursor()
	for k, _ := c.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, _ = c.Next() {
		out = append(out, string(k[len(prefix):]))
	}
	return out
}

// VolumeDir holds every data dir of a volume. Namespaces and handles are
// validated names (no slash, no leading dot), so the path cannot escape.
func (s *Store) VolumeDir(r volume.Ref) string {
	return filepath.Join(s.dir, "volumes", r.Namespace, r.Handle)
}

// LayerPath is where a volume's data dir named layer lives.
func (s *Store) LayerPath(r volume.Ref, layer string) string {
	return filepath.Join(s.VolumeDir(r), layer)
}

// DataPath is where a volume's current data lives.
func (s *Store) DataPath(v Volume) string { return s.LayerPath(v.Ref(), v.Layer) }

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

// TreesDir holds empty step volume trees made ahead for publishes; it is
// emptied at start-up.
func (s *Store) TreesDir() string { return filepath.Join(s.dir, "trees") }

// TrashDir holds trees renamed away for deletion in the background.
func (s *Store) TrashDir() string { return filepath.Join(s.dir, "trash") }

func key(r volume.Ref) []byte { return []byte(r.String()) }

func getJSON[T any](b *bolt.Bucket, key []byte) (T, bool, error) {
	var v T
	raw := b.Get(key)
	if raw == nil {
		return v, false, nil
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return v, false, fmt.Errorf("decoding record %q: %w", key, err)
	}
	return v, true, nil
}

func putJSON(b *bolt.Bucket, key []byte, v any) error {
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return b.Put(key, raw)
}

// listJSON decodes every record of a bucket. A record that does not decode
// is skipped and named in bad: one damaged entry must not take down every
// listing (and with it the plugin's start-up).
func listJSON[T any](b *bolt.Bucket) (out []T, bad []string) {
	_ = b.ForEach(func(k, raw []byte) error {
		var v T
		if err := json.Unmarshal(raw, &v); err != nil {
			bad = append(bad, string(k))
			return nil
		}
		out = append(out, v)
		return nil
	})
	return out, bad
}

// getOne reads one record, answering ErrNotFound (naming what) if absent.
func getOne[T any](s *Store, bucket, k []byte, what string) (T, error) {
	var v T
	err := s.db.View(func(tx *bolt.Tx) error {
		var ok bool
		var err error
		v, ok, err = getJSON[T](tx.Bucket(bucket), k)
		if err == nil && !ok {
			err = fmt.Errorf("%s %q: %w", what, k, ErrNotFound)
		}
		return err
	})
	return v, err
}

// listAll reads every decodable record of a bucket, in key order.
func listAll[T any](s *Store, bucket []byte) []T {
	var out []T
	_ = s.db.View(func(tx *bolt.Tx) error {
		out, _ = listJSON[T](tx.Bucket(bucket))
		return nil
	})
	return out
}

// Get returns the volume named by r.
func (s *Store) Get(r volume.Ref) (Volume, error) {
	return getOne[Volume](s, volumesBucket, key(r), "volume")
}

// List returns every volume, sorted by namespace and handle.
func (s *Store) List() []Volume { return listAll[Volume](s, volumesBucket) }

// GetView returns the step volume with the ID.
func (s *Store) GetView(volumeID string) (View, error) {
	return getOne[View](s, viewsBucket, []byte(volumeID), "step volume")
}

// ListViews returns every step volume.
func (s *Store) ListViews() []View { return listAll[View](s, viewsBucket) }

// BadRecords names the records that do not decode, per bucket.
func (s *Store) BadRecords() []string {
	var out []string
	_ = s.db.View(func(tx *bolt.Tx) error {
		_, vols := listJSON[Volume](tx.Bucket(volumesBucket))
		_, views := listJSON[View](tx.Bucket(viewsBucket))
		for _, k := range vols {
			out = append(out, "volume "+k)
		}
		for _, k := range views {
			out = append(out, "step volume "+k)
		}
		return nil
	})
	return out
}

// chain walks from r down its Base links, returning refs and data dirs top
// first; usable says which layers may be in it. Errors name only the
// volume asked for: a layer below may belong to another namespace.
func (s *Store) chain(vols *bolt.Bucket, r volume.Ref, usable func(v Volume, top bool) bool) (refs []volume.Ref, dirs []string, err error) {
	for cur := r; !cur.IsZero(); {
		v, ok, err := getJSON[Volume](vols, key(cur))
		if err != nil {
			return nil, nil, err
		}
		if !ok {
			return nil, nil, fmt.Errorf("volume %q cannot be used: a layer it is built on is missing: %w", r.Handle, ErrUnusable)
		}
		if !usable(v, cur == r) {
			if v.State == volume.StateFilling {
				return nil, nil, fmt.Errorf("volume %q is still arriving from a peer: %w", r.Handle, ErrNotReady)
			}
			return nil, nil, fmt.Errorf("volume %q cannot be used: a layer it is built on is %s: %w", r.Handle, v.State, ErrUnusable)
		}
		refs = append(refs, cur)
		dirs = append(dirs, s.DataPath(v))
		if len(refs) > 10000 {
			return nil, nil, fmt.Errorf("chain of %q loops", r.Handle)
		}
		cur = v.Base
	}
	return refs, dirs, nil
}

// Chain returns the data dirs, top first, of a volume's chain whose data
// is all here.
func (s *Store) Chain(r volume.Ref) ([]string, error) {
	_, dirs, err := s.ChainOf(r)
	return dirs, err
}

// ChainOf returns the volumes of a chain whose data is all here, and their
// data dirs, top first: what may be copied out.
func (s *Store) ChainOf(r volume.Ref) (refs []volume.Ref, dirs []string, err error) {
	err = s.db.View(func(tx *bolt.Tx) error {
		refs, dirs, err = s.chain(tx.Bucket(volumesBucket), r, Volume.layerComplete)
		return err
	})
	return refs, dirs, err
}

// NotVisible is the one answer for a source that does not exist and for one
// the pod may not read: the two must be indistinguishable, or the answer
// would tell another namespace's handles, owners and states.
func NotVisible(src volume.Ref, podNamespace string) error {
	if src.Namespace == podNamespace {
		return fmt.Errorf("source volume %q is not cached on this node: %w", src.Handle, ErrNotFound)
	}
	return fmt.Errorf("source volume %q of namespace %q is not cached on this node, or is not shared "+
		"(captured with scope: cluster): %w", src.Handle, src.Namespace, ErrNotFound)
}

// ReadableBy says whether a pod of namespace may use v as a source: its
// own namespace's volumes, and others' that their owners shared.
func (v Volume) ReadableBy(namespace string) bool {
	return volume.Readable(v.Ref(), v.Scope, namespace)
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
				Namespace: c.Namespace, Handle: c.Handle, Parent: v.Source, Layer: fmt.Sprintf("l%x", now.UnixNano()),
				State: volume.StateCreating, Scope: v.Scope, Properties: v.Properties, TTL: v.TTL,
				SizeBytes: -1, Inodes: -1, CreatedAt: now, LastUsed: now, Lease: viewLease(v.VolumeID),
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
		vols, views := tx.Bucket(volumesBucket), tx.Bucket(viewsBucket)
		view, ok, err := getJSON[View](views, []byte(volumeID))
		if err != nil {
			return err
		}
		if !ok || view.State != ViewCapturing {
			return fmt.Errorf("step volume %q is not capturing: %w", volumeID, ErrWrongViewState)
		}
		ref := view.CaptureRef()
		vol, ok, err := getJSON[Volume](vols, key(ref))
		if err != nil {
			return err
		}
		if !ok || !vol.ReservedBy(viewLease(volumeID)) {
			return fmt.Errorf("capture handle %q is not reserved by %q: %w", view.Capture, volumeID, ErrExists)
		}
		if c.Diff {
			vol.Base = view.Source
			if err := tx.Bucket(childrenBucket).Put(indexKey(vol.Base.String(), ref.String()), nil); err != nil {
				return err
			}
		}
		vol.SizeBytes, vol.Inodes = c.Bytes, c.Inodes
		if len(c.Properties) > 0 {
			vol.Properties = maps.Clone(vol.Properties)
			if vol.Properties == nil {
				vol.Properties = map[string]string{}
			}
			maps.Copy(vol.Properties, c.Properties)
		}
		if err := vol.apply(EventCommit, viewLease(volumeID)); err != nil {
			return err
		}
		now := time.Now()
		vol.CreatedAt, vol.LastUsed = now, now
		if err := putJSON(vols, key(ref), vol); err != nil {
			return err
		}
		out = vol
		if err := errors.Join(unpin(tx, view), bump(tx), tx.Bucket(failuresBucket).Delete(key(ref))); err != nil {
			return err
		}
		return views.Delete([]byte(volumeID))
	})
	return out, err
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

// ReplaceLayer makes layer (already in place under the volume's dir) the
// volume's data, as a root layer; the old one is kept until unused.
func (s *Store) ReplaceLayer(r volume.Ref, layer string) error {
	return s.update(r, func(v *Volume) error {
		if v.State != volume.StateReady {
			return fmt.Errorf("volume %s is %s: %w", r, v.State, ErrUnusable)
		}
		v.OldLayers = append(v.OldLayers, v.Layer)
		v.Layer = layer
		return nil
	}, func(tx *bolt.Tx, v *Volume) error {
		// A root layer rests on nothing: its base holds no data for it.
		if v.Base.IsZero() {
			return nil
		}
		err := tx.Bucket(childrenBucket).Delete(indexKey(v.Base.String(), r.String()))
		v.Base = volume.Ref{}
		return err
	})
}

// update changes a volume in one transaction; also runs after the change,
// in the same transaction, for index upkeep.
func (s *Store) update(r volume.Ref, change func(*Volume) error, also ...func(*bolt.Tx, *Volume) error) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		vols := tx.Bucket(volumesBucket)
		v, ok, err := getJSON[Volume](vols, key(r))
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("volume %s: %w", r, ErrNotFound)
		}
		if err := change(&v); err != nil {
			return err
		}
		for _, fn := range also {
			if err := fn(tx, &v); err != nil {
				return err
			}
		}
		if err := bump(tx); err != nil {
			return err
		}
		return putJSON(vols, key(r), v)
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
func (s *Store) Unsynced() []volume.Ref {
	var out []volume.Ref
	for _, v := range s.List() {
		if v.State == volume.StateReady && !v.Synced {
			out = append(out, v.Ref())
		}
	}
	return out
}

// MarkSynced records that the volumes' data reached the disk. Volumes gone
// since are skipped.
func (s *Store) MarkSynced(refs []volume.Ref) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		vols := tx.Bucket(volumesBucket)
		for _, r := range refs {
			v, ok, err := getJSON[Volume](vols, key(r))
			if err != nil {
				return err
			}
			if !ok || v.Synced {
				continue
			}
			v.Synced = true
			if err := putJSON(vols, key(r), v); err != nil {
				return err
			}
		}
		return nil
	})
}

// PruneLayers removes data dirs that flattening replaced and that no view
// mounts any longer, leaving the volumes this process is streaming or
// filling.
func (s *Store) PruneLayers(remove Remover) error {
	mounted := map[string]bool{}
	for _, v := range s.ListViews() {
		for _, l := range v.Lowers {
			mounted[l] = true
		}
	}
	var errs []error
	for _, v := range s.List() {
		if len(v.OldLayers) == 0 || s.live.any(v.Ref()) {
			continue
		}
		var gone []string
		for _, old := range v.OldLayers {
			p := s.LayerPath(v.Ref(), old)
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
		errs = append(errs, s.update(v.Ref(), func(cur *Volume) error {
			cur.OldLayers = slices.DeleteFunc(cur.OldLayers, func(l string) bool { return slices.Contains(gone, l) })
			return nil
		}))
	}
	return errors.Join(errs...)
}

// RecoveryReport says what Recover found and did.
type RecoveryReport struct {
	Ready, DroppedReservations, Destroying, MarkedFailed, RemovedOrphans int
	// BadRecords are metadata entries that do not decode: left alone,
	// never served.
	BadRecords []string
}

// Recover reconciles the volume metadata with the disk after a restart. It
// must run after the caller has settled the views (dropping the ones that
// were half-published), so that a reservation whose view is gone is known to
// be half-made. Half-made volumes and orphan dirs are removed; a ready
// volume whose data is missing, or that a reboot caught unsynced, is marked
// failed, never silently dropped or served torn. Each failure is reported
// and the rest goes on: one bad entry must not stop the node.
func (s *Store) Recover(remove Remover, rebooted bool) (RecoveryReport, error) {
	rep := RecoveryReport{BadRecords: s.BadRecords()}
	live := map[string]bool{}
	for _, v := range s.ListViews() {
		live[v.VolumeID] = true
	}
	var errs []error
	known := map[volume.Ref]Volume{}
	for _, v := range s.List() {
		switch rec := v.recovered(live); {
		case rec == recoveryDrop:
			errs = append(errs, s.remove(v, remove))
			rep.DroppedReservations++
			continue
		case rec == recoveryFail:
			errs = append(errs, s.MarkFailed(v.Ref()))
			rep.MarkedFailed++
		case v.State == volume.StateDestroying:
			rep.Destroying++ // the reaper frees them once nothing holds them
		case v.State == volume.StateReady:
			_, statErr := os.Lstat(s.DataPath(v))
			if statErr != nil || (rebooted && !v.Synced) {
				errs = append(errs, s.MarkFailed(v.Ref()))
				rep.MarkedFailed++
			} else {
				rep.Ready++
			}
		}
		known[v.Ref()] = v
	}
	// Dirs on disk that the metadata does not name are leftovers of a
	// capture or flatten cut short: they were never visible, so they go.
	n, err := s.removeOrphans(known, remove)
	rep.RemovedOrphans += n
	errs = append(errs, err)
	staged, err := os.ReadDir(s.StagingDir())
	errs = append(errs, err)
	for _, e := range staged {
		errs = append(errs, remove(filepath.Join(s.StagingDir(), e.Name())))
		rep.RemovedOrphans++
	}
	errs = append(errs, s.PruneLayers(remove))
	return rep, errors.Join(errs...)
}

// removeOrphans removes what lies under volumes/ that no known volume owns:
// namespace dirs, volume dirs and data dirs.
func (s *Store) removeOrphans(known map[volume.Ref]Volume, remove Remover) (int, error) {
	root := filepath.Join(s.dir, "volumes")
	owned := map[string]bool{}
	for r := range known {
		owned[r.Namespace] = true
	}
	var errs []error
	removed := 0
	drop := func(p string) {
		errs = append(errs, remove(p))
		removed++
	}
	namespaces, err := os.ReadDir(root)
	if err != nil {
		return 0, err
	}
	for _, ns := range namespaces {
		nsDir := filepath.Join(root, ns.Name())
		if !owned[ns.Name()] {
			drop(nsDir)
			continue
		}
		handles, err := os.ReadDir(nsDir)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, h := range handles {
			v, ok := known[volume.Ref{Namespace: ns.Name(), Handle: h.Name()}]
			if !ok {
				drop(filepath.Join(nsDir, h.Name()))
				continue
			}
			layers, err := os.ReadDir(filepath.Join(nsDir, h.Name()))
			if err != nil {
				errs = append(errs, err)
				continue
			}
			for _, l := range layers {
				if l.Name() != v.Layer && !slices.Contains(v.OldLayers, l.Name()) {
					drop(s.LayerPath(v.Ref(), l.Name()))
				}
			}
		}
	}
	return removed, errors.Join(errs...)
}
