package test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

// Nodes pulling one volume at about the same time form a swarm: its holder
// streams it once, to the first of them, and each relays it, as it arrives,
// to the next. A relay that dies sends its puller back to the holder.
func TestSwarmPulls(t *testing.T) {
	f := startPeerFleet(t)
	swarm := "--swarm-min-size=1Mi"
	a := f.node("node-a", testfs.XFS, 1<<30, swarm)
	// The holder's link sends the 24 MiB volume in about 4 s: pulls
	// overlap, as a swarm's do.
	a.host.ShapeLink("50mbit")
	pullers := []*peerNode{
		f.node("node-b", testfs.XFS, 1<<30, swarm),
		f.node("node-c", testfs.XFS, 1<<30, swarm),
		f.node("node-d", testfs.XFS, 1<<30, swarm),
	}
	// captured makes a volume on the holder of a layer tree, a 24 MiB
	// file and small files more.
	captured := func(handle string, seed uint64, small int) testfs.Tree {
		a.step("", handle, func(dir string) {
			testfs.LayerTree(t, dir)
			randomFile(t, dir, "random", 24<<20, seed)
			for i := range small {
				sub := filepath.Join(dir, "small", strconv.Itoa(i/1000))
				require.NoError(t, os.MkdirAll(sub, 0o755))
				require.NoError(t, os.WriteFile(filepath.Join(sub, strconv.Itoa(i)), []byte(strconv.Itoa(i)), 0o644))
			}
		})
		var want testfs.Tree
		a.read(handle, func(dir string) { want = testfs.Describe(t, dir) })
		// Its size decides whether it is swarmed: measured by the sync round.
		eventually(t, handle+" measured", func() bool {
			v, err := a.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", handle)})
			return err == nil && v.SizeBytes > 1<<20
		})
		f.holders("ci", handle, "node-a")
		return want
	}
	pulls := func(n *peerNode, from string) float64 {
		return metricValue(t, n.env, fmt.Sprintf(`cowvol_swarm_pulls_total{from=%q}`, from))
	}
	publish := func(n *peerNode, handle string) (testfs.Tree, error) {
		v := n.volume(map[string]string{driver.AttrSource: handle}, true)
		if err := n.publishWaiting(v); err != nil {
			return nil, err
		}
		defer n.umount(v)
		return testfs.Describe(t, v.Target), nil
	}

	t.Run("three nodes pulling at once: the holder sends it once", func(t *testing.T) {
		want := captured("wide", 1, 0)
		served := metricValue(t, a.env, servedOK)
		var wg sync.WaitGroup
		got := make([]testfs.Tree, len(pullers))
		errs := make([]error, len(pullers))
		for i, n := range pullers {
			wg.Add(1)
			go func() { defer wg.Done(); got[i], errs[i] = publish(n, "wide") }()
		}
		wg.Wait()
		var fromHolder, fromRelay, relayed float64
		for i, n := range pullers {
			require.NoError(t, errs[i])
			require.Equal(t, want, got[i], "%s's copy is the holder's", n.p.NodeID)
			fromHolder += pulls(n, "holder")
			fromRelay += pulls(n, "relay")
			relayed += metricValue(t, n.env, `cowvol_swarm_relayed_layers_total{result="ok"}`)
			require.Zero(t, pulls(n, "relay_failed"))
		}
		require.Equal(t, served+1, metricValue(t, a.env, servedOK), "the holder sent the layer once")
		require.Equal(t, 1.0, fromHolder, "one node pulled it from the holder")
		require.Equal(t, 2.0, fromRelay, "the others from the node that joined before them")
		require.Equal(t, 2.0, relayed)
		require.Equal(t, 1.0, metricValue(t, a.env, `cowvol_swarm_joins_total{from="holder"}`))
		require.Equal(t, 2.0, metricValue(t, a.env, `cowvol_swarm_joins_total{from="relay"}`))
	})

	t.Run("lazy pullers: the data behind the index crosses the holder's link once", func(t *testing.T) {
		// 20,000 small files more, which the index carries whole. Its
		// records (under a MiB) leave the holder's kept file in
		// milliseconds, into the socket's buffers: a second puller
		// joins their swarm only if it asks within them (a swarm takes
		// members only while its first stream runs), else it takes its
		// own from the holder. The data behind (24 MiB over the shaped
		// link) is streamed for seconds, and crosses that link once.
		want := captured("wide-lazy", 3, 20_000)
		treesServed := func() float64 {
			return metricValue(t, a.env, `cowvol_peer_stub_trees_served_total{form="records",source="kept"}`) +
				metricValue(t, a.env, `cowvol_peer_stub_trees_served_total{form="records",source="walked"}`)
		}
		trees := treesServed()
		lazy := []*peerNode{
			f.node("node-e", testfs.XFS, 1<<30, swarm, "--pull-mode=lazy"),
			f.node("node-f", testfs.XFS, 1<<30, swarm, "--pull-mode=lazy"),
		}
		served := metricValue(t, a.env, servedOK)
		var wg sync.WaitGroup
		errs := make([]error, len(lazy))
		for i, n := range lazy {
			wg.Add(1)
			go func() {
				defer wg.Done()
				v := n.volume(map[string]string{driver.AttrSource: "wide-lazy"}, true)
				if errs[i] = n.publishWaiting(v); errs[i] == nil {
					n.umount(v)
				}
			}()
		}
		wg.Wait()
		var fromRelay float64
		for i, n := range lazy {
			require.NoError(t, errs[i])
			eventually(t, "the lazily pulled volume filled on "+n.p.NodeID, func() bool { return volumeState(t, n.env, "wide-lazy") == "ready" })
			n.read("wide-lazy", func(dir string) { require.Equal(t, want, testfs.Describe(t, dir)) })
			fromRelay += pulls(n, "relay")
			require.Zero(t, pulls(n, "relay_failed"))
		}
		treesSent := treesServed() - trees
		require.Contains(t, []float64{1, 2}, treesSent, "the holder sent the index's records once, or to each")
		require.Equal(t, served+treesSent+1, metricValue(t, a.env, servedOK), "the holder sent one stream of data")
		require.Equal(t, 1+(2-treesSent), fromRelay, "the data, and the records unless each had them from the holder, from the other node")
	})

	t.Run("an eager and a lazy puller: the data crosses the holder's link once", func(t *testing.T) {
		want := captured("mixed", 4, 0)
		eager, lazy := pullers[2], f.node("node-g", testfs.XFS, 1<<30, swarm, "--pull-mode=lazy")
		served := metricValue(t, a.env, servedOK)
		relayed := metricValue(t, a.env, `cowvol_swarm_joins_total{from="relay"}`)
		var wg sync.WaitGroup
		var got testfs.Tree
		errs := make([]error, 2)
		wg.Add(2)
		go func() { defer wg.Done(); got, errs[0] = publish(eager, "mixed") }()
		go func() {
			defer wg.Done()
			v := lazy.volume(map[string]string{driver.AttrSource: "mixed"}, true)
			if errs[1] = lazy.publishWaiting(v); errs[1] == nil {
				lazy.umount(v)
			}
		}()
		wg.Wait()
		require.NoError(t, errs[0])
		require.NoError(t, errs[1])
		require.Equal(t, want, got, "the eager copy is the holder's")
		eventually(t, "the lazily pulled volume filled", func() bool { return volumeState(t, lazy.env, "mixed") == "ready" })
		lazy.read("mixed", func(dir string) { require.Equal(t, want, testfs.Describe(t, dir)) })
		require.Equal(t, served+2, metricValue(t, a.env, servedOK), "the holder sent the lazy puller's stub tree, and the layer once")
		require.Equal(t, relayed+1, metricValue(t, a.env, `cowvol_swarm_joins_total{from="relay"}`), "one puller took the other's stream")
		require.Zero(t, pulls(eager, "relay_failed")+pulls(lazy, "relay_failed"))
	})

	t.Run("a relay that dies mid-stream sends its puller to the holder", func(t *testing.T) {
		want := captured("wide-2", 2, 0)
		b, c := pullers[0], pullers[1]
		joins := func(from string) float64 {
			return metricValue(t, a.env, fmt.Sprintf(`cowvol_swarm_joins_total{from=%q}`, from))
		}
		first, relayed := joins("holder"), joins("relay")
		go func() { _, _ = publish(b, "wide-2") }() // b dies under it
		eventually(t, "b pulling from the holder", func() bool { return joins("holder") == first+1 })
		var got testfs.Tree
		cDone := make(chan error, 1)
		go func() {
			var err error
			got, err = publish(c, "wide-2")
			cDone <- err
		}()
		eventually(t, "c joined behind b", func() bool { return joins("relay") == relayed+1 })
		b.p.Kill()
		require.NoError(t, <-cDone)
		require.Equal(t, want, got, "the copy the holder sent once the relay failed")
		require.Equal(t, 1.0, pulls(c, "relay_failed"))

		// A relay's copy of the stream leaves nothing on disk.
		b.p.Restart()
		staging, err := os.ReadDir(b.p.StateDir + "/staging")
		require.NoError(t, err)
		require.Empty(t, staging)
	})
}
