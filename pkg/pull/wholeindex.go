package pull

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/volume"
)

// WholeIndexes are the ready volumes whose layer is a whole index: pulled
// as one (index.go), their blob filled and synced, mounted at the layer's
// dir. A volume is ready as its index the moment its blob is whole, so
// that the steps reading it are not made to wait on (or compete with) a
// copy of it. The node mounts them again where the mount went (a reboot,
// a restarted plugin's new mount namespace: Remount), and copies each
// into a plain layer once no view mounts it (MakePlain), so that a node
// does not keep a mount per volume it ever pulled and flattens clone
// plain files. It owns the index's files once whole; not the volume's
// metadata beyond swapping its layer, not the views. It holds nothing of
// an index in memory: the copy reads the blob's layout back from the
// image, whoever pulled it (this process or one before a restart).
type WholeIndexes struct {
	store *cache.Store
}

// NewWholeIndexes tracks the whole indexes of store's volumes.
func NewWholeIndexes(store *cache.Store) *WholeIndexes {
	return &WholeIndexes{store: store}
}

// isIndex says whether data, a volume's layer dir, is an index (the dir
// of its image and blob is beside it).
func isIndex(data string) bool {
	st, err := os.Lstat(cache.IndexDir(data))
	return err == nil && st.IsDir()
}

// ready lists the ready volumes whose layer is an index, by layer dir.
func (w *WholeIndexes) ready() map[string]cache.Volume {
	out := map[string]cache.Volume{}
	for _, v := range w.store.List() {
		if data := w.store.DataPath(v); v.State == volume.StateReady && v.Layer != "" && isIndex(data) {
			out[data] = v
		}
	}
	return out
}

// Remount mounts again every ready volume's whole index whose mount is
// gone, before any view is made over it: an unmounted index's layer dir is
// an empty dir, which a view must never show for the volume. A volume
// whose index cannot be mounted is marked failed (its image or blob lost
// or torn: its data is not here), and the rest go on. It says how many it
// mounted.
func (w *WholeIndexes) Remount() (mounted int) {
	for data, v := range w.ready() {
		if overlay.IndexMounted(data) {
			continue
		}
		dir := cache.IndexDir(data)
		if err := overlay.MountIndex(filepath.Join(dir, indexImage), filepath.Join(dir, indexBlob), data); err != nil {
			klog.ErrorS(err, "Mounting a ready volume's whole index again failed; the volume is marked failed", "volume", v.Ref())
			if merr := w.store.MarkFailed(v.Ref()); merr != nil {
				klog.ErrorS(merr, "Marking a volume whose index does not mount failed", "volume", v.Ref())
			}
			continue
		}
		mounted++
	}
	return mounted
}

// Unmount detaches every ready volume's whole index mount, as a stopping
// node leaves its state dir: the views made over one keep it (an overlay
// holds its own clone of each lower's mount), and the next start mounts
// it again (Remount). It says how many it detached.
func (w *WholeIndexes) Unmount() (detached int) {
	for data, v := range w.ready() {
		if !overlay.IndexMounted(data) {
			continue
		}
		if err := overlay.UnmountIndex(data); err != nil {
			klog.ErrorS(err, "Detaching a whole index as the node stops", "volume", v.Ref())
			continue
		}
		detached++
	}
	return detached
}

// Idle lists the ready volumes whose layer is a whole index that no view
// mounts and no step image runs on.
func (w *WholeIndexes) Idle() []cache.Volume {
	mounted := map[string]bool{}
	for _, view := range w.store.ListViews() {
		for _, l := range view.Lowers {
			mounted[l] = true
		}
	}
	ready := w.ready()
	var idle []cache.Volume
	for data, v := range ready {
		if !mounted[data] && len(w.store.Holders(v.Ref()).Images) == 0 {
			idle = append(idle, v)
		}
	}
	return idle
}

// MakePlain copies the ready volume v's layer, a whole index, into a
// plain layer of its own, synced, and swaps it in (cache.SwapLayer); the
// index goes once no view mounts it (cache.Store.PruneLayers). Each file's
// data is cloned from the blob where this process learnt the index's
// layout, and copied from the mount where not. The copy keeps the index's
// file sums, refused unless its files are the ones the table names; it is
// not read back to sum it. The caller holds v. A volume changed meanwhile
// is left alone (cache.ErrUnusable).
func (w *WholeIndexes) MakePlain(ctx context.Context, v cache.Volume) (overlay.CopyStats, error) {
	data := w.store.DataPath(v)
	at := blobOffsets(v, filepath.Join(cache.IndexDir(data), indexImage))
	var known func(string) (filesum.Sum, bool)
	var files filesum.Sum
	if table, err := w.store.LayerSums(v); err == nil {
		known, files = table.Finder().Sum, table.Digest() // (asked in the walk's order)
	} else {
		klog.V(2).InfoS("A whole index's kept sums could not be read; its plain copy is summed when first asked", "volume", v.Ref(), "err", err)
	}
	work, err := os.MkdirTemp(w.store.StagingDir(), "index-")
	if err != nil {
		return overlay.CopyStats{}, err
	}
	defer func() {
		if err := overlay.RemoveTree(work); err != nil {
			klog.ErrorS(err, "Removing the staging of a layer made of an index", "dir", work)
		}
	}()
	tree := filepath.Join(work, "tree")
	stats, err := overlay.CopyIndex(ctx, data, filepath.Join(cache.IndexDir(data), indexBlob), at, tree)
	if err == nil {
		err = overlay.SyncFS(tree)
	}
	if err != nil {
		return stats, fmt.Errorf("copying a whole index into a layer: %w", err)
	}
	if err := keepLayerSums(ctx, tree, known, files, cache.SumsFile(tree)); err != nil {
		return stats, err
	}
	layer := cache.NewLayerName(cache.LayerPulled, time.Now())
	dst := w.store.LayerPath(v.Ref(), layer)
	if err := os.Rename(tree, dst); err != nil {
		return stats, err
	}
	if err := os.Rename(cache.SumsFile(tree), cache.SumsFile(dst)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return stats, errors.Join(err, overlay.RemoveTree(dst))
	}
	plain := v
	plain.Layer = layer
	// The stub tree kept for the index's peers is the copy's too: the same
	// names, stats and sums.
	if err := os.Link(w.store.StubsPath(v), w.store.StubsPath(plain)); err != nil && !errors.Is(err, os.ErrNotExist) {
		klog.ErrorS(err, "Keeping a whole index's stub tree for its plain copy failed; a peer's pull walks the copy", "volume", v.Ref())
	}
	if err := overlay.Sync(filepath.Dir(dst)); err != nil {
		return stats, errors.Join(err, w.unstage(dst, plain))
	}
	if err := w.store.SwapLayer(v.Ref(), v.Layer, layer); err != nil {
		return stats, errors.Join(err, w.unstage(dst, plain))
	}
	return stats, nil
}

// blobOffsets says where each file's data starts in the blob of the
// index whose image is at image, by its first name: the layout read back
// from the image. An image whose layout cannot be read says none (the
// copy reads every file through the mount then: slower, and as right).
func blobOffsets(v cache.Volume, image string) func(path string) (int64, bool) {
	none := func(string) (int64, bool) { return 0, false }
	f, err := os.Open(image)
	if err != nil {
		klog.InfoS("A whole index's image could not be opened to clone its files; they are copied from its mount", "volume", v.Ref(), "err", err)
		return none
	}
	defer f.Close()
	layout, err := index.ReadLayout(f)
	if err != nil {
		klog.InfoS("A whole index's layout could not be read back; its files are copied from its mount", "volume", v.Ref(), "err", err)
		return none
	}
	return layout.Offset
}

// unstage removes the plain layer at dst that was not swapped in for the
// index, with what lies beside it: its sums, and plain's stub tree.
func (w *WholeIndexes) unstage(dst string, plain cache.Volume) error {
	return errors.Join(overlay.RemoveTree(dst), removeMissing(cache.SumsFile(dst)), removeMissing(w.store.StubsPath(plain)))
}

// removeMissing removes path, which may be missing.
func removeMissing(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// syncIndex writes a whole index's image and blob, in dir, to disk, and
// the dirs that name them: a volume is recorded ready as its index only
// once a reboot cannot tear it.
func syncIndex(dir string) error {
	for _, p := range []string{filepath.Join(dir, indexImage), filepath.Join(dir, indexBlob), dir, filepath.Dir(dir)} {
		if err := overlay.Sync(p); err != nil {
			return fmt.Errorf("syncing a whole index: %w", err)
		}
	}
	return nil
}
