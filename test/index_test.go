package test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/overlay"
)

// pullForm is a form a lazy pull takes on B: a stub per file, or an index
// mounted (--pull-index).
type pullForm struct {
	name  string
	index bool
}

var pullForms = []pullForm{{name: "stubs"}, {name: "index", index: true}}

// indexNodes are lazyNodes whose B mounts an index of what it pulls.
func indexNodes(t *testing.T) (a, b *env, proxy *cuttableProxy) {
	return lazyNodesAs(t, pullForm{name: "index", index: true}, 0)
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
	return nil
}

// require checks that e pulls lazily in form; an index form is skipped
// where e's kernel cannot mount one.
func (form pullForm) require(t *testing.T, e *env) {
	t.Helper()
	node, err := e.p.NodeAPI.GetNode(context.Background(), &nodev1.GetNodeRequest{})
	require.NoError(t, err)
	require.Equal(t, "lazy", node.PullMode, node.PullModeReason)
	if indexes := strings.Contains(node.PullModeReason, "as indexes"); indexes != form.index {
		if form.index {
			t.Skipf("the node pulls stub trees: %s", node.PullModeReason)
		}
		t.Fatalf("a node not asked for indexes pulls them: %s", node.PullModeReason)
	}
}

// A source held only on A is published on B as an index mounted under the
// step's overlay, no file made per file: the step reads A's bytes, runs a
// program from it, writes over it and captures; the data arrives behind,
// and once whole the volume is an ordinary ready one in a plain layer (A's
// tree to the last time stamp), the index gone once nothing mounts it.
func TestIndexPull(t *testing.T) {
	a, b, _ := indexNodes(t)
	truePath, err := exec.LookPath("true")
	require.NoError(t, err)
	prog, err := os.ReadFile(truePath)
	require.NoError(t, err)
	var want testfs.Tree
	a.step("", "src", func(dir string) {
		testfs.LayerTree(t, dir)
		require.NoError(t, os.WriteFile(filepath.Join(dir, "true"), prog, 0o755))
		for i := range 8 {
			randomFile(t, dir, fmt.Sprintf("big-%d", i), 4<<20, uint64(i+1))
		}
	})
	a.read("src", func(dir string) { want = testfs.Describe(t, dir) })

	v := b.volume(map[string]string{driver.AttrSource: "src", driver.AttrCapture: "out"}, false)
	require.NoError(t, b.publishWaiting(v))
	indexes := erofsMountsUnder(t, b.p.StateDir)
	require.Len(t, indexes, 1, "the source is an index mounted under the step's overlay")
	out, err := exec.Command(filepath.Join(v.Target, "true")).CombinedOutput()
	require.NoError(t, err, "running a program from an index: %s", out)
	for i := range 8 {
		name := fmt.Sprintf("big-%d", i)
		require.Equal(t, fileDigestOf(t, &peerNode{env: a}, "src", name), fileDigest(t, filepath.Join(v.Target, name)), "the step reads A's %s", name)
	}
	write(t, v.Target, "result", "built")
	write(t, v.Target, "big-0", "written over")
	require.NoError(t, os.Remove(filepath.Join(v.Target, "big-1")))
	b.umount(v)
	require.Equal(t, "ready", volumeState(t, b, "out"), "the step's output is captured")
	b.read("out", func(dir string) {
		data, err := os.ReadFile(filepath.Join(dir, "big-0"))
		require.NoError(t, err)
		require.Equal(t, "written over", string(data))
		_, err = os.Stat(filepath.Join(dir, "big-1"))
		require.ErrorIs(t, err, os.ErrNotExist)
		require.Equal(t, fileDigestOf(t, &peerNode{env: a}, "src", "big-2"), fileDigest(t, filepath.Join(dir, "big-2")))
	})

	eventually(t, "the volume pulled as an index to be ready", func() bool { return volumeState(t, b, "src") == "ready" })
	got, err := b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "src")})
	require.NoError(t, err)
	require.True(t, got.Synced)
	b.read("src", func(dir string) { require.Equal(t, want, testfs.Describe(t, dir)) })
	eventually(t, "the index unmounted once no view mounts it", func() bool { return len(erofsMountsUnder(t, b.p.StateDir)) == 0 })
	b.noLeaks(t)
}

// A holder cut off mid-fill, with no other: each file a reader of the
// index opens reads either all its bytes or EIO (never the blob's holes),
// the volume fails, and the step over it captures nothing; its index goes
// with it.
func TestIndexPullWithItsHolderGone(t *testing.T) {
	a, b, proxy := indexNodes(t)
	sums := a.captureRandom("src", 48, 4<<20)
	v := b.volume(map[string]string{driver.AttrSource: "src", driver.AttrCapture: "out"}, false)
	require.NoError(t, b.publishWaiting(v))
	proxy.Cut()
	start := time.Now()
	eio := 0
	for name, sum := range sums {
		err := readsAs(filepath.Join(v.Target, name), sum)
		if errors.Is(err, syscall.EIO) {
			eio++
			continue
		}
		require.NoError(t, err)
	}
	require.Positive(t, eio, "192 MiB crossed a cut link")
	require.Less(t, time.Since(start), time.Minute, "readers are not held for long")
	eventually(t, "the volume that cannot be filled to fail", func() bool {
		s := volumeState(t, b, "src")
		return s == "failed" || s == "gone"
	})
	b.umount(v)
	require.Equal(t, "gone", volumeState(t, b, "out"), "a step whose input was incomplete captures nothing")
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
