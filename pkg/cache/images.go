package cache

import (
	"bytes"
	"fmt"
	"strings"

	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

// Image holds: the node's container runtime runs step images straight on
// cached volumes' layers (package snapshotter), and a container may
// outlive the plugin that let it start, so each of its snapshots holds
// the volumes it runs on in the metadata, as a step volume pins its
// chain, until the runtime removes it.

// HoldImage records that the runtime's snapshot holder runs on r's chain,
// once check accepts r's record, in one transaction: every layer of r's
// chain must be mountable (ready, or filling: a container reads a lazily
// pulled image as a step reads its input, each file's data arriving as it
// is opened), and check says whether r itself will do. It returns the
// chain's data dirs, top first. Holding again under the same holder
// answers the same, with no check: a volume destroyed under a hold is
// still there for it.
func (s *Store) HoldImage(holder string, r volume.Ref, check func(Volume) error) (dirs []string, err error) {
	if holder == "" || strings.ContainsRune(holder, 0) {
		return nil, fmt.Errorf("image holder %s: want a name without NUL", volume.Quote(holder))
	}
	// Held already (a snapshot's mounts asked for again): a read, with no
	// commit to sync.
	held := false
	err = s.db.View(func(tx *bolt.Tx) error {
		if held = tx.Bucket(imagesBucket).Get(indexKey(r.String(), holder)) != nil; held {
			_, dirs, err = s.chain(tx.Bucket(volumesBucket), r, heldLayer)
		}
		return err
	})
	if held || err != nil {
		return dirs, err
	}
	err = s.withRoom(func() error {
		return s.db.Update(func(tx *bolt.Tx) error {
			vols, images := tx.Bucket(volumesBucket), tx.Bucket(imagesBucket)
			usable := Volume.layerMountable
			if images.Get(indexKey(r.String(), holder)) != nil {
				usable = heldLayer
			} else {
				top, ok, err := getJSON[Volume](vols, key(r))
				if err != nil {
					return err
				}
				if !ok || top.Hidden() {
					return fmt.Errorf("volume %s: %w", r, ErrNotFound)
				}
				if err := check(top); err != nil {
					return err
				}
			}
			refs, chainDirs, err := s.chain(vols, r, usable)
			if err != nil {
				return err
			}
			for _, ref := range refs {
				if err := images.Put(indexKey(ref.String(), holder), nil); err != nil {
					return err
				}
			}
			dirs = chainDirs
			return nil
		})
	})
	return dirs, err
}

// ReleaseImage ends every hold of the runtime's snapshot holder. A holder
// that holds nothing is already released.
func (s *Store) ReleaseImage(holder string) error {
	suffix := []byte("\x00" + holder)
	err := s.db.Update(func(tx *bolt.Tx) error {
		images := tx.Bucket(imagesBucket)
		var gone [][]byte
		_ = images.ForEach(func(k, _ []byte) error {
			if bytes.HasSuffix(k, suffix) && !bytes.ContainsRune(k[:len(k)-len(suffix)], 0) {
				gone = append(gone, bytes.Clone(k))
			}
			return nil
		})
		for _, k := range gone {
			if err := images.Delete(k); err != nil {
				return err
			}
		}
		return nil
	})
	return err
}

// ImageHolders lists the runtime's snapshots that hold volumes, each once.
func (s *Store) ImageHolders() []string {
	seen := map[string]bool{}
	var out []string
	_ = s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(imagesBucket).ForEach(func(k, _ []byte) error {
			if i := bytes.IndexByte(k, 0); i >= 0 && !seen[string(k[i+1:])] {
				seen[string(k[i+1:])] = true
				out = append(out, string(k[i+1:]))
			}
			return nil
		})
	})
	return out
}

// heldLayer says whether a layer of a held chain is still there: a
// destroyed volume's data stays while it is held, and a filling one's
// arrives.
func heldLayer(v Volume, _ bool) bool { return v.layerMountable(false) }
