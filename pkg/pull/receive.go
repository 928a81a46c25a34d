package pull

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
	"k8s.io/klog/v2"
)

// CommitFunc commits a received layer, in place at data, under the lease
// id; synced says whether its data is on disk yet.
type CommitFunc func(v cache.Volume, id, data string, synced bool) (cache.Volume, error)

// CommitPulled makes a layer that arrived whole a ready volume of store,
// and tells n (whose sync round writes it back if it is not on disk yet).
func CommitPulled(store *cache.Store, n Notifier, l streamer.Layer) CommitFunc {
	return func(v cache.Volume, id, _ string, synced bool) (cache.Volume, error) {
		vol, err := store.CommitPull(v.Ref(), id, l.SizeBytes, -1, synced)
		if err != nil {
			return vol, err
		}
		n.Committed(vol, synced)
		return vol, nil
	}
}

// Durability says when a received layer's data must reach the disk.
type Durability bool

const (
	// SyncBefore: before it is committed. An upload is the only copy,
	// and its sender is told it is made.
	SyncBefore Durability = false
	// SyncBehind: later, off the step's path. A pulled layer is a copy
	// of a peer's: the next sync round writes it back, as it does a
	// capture, and a reboot that comes first marks it failed, to be
	// pulled again; its step does not wait for the node to write a
	// gigabyte back, which took a fifth of a pull's time. A stub tree is
	// synced with its data once filled (a restart fails a volume still
	// filling, synced or not).
	SyncBehind Durability = true
)

// Receive makes a cached volume of a layer that arrives from
// elsewhere (a pull, an upload), vouched for with vouch (those its pull is
// checked against; none for an upload): reserved under the lease id, filled by fill
// in staging out of sight (tree, and its index beside it if it makes one;
// data is where it will live), synced as
// when says, moved into place and committed in one transaction. Anything
// short of that leaves no trace: the reservation and the staging go (and a
// crash leaves them to recovery).
func Receive(store *cache.Store, kind overlay.Kind, l streamer.Layer, vouch volume.Digests, id string, fill func(tree, data string) (streamer.Summary, error),
	commit CommitFunc, when Durability) (vol cache.Volume, err error) {
	vouch.FirstHand = false
	v, err := store.ReservePull(cache.Volume{
		Namespace: l.Ref.Namespace, Handle: l.Ref.Handle, Parent: l.Parent, Base: l.Base, Scope: l.Scope,
		Properties: l.Properties, TTL: l.TTL, DestroyOnCommit: l.Destroyed, Vouch: vouch,
	}, id)
	if err != nil {
		return cache.Volume{}, err
	}
	defer func() {
		if err != nil {
			if aerr := store.AbortPull(v.Ref(), id, overlay.RemoveTree); aerr != nil {
				klog.ErrorS(aerr, "Dropping a reservation of a layer that did not arrive; recovery will", "volume", v.Ref())
			}
		}
	}()
	stage, err := os.MkdirTemp(store.StagingDir(), "receive-")
	if err != nil {
		return cache.Volume{}, err
	}
	defer func() {
		if rerr := overlay.RemoveTree(stage); rerr != nil {
			klog.ErrorS(rerr, "Removing a received layer's staging", "dir", stage)
		}
	}()
	tree := filepath.Join(stage, "layer")
	if err := overlay.NewLayerDir(kind, tree); err != nil {
		return cache.Volume{}, err
	}
	data := store.DataPath(v)
	sum, err := fill(tree, data)
	if err != nil {
		return cache.Volume{}, err
	}
	// Sums the extraction checked every file against are kept, not read
	// back later (Limits.Tabled).
	if sum.Table != nil {
		if err := sum.Table.WriteFile(cache.SumsFile(tree)); err != nil {
			return cache.Volume{}, err
		}
	}
	cache.CrashPoint("pull-extracted")
	// A reboot must not find a torn volume ready: it is on disk before
	// it is committed, or committed unsynced (and failed by a reboot
	// that comes before the sync round).
	if when == SyncBefore {
		if err := overlay.SyncFS(tree); err != nil {
			return cache.Volume{}, err
		}
	}
	if err := os.MkdirAll(filepath.Dir(data), 0o700); err != nil {
		return cache.Volume{}, err
	}
	if err := os.Rename(tree, data); err != nil {
		return cache.Volume{}, err
	}
	// A layer received as an index has it beside it (IndexDir), one
	// received with its table its sums (SumsFile), and one whose stub
	// tree's records are kept as received those (StubsFile).
	for _, beside := range []func(string) string{cache.IndexDir, cache.SumsFile, cache.StubsFile} {
		if err := os.Rename(beside(tree), beside(data)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return cache.Volume{}, err
		}
	}
	if when == SyncBefore {
		if err := overlay.Sync(filepath.Dir(data)); err != nil {
			return cache.Volume{}, err
		}
	}
	cache.CrashPoint("pull-renamed")
	if vol, err = commit(v, id, data, when == SyncBefore); err != nil {
		return cache.Volume{}, err
	}
	klog.V(2).InfoS("Received a layer", "volume", vol.Ref(), "state", vol.State, "tarBytes", sum.Bytes, "entries", sum.Entries, "digest", sum.Digest)
	return vol, nil
}
