package cache

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/volume"
)

// forkCache publishes a step's view of key in ns, as the node does for a
// cache volume.
func forkCache(t *testing.T, s *Store, ns, id, key string) View {
	t.Helper()
	handle, err := volume.NewCacheHandle(key)
	require.NoError(t, err)
	v, err := s.Publish(View{VolumeID: id, Target: "/t/" + id, Capture: handle, Properties: map[string]string{volume.PropertyCacheKey: key},
		Cache: volume.Cache{Key: key}, Pod: volume.Pod{Namespace: ns, Name: id, UID: "u"}})
	require.NoError(t, err)
	require.NoError(t, s.SetMounted(id, 1, ""))
	return v
}

// promote commits a forked view as a version of bytes, capped at maxBytes.
func promote(t *testing.T, s *Store, v View, bytes, maxBytes int64) (Volume, Promoted, error) {
	t.Helper()
	require.NoError(t, s.SetViewState(v.VolumeID, ViewPublished, ViewCapturing))
	res, err := s.CaptureTarget(v)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(res), 0o755))
	return s.CommitCacheVersion(v.VolumeID, Captured{Diff: !v.Source.IsZero(), Bytes: bytes},
		Promotion{Key: v.Cache.Key, By: v.Pod.Name, MaxBytes: maxBytes})
}

func TestCacheVersions(t *testing.T) {
	const key = "go-build/linux-amd64"
	tests := []struct {
		name string
		run  func(t *testing.T, s *Store)
	}{
		{"the first use starts empty, and its success is the next step's start", func(t *testing.T, s *Store) {
			first := forkCache(t, s, "ci", "a", key)
			require.True(t, first.Source.IsZero(), "no version yet: an empty volume")
			_, err := s.CacheCurrent("ci", key)
			require.ErrorIs(t, err, ErrNotFound)
			vol, res, err := promote(t, s, first, 100, 0)
			require.NoError(t, err)
			require.Empty(t, res.Refused)
			require.True(t, res.Previous.Current == "", "nothing was current")
			require.Equal(t, volume.StateReady, vol.State)
			rec, err := s.CacheCurrent("ci", key)
			require.NoError(t, err)
			require.Equal(t, CacheKey{Namespace: "ci", Key: key, Current: vol.Handle, PromotedAt: rec.PromotedAt, PromotedBy: "a", Promotions: 1}, rec)

			next := forkCache(t, s, "ci", "b", key)
			require.Equal(t, vol.Ref(), next.Source, "the next step forks the current version")
			require.Equal(t, []volume.Ref{vol.Ref()}, next.Pins, "and holds it while it runs")
		}},
		{"concurrent steps fork the same version; the last to finish wins", func(t *testing.T, s *Store) {
			v1, _, err := promote(t, s, forkCache(t, s, "ci", "seed", key), 10, 0)
			require.NoError(t, err)
			a, b := forkCache(t, s, "ci", "a", key), forkCache(t, s, "ci", "b", key)
			require.Equal(t, v1.Ref(), a.Source)
			require.Equal(t, v1.Ref(), b.Source)
			require.NotEqual(t, a.Capture, b.Capture, "each writes a version of its own")
			vb, _, err := promote(t, s, b, 20, 0)
			require.NoError(t, err)
			afterB, err := s.CacheCurrent("ci", key)
			require.NoError(t, err)
			va, res, err := promote(t, s, a, 30, 0)
			require.NoError(t, err)
			require.Equal(t, vb.Handle, res.Previous.Current)
			rec, err := s.CacheCurrent("ci", key)
			require.NoError(t, err)
			require.Equal(t, va.Handle, rec.Current, "a finished last")
			require.True(t, rec.PromotedAt.After(afterB.PromotedAt), "current moves forward only")
			require.Equal(t, uint64(3), rec.Promotions)
			require.Equal(t, v1.Ref(), va.Base, "a's version is a diff over what it forked")
			require.Len(t, s.CacheVersions("ci", key), 3)
		}},
		{"a version over the cap is refused and the key keeps its version", func(t *testing.T, s *Store) {
			v1, _, err := promote(t, s, forkCache(t, s, "ci", "seed", key), 600, 1000)
			require.NoError(t, err)
			big := forkCache(t, s, "ci", "big", key)
			vol, res, err := promote(t, s, big, 500, 1000)
			require.NoError(t, err)
			require.Equal(t, RefusedOverCap, res.Refused)
			require.Equal(t, int64(1100), res.Bytes, "its own 500 bytes over its base's 600")
			require.True(t, vol.Hidden(), "the refused version is destroyed as it commits")
			rec, err := s.CacheCurrent("ci", key)
			require.NoError(t, err)
			require.Equal(t, v1.Handle, rec.Current)
			_, err = s.GetView("big")
			require.ErrorIs(t, err, ErrNotFound, "the view is gone either way")
			small := forkCache(t, s, "ci", "small", key)
			require.Equal(t, v1.Ref(), small.Source)
			_, res, err = promote(t, s, small, 400, 1000)
			require.NoError(t, err)
			require.Empty(t, res.Refused, "1000 bytes is at the cap, not over it")
		}},
		{"a version from another node is adopted only forward", func(t *testing.T, s *Store) {
			v1, _, err := promote(t, s, forkCache(t, s, "ci", "a", key), 10, 0)
			require.NoError(t, err)
			v2, _, err := promote(t, s, forkCache(t, s, "ci", "b", key), 10, 0)
			require.NoError(t, err)
			rec, err := s.CacheCurrent("ci", key)
			require.NoError(t, err)
			at := rec.PromotedAt
			moved, err := s.AdoptCacheVersion("ci", key, v1.Handle, at, "elsewhere")
			require.NoError(t, err)
			require.False(t, moved, "promoted no later than the current one")
			moved, err = s.AdoptCacheVersion("ci", key, v1.Handle, at.Add(time.Hour), "elsewhere")
			require.NoError(t, err)
			require.True(t, moved)
			rec, err = s.CacheCurrent("ci", key)
			require.NoError(t, err)
			require.Equal(t, CacheKey{Namespace: "ci", Key: key, Current: v1.Handle, PromotedAt: at.Add(time.Hour), PromotedBy: "elsewhere",
				Promotions: 2}, rec)
			require.Equal(t, v1.Ref(), forkCache(t, s, "ci", "c", key).Source)

			_, err = s.ClearCache("ci", key)
			require.NoError(t, err)
			moved, err = s.AdoptCacheVersion("ci", key, v2.Handle, at, "elsewhere")
			require.NoError(t, err)
			require.False(t, moved, "promoted before the key was cleared here")
			moved, err = s.AdoptCacheVersion("ci", key, v2.Handle, time.Now().Add(time.Hour), "elsewhere")
			require.NoError(t, err)
			require.True(t, moved, "promoted elsewhere after the clear")

			other, err := volume.NewCacheHandle("other-key")
			require.NoError(t, err)
			missing, err := volume.NewCacheHandle(key)
			require.NoError(t, err)
			for name, h := range map[string]string{"a version of another key": other, "a volume that is not a version": "plain",
				"a version not here": missing} {
				_, err := s.AdoptCacheVersion("ci", key, h, time.Now().Add(time.Hour), "x")
				require.ErrorIs(t, err, ErrNotFound, name)
			}
			_, err = s.AdoptCacheVersion("other", key, v2.Handle, time.Now().Add(time.Hour), "x")
			require.ErrorIs(t, err, ErrNotFound, "another namespace's version")
		}},
		{"another namespace's key of the same name is another key", func(t *testing.T, s *Store) {
			v1, _, err := promote(t, s, forkCache(t, s, "ci", "seed", key), 10, 0)
			require.NoError(t, err)
			other := forkCache(t, s, "other", "x", key)
			require.True(t, other.Source.IsZero(), "ci's version is not other's")
			_, err = s.CacheCurrent("other", key)
			require.ErrorIs(t, err, ErrNotFound)
			versions := s.CacheVersions("other", key)
			require.Len(t, versions, 1, "its own, being made, and none of ci's")
			require.Equal(t, other.Capture, versions[0].Handle)
			require.Len(t, s.Caches("ci"), 1)
			require.Empty(t, s.Caches("other"))
			_, _, err = promote(t, s, other, 10, 0)
			require.NoError(t, err)
			rec, err := s.CacheCurrent("ci", key)
			require.NoError(t, err)
			require.Equal(t, v1.Handle, rec.Current, "other's promotion leaves ci's key alone")
			require.Len(t, s.Caches(""), 2)
		}},
		{"a cleared key starts empty; a step reading a version keeps it", func(t *testing.T, s *Store) {
			v1, _, err := promote(t, s, forkCache(t, s, "ci", "seed", key), 10, 0)
			require.NoError(t, err)
			reader := forkCache(t, s, "ci", "reader", key)
			rec, err := s.ClearCache("ci", key)
			require.NoError(t, err)
			require.Equal(t, v1.Handle, rec.Current)
			require.NoError(t, s.Destroy(v1.Ref()))
			require.True(t, forkCache(t, s, "ci", "after", key).Source.IsZero())
			require.Equal(t, []string{reader.VolumeID}, s.Holders(v1.Ref()).Views, "the reader's view holds its data")
			vol, res, err := promote(t, s, reader, 10, 0)
			require.NoError(t, err)
			require.Equal(t, RefusedCleared, res.Refused, "it forked what the clear dropped")
			require.True(t, vol.Hidden())
			rec, err = s.CacheCurrent("ci", key)
			require.NoError(t, err)
			require.Empty(t, rec.Current)
			require.False(t, rec.ClearedAt.IsZero())
			_, err = s.ClearCache("ci", key)
			require.NoError(t, err, "clearing again is done")
			_, err = s.ClearCache("ci", "never-used")
			require.NoError(t, err, "a key never used is cleared too")
		}},
		{"a current version destroyed (evicted, expired) is a miss", func(t *testing.T, s *Store) {
			v1, _, err := promote(t, s, forkCache(t, s, "ci", "seed", key), 10, 0)
			require.NoError(t, err)
			require.NoError(t, s.Destroy(v1.Ref()))
			require.True(t, forkCache(t, s, "ci", "next", key).Source.IsZero())
		}},
		{"a promotion of a view that is not capturing changes nothing", func(t *testing.T, s *Store) {
			v1, _, err := promote(t, s, forkCache(t, s, "ci", "seed", key), 10, 0)
			require.NoError(t, err)
			v := forkCache(t, s, "ci", "a", key)
			_, _, err = s.CommitCacheVersion(v.VolumeID, Captured{}, Promotion{Key: key, By: "a"})
			require.ErrorIs(t, err, ErrWrongViewState)
			rec, err := s.CacheCurrent("ci", key)
			require.NoError(t, err)
			require.Equal(t, v1.Handle, rec.Current)
		}},
		{"versions of another key are not this key's", func(t *testing.T, s *Store) {
			_, _, err := promote(t, s, forkCache(t, s, "ci", "a", key), 10, 0)
			require.NoError(t, err)
			_, _, err = promote(t, s, forkCache(t, s, "ci", "b", "m2"), 10, 0)
			require.NoError(t, err)
			require.Len(t, s.CacheVersions("ci", key), 1)
			require.Len(t, s.CacheVersions("ci", "m2"), 1)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.run(t, openStore(t)) })
	}
}

// A cache key's versions are evicted as one: by the key's last use, so a
// volume used between the key's two versions goes before either.
func TestCacheVersionsEvictedTogether(t *testing.T) {
	s := openStore(t)
	a, b := forkCache(t, s, "ci", "a", "deps"), forkCache(t, s, "ci", "b", "deps")
	va, _, err := promote(t, s, a, 10, 0)
	require.NoError(t, err)
	mid := ready(t, s, "ci", "mid", volume.Ref{}, volume.ScopeNamespace, nil)
	vb, _, err := promote(t, s, b, 10, 0)
	require.NoError(t, err)
	require.True(t, va.LastUsed.Before(mid.LastUsed) && mid.LastUsed.Before(vb.LastUsed))
	now := time.Now()
	require.Equal(t, []volume.Ref{mid.Ref(), va.Ref(), vb.Ref()}, refs(s.Candidates(now)),
		"the key's versions together, its older one first")
	// A volume that only says it is a version of the key is not one.
	impostor := ready(t, s, "ci", "impostor", volume.Ref{}, volume.ScopeNamespace, map[string]string{volume.PropertyCacheKey: "deps"})
	require.Equal(t, []volume.Ref{mid.Ref(), va.Ref(), vb.Ref(), impostor.Ref()}, refs(s.Candidates(now)))
}
