package node

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/volume"
)

const goCache = "go-build/linux-amd64"

// cacheVolume is a new pod's volume of key in namespace ns.
func (f *fixture) cacheVolume(ns, key string, opts ...func(*volume.Cache)) PublishRequest {
	r := f.volume(ns, "", "")
	r.Scope, r.Cache = "", volume.Cache{Key: key}
	for _, o := range opts {
		o(&r.Cache)
	}
	return r
}

// files lists what a step sees in its volume.
func files(t *testing.T, r PublishRequest) []string {
	t.Helper()
	entries, err := os.ReadDir(r.Target.Full)
	require.NoError(t, err)
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

// step publishes a cache volume, writes a file named name in it, and ends
// as result says.
func (f *fixture) cacheStep(pods *fakePods, r PublishRequest, name string, result volume.StepResult) {
	f.t.Helper()
	require.NoError(f.t, f.publish(r))
	require.NoError(f.t, os.WriteFile(filepath.Join(r.Target.Full, name), []byte(name), 0o644))
	f.endStep(pods, r, result)
}

// endStep ends the step of r's pod with result, and tears r down.
func (f *fixture) endStep(pods *fakePods, r PublishRequest, result volume.StepResult) {
	f.t.Helper()
	pods.set(r.Pod.Name, false, result)
	require.NoError(f.t, f.unpublish(r))
}

func (f *fixture) current(ns, key string) cache.CacheKey {
	f.t.Helper()
	rec, err := f.store.CacheCurrent(ns, key)
	require.NoError(f.t, err)
	return rec
}

// A cache forks its key's current version for each step, which becomes
// the next current version only if the step succeeds.
func TestCacheVolumes(t *testing.T) {
	tests := []struct {
		name string
		run  func(t *testing.T, f *fixture, pods *fakePods)
	}{
		{"the first use is empty and a success is what the next step starts from", func(t *testing.T, f *fixture, pods *fakePods) {
			first := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(first))
			require.Empty(t, files(t, first), "no version yet")
			require.NoError(t, f.publish(first), "a publish again is the same publish")
			require.NoError(t, os.WriteFile(filepath.Join(first.Target.Full, "a"), nil, 0o644))
			f.endStep(pods, first, volume.StepSucceeded)
			rec := f.current("ci", goCache)
			require.Equal(t, first.Pod.Name, rec.PromotedBy)
			require.Contains(t, f.events.of(first.Pod.Name)[0], `CachePromoted: Cache "go-build/linux-amd64" is now the step's version `+rec.Current)
			v, err := f.store.Get(rec.CurrentRef())
			require.NoError(t, err)
			require.Equal(t, goCache, v.Properties[volume.PropertyCacheKey])
			require.Equal(t, string(volume.StepSucceeded), v.Properties[volume.PropertyStepResult])
			require.Equal(t, first.Pod.Name, v.Properties[volume.PropertyCachePromotedBy])
			require.Equal(t, rec.PromotedAt.UTC().Format(time.RFC3339Nano), v.Properties[volume.PropertyCachePromotedAt])

			next := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(next))
			require.Equal(t, []string{"a"}, files(t, next))
			require.Equal(t, 1.0, testutil.ToFloat64(f.engine.metrics.cacheForks.WithLabelValues("local")))
			require.Equal(t, 1.0, testutil.ToFloat64(f.engine.metrics.cacheForks.WithLabelValues("none")))
			require.Equal(t, 1.0, testutil.ToFloat64(f.engine.metrics.cachePromotions))
			require.NoError(t, f.unpublish(next))
		}},
		{"a step that failed or never started or ended untold leaves the key as it was", func(t *testing.T, f *fixture, pods *fakePods) {
			f.cacheStep(pods, f.cacheVolume("ci", goCache), "good", volume.StepSucceeded)
			good := f.current("ci", goCache)
			failed := f.cacheVolume("ci", goCache)
			f.cacheStep(pods, failed, "broken", volume.StepFailed)
			require.Equal(t, []string{`CacheDiscarded: Cache "go-build/linux-amd64" keeps its version: what the step wrote was discarded ` +
				`(the step failed; cachePromote: always promotes whatever the result)`}, f.events.of(failed.Pod.Name))
			untold := f.cacheVolume("ci", goCache)
			f.cacheStep(pods, untold, "untold", "")
			notStarted := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(notStarted))
			f.endStep(pods, notStarted, volume.StepNotStarted)
			require.Equal(t, good, f.current("ci", goCache))
			for reason, n := range map[string]float64{discardFailed: 1, discardUnknown: 1, discardNotStarted: 1} {
				require.Equal(t, n, testutil.ToFloat64(f.engine.metrics.cacheDiscards.WithLabelValues(reason)), reason)
			}
			after := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(after))
			require.Equal(t, []string{"good"}, files(t, after))
			require.NoError(t, f.unpublish(after))
			require.Len(t, f.store.CacheVersions("ci", goCache), 1, "the discarded views made no version")
		}},
		{"cachePromote always promotes a failed step's view and not one that never started", func(t *testing.T, f *fixture, pods *fakePods) {
			always := func(c *volume.Cache) { c.PromoteAlways = true }
			f.cacheStep(pods, f.cacheVolume("ci", goCache, always), "from-a-failure", volume.StepFailed)
			f.cacheStep(pods, f.cacheVolume("ci", goCache, always), "untold", "")
			notStarted := f.cacheVolume("ci", goCache, always)
			require.NoError(t, f.publish(notStarted))
			f.endStep(pods, notStarted, volume.StepNotStarted)
			next := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(next))
			require.ElementsMatch(t, []string{"from-a-failure", "untold"}, files(t, next))
			require.NoError(t, f.unpublish(next))
		}},
		{"concurrent steps never see each other's writes and the last to finish wins", func(t *testing.T, f *fixture, pods *fakePods) {
			f.cacheStep(pods, f.cacheVolume("ci", goCache), "base", volume.StepSucceeded)
			a, b := f.cacheVolume("ci", goCache), f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(a))
			require.NoError(t, f.publish(b))
			require.NoError(t, os.WriteFile(filepath.Join(a.Target.Full, "from-a"), nil, 0o644))
			require.NoError(t, os.WriteFile(filepath.Join(b.Target.Full, "from-b"), nil, 0o644))
			require.Equal(t, []string{"base", "from-a"}, files(t, a))
			require.Equal(t, []string{"base", "from-b"}, files(t, b))
			pods.set(a.Pod.Name, false, volume.StepSucceeded)
			pods.set(b.Pod.Name, false, volume.StepSucceeded)
			require.NoError(t, f.unpublish(b))
			require.NoError(t, f.unpublish(a))
			require.Equal(t, a.Pod.Name, f.current("ci", goCache).PromotedBy, "a finished last")
			next := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(next))
			require.Equal(t, []string{"base", "from-a"}, files(t, next), "b's writes are not in a's version")
			require.NoError(t, f.unpublish(next))
		}},
		{"a read-only view reads the current version and makes none", func(t *testing.T, f *fixture, pods *fakePods) {
			f.cacheStep(pods, f.cacheVolume("ci", goCache), "base", volume.StepSucceeded)
			before := f.current("ci", goCache)
			ro := f.cacheVolume("ci", goCache)
			ro.ReadOnly = true
			require.NoError(t, f.publish(ro))
			require.Equal(t, []string{"base"}, files(t, ro))
			require.Error(t, os.WriteFile(filepath.Join(ro.Target.Full, "x"), nil, 0o644), "read-only")
			f.endStep(pods, ro, volume.StepSucceeded)
			require.Equal(t, before, f.current("ci", goCache))
			require.Len(t, f.store.CacheVersions("ci", goCache), 1)
		}},
		{"the node keeps two versions a key and one a step reads stays until it ends", func(t *testing.T, f *fixture, pods *fakePods) {
			f.cacheStep(pods, f.cacheVolume("ci", goCache), "v1", volume.StepSucceeded)
			reader := f.cacheVolume("ci", goCache)
			reader.ReadOnly = true
			require.NoError(t, f.publish(reader))
			for _, name := range []string{"v2", "v3", "v4"} {
				f.cacheStep(pods, f.cacheVolume("ci", goCache), name, volume.StepSucceeded)
			}
			var ready int
			for _, v := range f.store.CacheVersions("ci", goCache) {
				if v.State == volume.StateReady {
					ready++
				}
			}
			require.Equal(t, 2, ready, "the current one and one before it")
			require.Equal(t, []string{"v1"}, files(t, reader), "the reader's version is destroyed, and still read")
			f.endStep(pods, reader, volume.StepSucceeded)
			next := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(next))
			require.Equal(t, []string{"v1", "v2", "v3", "v4"}, files(t, next))
			require.NoError(t, f.unpublish(next))
		}},
		{"a version over cacheMaxSize is refused and the key keeps its version", func(t *testing.T, f *fixture, pods *fakePods) {
			capped := func(c *volume.Cache) { c.MaxBytes = 64 << 10 }
			f.cacheStep(pods, f.cacheVolume("ci", goCache, capped), "small", volume.StepSucceeded)
			before := f.current("ci", goCache)
			big := f.cacheVolume("ci", goCache, capped)
			require.NoError(t, f.publish(big))
			require.NoError(t, os.WriteFile(filepath.Join(big.Target.Full, "big"), make([]byte, 1<<20), 0o644))
			f.endStep(pods, big, volume.StepSucceeded)
			require.Equal(t, before, f.current("ci", goCache))
			events := f.events.of(big.Pod.Name)
			require.Len(t, events, 1)
			require.Contains(t, events[0], "CachePromotionRefused: ")
			require.Contains(t, events[0], "over the volume's cacheMaxSize (65536)")
			require.Equal(t, 1.0, testutil.ToFloat64(f.engine.metrics.cacheRefusals.WithLabelValues(string(cache.RefusedOverCap))))
		}},
		{"a cleared key starts empty and a step reading it keeps reading and is not promoted", func(t *testing.T, f *fixture, pods *fakePods) {
			f.cacheStep(pods, f.cacheVolume("ci", goCache), "poisoned", volume.StepSucceeded)
			running := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(running))
			was, err := f.engine.ClearCache("ci", goCache)
			require.NoError(t, err)
			require.NotEmpty(t, was.Current)
			require.Equal(t, []string{"poisoned"}, files(t, running))
			require.NoError(t, os.WriteFile(filepath.Join(running.Target.Full, "more"), nil, 0o644))
			f.endStep(pods, running, volume.StepSucceeded)
			require.Empty(t, f.current("ci", goCache).Current, "the running step's version is refused")
			fresh := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(fresh))
			require.Empty(t, files(t, fresh))
			require.NoError(t, f.unpublish(fresh))
			_, err = f.engine.ClearCache("ci", "../x")
			require.Error(t, err, "a malformed key")
		}},
		{"another namespace naming the key gets a key of its own", func(t *testing.T, f *fixture, pods *fakePods) {
			f.cacheStep(pods, f.cacheVolume("ci", goCache), "ci-secret", volume.StepSucceeded)
			other := f.cacheVolume("other", goCache)
			require.NoError(t, f.publish(other))
			require.Empty(t, files(t, other))
			require.NoError(t, os.WriteFile(filepath.Join(other.Target.Full, "other-file"), nil, 0o644))
			f.endStep(pods, other, volume.StepSucceeded)
			next := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(next))
			require.Equal(t, []string{"ci-secret"}, files(t, next))
			require.NoError(t, f.unpublish(next))
			require.Len(t, f.engine.Caches("ci"), 1)
			require.Len(t, f.engine.Caches(""), 2)
		}},
		{"a cache survives a restart of the plugin mid-step", func(t *testing.T, f *fixture, pods *fakePods) {
			f.cacheStep(pods, f.cacheVolume("ci", goCache), "base", volume.StepSucceeded)
			r := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(r))
			require.NoError(t, os.WriteFile(filepath.Join(r.Target.Full, "during"), nil, 0o644))
			f.restart()
			require.NoError(t, f.publish(r), "the kubelet's publish again, after the restart")
			f.endStep(pods, r, volume.StepSucceeded)
			next := f.cacheVolume("ci", goCache)
			require.NoError(t, f.publish(next))
			require.Equal(t, []string{"base", "during"}, files(t, next))
			require.NoError(t, f.unpublish(next))
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, pods := newPodsFixture(t, t.TempDir())
			tc.run(t, f, pods)
		})
	}
}
