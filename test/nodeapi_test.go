package test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

func vref(ns, h string) *nodev1.VolumeRef { return &nodev1.VolumeRef{Namespace: ns, Handle: h} }

// The node API's contract through the real binary: codes, idempotency,
// paging, filters.
func TestNodeAPIContract(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	api, ctx := e.p.NodeAPI, context.Background()
	var want []string
	for i := range 5 {
		h := fmt.Sprintf("ci-%d", i)
		e.captureIn("ci", h, map[string]string{"property.version": fmt.Sprint(i % 2)})
		want = append(want, "ci/"+h)
	}
	for i := range 3 {
		h := fmt.Sprintf("other-%d", i)
		e.captureIn("other", h, nil)
		want = append(want, "other/"+h)
	}
	sort.Strings(want)

	t.Run("paging", func(t *testing.T) {
		var got []string
		token, pages := "", 0
		for {
			resp, err := api.ListVolumes(ctx, &nodev1.ListVolumesRequest{PageSize: 3, PageToken: token})
			require.NoError(t, err)
			require.LessOrEqual(t, len(resp.Volumes), 3)
			for _, v := range resp.Volumes {
				got = append(got, v.Ref.Namespace+"/"+v.Ref.Handle)
			}
			pages++
			if token = resp.NextPageToken; token == "" {
				break
			}
		}
		require.Equal(t, want, got, "every volume once, in order")
		require.GreaterOrEqual(t, pages, 3)
	})
	t.Run("filters", func(t *testing.T) {
		resp, err := api.ListVolumes(ctx, &nodev1.ListVolumesRequest{Namespace: "other"})
		require.NoError(t, err)
		require.Len(t, resp.Volumes, 3)
		resp, err = api.ListVolumes(ctx, &nodev1.ListVolumesRequest{Namespace: "ci", Selector: map[string]string{"version": "1"}})
		require.NoError(t, err)
		require.Len(t, resp.Volumes, 2)
		require.Positive(t, resp.Revision)
	})
	tests := []struct {
		name     string
		call     func() error
		wantCode codes.Code
	}{
		{"get", func() error {
			_, err := api.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", "ci-1")})
			return err
		}, codes.OK},
		{"get missing", func() error {
			_, err := api.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", "nope")})
			return err
		}, codes.NotFound},
		{"get another namespace's handle", func() error {
			_, err := api.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("other", "ci-1")})
			return err
		}, codes.NotFound},
		{"get without ref", func() error { _, err := api.GetVolume(ctx, &nodev1.GetVolumeRequest{}); return err }, codes.InvalidArgument},
		{"get bad handle", func() error {
			_, err := api.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", "../x")})
			return err
		}, codes.InvalidArgument},
		{"list bad namespace", func() error { _, err := api.ListVolumes(ctx, &nodev1.ListVolumesRequest{Namespace: "A/B"}); return err }, codes.InvalidArgument},
		{"list negative page", func() error { _, err := api.ListVolumes(ctx, &nodev1.ListVolumesRequest{PageSize: -1}); return err }, codes.InvalidArgument},
		{"list forged token", func() error { _, err := api.ListVolumes(ctx, &nodev1.ListVolumesRequest{PageToken: "%%%"}); return err }, codes.InvalidArgument},
		{"list another listing's token", func() error {
			_, err := api.ListVolumes(ctx, &nodev1.ListVolumesRequest{Namespace: "ci", PageToken: "b3RoZXIvb3RoZXItMA"})
			return err
		}, codes.InvalidArgument},
		{"pin", func() error {
			_, err := api.PinVolume(ctx, &nodev1.PinVolumeRequest{Ref: vref("ci", "ci-2")})
			return err
		}, codes.OK},
		{"pin again", func() error {
			_, err := api.PinVolume(ctx, &nodev1.PinVolumeRequest{Ref: vref("ci", "ci-2")})
			return err
		}, codes.OK},
		{"pin missing", func() error {
			_, err := api.PinVolume(ctx, &nodev1.PinVolumeRequest{Ref: vref("ci", "nope")})
			return err
		}, codes.NotFound},
		{"unpin", func() error {
			_, err := api.UnpinVolume(ctx, &nodev1.UnpinVolumeRequest{Ref: vref("ci", "ci-2")})
			return err
		}, codes.OK},
		{"unpin again", func() error {
			_, err := api.UnpinVolume(ctx, &nodev1.UnpinVolumeRequest{Ref: vref("ci", "ci-2")})
			return err
		}, codes.OK},
		{"destroy a batch too large", func() error {
			refs := make([]*nodev1.VolumeRef, 1001)
			for i := range refs {
				refs[i] = vref("ci", fmt.Sprintf("x%d", i))
			}
			_, err := api.DestroyVolumes(ctx, &nodev1.DestroyVolumesRequest{Refs: refs})
			return err
		}, codes.InvalidArgument},
		{"destroy a bad ref", func() error {
			_, err := api.DestroyVolumes(ctx, &nodev1.DestroyVolumesRequest{Refs: []*nodev1.VolumeRef{vref("", "x")}})
			return err
		}, codes.InvalidArgument},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			require.Equal(t, tc.wantCode, code(err), "err: %v", err)
		})
	}
	t.Run("pin with an expiry", func(t *testing.T) {
		until := time.Now().Add(time.Hour).Truncate(time.Second)
		v, err := api.PinVolume(ctx, &nodev1.PinVolumeRequest{Ref: vref("ci", "ci-3"), Until: timestamppb.New(until)})
		require.NoError(t, err)
		require.True(t, v.Pinned)
		require.True(t, until.Equal(v.PinnedUntil.AsTime()))
	})
	t.Run("node", func(t *testing.T) {
		n, err := api.GetNode(ctx, &nodev1.GetNodeRequest{})
		require.NoError(t, err)
		require.Len(t, n.StoreId, 32)
		require.Equal(t, int32(8), n.Volumes)
		require.Equal(t, "overlay", n.Backend)
		require.Equal(t, int32(90), n.HighWatermark)
		require.Positive(t, n.BytesTotal)
	})
}

// Destroy through the node API: a volume in use and a parent with children
// vanish from lookups at once and keep working for those who hold them; the
// data goes once they let go. Destroying again, or what is gone, succeeds.
func TestDestroyThroughTheNodeAPI(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	api, ctx := e.p.NodeAPI, context.Background()
	e.step("", "parent", func(dir string) { write(t, dir, "p", "parent") })
	e.step("parent", "child", func(dir string) { write(t, dir, "c", "child") })
	reader := e.mount(map[string]string{driver.AttrSource: "child"}, true)
	v, err := api.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", "parent")})
	require.NoError(t, err)
	require.Equal(t, []*nodev1.VolumeRef{vref("ci", "child")}, stripRefs(v.HoldingChildren))
	require.Len(t, v.HoldingStepVolumes, 1, "the reader mounts the parent through the child")

	resp, err := api.DestroyVolumes(ctx, &nodev1.DestroyVolumesRequest{Refs: []*nodev1.VolumeRef{vref("ci", "parent"), vref("ci", "child"), vref("ci", "never")}})
	require.NoError(t, err)
	for _, r := range resp.Results {
		require.Empty(t, r.Error, "destroying %v", r.Ref)
	}
	for _, h := range []string{"parent", "child"} {
		_, err := api.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", h)})
		require.Equal(t, codes.NotFound, code(err), "hidden at once")
		require.Equal(t, codes.NotFound, code(e.publish(e.volume(map[string]string{driver.AttrSource: h}, true))))
	}
	require.Equal(t, "parent", readFile(t, reader.Target, "p"), "the reader keeps working")
	held, err := api.ListVolumes(ctx, &nodev1.ListVolumesRequest{IncludeDestroyed: true})
	require.NoError(t, err)
	require.Len(t, held.Volumes, 2)
	require.Equal(t, "destroying", held.Volumes[0].State)
	n, err := api.GetNode(ctx, &nodev1.GetNodeRequest{})
	require.NoError(t, err)
	require.Positive(t, n.BytesHeldForChildren, "the parent's data is held for its child")

	e.umount(reader)
	eventually(t, "the destroyed volumes' data to go", func() bool {
		_, err := os.Stat(filepath.Join(e.p.StateDir, "volumes", "ci"))
		entries, _ := os.ReadDir(filepath.Join(e.p.StateDir, "volumes", "ci"))
		return errors.Is(err, os.ErrNotExist) || len(entries) == 0
	})
	resp, err = api.DestroyVolumes(ctx, &nodev1.DestroyVolumesRequest{Refs: []*nodev1.VolumeRef{vref("ci", "parent")}})
	require.NoError(t, err)
	require.Empty(t, resp.Results[0].Error, "destroy is idempotent")
	e.step("", "parent", func(dir string) { write(t, dir, "p", "anew") })
	e.noLeaks(t)
}

func stripRefs(refs []*nodev1.VolumeRef) []*nodev1.VolumeRef {
	out := make([]*nodev1.VolumeRef, len(refs))
	for i, r := range refs {
		out[i] = vref(r.Namespace, r.Handle)
	}
	return out
}

// The real binary on a small loop filesystem pushed over its high
// watermark: it evicts least recently used first and spares what is pinned,
// refuses captures with ResourceExhausted while it cannot get under the
// mark, and takes them again once space frees.
func TestWatermarksThroughTheBinary(t *testing.T) {
	state := testfs.Mount(t, testfs.Ext4, 96<<20)
	// No eviction grace: the volumes are made a moment before the disk
	// fills (TestEvictionGrace covers the grace).
	e := newEnv(t, plugintest.Config{StateDir: state, Backend: "overlay", Args: []string{"--high-watermark=70", "--low-watermark=50", "--eviction-grace=0s"}})
	api, ctx := e.p.NodeAPI, context.Background()
	for i := range 4 {
		e.step("", fmt.Sprintf("v%d", i), func(dir string) { write(t, dir, "blob", string(make([]byte, 8<<20))) })
	}
	_, err := api.PinVolume(ctx, &nodev1.PinVolumeRequest{Ref: vref("ci", "v0")})
	require.NoError(t, err)
	gone := func(h string) bool {
		_, err := api.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", h)})
		return code(err) == codes.NotFound
	}
	filler := filepath.Join(state, "filler")
	fillTo(t, filler, 75, api)
	eventually(t, "the least recently used unpinned volume to be evicted", func() bool {
		// A capture attempt wakes the reaper when it has not looked lately.
		if v := e.volume(nil, false); e.publish(v) == nil {
			require.NoError(t, e.unpublish(v))
		}
		return gone("v1")
	})
	require.False(t, gone("v0"), "a pinned volume is never evicted")

	fillTo(t, filler, 99, api)
	eventually(t, "captures to be refused", func() bool {
		v := e.volume(map[string]string{driver.AttrCapture: fmt.Sprintf("try-%d", e.n)}, false)
		err := e.publish(v)
		if err == nil {
			require.NoError(t, e.unpublish(v))
		}
		return code(err) == codes.ResourceExhausted
	})
	n, err := api.GetNode(ctx, &nodev1.GetNodeRequest{})
	require.NoError(t, err)
	require.True(t, n.OverHighWatermark)
	require.Contains(t, n.CapturesRefused, "high watermark", "the node says why it refuses captures")
	require.NoError(t, os.Remove(filler))
	retry(t, "a capture after space freed", func() error {
		v := e.volume(map[string]string{driver.AttrCapture: "accepted"}, false)
		if err := e.publish(v); err != nil {
			return err
		}
		return e.unpublish(v)
	})
	e.noLeaks(t)
}

// fillTo appends to path until the node says its state dir is pct full.
func fillTo(t *testing.T, path string, pct int32, api nodev1.NodeAPIClient) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	require.NoError(t, err)
	defer f.Close()
	for {
		n, err := api.GetNode(context.Background(), &nodev1.GetNodeRequest{})
		require.NoError(t, err)
		if n.UsedPercent >= pct {
			return
		}
		if _, err := f.Write(make([]byte, 1<<20)); err != nil {
			return // full
		}
		require.NoError(t, f.Sync())
	}
}
