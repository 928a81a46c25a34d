package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/image"
	"github.com/concourse/cowvol/pkg/registry/credential"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

func TestParseRepository(t *testing.T) {
	tests := []struct {
		name, repo string
		want       repository
		wantErr    bool
	}{
		{name: "own", repo: "ci/img-1", want: repository{reader: "ci", ref: volume.Ref{Namespace: "ci", Handle: "img-1"}}},
		{name: "shared", repo: "ci/team-a/img.2", want: repository{reader: "ci", ref: volume.Ref{Namespace: "team-a", Handle: "img.2"}}},
		{name: "upper case", repo: "ci/Img", wantErr: true},
		{name: "one part", repo: "img", wantErr: true},
		{name: "four parts", repo: "a/b/c/d", wantErr: true},
		{name: "dot dot", repo: "ci/..", wantErr: true},
		{name: "empty part", repo: "ci//img", wantErr: true},
		{name: "namespace too long", repo: fmt.Sprintf("%064d/img", 0), wantErr: true},
		{name: "handle starting with a separator", repo: "ci/-img", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseRepository(tt.repo)
			if tt.wantErr {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

// dirVolumes holds one volume, ci/img, in a dir; filling, it is still
// arriving lazily (here for NeedTree only).
type dirVolumes struct {
	dir     string
	filling bool
}

func (v dirVolumes) Version(ns string, r volume.Ref, need volume.Need) (string, error) {
	if ns != "ci" || r != (volume.Ref{Namespace: "ci", Handle: "img"}) || (v.filling && need == volume.NeedWhole) {
		return "", streamer.ErrNotHeld
	}
	return "ci/img@1", nil
}

func (v dirVolumes) Fetch(_ context.Context, ns string, r volume.Ref, need volume.Need) error {
	if _, err := v.Version(ns, r, volume.NeedTree); err == nil && v.filling && need == volume.NeedWhole {
		return errors.New("ci/img is arriving lazily from a peer; retry")
	}
	return streamer.ErrNotHeld
}

func (v dirVolumes) OpenVolume(ns string, r volume.Ref, path string, format streamer.Format, need volume.Need) (streamer.Reading, error) {
	if _, err := v.Version(ns, r, need); err != nil {
		return streamer.Reading{}, err
	}
	p := filepath.Join(v.dir, path)
	st, err := os.Stat(p)
	if errors.Is(err, os.ErrNotExist) {
		return streamer.Reading{}, streamer.ErrNoPath
	}
	if err != nil {
		return streamer.Reading{}, err
	}
	if format == streamer.FormatTar {
		return streamer.Reading{Dir: p, Size: -1, Close: func() {}}, nil
	}
	if !st.Mode().IsRegular() {
		return streamer.Reading{}, streamer.ErrWrongKind
	}
	f, err := os.Open(p)
	if err != nil {
		return streamer.Reading{}, err
	}
	return streamer.Reading{File: f, Size: st.Size(), Close: func() { f.Close() }}, nil
}

// TestABlobThatChangedIsCutShort: a layer made from a tree that is no
// longer what its digest says must never reach the runtime whole.
func TestABlobThatChangedIsCutShort(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "rootfs"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "rootfs/f"), []byte("one"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "metadata.json"), []byte(`{}`), 0o644))
	srv := httptest.NewServer(New(dirVolumes{dir: dir}, NewMetrics(), Options{Mode: AuthGrace}))
	defer srv.Close()

	resp, err := http.Get(srv.URL + "/v2/ci/img/manifests/latest")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var m ocispec.Manifest
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&m))
	resp.Body.Close()
	require.Len(t, m.Layers, 1)
	layer := m.Layers[0].Digest.String()

	get := func() ([]byte, error) {
		resp, err := http.Get(srv.URL + "/v2/ci/img/blobs/" + layer)
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		return io.ReadAll(resp.Body)
	}
	_, err = get()
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "rootfs/f"), []byte("two"), 0o644))
	_, err = get()
	assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
}

// rootfsDir is a volume dir holding a rootfs-format image.
func rootfsDir(t *testing.T) string {
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "rootfs"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "rootfs/f"), []byte("one"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "metadata.json"), []byte(`{"env":["A=1"]}`), 0o644))
	return dir
}

func newGrants(t *testing.T) *image.PullGrants {
	key, err := image.LoadLayerKey(filepath.Join(t.TempDir(), "key"))
	require.NoError(t, err)
	return image.NewPullGrants(key, GrantTTL)
}

// get fetches a registry path, as the namespace ns proves it ("": no
// credential), answering the status and body.
func get(t *testing.T, srv *httptest.Server, path, ns string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, srv.URL+path, nil)
	require.NoError(t, err)
	if ns != "" {
		req.SetBasicAuth(credential.User, jwtOf("token-of-"+ns))
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

func manifestOf(t *testing.T, srv *httptest.Server, repo, tag string) ocispec.Manifest {
	t.Helper()
	code, body := get(t, srv, "/v2/"+repo+"/manifests/"+tag, "")
	require.Equal(t, http.StatusOK, code, body)
	var m ocispec.Manifest
	require.NoError(t, json.Unmarshal([]byte(body), &m))
	require.Len(t, m.Layers, 1)
	return m
}

// TestRemoteTag: with a snapshotter, each pull of the tag cowvol is handed
// an image of its own whose one layer is remote (no pass over the rootfs:
// its digest is the node key's MAC of reader, version and pull), which the
// pull may fetch by digest and the snapshotter take once; the remote
// layer's blob is refused saying why; every other tag names the image any
// runtime pulls.
func TestRemoteTag(t *testing.T) {
	dir := rootfsDir(t)
	grants := newGrants(t)
	srv := httptest.NewServer(New(dirVolumes{dir: dir}, NewMetrics(), Options{Mode: AuthGrace, Grants: grants}))
	defer srv.Close()

	remote := manifestOf(t, srv, "ci/img", RemoteTag)
	l, ref, err := image.ParseRemoteLayer(remote.Layers[0].Annotations[image.RemoteLayerAnnotation])
	require.NoError(t, err)
	assert.Equal(t, volume.Ref{Namespace: "ci", Handle: "img"}, ref)
	assert.Equal(t, "ci", l.Reader)
	assert.Equal(t, "ci/img@1", l.Version)
	assert.NotEmpty(t, l.Pull)
	again := manifestOf(t, srv, "ci/img", RemoteTag)
	assert.NotEqual(t, remote.Layers[0].Digest, again.Layers[0].Digest, "each pull is handed a layer of its own")

	code, body := get(t, srv, "/v2/ci/img/blobs/"+remote.Layers[0].Digest.String(), "")
	assert.Equal(t, http.StatusNotFound, code)
	assert.Contains(t, body, "only the node's cowvol snapshotter mounts")
	code, body = get(t, srv, "/v2/ci/img/blobs/"+remote.Config.Digest.String(), "")
	require.Equal(t, http.StatusOK, code)
	var cfg ocispec.Image
	require.NoError(t, json.Unmarshal([]byte(body), &cfg))
	assert.Equal(t, []string{"A=1"}, cfg.Config.Env)
	assert.Equal(t, remote.Layers[0].Digest, cfg.RootFS.DiffIDs[0])

	// The grant: taken once, for that layer alone.
	forged := l
	forged.Reader = "other"
	assert.ErrorIs(t, grants.Redeem(forged, remote.Layers[0].Digest), image.ErrNoGrant)
	require.NoError(t, grants.Redeem(l, remote.Layers[0].Digest))
	assert.ErrorIs(t, grants.Redeem(l, remote.Layers[0].Digest), image.ErrNoGrant, "a replay")

	plain := manifestOf(t, srv, "ci/img", "latest")
	assert.NotEqual(t, remote.Layers[0].Digest, plain.Layers[0].Digest)
	assert.Empty(t, plain.Layers[0].Annotations)
	code, _ = get(t, srv, "/v2/ci/img/blobs/"+plain.Layers[0].Digest.String(), "")
	assert.Equal(t, http.StatusOK, code)

	// No snapshotter: cowvol is a tag like any other.
	noSnapshotter := httptest.NewServer(New(dirVolumes{dir: dir}, NewMetrics(), Options{Mode: AuthGrace}))
	defer noSnapshotter.Close()
	assert.Equal(t, plain.Layers[0].Digest, manifestOf(t, noSnapshotter, "ci/img", RemoteTag).Layers[0].Digest)
}

// TestRemoteTagOfAVolumeStillArriving: as the snapshotter runs it, a
// rootfs-format image whose volume is still arriving lazily is served at
// once (the container reads the volume's layers as they fill); every other
// read waits for the volume to be whole, as the runtime reads all of it.
func TestRemoteTagOfAVolumeStillArriving(t *testing.T) {
	filling := dirVolumes{dir: rootfsDir(t), filling: true}
	srv := httptest.NewServer(New(filling, NewMetrics(), Options{Mode: AuthGrace, Grants: newGrants(t)}))
	defer srv.Close()
	remote := manifestOf(t, srv, "ci/img", RemoteTag)
	require.Len(t, remote.Layers, 1)
	assert.Contains(t, remote.Layers[0].Annotations[image.RemoteLayerAnnotation], "ci/img@1")
	code, _ := get(t, srv, "/v2/ci/img/blobs/"+remote.Config.Digest.String(), "")
	assert.Equal(t, http.StatusOK, code, "the minted config")

	code, body := get(t, srv, "/v2/ci/img/manifests/latest", "")
	assert.Equal(t, http.StatusServiceUnavailable, code, "pulled as any runtime pulls it, the image waits for its volume: %s", body)
	assert.Contains(t, body, "arriving lazily")

	// No rootfs/: no remote layer, and the runtime unpacks the blobs, so
	// the volume must be whole first.
	notRootfs := httptest.NewServer(New(dirVolumes{dir: t.TempDir(), filling: true}, NewMetrics(), Options{Mode: AuthGrace, Grants: newGrants(t)}))
	defer notRootfs.Close()
	code, body = get(t, notRootfs, "/v2/ci/img/manifests/"+RemoteTag, "")
	assert.Equal(t, http.StatusServiceUnavailable, code, "%s", body)

	s := New(filling, NewMetrics(), Options{Mode: AuthGrace, Grants: newGrants(t)})
	stale, err := s.Stale(context.Background(), "ci/img:"+RemoteTag, "", func() ([]byte, error) { return json.Marshal(remote) })
	require.NoError(t, err)
	assert.False(t, stale, "a container may run on a :cowvol image while its volume fills")
}

// TestStale: an image the runtime keeps is stale once its volume is gone
// for its reader, or, as the snapshotter runs it, its remote layer names
// another version or reader; references not of this registry's form are
// left alone.
func TestStale(t *testing.T) {
	dir := rootfsDir(t)
	s := New(dirVolumes{dir: dir}, NewMetrics(), Options{Mode: AuthGrace, Grants: newGrants(t)})
	remote := func(reader, version string) func() ([]byte, error) {
		return func() ([]byte, error) {
			return json.Marshal(ocispec.Manifest{Layers: []ocispec.Descriptor{{Annotations: map[string]string{
				image.RemoteLayerAnnotation: image.RemoteLayer{Reader: reader, Version: version, Pull: strings.Repeat("a", 32)}.String()}}}})
		}
	}
	none := func() ([]byte, error) { return nil, errors.New("not asked") }
	tests := []struct {
		ref      string
		manifest func() ([]byte, error)
		want     bool
	}{
		{"ci/img:latest", none, false},
		{"ci/img@sha256:" + strings.Repeat("2", 64), none, false},
		{"ci/gone:latest", none, true},
		{"other/ci/img:latest", none, true},
		{"ci/img:" + RemoteTag, remote("ci", "ci/img@1"), false},
		{"ci/img:" + RemoteTag, remote("ci", "ci/img@0"), true},
		{"ci/img:" + RemoteTag, remote("other", "ci/img@1"), true},
		{"Not/Ours:latest", none, false},
	}
	for _, tt := range tests {
		t.Run(tt.ref, func(t *testing.T) {
			got, err := s.Stale(context.Background(), tt.ref, digest.Digest("sha256:"+strings.Repeat("1", 64)), tt.manifest)
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

// One namespace's burst of minted images leaves another's findable: ci's
// config, minted before and after team-a was minted more images than the
// node keeps in all, is served.
func TestMintedImagesPerReader(t *testing.T) {
	s := New(dirVolumes{dir: rootfsDir(t)}, NewMetrics(), Options{Mode: AuthGrace, Grants: newGrants(t)})
	srv := httptest.NewServer(s)
	defer srv.Close()
	before := manifestOf(t, srv, "ci/img", RemoteTag)
	for i := range maxMinted + 1 {
		d := digest.FromString(fmt.Sprint("a burst ", i))
		s.minted.Put("team-a", []digest.Digest{d}, minted{repo: "team-a/img"}, time.Now())
	}
	after := manifestOf(t, srv, "ci/img", RemoteTag)
	for _, m := range []ocispec.Manifest{before, after} {
		code, _ := get(t, srv, "/v2/ci/img/blobs/"+m.Config.Digest.String(), "")
		assert.Equal(t, http.StatusOK, code, "ci's minted config beside team-a's burst")
	}
}
