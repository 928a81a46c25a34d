package cache

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

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
			for _, beside := range []string{p + sumsSuffix, p + stubsSuffix} {
				if err := os.Remove(beside); err != nil && !errors.Is(err, fs.ErrNotExist) {
					errs = append(errs, err)
				}
			}
			if err := remove(IndexDir(p)); err != nil {
				errs = append(errs, err)
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
				layer := l.Name()
				if of := layerBeside(layer); of != "" {
					layer = of // a layer's sums and index go with it
				}
				if layer != v.Layer && !slices.Contains(v.OldLayers, layer) {
					drop(s.LayerPath(v.Ref(), l.Name()))
				}
			}
		}
	}
	return removed, errors.Join(errs...)
}
