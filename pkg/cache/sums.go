package cache

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/ttlcache"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/volume"
)

// sums.go: each ready layer's file sums (pkg/filesum), kept beside the
// layer as <layer>.sums. They are computed once from the layer, after a
// capture in the background and at the latest when a peer first asks, and
// read back after; they go with the layer (a destroy removes the volume's
// dir, a prune the replaced layer's, recovery whatever names no layer of
// its volume). A few tables are kept in memory (a lazy pull asks for one
// file at a time): their paths, their sums read from their file as asked
// (filesum.ReadFile), which a table does not hold open.

// sumsSuffix names a layer's sums beside it.
const sumsSuffix = ".sums"

// sumsKept is how many layers' tables are kept in memory, and for how long.
const (
	sumsKept    = 16
	sumsKeptFor = 10 * time.Minute
)

// indexSuffix names the dir beside a layer pulled as an index that holds
// the index's image and blob (the layer's dir is where it is mounted).
const indexSuffix = ".index"

// stubsSuffix names the file beside a layer that keeps its stub tree as a
// stream (streamer.KeepStubs), which pulls of its stubs are served from.
const stubsSuffix = ".stubs"

// StubsPath is where v's layer's stub tree is kept, if it is.
func (s *Store) StubsPath(v Volume) string { return StubsFile(s.DataPath(v)) }

// StubsFile is where the stub tree of the layer dir at layerPath is kept,
// if it is: beside it, as its sums are.
func StubsFile(layerPath string) string { return layerPath + stubsSuffix }

// IndexDir is where the image and blob of the index mounted at the layer
// dir at layerPath lie: beside it, so that they go with it as its sums do.
func IndexDir(layerPath string) string { return layerPath + indexSuffix }

// layerBeside is the layer whose sums, index or kept stub tree an entry
// beside a volume's layers is ("" for none).
func layerBeside(name string) string {
	for _, suffix := range []string{sumsSuffix, indexSuffix, stubsSuffix} {
		if layer, ok := strings.CutSuffix(name, suffix); ok {
			return layer
		}
	}
	return ""
}

func newSumsCache() *ttlcache.Cache[string, *filesum.Table] {
	return ttlcache.New[string, *filesum.Table](sumsKeptFor, sumsKept)
}

func (s *Store) sumsPath(r volume.Ref, layer string) string {
	return SumsFile(s.LayerPath(r, layer))
}

// SumsFile is where the file sums of the layer dir at layerPath are kept:
// beside it, as IndexDir is.
func SumsFile(layerPath string) string { return layerPath + sumsSuffix }

// LayerSums answers the file sums of v's own layer: those kept, or computed
// now from the layer and kept (once, whoever else asks meanwhile). The
// layer must be held while they are computed.
func (s *Store) LayerSums(v Volume) (*filesum.Table, error) {
	return s.layerSums(v.Ref(), v.Layer)
}

// LayerSumsAt is LayerSums of the layer of r at dir, as a chain read
// (ChainOf) named it: the layer it read, which a flatten since may have
// replaced (held, it is not pruned).
func (s *Store) LayerSumsAt(r volume.Ref, dir string) (*filesum.Table, error) {
	layer := filepath.Base(dir)
	if s.LayerPath(r, layer) != dir {
		return nil, fmt.Errorf("%s is not a layer of volume %s", dir, r)
	}
	return s.layerSums(r, layer)
}

func (s *Store) layerSums(r volume.Ref, layer string) (*filesum.Table, error) {
	path := s.sumsPath(r, layer)
	if t, ok := s.sums.Get(path, time.Now()); ok {
		return t, nil
	}
	t, err, _ := s.summing.Do(path, func() (any, error) {
		t, err := filesum.ReadFile(path)
		if err == nil {
			return t, nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			klog.ErrorS(err, "A layer's file sums do not read whole; computing them again from the layer", "volume", r, "layer", layer)
		}
		start := time.Now()
		// Not the asker's context: the sums are the layer's, kept for
		// every later asker, whoever gave up meanwhile. Written as the
		// layer is walked, then read back small (their sums left in
		// the file): a table of a million files is never held whole.
		dir := s.LayerPath(r, layer)
		err = filesum.KeepTreeFile(context.Background(), dir, path)
		if err == nil {
			t, err = filesum.ReadFile(path)
		}
		if err != nil {
			// A full disk must not stop the node serving what it holds:
			// the sums are kept in memory, and written by the next asker
			// that computes them once these are forgotten (the layer
			// read twice, only while they cannot be kept).
			klog.ErrorS(err, "Keeping a layer's file sums failed; computing them in memory", "volume", r, "layer", layer)
			if t, err = filesum.OfTree(context.Background(), dir); err != nil {
				return nil, err
			}
		}
		klog.V(2).InfoS("Computed a layer's file sums", "volume", r, "layer", layer, "files", t.Len(), "duration", time.Since(start))
		return t, nil
	})
	if err != nil {
		return nil, err
	}
	table := t.(*filesum.Table)
	s.sums.Put(path, table, time.Now())
	return table, nil
}

// Vouch keeps the digests computed from a volume's layer after its capture
// (Volume.Vouch), if it is still ready with that layer and has none yet.
func (s *Store) Vouch(r volume.Ref, layer string, d volume.Digests) error {
	return s.update(r, func(v *Volume) error {
		if v.State != volume.StateReady || v.Layer != layer || v.Vouch.Known() {
			return fmt.Errorf("volume %s: not the ready layer its digests were computed from: %w", r, ErrUnusable)
		}
		v.Vouch = d
		return nil
	})
}

// LayerDigest is the digest a layer is vouched for with (volume.Digests'
// Layer): its base's name ("" for a root layer) and the digest of its
// files' table.
func LayerDigest(base volume.Ref, files filesum.Sum) volume.Digest {
	name := ""
	if !base.IsZero() {
		name = base.String()
	}
	return volume.Digest(filesum.LayerDigest(name, files))
}
