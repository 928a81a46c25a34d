// Package cache owns cowvol's node-local volume store: the metadata of every
// cached volume (namespace and handle, lineage, state, properties, size, pin,
// TTL) and of every step volume ("view") published from one, kept in a
// single bbolt file so that each change is one fsynced transaction, with
// indexes of what holds each volume's data, plus the layout of the state dir
// and, per namespace, the order steps read lazily pulled inputs in (a hint
// for the next lazy pull, readorder.go) and the current version of each
// cache key (caches.go).
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
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sync/singleflight"

	"github.com/concourse/cowvol/internal/ttlcache"
	"github.com/concourse/cowvol/pkg/filesum"
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
	// Copies is how many nodes the controller should keep the volume on
	// (0 or 1: the one that made it); a pulled copy does not carry it.
	Copies int `json:"copies,omitempty"`
	// Pin protects the volume from TTL expiry and eviction.
	Pin Pin `json:"pin,omitzero"`
	// Vouch are the digests of its files that the node that captured it
	// vouches for (volume.Digests): computed here after a capture, or
	// those a pull was checked against; zero until known.
	Vouch volume.Digests `json:"vouch,omitzero"`
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

var allBuckets = [][]byte{volumesBucket, viewsBucket, metaBucket, childrenBucket, pinsBucket, failuresBucket, readOrdersBucket, imagesBucket, cachesBucket}

// Store is the node's volume store. It is safe for concurrent use; bbolt
// serialises writers.
type Store struct {
	dir  string
	db   *bolt.DB
	id   string
	live liveHolds
	// sums are layers' file sums read or computed lately (sums.go), by
	// their file; summing computes each once.
	sums    *ttlcache.Cache[string, *filesum.Table]
	summing singleflight.Group
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
	s := &Store{dir: dir, db: db, sums: newSumsCache()}
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

// LayerKind says what made a volume's layer; it starts the layer's name.
type LayerKind byte

const (
	// LayerCaptured is a step's output, captured.
	LayerCaptured LayerKind = 'l'
	// LayerPulled is a layer pulled from a peer, or made plain of a whole
	// index pulled so.
	LayerPulled LayerKind = 'p'
	// LayerFlattened is a chain flattened into one root layer.
	LayerFlattened LayerKind = 'f'
)

// NewLayerName names a new data dir of a volume: its kind and the moment
// it is made, so that a volume's new layer never takes the name of an old
// one still read (OldLayers). Nothing parses it back.
func NewLayerName(kind LayerKind, now time.Time) string {
	return fmt.Sprintf("%c%x", kind, now.UnixNano())
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
	err = walkChain(vols, r, func(v Volume, ok bool) error {
		top := len(refs) == 0
		switch {
		case !ok:
			return fmt.Errorf("volume %q cannot be used: a layer it is built on is missing: %w", r.Handle, ErrUnusable)
		case !usable(v, top) && v.State == volume.StateFilling:
			return fmt.Errorf("volume %q is still arriving from a peer: %w", r.Handle, ErrNotReady)
		case !usable(v, top):
			return fmt.Errorf("volume %q cannot be used: a layer it is built on is %s: %w", r.Handle, v.State, ErrUnusable)
		}
		refs = append(refs, v.Ref())
		dirs = append(dirs, s.DataPath(v))
		return nil
	})
	if errors.Is(err, errChainLoops) {
		return nil, nil, fmt.Errorf("chain of %q loops", r.Handle)
	}
	if err != nil {
		return nil, nil, err
	}
	return refs, dirs, nil
}

// errChainLoops: a chain ran deeper than maxChain layers.
var errChainLoops = errors.New("a chain loops")

// walkChain calls fn with each volume of the chain from r down, top first
// (ok false, and the walk's end, where a layer is missing), until fn
// returns an error, which it returns. A chain that loops ends after
// maxChain layers with errChainLoops, which names no layer (one below r
// may be another namespace's).
func walkChain(vols *bolt.Bucket, r volume.Ref, fn func(v Volume, ok bool) error) error {
	for i := 0; !r.IsZero(); i++ {
		if i == maxChain {
			return errChainLoops
		}
		v, ok, err := getJSON[Volume](vols, key(r))
		if err != nil {
			return err
		}
		if err := fn(v, ok); err != nil || !ok {
			return err
		}
		r = v.Base
	}
	return nil
}

// maxChain bounds a walk down a chain (a node flattens long before).
const maxChain = 10000

// Chain returns the data dirs, top first, of a volume's chain whose data
// is all here.
func (s *Store) Chain(r volume.Ref) ([]string, error) {
	_, dirs, err := s.ChainOf(r, volume.NeedWhole)
	return dirs, err
}

// ChainOf returns the volumes of a chain and their data dirs, top first,
// as a reader that needs need of it may read them: with all of their data
// here (what may be copied out), or, for NeedTree, some still filling.
func (s *Store) ChainOf(r volume.Ref, need volume.Need) (refs []volume.Ref, dirs []string, err error) {
	usable := Volume.layerComplete
	if need == volume.NeedTree {
		usable = Volume.layerMountable
	}
	err = s.db.View(func(tx *bolt.Tx) error {
		refs, dirs, err = s.chain(tx.Bucket(volumesBucket), r, usable)
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
