package cache

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

func openStore(t *testing.T) *Store {
	t.Helper()
	s, err := Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

func ref(ns, h string) volume.Ref { return volume.Ref{Namespace: ns, Handle: h} }

func pod(ns string) volume.Pod { return volume.Pod{Namespace: ns, Name: "p", UID: "u"} }

// ready captures handle in ns over source through the store's own steps,
// with a data dir, as the node service does.
func ready(t *testing.T, s *Store, ns, handle string, source volume.Ref, scope volume.Scope, props map[string]string) Volume {
	t.Helper()
	id := "view-" + ns + "-" + handle
	v, err := s.Publish(View{VolumeID: id, Target: "/t/" + handle, Source: source, Capture: handle,
		Scope: scope, Properties: props, Pod: pod(ns)})
	require.NoError(t, err)
	require.NoError(t, s.SetMounted(id, 1))
	require.NoError(t, s.SetViewState(id, ViewPublished, ViewCapturing))
	res, err := s.CaptureTarget(v)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(res), 0o755))
	vol, err := s.CommitCapture(id, !source.IsZero())
	require.NoError(t, err)
	return vol
}

func TestPublishFindOrCreate(t *testing.T) {
	s := openStore(t)
	base := ready(t, s, "ci", "base", volume.Ref{}, volume.ScopeNamespace, nil)
	require.Equal(t, volume.StateReady, base.State)

	_, err := s.Publish(View{VolumeID: "v1", Capture: "base", Pod: pod("ci")})
	require.ErrorIs(t, err, ErrExists, "a ready handle is never overwritten")

	v, err := s.Publish(View{VolumeID: "v2", Source: ref("ci", "base"), Capture: "out", Pod: pod("ci")})
	require.NoError(t, err)
	require.Equal(t, []volume.Ref{ref("ci", "base")}, v.Pins)
	require.Equal(t, []string{s.DataPath(base)}, v.Lowers)
	_, err = s.Publish(View{VolumeID: "v3", Capture: "out", Pod: pod("ci")})
	require.ErrorIs(t, err, ErrExists, "a reserved handle is taken")
	_, err = s.Publish(View{VolumeID: "v2", Pod: pod("ci")})
	require.ErrorIs(t, err, ErrExists, "one record per step volume")
	_, err = s.Publish(View{VolumeID: "v4", Source: ref("ci", "out"), Pod: pod("ci")})
	require.ErrorIs(t, err, ErrNotReady, "a creating volume is never a source")
	_, err = s.Publish(View{VolumeID: "v6", Source: ref("ci", "absent"), Pod: pod("ci")})
	require.ErrorIs(t, err, ErrNotFound)

	// Dropping the view releases its reservation.
	reserved, err := s.DropView("v2")
	require.NoError(t, err)
	require.Equal(t, filepath.Join(s.Dir(), "volumes", "ci", "out"), reserved)
	_, err = s.Get(ref("ci", "out"))
	require.ErrorIs(t, err, ErrNotFound)
}

// Handles are per namespace: two namespaces capture the same handle without
// meeting, each reads its own, and another namespace's private volume is
// answered exactly like a missing one.
func TestNamespacesNeverMeet(t *testing.T) {
	s := openStore(t)
	evil := ready(t, s, "evil", "res", volume.Ref{}, volume.ScopeCluster, nil)
	ci := ready(t, s, "ci", "res", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NotEqual(t, s.DataPath(evil), s.DataPath(ci))

	v, err := s.Publish(View{VolumeID: "r1", Source: ref("ci", "res"), Pod: pod("ci")})
	require.NoError(t, err)
	require.Equal(t, []string{s.DataPath(ci)}, v.Lowers, "ci's source resolves in ci")

	_, hidden := s.Publish(View{VolumeID: "r2", Source: ref("ci", "res"), Pod: pod("evil")})
	_, missing := s.Publish(View{VolumeID: "r3", Source: ref("ci", "nope"), Pod: pod("evil")})
	require.ErrorIs(t, hidden, ErrNotFound)
	require.ErrorIs(t, missing, ErrNotFound)
	require.Equal(t, missing.Error(), strings.Replace(hidden.Error(), `"res"`, `"nope"`, 1), "no existence oracle")

	shared, err := s.Publish(View{VolumeID: "r4", Source: ref("evil", "res"), Pod: pod("ci")})
	require.NoError(t, err, "a cluster-scoped volume is readable when named with its namespace")
	require.Equal(t, []string{s.DataPath(evil)}, shared.Lowers)
}

func TestChainsAcrossNamespaces(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "a", volume.Ref{}, volume.ScopeCluster, nil)
	ready(t, s, "other", "b", ref("ci", "a"), volume.ScopeNamespace, map[string]string{"k": "v"})
	c := ready(t, s, "other", "c", ref("other", "b"), volume.ScopeNamespace, nil)
	require.Equal(t, ref("other", "b"), c.Base)
	dirs, err := s.Chain(ref("other", "c"))
	require.NoError(t, err)
	require.Len(t, dirs, 3)
	require.Equal(t, s.LayerPath(ref("other", "c"), c.Layer), dirs[0])

	// A chain whose bottom layer failed names only the volume asked for.
	require.NoError(t, s.update(ref("ci", "a"), func(v *Volume) error { v.State = volume.StateFailed; return nil }))
	_, err = s.Publish(View{VolumeID: "r", Source: ref("other", "c"), Pod: pod("other")})
	require.ErrorIs(t, err, ErrUnusable)
	require.NotContains(t, err.Error(), `"a"`)
}

func TestDestroyRefusesChildrenAndUsers(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "parent", volume.Ref{}, volume.ScopeNamespace, nil)
	child := ready(t, s, "ci", "child", ref("ci", "parent"), volume.ScopeNamespace, nil)
	require.ErrorIs(t, s.Destroy(ref("ci", "parent"), os.RemoveAll), ErrHasChildren)

	_, err := s.Publish(View{VolumeID: "reader", Source: ref("ci", "child"), Pod: pod("ci")})
	require.NoError(t, err)
	require.ErrorIs(t, s.Destroy(ref("ci", "child"), os.RemoveAll), ErrInUse)
	_, err = s.DropView("reader")
	require.NoError(t, err)

	require.NoError(t, s.Destroy(ref("ci", "child"), os.RemoveAll))
	_, err = os.Stat(s.DataPath(child))
	require.ErrorIs(t, err, os.ErrNotExist)
	require.NoError(t, s.Destroy(ref("ci", "child"), os.RemoveAll), "destroy is idempotent")
	require.NoError(t, s.Destroy(ref("ci", "parent"), os.RemoveAll), "no children left")

	_, err = s.Publish(View{VolumeID: "w", Capture: "wip", Pod: pod("ci")})
	require.NoError(t, err)
	require.ErrorIs(t, s.Destroy(ref("ci", "wip"), os.RemoveAll), ErrInUse, "a volume being captured stays")
}

func TestRecoverDropsHalfMadeAndOrphans(t *testing.T) {
	s := openStore(t)
	good := ready(t, s, "ci", "good", volume.Ref{}, volume.ScopeNamespace, nil)
	// A reservation whose view is gone (a crash between the two).
	_, err := s.Publish(View{VolumeID: "dead", Capture: "half", Pod: pod("ci")})
	require.NoError(t, err)
	half, err := s.Get(ref("ci", "half"))
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(half), 0o755))
	require.NoError(t, s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(viewsBucket).Delete([]byte("dead")) }))
	// A reservation whose view lives on.
	_, err = s.Publish(View{VolumeID: "live", Capture: "pending", Pod: pod("ci")})
	require.NoError(t, err)
	// Orphans on disk: a namespace nobody owns, a volume dir nobody names,
	// a stray dir inside a known volume, staging leftovers.
	for _, d := range []string{filepath.Join(s.Dir(), "volumes", "gone", "x", "l1"), s.LayerPath(ref("ci", "orphan"), "l1"),
		s.LayerPath(ref("ci", "good"), "stray"), filepath.Join(s.StagingDir(), "flatten-1")} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	// A ready volume whose data is gone.
	lost := ready(t, s, "ci", "lost", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NoError(t, os.RemoveAll(s.DataPath(lost)))

	rep, err := s.Recover(os.RemoveAll, false)
	require.NoError(t, err)
	require.Equal(t, RecoveryReport{Ready: 1, DroppedReservations: 1, MarkedFailed: 1, RemovedOrphans: 4}, rep)
	_, err = s.Get(ref("ci", "half"))
	require.ErrorIs(t, err, ErrNotFound)
	_, err = s.Get(ref("ci", "pending"))
	require.NoError(t, err, "a live view's reservation stays")
	vol, err := s.Get(ref("ci", "lost"))
	require.NoError(t, err)
	require.Equal(t, volume.StateFailed, vol.State)
	_, err = os.Stat(s.DataPath(good))
	require.NoError(t, err)
	entries, err := os.ReadDir(s.VolumeDir(ref("ci", "good")))
	require.NoError(t, err)
	require.Len(t, entries, 1)
}

// A record that does not decode is reported and skipped: listings and
// recovery go on with the rest.
func TestBadRecordIsSkipped(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "fine", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NoError(t, s.db.Update(func(tx *bolt.Tx) error {
		return errors.Join(tx.Bucket(volumesBucket).Put([]byte("ci/broken"), []byte("{not json")),
			tx.Bucket(viewsBucket).Put([]byte("csi-broken"), []byte("[")))
	}))
	require.Len(t, s.List(), 1)
	require.Empty(t, s.ListViews())
	rep, err := s.Recover(os.RemoveAll, false)
	require.NoError(t, err)
	require.Equal(t, []string{"volume ci/broken", "step volume csi-broken"}, rep.BadRecords)
	require.Equal(t, 1, rep.Ready)
}

func TestReplaceAndPruneLayers(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "a", volume.Ref{}, volume.ScopeNamespace, nil)
	b := ready(t, s, "ci", "b", ref("ci", "a"), volume.ScopeNamespace, nil)
	v, err := s.Publish(View{VolumeID: "reader", Source: ref("ci", "b"), Pod: pod("ci")})
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.LayerPath(ref("ci", "b"), "flat"), 0o755))
	require.NoError(t, s.ReplaceLayer(ref("ci", "b"), "flat"))
	dirs, err := s.Chain(ref("ci", "b"))
	require.NoError(t, err)
	require.Equal(t, []string{s.LayerPath(ref("ci", "b"), "flat")}, dirs, "a flattened volume is a root layer")

	require.NoError(t, s.PruneLayers(os.RemoveAll))
	_, err = os.Stat(s.DataPath(b))
	require.NoError(t, err, "the old layer stays while a view mounts it")
	require.Contains(t, v.Lowers, s.DataPath(b))

	_, err = s.DropView("reader")
	require.NoError(t, err)
	require.NoError(t, s.PruneLayers(os.RemoveAll))
	_, err = os.Stat(s.DataPath(b))
	require.ErrorIs(t, err, os.ErrNotExist)
	cur, err := s.Get(ref("ci", "b"))
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
	ready(t, s, "ci", "synced", volume.Ref{}, volume.ScopeNamespace, nil)
	ready(t, s, "ci", "unsynced", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NoError(t, s.MarkSynced([]volume.Ref{ref("ci", "synced"), ref("ci", "gone")}))
	require.Equal(t, []volume.Ref{ref("ci", "unsynced")}, s.Unsynced())

	prev, err = s.SwapBoot("boot-2")
	require.NoError(t, err)
	require.Equal(t, "boot-1", prev)
	rep, err := s.Recover(os.RemoveAll, true)
	require.NoError(t, err)
	require.Equal(t, 1, rep.MarkedFailed)
	v, err := s.Get(ref("ci", "unsynced"))
	require.NoError(t, err)
	require.Equal(t, volume.StateFailed, v.State, "a reboot may have torn it")
	v, err = s.Get(ref("ci", "synced"))
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, v.State)
}
