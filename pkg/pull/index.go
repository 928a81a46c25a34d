package pull

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/fill"
	"github.com/concourse/cowvol/pkg/index"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// index.go: a lazily pulled layer made an index (pkg/index) where the
// node asks for it and can (--pull-index): the holder's stub tree is learnt
// into an EROFS image instead of being made a stub per file, and the image
// is mounted file-backed at the layer's dir, with a sparse blob beside it
// (cache.IndexDir) whose extents a fill.Blob fetches when a reader reaches
// them, a stream of the layer fills behind, and a prefetch completes. Once
// the blob is whole and synced the volume is ready as its index
// (WholeIndexes), copied into a plain layer later, once no view mounts it.
// A restart that finds the volume still filling fails it, as a stub
// layer's.

// The index's files, in the dir beside its layer.
const (
	indexImage = "image"
	indexBlob  = "blob"
)

// IndexSupported says whether the node can mount a pulled layer's index:
// the kernel mounts an EROFS image from a regular file with a regular file
// as its blob (a probe index of one file, made under stateDir, mounted and
// read back). The error says why not.
func IndexSupported(stateDir string) error {
	dir, err := os.MkdirTemp(stateDir, ".index-probe-")
	if err != nil {
		return err
	}
	defer func() {
		if err := overlay.RemoveTree(dir); err != nil {
			klog.ErrorS(err, "Removing the index probe", "dir", dir)
		}
	}()
	image, err := createIndex(filepath.Join(dir, "index"))
	if err != nil {
		return err
	}
	layout, err := writeProbe(image)
	if cerr := image.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = makeBlob(filepath.Join(dir, "index"), layout)
	}
	if err != nil {
		return err
	}
	blob, err := os.OpenFile(filepath.Join(dir, "index", indexBlob), os.O_WRONLY, 0)
	if err == nil {
		err = errors.Join(layout.WriteInline(blob, func(int) {}), blob.Close())
	}
	if err != nil {
		return err
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return err
	}
	if err := overlay.MountIndex(filepath.Join(dir, "index", indexImage), filepath.Join(dir, "index", indexBlob), mnt); err != nil {
		return err
	}
	got, err := os.ReadFile(filepath.Join(mnt, "probe"))
	if err == nil && string(got) != "probe" {
		err = fmt.Errorf("the probe index read %q", got)
	}
	return err
}

// writeProbe writes the index of a tree of one small file into image.
func writeProbe(image *os.File) (*index.Layout, error) {
	w, err := index.NewWriter(image, index.Options{}, index.Entry{Stat: unix.Stat_t{Mode: unix.S_IFDIR | 0o755}})
	if err != nil {
		return nil, err
	}
	err = w.Add(index.Entry{Name: "probe", Stat: unix.Stat_t{Mode: unix.S_IFREG | 0o644, Size: 5}, Data: []byte("probe")})
	layout, cerr := w.Close()
	return layout, errors.Join(err, cerr)
}

// createIndex makes dir, an index's, and its image, empty, for an
// index.Writer to write.
func createIndex(dir string) (*os.File, error) {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	return os.OpenFile(filepath.Join(dir, indexImage), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
}

// makeBlob makes the blob of the index in dir: empty, of layout's size.
func makeBlob(dir string, layout *index.Layout) error {
	blob, err := os.OpenFile(filepath.Join(dir, indexBlob), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = blob.Truncate(layout.Size)
	if cerr := blob.Close(); err == nil {
		err = cerr
	}
	return err
}

// pullIndex pulls a layer's stub tree as an index, mounted at the layer's
// dir with its blob held (readers of what is not here wait for it), and
// makes it a filling volume whose data is fetched behind.
func (pl *Puller) pullIndex(p *pull, client *streamer.Client, top, l streamer.Layer, want volume.Digests, progress func(int64)) (cache.Volume, error) {
	src := newLazySource(pl, p.key.namespace, l, top)
	s := streamer.LayerStream{Namespace: p.key.namespace, Ref: l.Ref, Via: p.key.ref, Encoding: pl.cfg.Encoding, Shape: streamer.StubRecords,
		Inline: streamer.StubInline}
	var layout *index.Layout
	var files filesum.Sum // the digest of the layer's table, as its records said
	var blob *fill.Blob
	var vol cache.Volume
	err := pl.inSwarm(pl.ctx, client, s, top, l, true, func(from *streamer.Client, sw streamer.Swarmed, done func(streamer.Summary) error) (err error) {
		vol, err = Receive(pl.store, pl.kind, l, want, p.id, func(tree, _ string) (streamer.Summary, error) {
			closeLayout(layout) // a try from another holder
			layout = nil
			image, err := createIndex(cache.IndexDir(tree))
			if err != nil {
				return streamer.Summary{}, err
			}
			records := receiveRecords(l.Ref, tree)
			defer records.Abandon()
			table := tableAside(l.Ref, tree)
			defer table.Abandon()
			var sum streamer.Summary
			layout, sum, err = from.PullLayerIndex(pl.ctx, s, sw, pl.cfg.Limits, progress, image, streamer.IndexAside{Records: records, Sums: table})
			if cerr := image.Close(); err == nil {
				err = cerr
			}
			if err == nil {
				err = pl.checkVouched(l, want, sum)
			}
			if err == nil {
				err = done(sum)
			}
			if err == nil {
				files = sum.Files
				err = makeBlob(cache.IndexDir(tree), layout)
			}
			if err == nil && layout.Data() > pl.cfg.Limits.Bytes {
				err = overLimit(l.Ref, pl.cfg.Limits.Bytes) // bounded as a stub tree's stubs are
			}
			if err == nil {
				keepRecords(l.Ref, records, s.Inline, sum, layout)
				keepTable(l.Ref, table)
			}
			if sum.Inlined != "" {
				src.inlined = streamer.Inline{Max: streamer.StubInline.Max, Through: sum.Inlined}
			}
			return sum, err
		}, func(v cache.Volume, id, data string, _ bool) (cache.Volume, error) {
			var err error
			if blob, err = pl.mountIndex(data, layout, src); err != nil {
				return cache.Volume{}, err
			}
			committed, err := pl.store.CommitPullFilling(v.Ref(), id, l.SizeBytes)
			if err != nil {
				pl.unmountIndex(data, blob)
				blob = nil
			}
			return committed, err
		}, SyncBehind)
		return err
	})
	if err != nil {
		closeLayout(layout)
		return cache.Volume{}, err
	}
	pods, profiles := pl.askers(p)
	pl.fillIndexInBackground(vol.Ref(), blob, layout, files, src, p.key.namespace, pods, profiles)
	return vol, nil
}

// mountIndex holds the readers of the blob of the index beside the layer
// dir data and mounts the index at data.
func (pl *Puller) mountIndex(data string, layout *index.Layout, src *lazySource) (*fill.Blob, error) {
	dir := cache.IndexDir(data)
	blob, err := pl.lazy.group.OpenBlob(filepath.Join(dir, indexBlob), layout, src.fetchExtent, src.corrupt)
	if err != nil {
		return nil, err
	}
	if err := overlay.MountIndex(filepath.Join(dir, indexImage), filepath.Join(dir, indexBlob), data); err != nil {
		if cerr := blob.Close(); cerr != nil {
			klog.ErrorS(cerr, "Letting go of an index's blob that did not mount", "dir", dir)
		}
		return nil, err
	}
	return blob, nil
}

// unmountIndex takes down an index mounted at data that no step saw, and
// lets go of its blob.
func (pl *Puller) unmountIndex(data string, blob *fill.Blob) {
	if err := overlay.UnmountIndex(data); err != nil {
		klog.ErrorS(err, "Unmounting an index no step saw", "dir", data)
	}
	if err := blob.Close(); err != nil {
		klog.ErrorS(err, "Letting go of the blob of an index no step saw", "dir", data)
	}
}

// fillIndexInBackground fills a volume pulled as an index (see
// fillBehind): one stream of the layer offers every extent no reader asked
// for, the files of the recorded read order first, what it did not bring
// is prefetched, and once the blob is whole the volume is made ready as
// its index, synced, with the file sums its extents were checked against
// kept as its own (files: their table's digest); WholeIndexes copies it
// into a plain layer once no view mounts it.
func (pl *Puller) fillIndexInBackground(r volume.Ref, blob *fill.Blob, layout *index.Layout, files filesum.Sum, src *lazySource, namespace string,
	pods []volume.Pod, profiles []string) {
	fl := &lazyFill{blob: blob, reaches: blob, namespaces: map[string]bool{}, profiles: map[string]bool{}}
	pl.fillBehind(r, fl, src, namespace, pods, profiles, blob.Done(), func(order []string) {
		if err := src.stream(pl.ctx, blob.Offer, order); err != nil && pl.ctx.Err() == nil {
			klog.InfoS("Streaming a layer pulled as an index stopped; fetching the rest extent by extent", "volume", r, "err", err)
		}
		blob.Prefetch(prefetchWorkers)
	}, func() (cache.Volume, error) {
		defer closeLayout(layout) // its sums are kept, or the fill failed
		if err := blob.Err(); err != nil {
			return cache.Volume{}, err
		}
		v, err := pl.store.Get(r)
		if err != nil {
			return cache.Volume{}, err
		}
		data := pl.store.DataPath(v)
		if err := syncTable(pl.ctx, data, layout, files); err != nil {
			return cache.Volume{}, err
		}
		if err := syncIndex(cache.IndexDir(data)); err != nil {
			return cache.Volume{}, err
		}
		return pl.store.Filled(r)
	})
}

// receiveRecords starts receiving the records of the stub tree of layer
// r, pulled into the layer dir tree, to keep them beside it as its own
// peers' pulls are served (streamer.ReceiveRecords); nil where it cannot
// (said in the log: the filled layer is walked for them, as before).
func receiveRecords(r volume.Ref, tree string) *streamer.ReceivedRecords {
	records, err := streamer.ReceiveRecords(cache.StubsFile(tree))
	if err != nil {
		klog.ErrorS(err, "Receiving a pulled layer's stub records to keep them; its tree is walked for them once filled", "volume", r)
	}
	return records
}

// tableAside starts the table of sums of layer r, pulled into the layer
// dir tree, to be written as the pull's records come and kept beside it
// (keepTable); nil where it cannot (said in the log: the filled layer is
// walked for it, as before).
func tableAside(r volume.Ref, tree string) *filesum.TableWriter {
	table, err := filesum.CreateTableFile(cache.SumsFile(tree))
	if err != nil {
		klog.ErrorS(err, "Writing a pulled layer's file sums as they come; its tree is walked for them once filled", "volume", r)
	}
	return table
}

// keepTable keeps the table of sums of layer r written as its pull came,
// the pull checked (its listing's digest is the one vouched for, and
// the table is what was listed); not synced on the publish's path
// (syncTable syncs it once the layer is filled). If it cannot be, the
// layer is walked for it once filled.
func keepTable(r volume.Ref, table *filesum.TableWriter) {
	if table == nil {
		return
	}
	if err := table.Keep(); err != nil {
		klog.ErrorS(err, "A pulled layer's file sums were not kept as they came; its tree is walked for them once filled", "volume", r)
	}
}

// syncTable syncs the table of sums of the filled index-pulled layer at
// data, kept as its records came (keepTable); where none was, it keeps
// one from a walk of the layer (keepLayerSums, sums from layout's
// extents), whose digest must be files.
func syncTable(ctx context.Context, data string, layout *index.Layout, files filesum.Sum) error {
	err := overlay.Sync(cache.SumsFile(data))
	if errors.Is(err, fs.ErrNotExist) {
		return keepLayerSums(ctx, data, layout.Sum, files, cache.SumsFile(data))
	}
	if err != nil {
		return fmt.Errorf("syncing a pulled layer's file sums: %w", err)
	}
	return nil
}

// keepRecords keeps the stub records received of layer r (if any), their
// pull checked as sum says, if its tree is big enough for a holder to
// keep (layout's files, streamer.KeepsStubs); else, or if they cannot be
// kept, the node keeps the tree once filled, from a walk of it, as it
// keeps a capture's.
func keepRecords(r volume.Ref, records *streamer.ReceivedRecords, inline streamer.Inline, sum streamer.Summary, layout *index.Layout) {
	if records == nil || !streamer.KeepsStubs(layout.Len()) {
		return
	}
	if err := records.Keep(inline, sum); err != nil {
		klog.V(2).InfoS("A pulled layer's stub records were not kept as received; its tree is walked for them once filled", "volume", r, "err", err)
		return
	}
	klog.V(2).InfoS("Kept a pulled layer's stub records as received", "volume", r, "entries", sum.Entries, "bytes", sum.Bytes)
}

// closeLayout lets go of the sums and inline bytes of layout, if any:
// once its extents are checked and its sums kept, or once the pull
// failed. Its extents stay.
func closeLayout(layout *index.Layout) {
	if layout == nil {
		return
	}
	if err := layout.Close(); err != nil {
		klog.ErrorS(err, "Letting go of an index's file sums and inline bytes")
	}
}

// keepLayerSums keeps the file sums of a lazily pulled layer's tree,
// filled, at sums (the layer's sums file, cache.SumsFile): each file's sum
// as known says (the sum its data was checked against as it arrived: an
// index's extent's, a stub's), a file of no bytes's, or read where known
// says none. They are written as the tree is walked, never whole in
// memory, and kept only if they are the table the layer's stub tree
// carried, whose digest is files: else the layer is refused
// (filesum.ErrMismatch). With no digest known nothing is kept (the layer
// is summed when first asked, as before).
func keepLayerSums(ctx context.Context, tree string, known func(path string) (filesum.Sum, bool), files filesum.Sum, sums string) error {
	if files == (filesum.Sum{}) {
		return nil
	}
	if err := filesum.WriteTreeFile(ctx, tree, known, sums, files); err != nil {
		return fmt.Errorf("the file sums of a lazily pulled layer: %w", err)
	}
	return nil
}
