package fleet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/volume"
)

// cacheVersion is a version of key in namespace ci, promoted at (zero: a
// version never made current), by pod.
func cacheVersion(t *testing.T, key, state string, at time.Time, pod string) Held {
	t.Helper()
	h, err := volume.NewCacheHandle(key)
	require.NoError(t, err)
	props := []Property{{volume.PropertyCacheKey, key}}
	if !at.IsZero() {
		props = append(props, Property{volume.PropertyCachePromotedAt, at.UTC().Format(time.RFC3339Nano)},
			Property{volume.PropertyCachePromotedBy, pod})
	}
	held := vol(h, state, 100)
	held.Properties = props
	return held
}

// The fleet's current version of a key is the one promoted last that a
// live node holds ready, wherever it was made; versions never made
// current, failed, or on a node gone silent do not count, nor do volumes
// that only look like a version (a property naming a key their handle is
// not of), nor one dated later than a node's clock may be ahead.
func TestCacheLookups(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	t0 := now.Add(-time.Hour)
	older := cacheVersion(t, "go/build", "ready", t0, "ci/build-1")
	newest := cacheVersion(t, "go/build", "ready", t0.Add(time.Minute+123*time.Millisecond), "ci/build-2")
	newest.Parent = older.Ref // forked from it
	unpromoted := cacheVersion(t, "go/build", "ready", time.Time{}, "")
	failed := cacheVersion(t, "go/build", "failed", t0.Add(time.Hour), "ci/build-9")
	onSilent := cacheVersion(t, "go/build", "ready", t0.Add(50*time.Minute), "ci/build-8")
	npm := cacheVersion(t, "npm", "ready", t0, "ci/web-1")
	impostor := cacheVersion(t, "npm", "ready", t0.Add(55*time.Minute), "ci/evil")
	impostor.Properties[0].Value = "go/build" // names a key its handle is not of
	ahead := cacheVersion(t, "go/build", "ready", now.Add(time.Hour), "ci/clock-ahead")
	other := cacheVersion(t, "go/build", "ready", t0.Add(30*time.Minute), "other/x")
	other.Ref.Namespace = "other"

	report := func(node string, at time.Time, held ...Held) Answer {
		a, err := v.Report(Report{NodeID: node, StoreID: "s-" + node, Revision: 1, Full: true, Upserts: held, PeerAddress: node + ":7443"}, at)
		require.NoError(t, err)
		return a
	}
	report("silent", now.Add(-10*time.Minute), onSilent)
	report("a", now, older, unpromoted, failed, npm, impostor, other, ahead)
	report("b", now, newest, older)

	got := v.Caches("ci", []string{"go/build", "npm", "never"}, 0, now)
	require.Len(t, got, 3)
	build := got[0]
	require.True(t, build.Found)
	require.Equal(t, newest.Ref, build.Version.Ref)
	require.Equal(t, []string{"b"}, build.Version.Nodes)
	require.Equal(t, []string{"b:7443"}, build.Version.PeerAddresses)
	require.Equal(t, "ci/build-2", build.PromotedBy)
	require.True(t, build.PromotedAt.Equal(t0.Add(time.Minute+123*time.Millisecond)), "parsed to the nanosecond")
	require.Equal(t, 2, build.Versions, "the newest and the older, which two nodes hold")
	require.Equal(t, int64(200), build.Bytes, "its layer and the one it was forked from")
	require.True(t, got[1].Found)
	require.Equal(t, npm.Ref, got[1].Version.Ref)
	require.Equal(t, CacheLocation{Namespace: "ci", Key: "never"}, got[2])

	all := v.Caches("ci", nil, 1, now)
	require.Len(t, all, 2)
	require.Equal(t, []string{"go/build", "npm"}, []string{all[0].Key, all[1].Key})
	require.Equal(t, newest.Ref, all[0].Version.Ref)

	require.Equal(t, other.Ref, v.Caches("other", []string{"go/build"}, 0, now)[0].Version.Ref, "each namespace its own")

	// Once b stops reporting, the older version is the newest a live node
	// holds.
	later := now.Add(2 * time.Minute)
	report("a", later, older, npm, other)
	got = v.Caches("ci", []string{"go/build"}, 0, later)
	require.Equal(t, older.Ref, got[0].Version.Ref)
	require.Equal(t, []string{"a"}, got[0].Version.Nodes)

	// Clearing the key destroys every version any node reports, on any
	// node (silent and b too, which are stalled now), and leaves other
	// keys and namespaces alone.
	told := v.ClearCache(volume.CacheRef{Namespace: "ci", Key: "go/build"}, later)
	var refs []volume.Ref
	for _, vn := range told {
		refs = append(refs, vn.Ref)
		require.NotEmpty(t, vn.Nodes, "%s", vn.Ref)
	}
	require.ElementsMatch(t, []volume.Ref{older.Ref, newest.Ref, onSilent.Ref}, refs)
	require.Empty(t, v.ClearCache(volume.CacheRef{Namespace: "ci", Key: "never"}, later))
	require.False(t, v.Caches("ci", []string{"go/build"}, 0, later)[0].Found)
	require.True(t, v.Caches("ci", []string{"npm"}, 0, later)[0].Found)
	require.True(t, v.Caches("other", []string{"go/build"}, 0, later)[0].Found)

	// A node that had not reported its version when the key was cleared
	// (promoted before the clear) is told to destroy it when it does, and
	// the version never counts; one promoted after the clear does, as
	// does the same key of another namespace.
	missed := cacheVersion(t, "go/build", "ready", later.Add(-time.Second), "ci/build-7")
	a := report("c", later, missed)
	require.Equal(t, []volume.Ref{missed.Ref}, a.Destroy)
	require.False(t, v.Caches("ci", []string{"go/build"}, 0, later)[0].Found)
	fresh := cacheVersion(t, "go/build", "ready", later.Add(time.Second), "ci/build-10")
	otherMissed := cacheVersion(t, "go/build", "ready", later.Add(-time.Second), "other/y")
	otherMissed.Ref.Namespace = "other"
	a = report("c", later.Add(2*time.Second), missed, fresh, otherMissed)
	require.Equal(t, []volume.Ref{missed.Ref}, a.Destroy)
	got = v.Caches("ci", []string{"go/build"}, 0, later.Add(2*time.Second))
	require.True(t, got[0].Found)
	require.Equal(t, fresh.Ref, got[0].Version.Ref)
	require.Equal(t, 1, got[0].Versions)

	// The clear is forgotten after clearsKeptFor.
	week := later.Add(clearsKeptFor + time.Minute)
	v.ClearCache(volume.CacheRef{Namespace: "ci", Key: "npm"}, week)
	back := cacheVersion(t, "go/build", "ready", later.Add(-2*time.Second), "ci/build-6")
	require.Empty(t, report("d", week, back).Destroy)
}
