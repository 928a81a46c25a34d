package ociimage

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/stretchr/testify/require"
)

// untar unpacks an OCI layout tar into a dir.
func untar(t *testing.T, archive, dir string) {
	t.Helper()
	f, err := os.Open(archive)
	require.NoError(t, err)
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		require.NoError(t, err)
		p := filepath.Join(dir, hdr.Name)
		if hdr.Typeflag == tar.TypeDir {
			require.NoError(t, os.MkdirAll(p, 0o755))
			continue
		}
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(p, data, 0o644))
	}
}

// writeTwice writes images twice, checks the archives are the same bytes,
// and reads the layout back.
func writeTwice(t *testing.T, images ...Image) v1.ImageIndex {
	t.Helper()
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.tar"), filepath.Join(dir, "b.tar")
	require.NoError(t, Write(a, images...))
	require.NoError(t, Write(b, images...))
	ab, err := os.ReadFile(a)
	require.NoError(t, err)
	bb, err := os.ReadFile(b)
	require.NoError(t, err)
	require.True(t, bytes.Equal(ab, bb), "two builds differ")
	unpacked := filepath.Join(dir, "layout")
	untar(t, a, unpacked)
	idx, err := layout.ImageIndexFromPath(unpacked)
	require.NoError(t, err)
	return idx
}

// The same files make the same archive, byte for byte, and it reads back
// as an OCI layout whose image runs what was asked with the files given.
func TestWriteIsReproducibleAndReadable(t *testing.T) {
	img := Image{Name: "example.org/cowvol/test:v1", Entrypoint: []string{"/bin/app"}, Env: []string{"A=1"},
		Labels: map[string]string{"k": "v"},
		Files: []File{
			{Path: "bin/app", Mode: 0o755, Data: []byte("#!binary")},
			{Path: "/etc/conf", Mode: 0o644, Data: []byte("x=1")},
			{Path: "bin/alias", Link: "app"},
			{Path: "tmp", Dir: true, Mode: 0o1777},
		}}
	idx := writeTwice(t, img)
	manifest, err := idx.IndexManifest()
	require.NoError(t, err)
	require.Len(t, manifest.Manifests, 1)
	require.Equal(t, img.Name, manifest.Manifests[0].Annotations["io.containerd.image.name"])
	image, err := idx.Image(manifest.Manifests[0].Digest)
	require.NoError(t, err)
	cfg, err := image.ConfigFile()
	require.NoError(t, err)
	require.Equal(t, []string{"/bin/app"}, cfg.Config.Entrypoint)
	require.Equal(t, "v", cfg.Config.Labels["k"])
	require.Equal(t, runtime.GOARCH, cfg.Architecture, "this machine's, unless an image says")
	layers, err := image.Layers()
	require.NoError(t, err)
	require.Len(t, layers, 1)
	rc, err := layers[0].Uncompressed()
	require.NoError(t, err)
	defer rc.Close()
	got := map[string]string{}
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		data, _ := io.ReadAll(tr)
		got[hdr.Name] = fmt.Sprintf("%c %o %s%s", hdr.Typeflag, hdr.Mode, hdr.Linkname, data)
		require.Zero(t, hdr.Uid)
		require.Equal(t, Epoch, hdr.ModTime.UTC())
	}
	require.Equal(t, map[string]string{
		"bin/":      "5 755 ",
		"bin/alias": "2 777 app",
		"bin/app":   "0 755 #!binary",
		"etc/":      "5 755 ",
		"etc/conf":  "0 644 x=1",
		"tmp/":      "5 1777 ",
	}, got)
}

func TestWriteRefusesPathsOutside(t *testing.T) {
	err := Write(filepath.Join(t.TempDir(), "x.tar"), Image{Name: "x", Files: []File{{Path: "../etc/passwd"}}})
	require.ErrorContains(t, err, "inside the image")
}

// Images of one name for two architectures are one image index under that
// name, each manifest saying its platform and each config its
// architecture; two of one architecture are refused.
func TestWriteMultiPlatform(t *testing.T) {
	image := func(arch, data string) Image {
		return Image{Name: "example.org/cowvol/multi:v1", Arch: arch, Entrypoint: []string{"/app"},
			Files: []File{{Path: "app", Mode: 0o755, Data: []byte(data)}}}
	}
	top := writeTwice(t, image("amd64", "x86"), image("arm64", "arm"))
	topManifest, err := top.IndexManifest()
	require.NoError(t, err)
	require.Len(t, topManifest.Manifests, 1, "one name")
	require.Equal(t, "example.org/cowvol/multi:v1", topManifest.Manifests[0].Annotations["io.containerd.image.name"])
	require.Equal(t, types.OCIImageIndex, topManifest.Manifests[0].MediaType)
	idx, err := top.ImageIndex(topManifest.Manifests[0].Digest)
	require.NoError(t, err)
	manifest, err := idx.IndexManifest()
	require.NoError(t, err)
	got := map[string]string{}
	for _, m := range manifest.Manifests {
		require.Equal(t, "linux", m.Platform.OS)
		img, err := idx.Image(m.Digest)
		require.NoError(t, err)
		cfg, err := img.ConfigFile()
		require.NoError(t, err)
		require.Equal(t, m.Platform.Architecture, cfg.Architecture)
		layers, err := img.Layers()
		require.NoError(t, err)
		rc, err := layers[0].Uncompressed()
		require.NoError(t, err)
		tr := tar.NewReader(rc)
		_, err = tr.Next()
		require.NoError(t, err)
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		rc.Close()
		got[m.Platform.Architecture] = string(data)
	}
	require.Equal(t, map[string]string{"amd64": "x86", "arm64": "arm"}, got)

	err = Write(filepath.Join(t.TempDir(), "c.tar"), image("arm64", "1"), image("arm64", "2"))
	require.ErrorContains(t, err, "two for arm64")
}
