package test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
)

// pullForm is a form a lazy pull takes on B: a stub per file, or an index
// mounted (--pull-index).
type pullForm struct {
	name  string
	index bool
}

var pullForms = []pullForm{{name: "stubs"}, {name: "index", index: true}}

// stubTree is the form of stub tree the form's puller asks for, as the
// holder's metrics say it.
func (f pullForm) stubTree() string {
	if f.index {
		return "records"
	}
	return "tar"
}

// lazyNodesAs are lazyNodesAt whose B pulls in form.
func lazyNodesAs(t *testing.T, form pullForm, rate int, bArgs ...string) (a, b *env, proxy *cuttableProxy) {
	t.Helper()
	a, b, proxy = lazyNodesAt(t, rate, append(form.args(), bArgs...)...)
	form.require(t, b)
	return a, b, proxy
}

// args are the plugin's flags for form.
func (form pullForm) args() []string {
	if form.index {
		return []string{"--pull-index"}
	}
	return []string{"--pull-index=false"}
}

// settled waits, for an index form, until e has no index mounted: a
// volume pulled as one is made a plain layer once whole, and its index
// taken down once no view mounts it, after the step's volume is gone.
func (form pullForm) settled(t *testing.T, e *env) {
	t.Helper()
	if form.index {
		eventually(t, "no index mounted once nothing mounts it", func() bool { return len(erofsMountsUnder(t, e.p.StateDir)) == 0 })
	}
}

// require checks that e pulls lazily in form, filling through fanotify;
// an index form is skipped where e's kernel cannot mount one.
func (form pullForm) require(t *testing.T, e *env) {
	t.Helper()
	node, err := e.p.NodeAPI.GetNode(context.Background(), &nodev1.GetNodeRequest{})
	require.NoError(t, err)
	require.Equal(t, "lazy", node.PullMode, node.PullModeReason)
	require.Contains(t, node.PullModeReason, "fanotify")
	if indexes := strings.Contains(node.PullModeReason, "as indexes"); indexes != form.index {
		if form.index {
			t.Skipf("the node pulls stub trees: %s", node.PullModeReason)
		}
		t.Fatalf("a node not asked for indexes pulls them: %s", node.PullModeReason)
	}
}

// erofsMountsUnder are the indexes mounted under dir.
func erofsMountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	mounts, err := overlay.MountsUnder(dir)
	require.NoError(t, err)
	var out []string
	for _, m := range mounts {
		var st syscall.Statfs_t
		if syscall.Statfs(m, &st) == nil && uint32(st.Type) == 0xe0f5e1e2 {
			out = append(out, m)
		}
	}
	return out
}

// A volume destroyed while it is being filled (as an index or stubs)
// keeps working for the step that mounts it: every file it reads is A's;
// once the step lets go and the fill ends, it is gone, its data freed (an
// index with it), and nothing leaks.
func TestLazyPullRacingADestroy(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) {
			// 24 files of 1 MiB at 8 MiB a second: most are still on
			// their way when the volume is destroyed.
			a, b, _ := lazyNodesAs(t, form, 8<<20)
			sums := a.captureRandom("src", 24, 1<<20)
			v := b.volume(map[string]string{driver.AttrSource: "src"}, true)
			require.NoError(t, b.publishWaiting(v))
			resp, err := b.p.NodeAPI.DestroyVolumes(context.Background(), &nodev1.DestroyVolumesRequest{Refs: []*nodev1.VolumeRef{vref("ci", "src")}})
			require.NoError(t, err)
			require.Empty(t, resp.Results[0].Error)
			for name, sum := range sums {
				require.NoError(t, readsAs(filepath.Join(v.Target, name), sum), "the step reads A's %s", name)
			}
			b.umount(v)
			eventually(t, "the destroyed volume's data to go", func() bool {
				if volumeState(t, b, "src") != "gone" {
					return false
				}
				entries, err := os.ReadDir(filepath.Join(b.p.StateDir, "volumes", "ci"))
				return errors.Is(err, os.ErrNotExist) || len(entries) == 0
			})
			require.Empty(t, erofsMountsUnder(t, b.p.StateDir))
			b.noLeaks(t)
		})
	}
}

// A layer an index cannot say (here a symlink whose 4,050-byte target
// does not fit in its inode's block; btrfs holds one, XFS does not) is
// pulled as a stub tree by a node that mounts indexes: its holder is
// asked for the tree both ways, and the step reads it whole.
func TestLazyPullOfALayerNoIndexCanSay(t *testing.T) {
	form := pullForm{name: "index", index: true}
	a, b, _ := lazyNodesOn(t, testfs.Btrfs, 0, form.args()...)
	form.require(t, b)
	target := strings.Repeat("a/", 2025)
	a.step("", "src", func(dir string) {
		require.NoError(t, os.Symlink(target, filepath.Join(dir, "long")))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), []byte("the bytes of f"), 0o644))
	})
	v := b.volume(map[string]string{driver.AttrSource: "src"}, true)
	require.NoError(t, b.publishWaiting(v))
	got, err := os.Readlink(filepath.Join(v.Target, "long"))
	require.NoError(t, err)
	require.Equal(t, target, got)
	require.Equal(t, "the bytes of f", readFile(t, v.Target, "f"))
	for _, shape := range []string{"records", "tar"} {
		require.Equal(t, 1.0, metricValue(t, a, fmt.Sprintf(`cowvol_peer_stub_trees_served_total{form=%q,source="walked"}`, shape)), shape)
	}
	b.umount(v)
	eventually(t, "the volume to be ready", func() bool { return volumeState(t, b, "src") == "ready" })
	b.noLeaks(t)
}

// A volume ready as its whole index whose mount went (a reboot, a
// restarted plugin's new mount namespace) is mounted again before any
// view is made over it, and reads A's bytes; once nothing mounts it, it is
// made a plain layer (cloned out of the blob by the layout read back from
// the image, which the new process never learnt) that keeps A's sums. One
// whose index is lost is failed, never shown empty.
func TestAWholeIndexAcrossARestart(t *testing.T) {
	form := pullForm{name: "index", index: true}
	a, b, _ := lazyNodesAs(t, form, 0)
	sums := a.captureRandom("src", 16, 1<<20)
	a.captureRandom("lost", 4, 1<<20)
	keep := b.mount(map[string]string{driver.AttrSource: "src"}, true)
	lost := b.mount(map[string]string{driver.AttrSource: "lost"}, true)
	for name, sum := range sums {
		require.NoError(t, readsAs(filepath.Join(keep.Target, name), sum))
	}
	for _, h := range []string{"src", "lost"} {
		eventually(t, h+" to be ready", func() bool { return volumeState(t, b, h) == "ready" })
	}
	require.Len(t, erofsMountsUnder(t, b.p.StateDir), 2, "both ready as their indexes while steps mount them")
	lostFile, _ := layerFile(t, b, "lost", "f-00")
	lostLayer := filepath.Dir(lostFile)

	b.p.Kill()
	for _, mp := range erofsMountsUnder(t, b.p.StateDir) {
		require.NoError(t, unix.Unmount(mp, unix.MNT_DETACH))
	}
	require.NoError(t, os.Remove(filepath.Join(cache.IndexDir(lostLayer), "image")))
	b.p.Restart()
	require.Len(t, erofsMountsUnder(t, b.p.StateDir), 1, "the index mounted again by recovery")
	require.Contains(t, []string{"failed", "gone"}, volumeState(t, b, "lost"), "a lost index fails its volume")
	b.read("src", func(dir string) {
		for name, sum := range sums {
			require.NoError(t, readsAs(filepath.Join(dir, name), sum), "a new step reads A's %s", name)
		}
	})
	for name, sum := range sums {
		require.NoError(t, readsAs(filepath.Join(keep.Target, name), sum), "the step that mounted it before still reads A's %s", name)
	}
	b.umount(keep)
	b.umount(lost)

	eventually(t, "no index mounted once nothing mounts it", func() bool { return len(erofsMountsUnder(t, b.p.StateDir)) == 0 })
	require.Equal(t, 1.0, metricValue(t, b, `cowvol_index_copies_total{result="ok"}`))
	require.Regexp(t, fmt.Sprintf(`"Made a whole index a plain layer" .*cloned=%d `, len(sums)), b.p.Log(),
		"every file cloned out of the blob, by the layout read back from the image")
	require.Equal(t, "ready", volumeState(t, b, "src"))
	b.read("src", func(dir string) {
		for name, sum := range sums {
			require.NoError(t, readsAs(filepath.Join(dir, name), sum), "its plain layer holds A's %s", name)
		}
	})
	requireKeptSums(t, a, b, "src", "f-00") // the copy keeps the sums the index's extents were checked against
	b.noLeaks(t)
}

// A volume ready as its whole index is served to peers as any ready
// volume, read through its mount: a node that pulls it eagerly and one
// that pulls it as an index of its own, from it alone, read A's bytes and
// keep A's sums, while a step there still mounts it.
func TestAWholeIndexServedToPeers(t *testing.T) {
	form := pullForm{name: "index", index: true}
	bAddr := plugintest.FreeAddr(t)
	a, b, _ := lazyNodesAs(t, form, 0, "--peer-address="+bAddr)
	sums := a.captureRandom("src", 16, 1<<20)
	keep := b.mount(map[string]string{driver.AttrSource: "src"}, true)
	for name, sum := range sums {
		require.NoError(t, readsAs(filepath.Join(keep.Target, name), sum))
	}
	eventually(t, "B to hold it ready", func() bool { return volumeState(t, b, "src") == "ready" })
	a.p.Stop() // B alone holds it

	for _, mode := range []struct{ name, args string }{{"eagerly", "--pull-mode=eager"}, {"as an index", "--pull-index"}} {
		t.Run(mode.name, func(t *testing.T) {
			c := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-c", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
				Args: []string{"--peers=node-b=" + bAddr, "--pull-wait=1s", "--pull-mode=lazy", mode.args}})
			v := c.volume(map[string]string{driver.AttrSource: "src"}, true)
			require.NoError(t, c.publishWaiting(v))
			for name, sum := range sums {
				require.NoError(t, readsAs(filepath.Join(v.Target, name), sum), "C reads A's %s from B's index", name)
			}
			c.umount(v)
			eventually(t, "C to hold it ready", func() bool { return volumeState(t, c, "src") == "ready" })
			requireKeptSums(t, b, c, "src", "f-00")
			require.NotEmpty(t, erofsMountsUnder(t, b.p.StateDir), "served while B is ready as its index")
			c.p.Stop()
		})
	}
	b.umount(keep)
	form.settled(t, b)
}

// A node that pulls a big layer as an index keeps the stub tree's records
// as they came (no walk of the tree it made), as soon as the pull is
// checked, and serves them to its own peers' index pulls; a peer that asks
// for what they are not (a StubTar: a stub pull) has the layer walked
// once, after which the node keeps the tree whole.
func TestAPulledIndexServesTheRecordsItReceived(t *testing.T) {
	form := pullForm{name: "index", index: true}
	bAddr := plugintest.FreeAddr(t)
	a, b, _ := lazyNodesAs(t, form, 0, "--peer-address="+bAddr)
	a.step("", "src", func(dir string) {
		for i := range keptStubsMin {
			require.NoError(t, os.WriteFile(filepath.Join(dir, strconv.Itoa(i)), []byte(strconv.Itoa(i*i)), 0o644))
		}
		randomFile(t, dir, "big", 4<<20, 1)
	})
	var want testfs.Tree
	a.read("src", func(dir string) { want = testfs.Describe(t, dir) })
	bigSum := fileDigestOf(t, &peerNode{env: a}, "src", "big")
	eventually(t, "A to keep the source's stub tree", func() bool { return keptStubs(t, a, "src") })

	// received says whether B keeps the source's stub tree as received
	// (and no other: a layer's copy out of its index keeps the same file).
	received := func() bool {
		matches, err := filepath.Glob(filepath.Join(b.p.StateDir, "volumes", "ci", "src", "*.stubs"))
		require.NoError(t, err)
		return len(matches) == 1 && streamer.KeptReceived(matches[0])
	}
	v := b.volume(map[string]string{driver.AttrSource: "src"}, true)
	require.NoError(t, b.publishWaiting(v))
	require.True(t, received(), "B keeps the records as received as its publish returns")
	// B keeps the layer's table of sums as its records came: A's, there
	// as the publish returns, and not made again once the layer is filled.
	aSums, bSums := layerSums(t, a, "src"), layerSums(t, b, "src")
	require.Equal(t, maps.Collect(aSums.table.All()), maps.Collect(bSums.table.All()), "B's table, kept as its pull came, is A's")
	require.Equal(t, aSums.table.Digest(), bSums.table.Digest())
	require.Equal(t, strconv.Itoa(77*77), readFile(t, v.Target, "77"))
	b.umount(v)
	eventually(t, "B to hold it ready", func() bool { return volumeState(t, b, "src") == "ready" })
	var filled unix.Stat_t
	require.NoError(t, unix.Stat(bSums.path, &filled))
	require.Equal(t, bSums.ino, filled.Ino, "the table kept as the pull came is the filled layer's (no walk wrote another)")
	eventually(t, "the fill counted", func() bool { return metricValue(t, b, `cowvol_lazy_fills_total{result="ok"}`) > 0 })
	form.settled(t, b)
	eventually(t, "the index's layer pruned", func() bool {
		matches, err := filepath.Glob(filepath.Join(b.p.StateDir, "volumes", "ci", "src", "*.index"))
		require.NoError(t, err)
		return len(matches) == 0
	})
	require.True(t, received(), "not walked for once filled, nor once copied out of its index")
	a.p.Stop() // B alone holds it

	for _, c := range []struct {
		form  pullForm
		walks float64 // B's walks of the layer for it
	}{{form, 0}, {pullForm{name: "stubs"}, 1}} {
		t.Run(c.form.name, func(t *testing.T) {
			node := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-c", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
				Args: append([]string{"--peers=node-b=" + bAddr, "--pull-wait=1s", "--pull-mode=lazy"}, c.form.args()...)})
			c.form.require(t, node)
			v := node.volume(map[string]string{driver.AttrSource: "src"}, true)
			require.NoError(t, node.publishWaiting(v))
			require.Equal(t, 1-c.walks, metricValue(t, b, fmt.Sprintf(`cowvol_peer_stub_trees_served_total{form=%q,source="kept"}`, c.form.stubTree())))
			require.Equal(t, c.walks, metricValue(t, b, fmt.Sprintf(`cowvol_peer_stub_trees_served_total{form=%q,source="walked"}`, c.form.stubTree())))
			require.NoError(t, readsAs(filepath.Join(v.Target, "big"), bigSum))
			node.umount(v)
			eventually(t, "C to hold it ready", func() bool { return volumeState(t, node, "src") == "ready" })
			node.read("src", func(dir string) { require.Equal(t, want, testfs.Describe(t, dir)) })
			c.form.settled(t, node)
			node.p.Stop()
		})
	}
	eventually(t, "B to keep the tree whole once a stub pull walked it", func() bool { return keptStubs(t, b, "src") && !received() })
}

// keptSums is the table of sums a node keeps beside a volume's layer.
type keptSums struct {
	table *filesum.Table
	path  string
	ino   uint64
}

// layerSums reads the table of sums e keeps beside the layer of volume
// handle, its only one.
func layerSums(t *testing.T, e *env, handle string) keptSums {
	t.Helper()
	matches, err := filepath.Glob(filepath.Join(e.p.StateDir, "volumes", "ci", handle, "*.sums"))
	require.NoError(t, err)
	require.Len(t, matches, 1, "one layer's sums")
	table, err := filesum.ReadFile(matches[0])
	require.NoError(t, err)
	var st unix.Stat_t
	require.NoError(t, unix.Stat(matches[0], &st))
	return keptSums{table: table, path: matches[0], ino: st.Ino}
}
