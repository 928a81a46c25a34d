package cache

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
	require.NoError(t, s.SetMounted(id, 1, ""))
	require.NoError(t, s.SetViewState(id, ViewPublished, ViewCapturing))
	res, err := s.CaptureTarget(v)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(res), 0o755))
	vol, err := s.CommitCapture(id, Captured{Diff: !source.IsZero()})
	require.NoError(t, err)
	return vol
}

// readyWithTTL captures an empty volume ci/handle whose TTL is ttl.
func readyWithTTL(t *testing.T, s *Store, handle string, ttl time.Duration) Volume {
	t.Helper()
	v, err := s.Publish(View{VolumeID: "view-" + handle, Capture: handle, TTL: ttl, Pod: pod("ci")})
	require.NoError(t, err)
	require.NoError(t, s.SetMounted(v.VolumeID, 1, ""))
	require.NoError(t, s.SetViewState(v.VolumeID, ViewPublished, ViewCapturing))
	res, err := s.CaptureTarget(v)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(res), 0o755))
	vol, err := s.CommitCapture(v.VolumeID, Captured{})
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

// Destroy hides a volume at once; its data goes once nothing holds it: not
// a step volume mounting it, not a child whose layer is a diff over it.
func TestDestroyHidesAtOnceAndReapsWhenFree(t *testing.T) {
	s := openStore(t)
	parent := ready(t, s, "ci", "parent", volume.Ref{}, volume.ScopeNamespace, nil)
	child := ready(t, s, "ci", "child", ref("ci", "parent"), volume.ScopeNamespace, nil)
	_, err := s.Publish(View{VolumeID: "reader", Source: ref("ci", "child"), Pod: pod("ci")})
	require.NoError(t, err)
	require.Equal(t, Holders{Children: []volume.Ref{ref("ci", "child")}, Views: []string{"reader"}}, s.Holders(ref("ci", "parent")))

	require.NoError(t, s.Destroy(ref("ci", "parent")))
	require.NoError(t, s.Destroy(ref("ci", "parent")), "destroy is idempotent")
	require.NoError(t, s.Destroy(ref("ci", "nope")), "a missing volume counts as destroyed")
	_, err = s.Publish(View{VolumeID: "r2", Source: ref("ci", "parent"), Pod: pod("ci")})
	require.ErrorIs(t, err, ErrNotFound, "hidden at once")
	require.Empty(t, s.Reapable(), "its child and a reader hold its data")
	require.ErrorIs(t, s.Reap(ref("ci", "parent"), os.RemoveAll), ErrInUse)
	_, err = s.Publish(View{VolumeID: "r3", Source: ref("ci", "child"), Pod: pod("ci")})
	require.NoError(t, err, "the child still works")

	require.NoError(t, s.Destroy(ref("ci", "child")))
	require.Empty(t, s.Reapable(), "readers hold both")
	for _, id := range []string{"reader", "r3"} {
		_, err = s.DropView(id)
		require.NoError(t, err)
	}
	require.Equal(t, []volume.Ref{ref("ci", "child")}, refs(s.Reapable()), "the child first: it holds its parent")
	require.NoError(t, s.Reap(ref("ci", "child"), os.RemoveAll))
	require.Equal(t, []volume.Ref{ref("ci", "parent")}, refs(s.Reapable()))
	require.NoError(t, s.Reap(ref("ci", "parent"), os.RemoveAll))
	for _, v := range []Volume{parent, child} {
		_, err = os.Stat(s.DataPath(v))
		require.ErrorIs(t, err, os.ErrNotExist)
	}
	require.Empty(t, s.List())

	// A volume being made is destroyed when its capture commits.
	_, err = s.Publish(View{VolumeID: "w", Capture: "wip", Pod: pod("ci")})
	require.NoError(t, err)
	require.NoError(t, s.Destroy(ref("ci", "wip")))
	require.NoError(t, s.SetMounted("w", 1, ""))
	require.NoError(t, s.SetViewState("w", ViewPublished, ViewCapturing))
	vol, err := s.CommitCapture("w", Captured{})
	require.NoError(t, err)
	require.Equal(t, volume.StateDestroying, vol.State)
}

func refs(vols []Volume) []volume.Ref {
	var out []volume.Ref
	for _, v := range vols {
		out = append(out, v.Ref())
	}
	return out
}

// Eviction candidates: unpinned leaves nobody mounts, least recently used
// first; taking a leaf makes its base one.
func TestCandidatesAndPins(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "old", volume.Ref{}, volume.ScopeNamespace, nil)
	ready(t, s, "ci", "base", volume.Ref{}, volume.ScopeNamespace, nil)
	ready(t, s, "ci", "leaf", ref("ci", "base"), volume.ScopeNamespace, nil)
	ready(t, s, "ci", "pinned", volume.Ref{}, volume.ScopeNamespace, nil)
	ready(t, s, "ci", "mounted", volume.Ref{}, volume.ScopeNamespace, nil)
	_, err := s.Publish(View{VolumeID: "m", Source: ref("ci", "mounted"), Pod: pod("ci")})
	require.NoError(t, err)
	now := time.Now()
	_, err = s.SetPin(ref("ci", "pinned"), true, time.Time{})
	require.NoError(t, err)
	require.Equal(t, []volume.Ref{ref("ci", "old"), ref("ci", "leaf")}, refs(s.Candidates(now)))
	require.NoError(t, s.Destroy(ref("ci", "leaf")))
	require.NoError(t, s.Reap(ref("ci", "leaf"), os.RemoveAll))
	require.Equal(t, []volume.Ref{ref("ci", "old"), ref("ci", "base")}, refs(s.Candidates(now)))
	_, err = s.SetPin(ref("ci", "pinned"), true, now.Add(time.Minute))
	require.NoError(t, err)
	require.NotContains(t, refs(s.Candidates(now)), ref("ci", "pinned"))
	require.Contains(t, refs(s.Candidates(now.Add(2*time.Minute))), ref("ci", "pinned"), "a pin expires")
}

// The reaper destroys what a scan found due only if it still is when it
// does: a pin, a step's view or a use that came since keeps the volume.
func TestDestroyDueChecksAgain(t *testing.T) {
	now := time.Now()
	tests := []struct {
		name string
		why  Due
		// since changes the store (and what the scan saw) after the scan.
		since         func(t *testing.T, s *Store, seen *Volume)
		wantDestroyed bool
	}{
		{"still evictable", DueWatermark, func(*testing.T, *Store, *Volume) {}, true},
		{"pinned since the scan", DueWatermark, func(t *testing.T, s *Store, seen *Volume) {
			_, err := s.SetPin(seen.Ref(), true, time.Time{})
			require.NoError(t, err)
		}, false},
		{"a step's view took it since the scan", DueWatermark, func(t *testing.T, s *Store, seen *Volume) {
			_, err := s.Publish(View{VolumeID: "reader", Source: seen.Ref(), Pod: pod("ci")})
			require.NoError(t, err)
		}, false},
		{"used since the scan", DueWatermark, func(_ *testing.T, _ *Store, seen *Volume) {
			seen.LastUsed = seen.LastUsed.Add(-time.Minute) // the scan saw an older use
		}, false},
		{"its TTL ran out", DueTTL, func(*testing.T, *Store, *Volume) {}, true},
		{"pinned since its TTL ran out", DueTTL, func(t *testing.T, s *Store, seen *Volume) {
			_, err := s.SetPin(seen.Ref(), true, now.Add(time.Hour))
			require.NoError(t, err)
		}, false},
		{"failed", DueFailed, func(t *testing.T, s *Store, seen *Volume) {
			require.NoError(t, s.MarkFailed(seen.Ref()))
		}, true},
		{"not failed", DueFailed, func(*testing.T, *Store, *Volume) {}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t)
			seen := readyWithTTL(t, s, "vol", time.Minute)
			tc.since(t, s, &seen)
			at := now.Add(2 * time.Minute) // past its TTL
			destroyed, err := s.DestroyDue(seen, tc.why, at)
			require.NoError(t, err)
			require.Equal(t, tc.wantDestroyed, destroyed)
			got, err := s.Get(seen.Ref())
			require.NoError(t, err)
			require.Equal(t, tc.wantDestroyed, got.Hidden(), "destroyed: %s", got.State)
		})
	}
	_, err := openStore(t).DestroyDue(Volume{}, "whim", now)
	require.Error(t, err)
}

func TestTTLExpiry(t *testing.T) {
	s := openStore(t)
	readyWithTTL(t, s, "short", time.Hour)
	now := time.Now()
	_, expired, next := s.Due(now)
	require.Empty(t, expired)
	require.WithinDuration(t, now.Add(time.Hour), next, time.Minute, "the TTL runs out an hour after the capture")
	_, expired, _ = s.Due(now.Add(2 * time.Hour))
	require.Len(t, expired, 1)
	require.Equal(t, ref("ci", "short"), expired[0].Ref())
	_, err := s.SetPin(ref("ci", "short"), true, now.Add(3*time.Hour))
	require.NoError(t, err)
	_, expired, next = s.Due(now.Add(2 * time.Hour))
	require.Empty(t, expired, "a pin protects from the TTL")
	require.True(t, now.Add(3*time.Hour).Equal(next), "until the pin ends, not %s", next)
	_, err = s.SetPin(ref("ci", "short"), true, time.Time{})
	require.NoError(t, err)
	_, expired, next = s.Due(now.Add(4 * time.Hour))
	require.Empty(t, expired)
	require.True(t, next.IsZero(), "pinned for good, it never runs out")
}

// A handle whose volume failed backs off: captures into it are refused
// with when to retry, the wait doubling per failure up to 10 minutes; a
// successful capture clears it.
func TestFailedHandleBacksOff(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "flaky", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NoError(t, s.MarkFailed(ref("ci", "flaky")))
	require.NoError(t, s.Destroy(ref("ci", "flaky")))
	require.NoError(t, s.Reap(ref("ci", "flaky"), os.RemoveAll))
	_, err := s.Publish(View{VolumeID: "again", Capture: "flaky", Pod: pod("ci")})
	require.ErrorIs(t, err, ErrBackoff)
	require.Contains(t, err.Error(), "retry after")
	_, err = s.Publish(View{VolumeID: "other-ns", Capture: "flaky", Pod: pod("other")})
	require.NoError(t, err, "another namespace's handle is its own")
	require.Equal(t, 10*time.Second, backoff(1))
	require.Equal(t, 20*time.Second, backoff(2))
	require.Equal(t, 10*time.Minute, backoff(50))
	require.NoError(t, s.db.Update(func(tx *bolt.Tx) error {
		return putJSON(tx.Bucket(failuresBucket), key(ref("ci", "flaky")), failure{Count: 1, RetryAfter: time.Now().Add(-time.Second)})
	}))
	ready(t, s, "ci", "flaky", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NoError(t, s.db.View(func(tx *bolt.Tx) error {
		require.Nil(t, tx.Bucket(failuresBucket).Get(key(ref("ci", "flaky"))), "a good capture clears the record")
		return nil
	}))
}

func TestStoreIDAndRevision(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	require.NoError(t, err)
	id, rev := s.ID(), s.Revision()
	require.Len(t, id, 32)
	ready(t, s, "ci", "x", volume.Ref{}, volume.ScopeNamespace, nil)
	require.Greater(t, s.Revision(), rev, "every change counts")
	require.NoError(t, s.Close())
	s, err = Open(dir)
	require.NoError(t, err)
	require.Equal(t, id, s.ID(), "the ID stays with the state dir")
	require.NoError(t, s.Close())
	other, err := Open(t.TempDir())
	require.NoError(t, err)
	defer other.Close()
	require.NotEqual(t, id, other.ID(), "a new state dir is a new store")
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
	_, err = s.Publish(View{VolumeID: "retry", Capture: "lost", Pod: pod("ci")})
	require.ErrorIs(t, err, ErrBackoff, "a failed volume's handle backs off")
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
	besideOld := []string{s.StubsPath(b), s.DataPath(b) + sumsSuffix}
	for _, p := range besideOld {
		require.NoError(t, os.WriteFile(p, []byte("the old layer's"), 0o600))
	}
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
	for _, p := range besideOld {
		_, err = os.Stat(p)
		require.ErrorIs(t, err, os.ErrNotExist, "what was beside the old layer goes with it")
	}
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

// RecordMounts writes a mount only on the view it was made for, while that
// view is published with no mount recorded.
func TestRecordMounts(t *testing.T) {
	tests := []struct {
		name   string
		change func(t *testing.T, s *Store, v View) // after the mount was made
		want   uint64                               // the mount ID recorded after
	}{
		{"the view as it was", func(*testing.T, *Store, View) {}, 7},
		{"the view was mounted again and recorded then", func(t *testing.T, s *Store, v View) {
			require.NoError(t, s.SetMounted(v.VolumeID, 9, "1:9"))
		}, 9},
		{"the view is capturing", func(t *testing.T, s *Store, v View) {
			require.NoError(t, s.SetViewState(v.VolumeID, ViewPublished, ViewCapturing))
		}, 0},
		{"the view was published again under the same ID", func(t *testing.T, s *Store, v View) {
			_, err := s.DropView(v.VolumeID)
			require.NoError(t, err)
			_, err = s.Publish(View{VolumeID: v.VolumeID, Target: v.Target, Pod: v.Pod})
			require.NoError(t, err)
		}, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t)
			v, err := s.Publish(View{VolumeID: "v", Target: "/t/v", Pod: pod("ci")})
			require.NoError(t, err)
			tc.change(t, s, v)
			made := []MadeMount{{VolumeID: "v", Published: v.CreatedAt, MountID: 7, Root: "1:7"}, {VolumeID: "gone", MountID: 8}}
			require.NoError(t, s.RecordMounts(made))
			got, err := s.GetView("v")
			require.NoError(t, err)
			require.Equal(t, tc.want, got.MountID)
		})
	}
}

// Lowers answers what Publish would mount, and refuses every source Publish
// refuses with the same error, writing nothing.
func TestLowersAnswersAsPublish(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "a", volume.Ref{}, volume.ScopeCluster, nil)
	ready(t, s, "ci", "b", ref("ci", "a"), volume.ScopeNamespace, nil)
	ready(t, s, "ci", "bad", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NoError(t, s.update(ref("ci", "bad"), func(v *Volume) error { v.State = volume.StateFailed; return nil }))
	_, err := s.Publish(View{VolumeID: "w", Capture: "creating", Pod: pod("ci")})
	require.NoError(t, err)

	tests := []struct {
		name    string
		view    View
		wantErr error
	}{
		{"a chain", View{Source: ref("ci", "b"), Pod: pod("ci")}, nil},
		{"a shared layer from another namespace", View{Source: ref("ci", "a"), Pod: pod("other")}, nil},
		{"no source", View{Pod: pod("ci")}, nil},
		{"a copy for a user namespace", View{Source: ref("ci", "b"), Pod: pod("ci"), UserNamespace: true}, nil},
		{"another namespace's private volume", View{Source: ref("ci", "b"), Pod: pod("other")}, ErrNotFound},
		{"a missing volume", View{Source: ref("ci", "nope"), Pod: pod("ci")}, ErrNotFound},
		{"a failed volume", View{Source: ref("ci", "bad"), Pod: pod("ci")}, ErrUnusable},
		{"a volume being made", View{Source: ref("ci", "creating"), Pod: pod("ci")}, ErrNotReady},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.view.VolumeID = fmt.Sprint("lowers-", i)
			before := s.ListViews()
			lowers, lerr := s.Lowers(tc.view)
			require.Equal(t, before, s.ListViews(), "Lowers writes nothing")
			published, perr := s.Publish(tc.view)
			if tc.wantErr != nil {
				require.ErrorIs(t, lerr, tc.wantErr)
				require.Equal(t, perr.Error(), lerr.Error(), "refused as Publish refuses")
				return
			}
			require.NoError(t, lerr)
			require.NoError(t, perr)
			require.Equal(t, published.Lowers, lowers)
		})
	}
}
