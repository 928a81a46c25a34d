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

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/image"
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

// dirVolumes holds one volume, ci/img, in a dir.
type dirVolumes struct{ dir string }

func (v dirVolumes) Version(ns string, r volume.Ref) (string, error) {
	if ns != "ci" || r != (volume.Ref{Namespace: "ci", Handle: "img"}) {
		return "", streamer.ErrNotHeld
	}
	return "v1", nil
}

func (v dirVolumes) Fetch(context.Context, string, volume.Ref) error { return streamer.ErrNotHeld }

func (v dirVolumes) OpenVolume(ns string, r volume.Ref, path string, format streamer.Format) (streamer.Reading, error) {
	if _, err := v.Version(ns, r); err != nil {
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
	srv := httptest.NewServer(New(dirVolumes{dir}, NewMetrics(), nil))
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

// TestRemoteTag: with a snapshotter, the tag cowvol names the image with a
// remote layer (no pass over the rootfs: its digest is the node key's MAC,
// which no other reader, version or key gives), whose blob is refused
// saying why; every other tag names the image any runtime pulls.
func TestRemoteTag(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "rootfs"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "rootfs/f"), []byte("one"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "metadata.json"), []byte(`{"env":["A=1"]}`), 0o644))
	key, err := image.LoadLayerKey(filepath.Join(t.TempDir(), "key"))
	require.NoError(t, err)
	manifest := func(srv *httptest.Server, tag string) ocispec.Manifest {
		resp, err := http.Get(srv.URL + "/v2/ci/img/manifests/" + tag)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		var m ocispec.Manifest
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&m))
		require.Len(t, m.Layers, 1)
		return m
	}
	blob := func(srv *httptest.Server, d string) (int, string) {
		resp, err := http.Get(srv.URL + "/v2/ci/img/blobs/" + d)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}

	srv := httptest.NewServer(New(dirVolumes{dir}, NewMetrics(), &key))
	defer srv.Close()
	remote := manifest(srv, RemoteTag)
	layer := image.RemoteLayer{Reader: "ci", Version: "v1"}
	assert.Equal(t, key.Digest(layer), remote.Layers[0].Digest)
	assert.Equal(t, layer.String(), remote.Layers[0].Annotations[image.RemoteLayerAnnotation])
	assert.False(t, key.Valid(image.RemoteLayer{Reader: "other", Version: "v1"}, remote.Layers[0].Digest))
	assert.False(t, key.Valid(image.RemoteLayer{Reader: "ci", Version: "v2"}, remote.Layers[0].Digest))
	other, err := image.LoadLayerKey(filepath.Join(t.TempDir(), "key"))
	require.NoError(t, err)
	assert.False(t, other.Valid(layer, remote.Layers[0].Digest))
	code, body := blob(srv, remote.Layers[0].Digest.String())
	assert.Equal(t, http.StatusNotFound, code)
	assert.Contains(t, body, "only the node's cowvol snapshotter mounts")
	code, body = blob(srv, remote.Config.Digest.String())
	require.Equal(t, http.StatusOK, code)
	var cfg ocispec.Image
	require.NoError(t, json.Unmarshal([]byte(body), &cfg))
	assert.Equal(t, []string{"A=1"}, cfg.Config.Env)
	assert.Equal(t, remote.Layers[0].Digest, cfg.RootFS.DiffIDs[0])

	plain := manifest(srv, "latest")
	assert.NotEqual(t, remote.Layers[0].Digest, plain.Layers[0].Digest)
	assert.Empty(t, plain.Layers[0].Annotations)
	code, _ = blob(srv, plain.Layers[0].Digest.String())
	assert.Equal(t, http.StatusOK, code)

	// No snapshotter: cowvol is a tag like any other.
	noKey := httptest.NewServer(New(dirVolumes{dir}, NewMetrics(), nil))
	defer noKey.Close()
	assert.Equal(t, plain.Layers[0].Digest, manifest(noKey, RemoteTag).Layers[0].Digest)
}

// TestStale: an image the runtime keeps is stale once its volume is gone
// for its reader, or, as the snapshotter runs it, is another version;
// references not of this registry's form are left alone.
func TestStale(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "rootfs"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "metadata.json"), []byte(`{}`), 0o644))
	key, err := image.LoadLayerKey(filepath.Join(t.TempDir(), "key"))
	require.NoError(t, err)
	s := New(dirVolumes{dir}, NewMetrics(), &key)
	remote, _, err := s.image(context.Background(), repository{reader: "ci", ref: volume.Ref{Namespace: "ci", Handle: "img"}}, "ci/img", true)
	require.NoError(t, err)
	tests := []struct {
		ref    string
		target string
		want   bool
	}{
		{"ci/img:latest", "sha256:" + strings.Repeat("1", 64), false},
		{"ci/img@sha256:" + strings.Repeat("2", 64), "sha256:" + strings.Repeat("2", 64), false},
		{"ci/gone:latest", "sha256:" + strings.Repeat("1", 64), true},
		{"other/ci/img:latest", "sha256:" + strings.Repeat("1", 64), true},
		{"ci/img:" + RemoteTag, remote.Root.Digest.String(), false},
		{"ci/img:" + RemoteTag, "sha256:" + strings.Repeat("3", 64), true},
		{"Not/Ours:latest", "sha256:" + strings.Repeat("1", 64), false},
	}
	for _, tt := range tests {
		t.Run(tt.ref+" "+tt.target[:12], func(t *testing.T) {
			got, err := s.Stale(context.Background(), tt.ref, digest.Digest(tt.target))
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}
