package test

import (
	"archive/tar"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/validate"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/image"
	"github.com/concourse/cowvol/pkg/plugin"
)

// writeRootfsImage leaves an image in dir as registry-image's rootfs
// format does.
func writeRootfsImage(t *testing.T, dir, greeting string) {
	write(t, dir, "rootfs/bin/greet", greeting)
	write(t, dir, "rootfs/etc/passwd", "root:x:0:0::/root:/bin/sh\n")
	write(t, dir, "metadata.json", `{"env":["PATH=/bin","GREETING=`+greeting+`"],"user":"root","cmd":["/bin/greet"]}`)
}

// writeLayoutImage leaves img in dir/oci as registry-image's oci-layout
// format does.
func writeLayoutImage(t *testing.T, dir string, img v1.Image) {
	_, err := layout.Write(filepath.Join(dir, "oci"), mutate.AppendManifests(empty.Index, mutate.IndexAddendum{Add: img}))
	require.NoError(t, err)
}

// pull pulls an image from the node's registry as a runtime would, and
// checks every blob against its digest (a layer's as it is read).
func pull(t *testing.T, ref string) (v1.Image, error) {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	require.NoError(t, err)
	img, err := remote.Image(r)
	if err != nil {
		return nil, err
	}
	// validate.Image would gunzip every layer: a rootfs image's one layer
	// is an uncompressed tar, as OCI allows and containerd takes.
	if err := validate.Image(img, validate.Fast); err != nil {
		return nil, err
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, err
	}
	for _, l := range layers {
		rc, err := l.Compressed()
		if err != nil {
			return nil, err
		}
		_, err = io.Copy(io.Discard, rc)
		rc.Close()
		if err != nil {
			return nil, err
		}
	}
	return img, nil
}

// registryAnswer is the status and error code the registry answers a GET.
func registryAnswer(t *testing.T, method, url string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var body struct {
		Errors []struct{ Code, Message string }
	}
	raw, _ := io.ReadAll(resp.Body)
	if json.Unmarshal(raw, &body) == nil && len(body.Errors) > 0 {
		return resp.StatusCode, body.Errors[0].Code + ": " + body.Errors[0].Message
	}
	return resp.StatusCode, ""
}

// TestImageRegistry pulls, from the real plugin's loopback registry, the
// images that captured volumes hold, in each format, through chains, and
// checks what a namespace may name.
func TestImageRegistry(t *testing.T) {
	testfs.Need(t)
	addr := plugintest.FreeAddr(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay", Args: []string{"--image-registry-address=" + addr, "--image-registry-auth=grace"}})
	e.step("", "rootfs-img", func(dir string) { writeRootfsImage(t, dir, "hello") })
	// A step that changes the image: its volume is a chain of two layers,
	// read merged.
	e.step("rootfs-img", "rootfs-img2", func(dir string) {
		write(t, dir, "rootfs/bin/greet", "bonjour")
		require.NoError(t, os.Remove(filepath.Join(dir, "rootfs/etc/passwd")))
	})
	layoutImg, err := random.Image(4096, 3)
	require.NoError(t, err)
	e.step("", "oci-img", func(dir string) { writeLayoutImage(t, dir, layoutImg) })
	e.step("", "not-an-image", func(dir string) { write(t, dir, "README", "no image here") })

	t.Run("rootfs", func(t *testing.T) {
		img, err := pull(t, addr+"/ci/rootfs-img:latest")
		require.NoError(t, err)
		cfg, err := img.ConfigFile()
		require.NoError(t, err)
		assert.Equal(t, []string{"PATH=/bin", "GREETING=hello"}, cfg.Config.Env)
		assert.Equal(t, []string{"/bin/greet"}, cfg.Config.Cmd)
		files := layerFiles(t, img)
		assert.Equal(t, "hello", files["bin/greet"])
		assert.Contains(t, files, "etc/passwd")
	})
	t.Run("a chain is served merged", func(t *testing.T) {
		img, err := pull(t, addr+"/ci/rootfs-img2:latest")
		require.NoError(t, err)
		files := layerFiles(t, img)
		assert.Equal(t, "bonjour", files["bin/greet"])
		assert.NotContains(t, files, "etc/passwd")
		for n := range files {
			assert.NotContains(t, n, ".wh.", "a whiteout reached the image")
		}
	})
	t.Run("OCI layout", func(t *testing.T) {
		img, err := pull(t, addr+"/ci/oci-img:v1")
		require.NoError(t, err)
		got, err := img.Digest()
		require.NoError(t, err)
		want, err := layoutImg.Digest()
		require.NoError(t, err)
		assert.Equal(t, want, got)
		byDigest, err := pull(t, addr+"/ci/oci-img@"+want.String())
		require.NoError(t, err)
		d, err := byDigest.Digest()
		require.NoError(t, err)
		assert.Equal(t, want, d)
	})

	base := "http://" + addr + "/v2/"
	e.captureIn("other", "private-img", nil)
	e.captureIn("other", "shared-img", map[string]string{driver.AttrScope: "cluster"})
	e.step("", "shared-rootfs", func(dir string) { writeRootfsImage(t, dir, "shared") })
	t.Run("tenancy", func(t *testing.T) {
		// Another namespace's volume answers as one that does not exist.
		private, _ := registryAnswer(t, http.MethodGet, base+"ci/other/private-img/manifests/latest")
		missing, _ := registryAnswer(t, http.MethodGet, base+"ci/other/no-such-img/manifests/latest")
		assert.Equal(t, http.StatusNotFound, private)
		assert.Equal(t, missing, private)
		_, privateMsg := registryAnswer(t, http.MethodGet, base+"ci/other/private-img/manifests/latest")
		_, missingMsg := registryAnswer(t, http.MethodGet, base+"ci/other/no-such-img/manifests/latest")
		assert.Equal(t, strings.ReplaceAll(missingMsg, "no-such-img", "private-img"), privateMsg)
		// Its owner reads it (and finds no image in it).
		code, msg := registryAnswer(t, http.MethodGet, base+"other/private-img/manifests/latest")
		assert.Equal(t, http.StatusNotFound, code)
		assert.True(t, strings.HasPrefix(msg, "MANIFEST_UNKNOWN"), msg)
		// A volume shared with scope cluster is read by naming its owner.
		code, msg = registryAnswer(t, http.MethodGet, base+"ci/other/shared-img/manifests/latest")
		assert.Equal(t, http.StatusNotFound, code)
		assert.Contains(t, msg, "MANIFEST_UNKNOWN", "shared, read, and found to hold no image")
		// ci's own volume is not other's.
		_, err := pull(t, addr+"/other/shared-rootfs:latest")
		assert.ErrorContains(t, err, "NAME_UNKNOWN")
		_, err = pull(t, addr+"/other/ci/shared-rootfs:latest")
		assert.ErrorContains(t, err, "NAME_UNKNOWN", "a namespace-scoped volume named through its owner")
	})
	t.Run("answers", func(t *testing.T) {
		for _, tt := range []struct {
			method, path string
			wantCode     int
			wantError    string
		}{
			{http.MethodGet, "", http.StatusOK, ""},
			{http.MethodGet, "ci/not-an-image/manifests/latest", http.StatusNotFound, "MANIFEST_UNKNOWN"},
			{http.MethodGet, "ci/Rootfs-Img/manifests/latest", http.StatusNotFound, "NAME_INVALID"},
			{http.MethodGet, "ci/rootfs-img/x/y/manifests/latest", http.StatusNotFound, "NAME_INVALID"},
			{http.MethodGet, "ci/rootfs-img/manifests/sha256:nothex", http.StatusBadRequest, "DIGEST_INVALID"},
			{http.MethodGet, "ci/rootfs-img/blobs/sha256:" + strings.Repeat("0", 64), http.StatusNotFound, "BLOB_UNKNOWN"},
			{http.MethodHead, "ci/rootfs-img/manifests/latest", http.StatusOK, ""},
			{http.MethodPut, "ci/rootfs-img/manifests/latest", http.StatusMethodNotAllowed, ""},
			{http.MethodPost, "ci/rootfs-img/blobs/uploads/", http.StatusMethodNotAllowed, ""},
			{http.MethodGet, "../../etc/passwd/manifests/latest", http.StatusNotFound, "NAME_INVALID"},
		} {
			t.Run(tt.method+" "+tt.path, func(t *testing.T) {
				code, msg := registryAnswer(t, tt.method, base+tt.path)
				assert.Equal(t, tt.wantCode, code, msg)
				assert.True(t, strings.HasPrefix(msg, tt.wantError), "%q", msg)
			})
		}
	})
	t.Run("metrics", func(t *testing.T) {
		resp, err := http.Get("http://" + e.metrics + "/metrics")
		require.NoError(t, err)
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		assert.Contains(t, string(body), `cowvol_image_registry_requests_total{code="200",kind="blob"}`)
		assert.Regexp(t, `cowvol_image_registry_sent_bytes_total [1-9]`, string(body))
	})
}

// layerFiles reads an image's one layer.
func layerFiles(t *testing.T, img v1.Image) map[string]string {
	t.Helper()
	layers, err := img.Layers()
	require.NoError(t, err)
	require.Len(t, layers, 1)
	rc, err := layers[0].Compressed() // an uncompressed tar
	require.NoError(t, err)
	defer rc.Close()
	return tarFiles(t, rc)
}

// TestImageRegistryIsLoopbackOnly: its names are nobody's credentials, so
// the plugin refuses to serve it anywhere but on loopback.
func TestImageRegistryIsLoopbackOnly(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:5000", ":5000", "10.0.0.1:5000"} {
		o := plugin.Defaults()
		o.Images.RegistryAddress = addr
		err := o.Validate()
		require.Error(t, err, addr)
		assert.Contains(t, err.Error(), "--image-registry-address", fmt.Sprint(addr))
	}
}

// tarFiles reads a tar's regular files, by name without "./".
func tarFiles(t *testing.T, r io.Reader) map[string]string {
	t.Helper()
	files := map[string]string{}
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return files
		}
		require.NoError(t, err)
		if hdr.Typeflag == tar.TypeReg {
			body, err := io.ReadAll(tr)
			require.NoError(t, err)
			files[strings.TrimPrefix(hdr.Name, "./")] = string(body)
		}
	}
}

// TestImageFromAPeer: a step's image volume held only by another node is
// pulled from it when the runtime asks this node's registry for it, as any
// input is (whole, but as the snapshotter runs it); another namespace's
// private volume is never pulled.
func TestImageFromAPeer(t *testing.T) {
	f := startPeerFleet(t)
	a := f.node("node-a", testfs.XFS, 1<<30)
	b := f.node("node-b", testfs.XFS, 1<<30, "--image-registry-address=127.0.0.1:7444", "--image-registry-auth=grace", "--pull-mode=auto",
		"--image-snapshotter-endpoint=unix://"+filepath.Join(t.TempDir(), "sn.sock"))
	a.step("", "img", func(dir string) { writeRootfsImage(t, dir, "from node-a") })
	a.step("", "img-on-layers", func(dir string) { writeRootfsImage(t, dir, "on its layers") })
	a.captureIn("other", "private-img", nil)
	f.holders("ci", "img", "node-a")
	f.holders("other", "private-img", "node-a")

	// The runtime on B reaches B's loopback.
	transport := &http.Transport{DialContext: b.host.DialContext}
	pullOnB := func(ref string) (v1.Image, error) {
		r, err := name.ParseReference(ref, name.Insecure)
		require.NoError(t, err)
		return remote.Image(r, remote.WithTransport(transport))
	}
	var img v1.Image
	eventually(t, "the image pulled through node-b", func() bool {
		var err error
		img, err = pullOnB("127.0.0.1:7444/ci/img:latest")
		if err != nil {
			require.NotContains(t, err.Error(), "NAME_UNKNOWN", "node-b did not find the volume on node-a")
		}
		return err == nil
	})
	files := layerFiles(t, img)
	assert.Equal(t, "from node-a", files["bin/greet"])
	f.holders("ci", "img", "node-a", "node-b")
	layers := metricValue(t, b.env, "cowvol_pulled_layers_total")
	require.Equal(t, 1.0, layers)

	_, err := pullOnB("127.0.0.1:7444/ci/other/private-img:latest")
	assert.ErrorContains(t, err, "NAME_UNKNOWN")
	assert.Equal(t, layers, metricValue(t, b.env, "cowvol_pulled_layers_total"), "another namespace's private volume was pulled")
	_, err = pullOnB("127.0.0.1:7444/other/private-img:latest")
	assert.ErrorContains(t, err, "MANIFEST_UNKNOWN", "its own namespace brings it (it holds no image)")
	f.holders("other", "private-img", "node-a", "node-b")

	// As the snapshotter runs it: the volume may arrive lazily (node-b
	// pulls lazily where it can), and the manifest names its remote
	// layer (TestImageSnapshotterOnAnImageArrivingLazily runs on it).
	var remoteLayer ocispec.Descriptor
	eventually(t, "the :cowvol manifest served through node-b", func() bool {
		r, err := name.ParseReference("127.0.0.1:7444/ci/img-on-layers:cowvol", name.Insecure)
		require.NoError(t, err)
		desc, err := remote.Get(r, remote.WithTransport(transport))
		if err != nil {
			require.NotContains(t, err.Error(), "NAME_UNKNOWN", "node-b did not find the volume on node-a")
			return false
		}
		var m ocispec.Manifest
		require.NoError(t, json.Unmarshal(desc.Manifest, &m))
		require.Len(t, m.Layers, 1)
		remoteLayer = m.Layers[0]
		return true
	})
	assert.Contains(t, remoteLayer.Annotations[image.RemoteLayerAnnotation], "ci/img-on-layers@")
	f.holders("ci", "img-on-layers", "node-a", "node-b")
}
