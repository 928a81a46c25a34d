package test

import (
	"cmp"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/proxy"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/ociimage"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/image"
)

// remoteManifest is the manifest of an image as the snapshotter runs it.
func remoteManifest(t *testing.T, addr, repo string) ocispec.Manifest {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/v2/" + repo + "/manifests/cowvol")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var m ocispec.Manifest
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&m))
	require.Len(t, m.Layers, 1)
	return m
}

// unpackRemote prepares a layer as containerd's unpacker does: labelled
// with what the manifest annotates and with the chain ID it wants.
func unpackRemote(ctx context.Context, sn snapshots.Snapshotter, key string, layer ocispec.Descriptor) error {
	labels := snapshots.FilterInheritedLabels(layer.Annotations)
	if labels == nil {
		labels = map[string]string{}
	}
	labels[snapshots.LabelSnapshotRef] = layer.Digest.String()
	_, err := sn.Prepare(ctx, key, "", snapshots.WithLabels(labels))
	return err
}

// withLayer is a layer descriptor annotated as the remote layer l.
func withLayer(d ocispec.Descriptor, l image.RemoteLayer) ocispec.Descriptor {
	d.Annotations = map[string]string{image.RemoteLayerAnnotation: l.String()}
	return d
}

// committedAs finds the committed snapshot of a chain ID, as containerd's
// metadata finds a remote snapshotter's.
func committedAs(t *testing.T, ctx context.Context, sn snapshots.Snapshotter, chainID string) string {
	t.Helper()
	var names []string
	require.NoError(t, sn.Walk(ctx, func(_ context.Context, i snapshots.Info) error {
		if i.Kind == snapshots.KindCommitted && i.Labels[snapshots.LabelSnapshotRef] == chainID {
			names = append(names, i.Name)
		}
		return nil
	}, `labels."`+snapshots.LabelSnapshotRef+`"==`+chainID))
	require.Len(t, names, 1)
	return names[0]
}

// TestImageSnapshotter drives the plugin's containerd snapshotter over its
// socket as containerd does: a rootfs-format image volume (a chain of two
// captures) is never fetched, a container runs on the volume's own layers,
// the volume is held while a snapshot runs on it (through a destroy and a
// SIGKILL), and no image from elsewhere can name a volume.
func TestImageSnapshotter(t *testing.T) {
	testfs.Need(t)
	addr := plugintest.FreeAddr(t)
	sock := filepath.Join(t.TempDir(), "sn.sock")
	e := newEnv(t, plugintest.Config{Backend: "overlay", Args: []string{
		"--image-registry-address=" + addr, "--image-registry-auth=grace", "--image-snapshotter-endpoint=unix://" + sock}})
	e.step("", "img", func(dir string) { writeRootfsImage(t, dir, "hello") })
	e.step("img", "img2", func(dir string) {
		write(t, dir, "rootfs/bin/greet", "bonjour")
		require.NoError(t, os.Remove(filepath.Join(dir, "rootfs/etc/passwd")))
	})
	e.captureIn("ci", "bystander", nil)

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	sn := proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "cowvol")
	ctx := context.Background()

	m := remoteManifest(t, addr, "ci/img2")
	layer := m.Layers[0]
	chainID := layer.Digest.String()
	err = unpackRemote(ctx, sn, "extract-1 "+chainID, layer)
	require.True(t, errdefs.IsAlreadyExists(err), "a remote layer exists at once: %v", err)
	remote := committedAs(t, ctx, sn, chainID)
	// The same layer again, as a replay of the pull would: refused. A
	// second pull is handed a layer of its own.
	err = unpackRemote(ctx, sn, "extract-2 "+chainID, layer)
	require.True(t, errdefs.IsPermissionDenied(err), "a replayed remote layer: %v", err)
	second := remoteManifest(t, addr, "ci/img2").Layers[0]
	require.NotEqual(t, layer.Digest, second.Digest)
	require.True(t, errdefs.IsAlreadyExists(unpackRemote(ctx, sn, "extract-2 "+second.Digest.String(), second)))
	assert.NotEqual(t, remote, committedAs(t, ctx, sn, second.Digest.String()))
	_, err = sn.Stat(ctx, "extract-1 "+chainID)
	assert.True(t, errdefs.IsNotFound(err), "the extraction snapshot is gone: %v", err)

	// A container on it: the volume's layers, merged, under its own
	// upper dir.
	mounts, err := sn.Prepare(ctx, "container-1", remote)
	require.NoError(t, err)
	root := t.TempDir()
	require.NoError(t, mount.All(mounts, root))
	t.Cleanup(func() { _ = mount.UnmountAll(root, 0) })
	assert.Equal(t, "bonjour", readFile(t, root, "bin/greet"))
	absent(t, root, "etc/passwd")
	write(t, root, "bin/greet", "changed by the container")
	_, err = sn.Prepare(ctx, "container-1", remote)
	require.True(t, errdefs.IsAlreadyExists(err), "a key in use: %v", err)
	e.read("img2", func(dir string) { assert.Equal(t, "bonjour", readFile(t, dir, "rootfs/bin/greet")) })

	dataDir := filepath.Join(e.p.StateDir, "volumes", "ci", "img2")
	destroy := func(handles ...string) {
		var refs []*nodev1.VolumeRef
		for _, h := range handles {
			refs = append(refs, vref("ci", h))
		}
		_, err := e.p.NodeAPI.DestroyVolumes(ctx, &nodev1.DestroyVolumesRequest{Refs: refs})
		require.NoError(t, err)
	}
	t.Run("a volume a container runs on is held", func(t *testing.T) {
		for _, h := range []string{"img2", "img"} {
			v, err := e.p.NodeAPI.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", h)})
			require.NoError(t, err)
			assert.Equal(t, []string{"container-1"}, v.HoldingImages, "the whole chain is held")
		}
		handedBefore := remoteManifest(t, addr, "ci/img2").Layers[0]
		destroy("img2", "bystander")
		// The reaper freed what nothing holds, and not the image.
		eventually(t, "the bystander freed", func() bool {
			_, err := os.Stat(filepath.Join(e.p.StateDir, "volumes", "ci", "bystander"))
			return os.IsNotExist(err)
		})
		assert.DirExists(t, dataDir)
		assert.Equal(t, "changed by the container", readFile(t, root, "bin/greet"))
		// Destroyed: no new image names it, and a layer handed to a pull
		// before is no remote layer.
		resp, err := http.Get("http://" + addr + "/v2/ci/img2/manifests/cowvol")
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusNotFound, resp.StatusCode)
		err = unpackRemote(ctx, sn, "extract-3 "+handedBefore.Digest.String(), handedBefore)
		assert.False(t, errdefs.IsAlreadyExists(err), "a destroyed volume is no remote layer: %v", err)
	})
	t.Run("holds outlive the plugin", func(t *testing.T) {
		e.p.Kill()
		e.p.Restart()
		got, err := sn.Mounts(ctx, "container-1")
		require.NoError(t, err)
		assert.Equal(t, mounts, got)
		assert.DirExists(t, dataDir)
	})
	t.Run("removing the container frees the volume", func(t *testing.T) {
		require.NoError(t, mount.UnmountAll(root, 0))
		require.NoError(t, sn.Remove(ctx, "container-1"))
		require.NoError(t, sn.(snapshots.Cleaner).Cleanup(ctx))
		eventually(t, "the destroyed image volume freed", func() bool {
			_, err := os.Stat(dataDir)
			return os.IsNotExist(err)
		})
	})
	t.Run("no image from elsewhere names a volume", func(t *testing.T) {
		m := remoteManifest(t, addr, "ci/img")
		good := m.Layers[0]
		l, _, err := image.ParseRemoteLayer(good.Annotations[image.RemoteLayerAnnotation])
		require.NoError(t, err)
		e.captureIn("other", "private", nil)
		taken := remoteManifest(t, addr, "ci/img").Layers[0]
		require.True(t, errdefs.IsAlreadyExists(unpackRemote(ctx, sn, "extract-taken", taken)))
		for _, tt := range []struct {
			name  string
			layer ocispec.Descriptor
		}{
			{"another reader", withLayer(good, image.RemoteLayer{Reader: "other", Version: l.Version, Pull: l.Pull})},
			{"another volume", withLayer(good, image.RemoteLayer{Reader: "ci", Version: "other/private@1", Pull: l.Pull})},
			{"a malformed annotation", withLayer(good, image.RemoteLayer{Reader: "ci", Version: "no version"})},
			{"bound to no pull", withLayer(good, image.RemoteLayer{Reader: l.Reader, Version: l.Version})},
			{"another pull's digest", func() ocispec.Descriptor { d := good; d.Digest = taken.Digest; return d }()},
			{"a layer taken already", taken},
		} {
			t.Run(tt.name, func(t *testing.T) {
				err := unpackRemote(ctx, sn, "extract-forged "+tt.name, tt.layer)
				assert.True(t, errdefs.IsPermissionDenied(err) || errdefs.IsInvalidArgument(err), "%v", err)
			})
		}
		require.True(t, errdefs.IsAlreadyExists(unpackRemote(ctx, sn, "extract-good", good)))

		// An image a step wrote that names the live remote layer (the
		// runtime would find its snapshot by that diff ID alone), or
		// carries the annotation: the registry serves neither.
		e.step("", "names-remote", func(dir string) { writeLayout(t, dir, taken.Digest, nil) })
		e.step("", "annotated", func(dir string) { writeLayout(t, dir, "", good.Annotations) })
		e.step("", "plain-layout", func(dir string) { writeLayout(t, dir, "", nil) })
		for _, repo := range []string{"ci/names-remote", "ci/annotated"} {
			for _, tag := range []string{"latest", "cowvol"} {
				resp, err := http.Get("http://" + addr + "/v2/" + repo + "/manifests/" + tag)
				require.NoError(t, err)
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				assert.Equal(t, http.StatusNotFound, resp.StatusCode, repo)
				assert.Contains(t, string(body), "claims a remote layer", repo)
			}
		}
		resp, err := http.Get("http://" + addr + "/v2/ci/plain-layout/manifests/latest")
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusOK, resp.StatusCode)
	})
}

// writeLayout writes an OCI image layout of one image whose first diff
// ID is diffID (empty: its layer's own), its layer annotated with
// annotations.
func writeLayout(t *testing.T, dir string, diffID digest.Digest, annotations map[string]string) {
	t.Helper()
	data := []byte("not really a tar")
	layer := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer, Digest: digest.FromBytes(data), Size: int64(len(data)), Annotations: annotations}
	require.NoError(t, ociimage.WriteLayout(dir, layer, data, cmp.Or(diffID, layer.Digest)))
}

// TestImageSnapshotterOnAnImageArrivingLazily: a :cowvol image whose
// volume only another node holds runs on this node's snapshotter while the
// volume still arrives lazily over a slow link, its tree first and its
// data behind: the container reads each file it opens as it is filled, the
// volume is held while it fills, and it ends an ordinary ready volume. As
// stubs or an index alike.
func TestImageSnapshotterOnAnImageArrivingLazily(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) { imageSnapshotterOnAnImageArrivingLazily(t, form) })
	}
}

func imageSnapshotterOnAnImageArrivingLazily(t *testing.T, form pullForm) {
	addr := plugintest.FreeAddr(t)
	sock := filepath.Join(t.TempDir(), "sn.sock")
	a, b, _ := lazyNodesAs(t, form, 512<<10, "--image-registry-address="+addr, "--image-registry-auth=grace",
		"--image-snapshotter-endpoint=unix://"+sock)
	a.step("", "img", func(dir string) {
		writeRootfsImage(t, dir, "from node-a")
		randomFile(t, filepath.Join(dir, "rootfs"), "data", 3<<20, 7)
	})
	var want []byte
	a.read("img", func(dir string) {
		var err error
		want, err = os.ReadFile(filepath.Join(dir, "rootfs", "data"))
		require.NoError(t, err)
	})

	// Served once the tree is here, not the data (3 MiB at 512 KiB/s).
	m := remoteManifest(t, addr, "ci/img")
	require.Equal(t, "filling", volumeState(t, b, "img"), "the image is served while its data still arrives")
	resp, err := http.Get("http://" + addr + "/v2/ci/img/manifests/latest")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "pulled as any runtime pulls it, it waits for the whole volume")

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	sn := proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "cowvol")
	ctx := context.Background()
	layer := m.Layers[0]
	require.True(t, errdefs.IsAlreadyExists(unpackRemote(ctx, sn, "extract-1 "+layer.Digest.String(), layer)))
	mounts, err := sn.Prepare(ctx, "container-1", committedAs(t, ctx, sn, layer.Digest.String()))
	require.NoError(t, err, "a container starts on the volume while it fills")
	root := t.TempDir()
	require.NoError(t, mount.All(mounts, root))
	defer func() { _ = mount.UnmountAll(root, 0) }()
	held, err := b.p.NodeAPI.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", "img")})
	require.NoError(t, err)
	assert.Equal(t, []string{"container-1"}, held.HoldingImages)
	assert.Equal(t, "from node-a", readFile(t, root, "bin/greet"))
	got, err := os.ReadFile(filepath.Join(root, "data"))
	require.NoError(t, err, "a file read through the container's root is filled as it is opened")
	assert.Equal(t, want, got)

	eventually(t, "the image's volume filled", func() bool { return volumeState(t, b, "img") == "ready" })
	// The store says ready a moment before the fill is counted.
	eventually(t, "the fill counted", func() bool {
		return metricValue(t, b, `cowvol_lazy_fills_total{result="ok"}`) == 1
	})
	require.NoError(t, mount.UnmountAll(root, 0))
	require.NoError(t, sn.Remove(ctx, "container-1"))
}
