package test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

// cacheAttrs name a cache promoted whatever the step's result: this plugin
// has no API server to tell it how a step ended (the node engine's tests
// cover promotion on success only).
func cacheAttrs(key string) map[string]string {
	return map[string]string{driver.AttrCache: key, driver.AttrCachePromote: "always"}
}

// listDir names what a dir holds.
func listDir(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// TestCacheOverGRPC drives cache volumes through the real binary: a first
// step starts empty, the next forks what it wrote, a read-only view reads
// it and makes no version, and hostile attributes are refused.
func TestCacheOverGRPC(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	first := e.mount(cacheAttrs("deps"), false)
	require.Empty(t, listDir(t, first.Target))
	write(t, first.Target, "module", "v1")
	e.umount(first)

	second := e.mount(cacheAttrs("deps"), false)
	require.Equal(t, "v1", readFile(t, second.Target, "module"))
	write(t, second.Target, "module", "v2")
	e.umount(second)

	ro := e.mount(map[string]string{driver.AttrCache: "deps"}, true)
	require.Equal(t, "v2", readFile(t, ro.Target, "module"))
	e.umount(ro)
	require.Equal(t, 2.0, metricValue(t, e, "cowvol_cache_promotions_total"))
	require.Equal(t, 1.0, metricValue(t, e, "cowvol_cache_keys"))

	other := e.volumeIn("other", cacheAttrs("deps"), false)
	require.NoError(t, e.publish(other))
	require.Empty(t, listDir(t, other.Target), "another namespace's key of the same name")
	require.NoError(t, e.unpublish(other))

	for name, attrs := range map[string]map[string]string{
		"a version named as a source": {driver.AttrSource: "cache.0123456789abcdef01234567.0123456789abcdef"},
		"a cache with a capture":      {driver.AttrCache: "deps", driver.AttrCapture: "out"},
		"a key that is a path":        {driver.AttrCache: "../../etc"},
	} {
		require.Equal(t, codes.InvalidArgument, code(e.publish(e.volume(attrs, false))), name)
	}
	e.noLeaks(t)
}

// TestCacheCrashPoints kills the plugin (SIGKILL) between a cache
// version's capture and its promotion, and just after the promotion: a
// step publishing the key in between finds the old version or the new
// one whole, never a mix, and the kubelet's retry completes the promotion.
func TestCacheCrashPoints(t *testing.T) {
	testfs.Need(t)
	for _, pt := range []struct {
		name  string
		after string // what a step publishing the key before the retry finds
	}{
		{"capture-unmounted", "v1"},
		{"cache-captured", "v1"},
		{"cache-promoted", "v2"},
	} {
		t.Run(pt.name, func(t *testing.T) {
			e := newEnv(t, plugintest.Config{Backend: "overlay"})
			first := e.mount(cacheAttrs("deps"), false)
			write(t, first.Target, "a", "v1")
			write(t, first.Target, "b", "v1")
			e.umount(first)

			v := e.mount(cacheAttrs("deps"), false)
			write(t, v.Target, "a", "v2")
			write(t, v.Target, "b", "v2")
			e.p.Restart("COWVOL_CRASH_AT=" + pt.name)
			require.Error(t, e.unpublish(v), "the plugin dies in the call")
			require.NoError(t, e.p.Wait(10*time.Second), "the plugin stopped at the crash point")
			e.p.Restart()

			between := e.mount(map[string]string{driver.AttrCache: "deps"}, true)
			require.Equal(t, pt.after, readFile(t, between.Target, "a"))
			require.Equal(t, pt.after, readFile(t, between.Target, "b"), "one version whole")
			e.umount(between)

			retry(t, "unpublish", func() error { return e.unpublish(v) })
			after := e.mount(map[string]string{driver.AttrCache: "deps"}, true)
			require.Equal(t, "v2", readFile(t, after.Target, "a"))
			require.Equal(t, "v2", readFile(t, after.Target, "b"))
			e.umount(after)
			e.noLeaks(t)
		})
	}
}

// fleetCache waits until the fleet's controller says the newest version of
// key in namespace ci is the one pod promoted, held by node, and returns
// it.
func (f *peerFleet) fleetCache(key, pod, node string) *controllerv1.CacheLocation {
	f.t.Helper()
	var got *controllerv1.CacheLocation
	eventually(f.t, fmt.Sprintf("the controller to see %s's version of cache %s on %s", pod, key, node), func() bool {
		resp, err := f.api.LookupCaches(context.Background(), &controllerv1.LookupCachesRequest{Namespace: "ci", Keys: []string{key}})
		if err != nil || len(resp.Caches) != 1 {
			return false
		}
		got = resp.Caches[0]
		return got.Found && got.PromotedBy == pod && slices.Contains(got.Version.Nodes, node)
	})
	return got
}

// TestCachesAcrossNodes runs a cache's steps on two nodes: each step forks
// the newest version the fleet holds (pulled from the node that made it
// where its own is older or missing), a step asking for the node's own
// (cacheFrom: node) gets it at once, and the controller answers a key of
// a namespace the caller may not read as a key never used.
func TestCachesAcrossNodes(t *testing.T) {
	f := startPeerFleet(t)
	a := f.node("node-a", testfs.XFS, 1<<30)
	b := f.node("node-b", testfs.XFS, 1<<30)
	forks := func(n *peerNode, found string) float64 {
		return metricValue(t, n.env, `cowvol_cache_forks_total{found="`+found+`"}`)
	}
	// build runs a step of the cache on n that finds want and writes next.
	build := func(t *testing.T, n *peerNode, attrs map[string]string, want, next string) kubeletsim.InlineVolume {
		t.Helper()
		v := n.volume(attrs, false)
		require.NoError(t, n.publishWaiting(v))
		if want == "" {
			require.Empty(t, listDir(t, v.Target))
		} else {
			require.Equal(t, want, readFile(t, v.Target, "module"))
		}
		write(t, v.Target, "module", next)
		n.umount(v)
		return v
	}

	var fromNode kubeletsim.InlineVolume // b's last step, forking its own version
	var v3 string                        // the handle of the version a promotes third
	first := build(t, a, cacheAttrs("deps"), "", "v1")
	v1 := f.fleetCache("deps", first.Pod.Name, "node-a")
	require.EqualValues(t, 1, v1.Versions)
	require.Equal(t, "ci", v1.Version.Ref.Namespace)
	deps := []*controllerv1.CacheRef{{Namespace: "ci", Key: "deps"}}
	placed, err := f.api.Place(context.Background(), &controllerv1.PlaceRequest{Caches: deps})
	require.NoError(t, err)
	require.Equal(t, "node-a", placed.Nodes[0].NodeId, "a step naming the cache goes where its version is")
	require.Positive(t, placed.Nodes[0].InputBytesHeld)
	placed, err = controllerv1.NewCacheClient(f.dial(otherTeamToken)).Place(context.Background(), &controllerv1.PlaceRequest{Caches: deps})
	require.NoError(t, err)
	for _, n := range placed.Nodes {
		require.Zero(t, n.InputBytesHeld, "another team's cache counts nowhere")
	}

	t.Run("a node without the key forks the fleet's version", func(t *testing.T) {
		second := build(t, b, cacheAttrs("deps"), "v1", "v2")
		require.Equal(t, 1.0, forks(b, "pulled"))
		require.Equal(t, 0.0, forks(b, "none"))
		v2 := f.fleetCache("deps", second.Pod.Name, "node-b")
		require.NotEqual(t, v1.Version.Ref.Handle, v2.Version.Ref.Handle)
		require.True(t, v2.PromotedAt.AsTime().After(v1.PromotedAt.AsTime()))
	})

	t.Run("a node whose version is older forks the newer one", func(t *testing.T) {
		ro := a.volume(map[string]string{driver.AttrCache: "deps"}, true)
		require.NoError(t, a.publishWaiting(ro))
		require.Equal(t, "v2", readFile(t, ro.Target, "module"))
		a.umount(ro)
		require.Equal(t, 1.0, forks(a, "pulled"))
		third := build(t, a, cacheAttrs("deps"), "v2", "v3")
		require.Equal(t, 1.0, forks(a, "local"), "the version it pulled is its own now")
		v3 = f.fleetCache("deps", third.Pod.Name, "node-a").Version.Ref.Handle
	})

	// v3 stacks on v2 and v1, which a keeps only as its bases (it keeps two
	// versions a key): a node that pulls v3 pulls them destroyed, as a
	// has them.
	t.Run("a node killed mid-pull of a version is left with none, and pulls it again", func(t *testing.T) {
		for i, point := range []string{"pull-extracted", "pull-renamed"} {
			c := f.node(fmt.Sprintf("node-c%d", i), testfs.XFS, 1<<30)
			c.p.Restart("COWVOL_CRASH_AT=" + point)
			v := c.volume(map[string]string{driver.AttrCache: "deps"}, true)
			require.Error(t, c.publishWaiting(v), "the plugin dies in the pull")
			require.NoError(t, c.p.Wait(10*time.Second), "the plugin stopped at the crash point")
			c.p.Restart()
			_, err := c.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", v3)})
			require.Equal(t, codes.NotFound, code(err), "%s: the half-pulled version was dropped", point)
			require.Equal(t, 0.0, metricValue(t, c.env, "cowvol_cache_keys"), "%s: no version is current", point)
			require.NoError(t, c.publishWaiting(v), "the retry pulls again")
			require.Equal(t, "v3", readFile(t, v.Target, "module"))
			c.umount(v)
			require.Equal(t, 1.0, metricValue(t, c.env, "cowvol_cache_keys"))
			c.noLeaks(t)
		}
	})

	t.Run("cacheFrom node forks the node's own version at once", func(t *testing.T) {
		attrs := cacheAttrs("deps")
		attrs[driver.AttrCacheFrom] = "node"
		fromNode = build(t, b, attrs, "v2", "v4")
		require.Equal(t, 1.0, forks(b, "local"))
		require.Equal(t, 1.0, forks(b, "pulled"), "nothing was pulled")
	})

	t.Run("a key of a namespace the caller may not read is one never used", func(t *testing.T) {
		other := controllerv1.NewCacheClient(f.dial(otherTeamToken))
		resp, err := other.LookupCaches(context.Background(), &controllerv1.LookupCachesRequest{Namespace: "ci", Keys: []string{"deps", "never"}})
		require.NoError(t, err)
		require.Len(t, resp.Caches, 2)
		for _, c := range resp.Caches {
			require.True(t, proto.Equal(&controllerv1.CacheLocation{Namespace: "ci", Key: c.Key}, c), "%v", c)
		}
		_, err = other.ClearCaches(context.Background(), &controllerv1.ClearCachesRequest{Namespace: "ci", Keys: []string{"deps"}})
		require.Equal(t, codes.PermissionDenied, code(err), "clearing another team's key")
		_, err = f.api.ClearCaches(context.Background(), &controllerv1.ClearCachesRequest{Namespace: "ci"})
		require.Equal(t, codes.InvalidArgument, code(err), "clearing no key")
		_, err = f.api.ClearCaches(context.Background(), &controllerv1.ClearCachesRequest{Namespace: "ci", Keys: []string{"/etc"}})
		require.Equal(t, codes.InvalidArgument, code(err), "clearing a key that is a path")
		resp, err = other.LookupCaches(context.Background(), &controllerv1.LookupCachesRequest{Namespace: "ci"})
		require.NoError(t, err)
		require.Empty(t, resp.Caches)
		resp, err = f.api.LookupCaches(context.Background(), &controllerv1.LookupCachesRequest{Namespace: "ci"})
		require.NoError(t, err)
		require.Len(t, resp.Caches, 1, "every key of the namespace")
		require.Equal(t, "deps", resp.Caches[0].Key)
		for name, req := range map[string]*controllerv1.LookupCachesRequest{
			"a key that is a path":    {Namespace: "ci", Keys: []string{"../x"}},
			"no namespace":            {Keys: []string{"deps"}},
			"max_nodes below zero":    {Namespace: "ci", MaxNodes: -1},
			"too many keys in a call": {Namespace: "ci", Keys: slices.Repeat([]string{"k"}, 1001)},
		} {
			_, err := f.api.LookupCaches(context.Background(), req)
			require.Equal(t, codes.InvalidArgument, code(err), name)
		}
	})
	t.Run("kubectl cowvol caches lists the key and clears it on every node", func(t *testing.T) {
		run := func(args ...string) string {
			t.Helper()
			out, err := exec.Command(kubectlCowvol(t), append([]string{"--controller-address=" + f.ctlAddr, "--tls-ca-file=" + f.pki.CA,
				"--token-file=" + f.nodeToken, "-n", "ci"}, args...)...).CombinedOutput()
			require.NoError(t, err, string(out))
			return string(out)
		}
		newest := f.fleetCache("deps", fromNode.Pod.Name, "node-b")
		table := run("caches")
		require.Regexp(t, `(?m)^NAMESPACE\s+KEY\s+VERSION\s+SIZE\s+NODES\s+PROMOTED\s+BY\s+VERSIONS$`, table)
		require.Regexp(t, `(?m)^ci\s+deps\s+`+regexp.QuoteMeta(newest.Version.Ref.Handle)+`\s+\S+\s+node-b\s+.+ ago\s+`+fromNode.Pod.Name+`\s+\d+$`, table)
		var listed struct {
			Items []struct {
				Key, Version string
				Nodes        []string
				Bytes        int64
			} `json:"items"`
		}
		require.NoError(t, json.Unmarshal([]byte(run("caches", "deps", "never", "-o", "json")), &listed))
		require.Len(t, listed.Items, 2)
		require.Equal(t, newest.Version.Ref.Handle, listed.Items[0].Version)
		require.Positive(t, listed.Items[0].Bytes)
		require.Equal(t, "never", listed.Items[1].Key)
		require.Empty(t, listed.Items[1].Version)

		reader := a.volume(map[string]string{driver.AttrCache: "deps"}, true)
		require.NoError(t, a.publishWaiting(reader))
		require.Equal(t, "v4", readFile(t, reader.Target, "module"))
		running := a.mount(cacheAttrs("deps"), false)
		write(t, running.Target, "module", "forked before the clear")
		f.fleetCache("deps", fromNode.Pod.Name, "node-a") // a holds the newest too
		// A clear reaches the nodes the controller knows to hold a
		// version: wait until it knows that the crashed nodes pulled v3.
		f.holders("ci", v3, "node-c0", "node-c1")

		require.Regexp(t, `(?m)^ci\s+deps\s+\d+\s+node-a,node-b,node-c0,node-c1$`, run("caches", "clear", "deps"))
		resp, err := f.api.LookupCaches(context.Background(), &controllerv1.LookupCachesRequest{Namespace: "ci", Keys: []string{"deps"}})
		require.NoError(t, err)
		require.False(t, resp.Caches[0].Found, "gone from lookups at once")
		for _, n := range []*peerNode{a, b} {
			eventually(t, n.p.NodeID+" to clear the key", func() bool { return metricValue(t, n.env, "cowvol_cache_keys") == 0 })
		}
		require.Equal(t, "v4", readFile(t, reader.Target, "module"), "a step reading a version keeps it")
		a.umount(reader)
		a.umount(running)
		require.Equal(t, 1.0, metricValue(t, a.env, `cowvol_cache_promotions_refused_total{reason="cleared"}`),
			"a step running when the key was cleared is not promoted")
		v5 := build(t, b, cacheAttrs("deps"), "", "v5")
		f.fleetCache("deps", v5.Pod.Name, "node-b")
		build(t, a, cacheAttrs("deps"), "v5", "v6")
	})
	a.noLeaks(t)
	b.noLeaks(t)
}
