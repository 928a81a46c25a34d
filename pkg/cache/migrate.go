package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	bolt "go.etcd.io/bbolt"

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

type v0View struct {
	View
	Source string   `json:"source,omitempty"`
	Pins   []string `json:"pins,omitempty"`
}

// migrate brings metadata and data written by an older schema up to this
// one. It is safe to cut short at any instant: the data dirs move first
// (each move a rename, redone or skipped on the next run), and the metadata
// changes in one transaction that also records the new schema.
func (s *Store) migrate() error {
	var version string
	if err := s.db.View(func(tx *bolt.Tx) error {
		version = string(tx.Bucket(metaBucket).Get(schemaKey))
		return nil
	}); err != nil {
		return err
	}
	switch version {
	case schemaVersion:
		return nil
	case "":
		return s.migrateFrom0()
	}
	return fmt.Errorf("metadata schema %q is newer than this plugin understands (%s): run a newer cowvol", version, schemaVersion)
}

func (s *Store) migrateFrom0() error {
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
		return tx.Bucket(metaBucket).Put(schemaKey, []byte(schemaVersion))
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
