package test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/filesum"
)

// layerFile is the path of name in the own layer of a node's volume, and
// its layer's file of sums (pkg/cache: <layer>.sums beside the layer).
func layerFile(t *testing.T, e *env, handle, name string) (file, sums string) {
	t.Helper()
	matches, err := filepath.Glob(filepath.Join(e.p.StateDir, "volumes", "ci", handle, "*", name))
	require.NoError(t, err)
	require.Len(t, matches, 1, "%s in %s's layer", name, handle)
	layer := filepath.Dir(matches[0])
	for filepath.Dir(layer) != filepath.Join(e.p.StateDir, "volumes", "ci", handle) {
		layer = filepath.Dir(layer)
	}
	return matches[0], layer + ".sums"
}

// requireKeptSums checks that puller keeps, beside its layer of handle
// (the one holding name), the table of file sums holder keeps beside its
// own, and that it is what puller's layer holds.
func requireKeptSums(t *testing.T, holder, puller *env, handle, name string) {
	t.Helper()
	_, sumsHolder := layerFile(t, holder, handle, name)
	_, sumsPuller := layerFile(t, puller, handle, name)
	want, err := filesum.ReadFile(sumsHolder)
	require.NoError(t, err)
	kept, err := filesum.ReadFile(sumsPuller)
	require.NoError(t, err)
	require.Equal(t, maps.Collect(want.All()), maps.Collect(kept.All()), "the puller keeps the holder's sums")
	read, err := filesum.OfTree(t.Context(), strings.TrimSuffix(sumsPuller, ".sums"))
	require.NoError(t, err)
	require.Equal(t, maps.Collect(read.All()), maps.Collect(kept.All()), "what the puller's layer holds")
}

// rot flips one bit of a file in place, keeping its size and times: what a
// failing disk gives, which no stat tells.
func rot(t *testing.T, path string, at int64) {
	t.Helper()
	st, err := os.Stat(path)
	require.NoError(t, err)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	b := make([]byte, 1)
	_, err = f.ReadAt(b, at)
	require.NoError(t, err)
	b[0] ^= 0x04
	_, err = f.WriteAt(b, at)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	require.NoError(t, os.Chtimes(path, st.ModTime(), st.ModTime()))
}

// A byte that rots on the only holder's disk after the capture reaches no
// step on another node and no other node's cache: the holder's sums were
// computed from the capture, the eager puller refuses the layer, and the
// holder, finding its copy wrong as it sends it, marks it failed and
// serves it no more, so that a lazy puller later finds no holder (rather
// than wrong bytes) and the controller no longer counts it.
func TestHolderRotReachesNoStep(t *testing.T) {
	testfs.Need(t, "mkfs.xfs")
	peerAddr := plugintest.FreeAddr(t)
	a := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
		Args: []string{"--peer-address=" + peerAddr}})
	a.step("", "rotten", func(dir string) {
		randomFile(t, dir, "fine", 3<<20, 1)
		randomFile(t, dir, "rots", 3<<20, 2)
	})
	file, sums := layerFile(t, a, "rotten", "rots")
	eventually(t, "the capture's sums to be kept", func() bool { _, err := os.Stat(sums); return err == nil })
	rot(t, file, 1<<20+17)

	eager := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-b", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
		Args: []string{"--peers=node-a=" + peerAddr, "--pull-wait=1s", "--pull-mode=eager"}})
	err := eager.publishWaiting(eager.volume(map[string]string{driver.AttrSource: "rotten"}, true))
	require.Equal(t, codes.Unavailable, code(err), "%v", err)
	_, err = eager.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "rotten")})
	require.Equal(t, codes.NotFound, code(err), "nothing became ready")

	eventually(t, "the holder to fail its rotten copy", func() bool {
		s := volumeState(t, a, "rotten")
		return s == "failed" || s == "gone"
	})
	require.Equal(t, 1.0, metricValue(t, a, "cowvol_rotten_volumes_total"))

	lazy := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-c", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
		Args: []string{"--peers=node-a=" + peerAddr, "--pull-wait=1s", "--pull-mode=lazy"}})
	err = lazy.publishWaiting(lazy.volume(map[string]string{driver.AttrSource: "rotten"}, true))
	require.Error(t, err, "a volume whose only holder's copy rotted is served by no one")
	require.NotEqual(t, "ready", volumeState(t, lazy, "rotten"))
}

// A relay (here a proxy on the holder's link) that flips a byte of a lazy
// layer's stream has the file fetched alone; one that flips it there too
// leaves the reader EIO: no step reads the flipped byte, over stubs or an
// index.
func TestLazyPullRefusesAFlippedByte(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) { lazyPullRefusesAFlippedByte(t, form) })
	}
}

func lazyPullRefusesAFlippedByte(t *testing.T, form pullForm) {
	testfs.Need(t, "mkfs.xfs")
	peerAddr := plugintest.FreeAddr(t)
	a := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
		Args: []string{"--peer-address=" + peerAddr}})
	marker := bytes.Repeat([]byte("cowvol-corrupt-me."), 64)
	a.step("", "victim", func(dir string) {
		require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), bytes.Repeat(marker, 4<<10), 0o644))
	})
	wantSum := fileDigestOf(t, &peerNode{env: a}, "victim", "f")
	// Every connection flips the first marker it carries past its first
	// 64 KiB: the stream's copy of f, and each fetch of f alone.
	proxy := corruptingProxy(t, peerAddr, marker, 64<<10)
	b := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-b", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
		Args: append([]string{"--peers=node-a=" + proxy, "--stream-encoding=raw", "--pull-wait=1s", "--pull-mode=lazy"}, form.args()...)})
	form.require(t, b)
	v := b.volume(map[string]string{driver.AttrSource: "victim"}, true)
	require.NoError(t, b.publishWaiting(v))
	if _, err := os.Stat(filepath.Join(v.Target, "f")); err == nil {
		got, err := os.ReadFile(filepath.Join(v.Target, "f"))
		if !errors.Is(err, syscall.EIO) {
			require.NoError(t, err)
			sum := sha256.Sum256(got)
			require.Equal(t, wantSum, hex.EncodeToString(sum[:]), "a step read f with a flipped byte")
		}
	}
	require.Positive(t, metricValue(t, b, `cowvol_pull_corrupt_total{from="stream"}`)+metricValue(t, b, `cowvol_pull_corrupt_total{from="holder"}`))
	eventually(t, "the volume to end", func() bool {
		s := volumeState(t, b, "victim")
		return s == "failed" || s == "gone" || s == "ready"
	})
	if volumeState(t, b, "victim") == "ready" {
		b.read("victim", func(dir string) {
			require.Equal(t, wantSum, fileDigest(t, filepath.Join(dir, "f")), "served on as it was captured")
		})
	}
}

// vouched waits until the controller knows what the maker of ns/handle
// vouches for it with.
func (f *peerFleet) vouched(ns, handle string) {
	f.t.Helper()
	eventually(f.t, fmt.Sprintf("the controller to know the digests of %s/%s", ns, handle), func() bool {
		resp, err := f.api.LookupVolumes(context.Background(), &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref(ns, handle)}})
		return err == nil && len(resp.Volumes[0].GetViewDigest()) == sha256.Size && len(resp.Volumes[0].GetLayerDigest()) == sha256.Size
	})
}

// A node that holds a volume it did not make cannot pass other bytes off
// as it: it serves them with sums that match them (its disk, its sums and
// its memory all agree), so no per-file check can tell; but the node that
// captured the volume vouched for its files to the controller, and every
// puller, eager or lazy, refuses the other files before anything of them
// is committed. A volume whose holder flattened its chain is checked
// against the files of its whole view.
func TestOnlyTheMakerVouchesForAVolume(t *testing.T) {
	f := startPeerFleet(t)
	a := f.node("node-a", testfs.XFS, 1<<30, "--flatten-depth=1")
	b := f.node("node-b", testfs.XFS, 1<<30)

	a.step("", "vouched", func(dir string) {
		randomFile(t, dir, "kept", 1<<20, 1)
		randomFile(t, dir, "swapped", 1<<20, 2)
	})
	a.step("vouched", "child", func(dir string) {
		write(t, dir, "child-only", "small")
		require.NoError(t, os.Remove(filepath.Join(dir, "kept")))
	})
	f.vouched("ci", "vouched")
	f.vouched("ci", "child")
	eventually(t, "A to flatten the child's chain", func() bool {
		got, err := a.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "child")})
		return err == nil && got.GetBase().GetHandle() == ""
	})

	for _, handle := range []string{"vouched", "child"} {
		v := b.volume(map[string]string{driver.AttrSource: handle}, true)
		require.NoError(t, b.publishWaiting(v), handle)
		b.umount(v)
	}
	require.Equal(t, 2.0, metricValue(t, b.env, `cowvol_pull_vouch_checks_total{result="matched"}`),
		"the root layer, and the flattened child checked against its view")
	f.holders("ci", "vouched", "node-a", "node-b")
	eventually(t, "B's copy synced", func() bool {
		got, err := b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "vouched")})
		return err == nil && got.Synced
	})

	// B turns: another file of the same size in its copy, and the sums
	// of what it now holds, kept and in memory.
	file, sums := layerFile(t, b.env, "vouched", "swapped")
	randomFile(t, filepath.Dir(file), "swapped", 1<<20, 3)
	table, err := filesum.OfTree(context.Background(), filepath.Dir(file))
	require.NoError(t, err)
	require.NoError(t, table.WriteFile(sums))
	b.p.Restart()
	a.p.Stop() // B is the only holder left
	eventually(t, "the controller to list B alone", func() bool {
		return slices.Equal(f.holders("ci", "vouched", "node-b"), []string{"node-b"})
	})

	for _, mode := range []string{"eager", "lazy"} {
		c := f.node("node-c-"+mode, testfs.XFS, 1<<30, "--pull-mode="+mode)
		err := c.publishWaiting(c.volume(map[string]string{driver.AttrSource: "vouched"}, true))
		require.Error(t, err, mode)
		require.NotEqual(t, "ready", volumeState(t, c.env, "vouched"), mode)
		require.NotEqual(t, "filling", volumeState(t, c.env, "vouched"), mode)
		require.GreaterOrEqual(t, metricValue(t, c.env, `cowvol_pull_vouch_checks_total{result="mismatched"}`), 1.0, mode)
		require.Zero(t, metricValue(t, b.env, "cowvol_rotten_volumes_total"), "B's sums match its bytes: only the maker's word tells")
	}
}
