package cache

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"
)

func openStore(t *testing.T) *Store {
	t.Helper()
	s, err := Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// ready captures handle over source through the store's own steps, with a
// data dir, as the node service does.
func ready(t *testing.T, s *Store, handle, source, ns string, scope Scope, props map[string]string) Volume {
	t.Helper()
	id := "view-" + handle
	v, err := s.Publish(View{VolumeID: id, Target: "/t/" + handle, Source: source, Capture: handle,
		Scope: scope, Properties: props, Pod: PodInfo{Namespace: ns}})
	require.NoError(t, err)
	require.NoError(t, s.SetViewState(id, ViewPublishing, ViewPublished))
	require.NoError(t, s.SetViewState(id, ViewPublished, ViewCapturing))
	res, err := s.CaptureTarget(v)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(res), 0o755))
	vol, err := s.CommitCapture(id, source != "")
	require.NoError(t, err)
	return vol
}

func TestPublishFindOrCreate(t *testing.T) {
	s := openStore(t)
	base := ready(t, s, "base", "", "ci", ScopeNamespace, nil)
	require.Equal(t, StateReady, base.State)

	_, err := s.Publish(View{VolumeID: "v1", Capture: "base", Pod: PodInfo{Namespace: "ci"}})
	require.ErrorIs(t, err, ErrExists, "a ready handle is never overwritten")

	v, err := s.Publish(View{VolumeID: "v2", Source: "base", Capture: "out", Pod: PodInfo{Namespace: "ci"}})
	require.NoError(t, err)
	require.Equal(t, []string{"base"}, v.Pins)
	require.Equal(t, []string{s.DataPath(base)}, v.Lowers)
	_, err = s.Publish(View{VolumeID: "v3", Capture: "out", Pod: PodInfo{Namespace: "ci"}})
	require.ErrorIs(t, err, ErrExists, "a reserved handle is taken")
	_, err = s.Publish(View{VolumeID: "v2", Pod: PodInfo{Namespace: "ci"}})
	require.ErrorIs(t, err, ErrExists, "one record per step volume")
	_, err = s.Publish(View{VolumeID: "v4", Source: "out", Pod: PodInfo{Namespace: "ci"}})
	require.ErrorIs(t, err, ErrNotReady, "a creating volume is never a source")
	_, err = s.Publish(View{VolumeID: "v5", Source: "base", Pod: PodInfo{Namespace: "other"}})
	require.ErrorIs(t, err, ErrPermission)
	_, err = s.Publish(View{VolumeID: "v6", Source: "absent"})
	require.ErrorIs(t, err, ErrNotFound)

	// Dropping the view releases its reservation.
	_, ok, reserved, err := s.DropView("v2")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, filepath.Join(s.Dir(), "layers", "out"), reserved)
	_, err = s.Get("out")
	require.ErrorIs(t, err, ErrNotFound)
}

func TestChainsAndScope(t *testing.T) {
	s := openStore(t)
	ready(t, s, "a", "", "ci", ScopeCluster, nil)
	ready(t, s, "b", "a", "other", ScopeNamespace, map[string]string{"k": "v"})
	c := ready(t, s, "c", "b", "other", ScopeNamespace, map[string]string{"k": "v", "x": "y"})
	require.Equal(t, "b", c.Base)
	dirs, err := s.Chain("c")
	require.NoError(t, err)
	require.Len(t, dirs, 3)
	require.Equal(t, s.LayerPath("c", c.Layer), dirs[0])

	found, err := s.FindByProperties(map[string]string{"k": "v"})
	require.NoError(t, err)
	require.Len(t, found, 2)
	found, err = s.FindByProperties(map[string]string{"x": "y"})
	require.NoError(t, err)
	require.Equal(t, "c", found[0].Handle)

	// A pod of ci may read cluster-scoped a, not other's c.
	_, err = s.Publish(View{VolumeID: "r1", Source: "a", Pod: PodInfo{Namespace: "ci"}})
	require.NoError(t, err)
	_, err = s.Publish(View{VolumeID: "r2", Source: "c", Pod: PodInfo{Namespace: "ci"}})
	require.ErrorIs(t, err, ErrPermission)
}

func TestDestroyRefusesChildrenAndUsers(t *testing.T) {
	s := openStore(t)
	ready(t, s, "parent", "", "ci", ScopeNamespace, nil)
	child := ready(t, s, "child", "parent", "ci", ScopeNamespace, nil)
	require.ErrorIs(t, s.Destroy("parent", os.RemoveAll), ErrHasChildren)

	_, err := s.Publish(View{VolumeID: "reader", Source: "child", Pod: PodInfo{Namespace: "ci"}})
	require.NoError(t, err)
	require.ErrorIs(t, s.Destroy("child", os.RemoveAll), ErrInUse)
	_, _, _, err = s.DropView("reader")
	require.NoError(t, err)

	require.NoError(t, s.Destroy("child", os.RemoveAll))
	_, err = os.Stat(s.DataPath(child))
	require.ErrorIs(t, err, os.ErrNotExist)
	require.NoError(t, s.Destroy("child", os.RemoveAll), "destroy is idempotent")
	require.NoError(t, s.Destroy("parent", os.RemoveAll), "no children left")

	_, err = s.Publish(View{VolumeID: "w", Capture: "wip", Pod: PodInfo{Namespace: "ci"}})
	require.NoError(t, err)
	require.ErrorIs(t, s.Destroy("wip", os.RemoveAll), ErrInUse, "a volume being captured stays")
}

func TestRecoverDropsHalfMadeAndOrphans(t *testing.T) {
	s := openStore(t)
	good := ready(t, s, "good", "", "ci", ScopeNamespace, nil)
	// A reservation whose view is gone (a crash between the two).
	_, err := s.Publish(View{VolumeID: "dead", Capture: "half", Pod: PodInfo{Namespace: "ci"}})
	require.NoError(t, err)
	half, err := s.Get("half")
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(half), 0o755))
	require.NoError(t, s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(viewsBucket).Delete([]byte("dead")) }))
	// A reservation whose view lives on.
	_, err = s.Publish(View{VolumeID: "live", Capture: "pending", Pod: PodInfo{Namespace: "ci"}})
	require.NoError(t, err)
	// Orphans on disk: a layer dir nobody names, a stray dir inside a
	// known volume, staging leftovers.
	for _, d := range []string{filepath.Join(s.Dir(), "layers", "orphan", "l1"), s.LayerPath("good", "stray"),
		filepath.Join(s.StagingDir(), "flatten-1")} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	// A ready volume whose data is gone.
	lost := ready(t, s, "lost", "", "ci", ScopeNamespace, nil)
	require.NoError(t, os.RemoveAll(s.DataPath(lost)))

	rep, err := s.Recover(os.RemoveAll, false)
	require.NoError(t, err)
	require.Equal(t, RecoveryReport{Ready: 1, DroppedReservations: 1, MarkedFailed: 1, RemovedOrphans: 3}, rep)
	_, err = s.Get("half")
	require.ErrorIs(t, err, ErrNotFound)
	_, err = s.Get("pending")
	require.NoError(t, err, "a live view's reservation stays")
	vol, err := s.Get("lost")
	require.NoError(t, err)
	require.Equal(t, StateFailed, vol.State)
	_, err = os.Stat(s.DataPath(good))
	require.NoError(t, err)
	entries, err := os.ReadDir(filepath.Join(s.Dir(), "layers", "good"))
	require.NoError(t, err)
	require.Len(t, entries, 1)
}

func TestReplaceAndPruneLayers(t *testing.T) {
	s := openStore(t)
	ready(t, s, "a", "", "ci", ScopeNamespace, nil)
	b := ready(t, s, "b", "a", "ci", ScopeNamespace, nil)
	v, err := s.Publish(View{VolumeID: "reader", Source: "b", Pod: PodInfo{Namespace: "ci"}})
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.LayerPath("b", "flat"), 0o755))
	require.NoError(t, s.ReplaceLayer("b", "flat"))
	dirs, err := s.Chain("b")
	require.NoError(t, err)
	require.Equal(t, []string{s.LayerPath("b", "flat")}, dirs, "a flattened volume is a root layer")

	require.NoError(t, s.PruneLayers(os.RemoveAll))
	_, err = os.Stat(s.DataPath(b))
	require.NoError(t, err, "the old layer stays while a view mounts it")
	require.Contains(t, v.Lowers, s.DataPath(b))

	_, _, _, err = s.DropView("reader")
	require.NoError(t, err)
	require.NoError(t, s.PruneLayers(os.RemoveAll))
	_, err = os.Stat(s.DataPath(b))
	require.ErrorIs(t, err, os.ErrNotExist)
	cur, err := s.Get("b")
	require.NoError(t, err)
	require.Empty(t, cur.OldLayers)
}

func TestTrash(t *testing.T) {
	s := openStore(t)
	dir := filepath.Join(s.Dir(), "views", "x")
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "deep"), 0o755))
	require.NoError(t, s.Trash(dir))
	require.NoError(t, s.Trash(dir), "trashing a missing dir is done")
	require.NoError(t, s.EmptyTrash(os.RemoveAll))
	entries, err := os.ReadDir(s.TrashDir())
	require.NoError(t, err)
	require.Empty(t, entries)
}

func TestRebootFailsUnsyncedVolumes(t *testing.T) {
	s := openStore(t)
	prev, err := s.SwapBoot("boot-1")
	require.NoError(t, err)
	require.Empty(t, prev)
	ready(t, s, "synced", "", "ci", ScopeNamespace, nil)
	ready(t, s, "unsynced", "", "ci", ScopeNamespace, nil)
	require.NoError(t, s.MarkSynced([]string{"synced", "gone"}))
	unsynced, err := s.Unsynced()
	require.NoError(t, err)
	require.Equal(t, []string{"unsynced"}, unsynced)

	prev, err = s.SwapBoot("boot-2")
	require.NoError(t, err)
	require.Equal(t, "boot-1", prev)
	rep, err := s.Recover(os.RemoveAll, true)
	require.NoError(t, err)
	require.Equal(t, 1, rep.MarkedFailed)
	v, err := s.Get("unsynced")
	require.NoError(t, err)
	require.Equal(t, StateFailed, v.State, "a reboot may have torn it")
	v, err = s.Get("synced")
	require.NoError(t, err)
	require.Equal(t, StateReady, v.State)
}
