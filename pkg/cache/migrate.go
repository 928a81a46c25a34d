package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	bolt "go.etcd.io/bbolt"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/volume"
)

// unownedNamespace receives volumes that schema 0 recorded without a
// namespace (a request without the kubelet's pod info was accepted then).
// It is not a valid Kubernetes namespace, so no pod can ever own or name
// them; they stay until they are destroyed.
const unownedNamespace = "_unowned"

// v0Volume and v0View are the schema 0 records: handles named volumes
// node-wide, so a parent, a base, a source and a pin were bare handles.
type v0Volume struct {
	Volume
	Parent string `json:"parent,omitempty"`
	Base   string `json:"base,omitempty"`
	Owner  string `json:"owner,omitempty"`
}

// v1Volume is a schema 1 record: a creating volume named the step volume
// that would be captured into it as its owner, before leases.
type v1Volume struct {
	Volume
	Owner string `json:"owner,omitempty"`
}

type v0View struct {
	View
	Source string   `json:"source,omitempty"`
	Pins   []string `json:"pins,omitempty"`
}

// migration brings a store at the schema before it up to schema. Each
// commits its metadata changes and its schema in one transaction, after
// any data it moves (each move a rename, redone or skipped on the next
// run), so a migration cut short at any instant runs again from where the
// store was.
type migration struct {
	schema  string
	what    string
	migrate func(*Store) error
}

// migrations are every schema the metadata has had, oldest first; the last
// is what this code writes. Schema 0 is a store without a schema key. A
// change to what a record or bucket means (a state an older plugin does not
// know, a field read another way, a bucket an older plugin would not keep)
// adds one here, so that an older plugin refuses the store instead of
// misreading it.
//
// An optional field added to a record (a volume's copies, its vouched
// digests) needs no new schema: an older plugin that rewrites the record
// drops it, losing only what it could not act on (the volume is kept on one
// node; its digests are not reported, and the controller keeps those it
// had), and misreads nothing it keeps. Files kept beside a volume's layers (its sums, pkg/
// cache/sums.go) are the same: an older plugin's recovery removes them as
// strays, and they are computed again from the layer when a peer asks.
var migrations = []migration{
	{schema: "1", what: "volumes keyed by namespace/handle, their data under volumes/<namespace>/<handle>", migrate: (*Store).migrateTo1},
	{schema: "2", what: "leases own creating volumes; children and pins indexed; the destroying and filling states; " +
		"failures, readOrders and images buckets", migrate: (*Store).migrateTo2},
	{schema: "3", what: "the caches bucket: each cache key's current version; views of a cache", migrate: (*Store).migrateTo3},
}

// schemaVersion is the metadata layout this code writes.
var schemaVersion = migrations[len(migrations)-1].schema

// migrate brings metadata and data written by an older schema up to this
// one, one migration at a time.
func (s *Store) migrate() error {
	var version string
	if err := s.db.View(func(tx *bolt.Tx) error {
		version = string(tx.Bucket(metaBucket).Get(schemaKey))
		return nil
	}); err != nil {
		return err
	}
	next := 0 // schema 0: every migration
	if version != "" {
		next = slices.IndexFunc(migrations, func(m migration) bool { return m.schema == version }) + 1
		if next == 0 {
			return fmt.Errorf("metadata schema %q is newer than this plugin understands (it knows up to %s): "+
				"run the cowvol that wrote it, or a newer one", version, schemaVersion)
		}
	}
	for _, m := range migrations[next:] {
		if err := m.migrate(s); err != nil {
			return fmt.Errorf("migrating metadata to schema %s (%s): %w", m.schema, m.what, err)
		}
		klog.InfoS("Migrated metadata", "dir", s.dir, "schema", m.schema, "change", m.what)
	}
	return nil
}

// putSchema records the schema a migration's transaction brings the store to.
func putSchema(tx *bolt.Tx, schema string) error {
	return tx.Bucket(metaBucket).Put(schemaKey, []byte(schema))
}

// migrateTo1 moves schema 0's volumes, keyed by handle alone, under their
// namespaces.
func (s *Store) migrateTo1() error {
	namespaces := map[string]string{} // handle → namespace
	var vols []v0Volume
	var views []v0View
	err := s.db.View(func(tx *bolt.Tx) error {
		return errors.Join(
			tx.Bucket(volumesBucket).ForEach(func(k, raw []byte) error {
				var v v0Volume
				if err := json.Unmarshal(raw, &v); err != nil {
					return fmt.Errorf("migrating volume %q: %w", k, err)
				}
				if v.Namespace == "" {
					v.Namespace = unownedNamespace
				}
				namespaces[v.Handle] = v.Namespace
				vols = append(vols, v)
				return nil
			}),
			tx.Bucket(viewsBucket).ForEach(func(k, raw []byte) error {
				var v v0View
				if err := json.Unmarshal(raw, &v); err != nil {
					return fmt.Errorf("migrating step volume %q: %w", k, err)
				}
				views = append(views, v)
				return nil
			}))
	})
	if err != nil {
		return err
	}
	ref := func(h string) volume.Ref {
		if h == "" {
			return volume.Ref{}
		}
		return volume.Ref{Namespace: namespaces[h], Handle: h}
	}
	oldLayers := filepath.Join(s.dir, "layers")
	for _, v := range vols {
		if err := moveDir(filepath.Join(oldLayers, v.Handle), s.VolumeDir(volume.Ref{Namespace: v.Namespace, Handle: v.Handle})); err != nil {
			return fmt.Errorf("migrating the data of %q: %w", v.Handle, err)
		}
	}
	err = s.db.Update(func(tx *bolt.Tx) error {
		vb, wb := tx.Bucket(volumesBucket), tx.Bucket(viewsBucket)
		for _, old := range vols {
			v := old.Volume
			v.Parent, v.Base = ref(old.Parent), ref(old.Base)
			if old.Owner != "" {
				v.Lease = viewLease(old.Owner)
			}
			if err := vb.Delete([]byte(v.Handle)); err != nil {
				return err
			}
			if err := putJSON(vb, key(v.Ref()), v); err != nil {
				return err
			}
			if !v.Base.IsZero() {
				if err := tx.Bucket(childrenBucket).Put(indexKey(v.Base.String(), v.Ref().String()), nil); err != nil {
					return err
				}
			}
		}
		for _, old := range views {
			v := old.View
			v.Source = ref(old.Source)
			v.Pins = nil
			for _, p := range old.Pins {
				v.Pins = append(v.Pins, ref(p))
			}
			// Lowers name data dirs, which moved with their volumes.
			for i, l := range v.Lowers {
				if rel, ok := strings.CutPrefix(l, oldLayers+"/"); ok {
					h, rest, _ := strings.Cut(rel, "/")
					v.Lowers[i] = filepath.Join(s.VolumeDir(ref(h)), rest)
				}
			}
			if err := putJSON(wb, []byte(v.VolumeID), v); err != nil {
				return err
			}
			for _, p := range v.Pins {
				if err := tx.Bucket(pinsBucket).Put(indexKey(p.String(), v.VolumeID), nil); err != nil {
					return err
				}
			}
		}
		return putSchema(tx, "1")
	})
	if err != nil {
		return err
	}
	// Every volume's dir has moved out; what may be left (leftovers of a
	// capture a crash cut short under schema 0) stays for an operator:
	// this code never deletes a tree it did not account for.
	_ = os.Remove(oldLayers)
	return nil
}

// moveDir renames from to to, making to's parent; a move already done (from
// gone, to there) is done.
func moveDir(from, to string) error {
	if err := os.MkdirAll(filepath.Dir(to), 0o700); err != nil {
		return err
	}
	err := os.Rename(from, to)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// migrateTo2 gives creating volumes that schema 1 recorded with an owner a
// lease, and rebuilds the children and pins indexes from the records: the
// first schema 1 stores had neither index, and a reaper reading an empty
// index would free a base under a child or a source under a step.
func (s *Store) migrateTo2() error {
	return s.db.Update(func(tx *bolt.Tx) error {
		vb, wb := tx.Bucket(volumesBucket), tx.Bucket(viewsBucket)
		children, pins := tx.Bucket(childrenBucket), tx.Bucket(pinsBucket)
		var leased []Volume
		err := vb.ForEach(func(k, raw []byte) error {
			var v v1Volume
			if err := json.Unmarshal(raw, &v); err != nil {
				// A record that does not decode is never served (see
				// Recover); the migration leaves it as it is.
				return nil
			}
			if !v.Base.IsZero() {
				if err := children.Put(indexKey(v.Base.String(), v.Ref().String()), nil); err != nil {
					return err
				}
			}
			if v.Owner != "" && v.Lease.Kind == "" {
				v.Volume.Lease = viewLease(v.Owner)
				leased = append(leased, v.Volume)
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, v := range leased {
			if err := putJSON(vb, key(v.Ref()), v); err != nil {
				return err
			}
		}
		err = wb.ForEach(func(k, raw []byte) error {
			var v View
			if err := json.Unmarshal(raw, &v); err != nil {
				return nil
			}
			for _, p := range v.Pins {
				if err := pins.Put(indexKey(p.String(), v.VolumeID), nil); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		return putSchema(tx, "2")
	})
}

// migrateTo3 adds the caches bucket (Open made it): an older plugin would
// not keep it, and would capture a cache's view without promoting it.
func (s *Store) migrateTo3() error {
	return s.db.Update(func(tx *bolt.Tx) error { return putSchema(tx, "3") })
}
