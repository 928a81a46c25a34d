package image

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
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
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/streamer"
)

// dirFiles reads a dir as a volume: paths resolved inside it.
type dirFiles struct{ root *os.Root }

func newDirFiles(t *testing.T, dir string) dirFiles {
	r, err := os.OpenRoot(dir)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })
	return dirFiles{r}
}

type osFile struct{ *os.File }

func (f osFile) Size() int64 {
	st, err := f.Stat()
	if err != nil {
		return -1
	}
	return st.Size()
}

func (d dirFiles) Open(path string) (File, error) {
	f, err := d.root.Open(path)
	if err != nil {
		return nil, err
	}
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		f.Close()
		return nil, errors.New("not a regular file")
	}
	return osFile{f}, nil
}

func (d dirFiles) Tree(ctx context.Context, path string, w io.Writer) error {
	if _, err := d.root.Stat(path); err != nil {
		return err
	}
	_, err := streamer.Pack(ctx, filepath.Join(d.root.Name(), path), w, streamer.Raw, streamer.PlainTar)
	return err
}

// blobBytes is what WriteBlob writes.
func blobBytes(t *testing.T, img *Image, files Files, d digest.Digest) []byte {
	t.Helper()
	var buf bytes.Buffer
	n, err := img.WriteBlob(context.Background(), files, d, &buf)
	require.NoError(t, err)
	require.Equal(t, int64(buf.Len()), n)
	require.Equal(t, d, digest.FromBytes(buf.Bytes()))
	return buf.Bytes()
}

func write(t *testing.T, path, content string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
}

func TestRootfs(t *testing.T) {
	dir := t.TempDir()
	write(t, filepath.Join(dir, "rootfs/bin/hello"), "#!/bin/sh\necho hello\n")
	write(t, filepath.Join(dir, "rootfs/etc/passwd"), "root:x:0:0::/root:/bin/sh\n")
	write(t, filepath.Join(dir, "metadata.json"),
		`{"env":["PATH=/bin","A=b"],"user":"1000","entrypoint":["/bin/hello"],"cmd":["x"],"working_dir":"/tmp","other":1}`)
	files := newDirFiles(t, dir)

	img, err := Load(context.Background(), files)
	require.NoError(t, err)
	assert.Equal(t, FormatRootfs, img.Format)
	assert.Equal(t, ocispec.MediaTypeImageManifest, img.Root.MediaType)

	var m ocispec.Manifest
	require.NoError(t, json.Unmarshal(blobBytes(t, img, files, img.Root.Digest), &m))
	require.Len(t, m.Layers, 1)
	var cfg ocispec.Image
	require.NoError(t, json.Unmarshal(blobBytes(t, img, files, m.Config.Digest), &cfg))
	assert.Equal(t, []string{"PATH=/bin", "A=b"}, cfg.Config.Env)
	assert.Equal(t, "1000", cfg.Config.User)
	assert.Equal(t, []string{"/bin/hello"}, cfg.Config.Entrypoint)
	assert.Equal(t, "/tmp", cfg.Config.WorkingDir)
	assert.Equal(t, "linux", cfg.OS)
	assert.Equal(t, []digest.Digest{m.Layers[0].Digest}, cfg.RootFS.DiffIDs, "an uncompressed layer's diff ID is its digest")

	// The layer is rootfs/'s tree, and the same bytes each time.
	layer := blobBytes(t, img, files, m.Layers[0].Digest)
	assert.Equal(t, m.Layers[0].Size, int64(len(layer)))
	assert.Equal(t, layer, blobBytes(t, img, files, m.Layers[0].Digest))
	got := map[string]string{}
	tr := tar.NewReader(bytes.NewReader(layer))
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		body, _ := io.ReadAll(tr)
		got[hdr.Name] = string(body)
	}
	assert.Equal(t, "#!/bin/sh\necho hello\n", got["bin/hello"])
	assert.Contains(t, got, "etc/passwd")
	assert.NotContains(t, got, "metadata.json")

	// A tree that changes after it was found is not served as the image.
	write(t, filepath.Join(dir, "rootfs/bin/hello"), "changed")
	var partial bytes.Buffer
	_, err = img.WriteBlob(context.Background(), files, m.Layers[0].Digest, &partial)
	assert.ErrorContains(t, err, "changed")
	assert.Less(t, int64(partial.Len()), m.Layers[0].Size, "a whole wrong blob was written")
}

// writeLayout writes imgs as an OCI layout in dir.
func writeLayout(t *testing.T, dir string, imgs ...v1.Image) {
	t.Helper()
	var idx v1.ImageIndex = empty.Index
	for _, img := range imgs {
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img})
	}
	_, err := layout.Write(dir, idx)
	require.NoError(t, err)
}

// checkImage checks that the image served is want: its manifest, config
// and every layer, byte for byte.
func checkImage(t *testing.T, img *Image, files Files, root digest.Digest, want v1.Image) {
	t.Helper()
	wantDigest, err := want.Digest()
	require.NoError(t, err)
	require.Equal(t, wantDigest.String(), root.String())
	raw, err := want.RawManifest()
	require.NoError(t, err)
	assert.Equal(t, raw, blobBytes(t, img, files, root))
	cfgName, err := want.ConfigName()
	require.NoError(t, err)
	rawCfg, err := want.RawConfigFile()
	require.NoError(t, err)
	assert.Equal(t, rawCfg, blobBytes(t, img, files, digest.Digest(cfgName.String())))
	layers, err := want.Layers()
	require.NoError(t, err)
	for _, l := range layers {
		d, err := l.Digest()
		require.NoError(t, err)
		rc, err := l.Compressed()
		require.NoError(t, err)
		body, err := io.ReadAll(rc)
		require.NoError(t, err)
		assert.Equal(t, body, blobBytes(t, img, files, digest.Digest(d.String())))
	}
}

func TestOCILayout(t *testing.T) {
	one, err := random.Image(1024, 3)
	require.NoError(t, err)
	two, err := random.Image(512, 2)
	require.NoError(t, err)
	for _, sub := range []string{"", "oci", "image"} {
		t.Run("one image in /"+sub, func(t *testing.T) {
			dir := t.TempDir()
			writeLayout(t, filepath.Join(dir, sub), one)
			files := newDirFiles(t, dir)
			img, err := Load(context.Background(), files)
			require.NoError(t, err)
			assert.Equal(t, FormatOCILayout, img.Format)
			checkImage(t, img, files, img.Root.Digest, one)
		})
	}
	t.Run("two images are served as an index", func(t *testing.T) {
		dir := t.TempDir()
		writeLayout(t, dir, one, two)
		files := newDirFiles(t, dir)
		img, err := Load(context.Background(), files)
		require.NoError(t, err)
		assert.Equal(t, ocispec.MediaTypeImageIndex, img.Root.MediaType)
		var idx ocispec.Index
		require.NoError(t, json.Unmarshal(blobBytes(t, img, files, img.Root.Digest), &idx))
		require.Len(t, idx.Manifests, 2)
		checkImage(t, img, files, idx.Manifests[0].Digest, one)
		checkImage(t, img, files, idx.Manifests[1].Digest, two)
	})
	t.Run("a blob the image does not reach is not served", func(t *testing.T) {
		dir := t.TempDir()
		writeLayout(t, dir, one)
		write(t, filepath.Join(dir, "blobs/sha256", strings.Repeat("a", 64)), "secret")
		files := newDirFiles(t, dir)
		img, err := Load(context.Background(), files)
		require.NoError(t, err)
		_, ok := img.Blob(digest.Digest("sha256:" + strings.Repeat("a", 64)))
		assert.False(t, ok)
		_, err = img.WriteBlob(context.Background(), files, digest.Digest("sha256:"+strings.Repeat("a", 64)), io.Discard)
		assert.ErrorIs(t, err, fs.ErrNotExist)
	})
}

func TestImageTar(t *testing.T) {
	one, err := random.Image(2048, 2)
	require.NoError(t, err)
	t.Run("docker save", func(t *testing.T) {
		dir := t.TempDir()
		tag, err := name.NewTag("example.com/app:v1")
		require.NoError(t, err)
		require.NoError(t, tarball.WriteToFile(filepath.Join(dir, "image.tar"), tag, one))
		files := newDirFiles(t, dir)
		img, err := Load(context.Background(), files)
		require.NoError(t, err)
		assert.Equal(t, FormatArchive, img.Format)
		// A new manifest over the same config and layers.
		var m ocispec.Manifest
		require.NoError(t, json.Unmarshal(blobBytes(t, img, files, img.Root.Digest), &m))
		cfgName, err := one.ConfigName()
		require.NoError(t, err)
		assert.Equal(t, cfgName.String(), m.Config.Digest.String())
		layers, err := one.Layers()
		require.NoError(t, err)
		require.Len(t, m.Layers, len(layers))
		for i, l := range layers {
			d, err := l.Digest()
			require.NoError(t, err)
			assert.Equal(t, d.String(), m.Layers[i].Digest.String())
			assert.Equal(t, ocispec.MediaTypeImageLayerGzip, m.Layers[i].MediaType)
			blobBytes(t, img, files, m.Layers[i].Digest)
		}
	})
	t.Run("an OCI layout in a tar", func(t *testing.T) {
		dir, layoutDir := t.TempDir(), t.TempDir()
		writeLayout(t, layoutDir, one)
		tarDir(t, layoutDir, filepath.Join(dir, "image.tar"))
		files := newDirFiles(t, dir)
		img, err := Load(context.Background(), files)
		require.NoError(t, err)
		assert.Equal(t, FormatArchive, img.Format)
		checkImage(t, img, files, img.Root.Digest, one)
	})
}

// tarDir packs dir's files into a tar at dst, named as tar does ("./x").
func tarDir(t *testing.T, dir, dst string) {
	t.Helper()
	out, err := os.Create(dst)
	require.NoError(t, err)
	defer out.Close()
	tw := tar.NewWriter(out)
	require.NoError(t, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		body, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if err := tw.WriteHeader(&tar.Header{Name: "./" + rel, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err = tw.Write(body)
		return err
	}))
	require.NoError(t, tw.Close())
}

// TestHostileVolumes: what a pod author can leave in a volume is refused
// with a reason, and never read outside the layout.
func TestHostileVolumes(t *testing.T) {
	one, err := random.Image(256, 1)
	require.NoError(t, err)
	manifestDigest, err := one.Digest()
	require.NoError(t, err)
	rawManifest, err := one.RawManifest()
	require.NoError(t, err)
	index := func(d, mediaType string, size int) string {
		return `{"schemaVersion":2,"manifests":[{"mediaType":"` + mediaType + `","digest":"` + d + `","size":` + itoa(size) + `}]}`
	}
	tests := []struct {
		name    string
		setup   func(dir string)
		wantErr string
		wantIs  error
	}{
		{name: "nothing", setup: func(dir string) { write(t, filepath.Join(dir, "README"), "hi") }, wantIs: ErrNoImage},
		{name: "metadata.json without rootfs", setup: func(dir string) { write(t, filepath.Join(dir, "metadata.json"), "{}") }, wantErr: "rootfs"},
		{name: "metadata.json not JSON", setup: func(dir string) {
			write(t, filepath.Join(dir, "metadata.json"), "{")
			require.NoError(t, os.MkdirAll(filepath.Join(dir, "rootfs"), 0o755))
		}, wantErr: "metadata.json"},
		{name: "a huge metadata.json", setup: func(dir string) {
			write(t, filepath.Join(dir, "metadata.json"), strings.Repeat(" ", maxDocument+1))
		}, wantErr: "at most"},
		{name: "a digest that is a path", setup: func(dir string) {
			write(t, filepath.Join(dir, "index.json"), index("sha256:../../../etc/passwd", ocispec.MediaTypeImageManifest, 10))
		}, wantErr: "want sha256"},
		{name: "another algorithm", setup: func(dir string) {
			write(t, filepath.Join(dir, "index.json"), index("sha512:"+strings.Repeat("a", 128), ocispec.MediaTypeImageManifest, 10))
		}, wantErr: "want sha256"},
		{name: "a blob that is not there", setup: func(dir string) {
			write(t, filepath.Join(dir, "index.json"), index(manifestDigest.String(), ocispec.MediaTypeImageManifest, len(rawManifest)))
		}, wantIs: fs.ErrNotExist},
		{name: "a blob of another size", setup: func(dir string) {
			write(t, filepath.Join(dir, "index.json"), index(manifestDigest.String(), ocispec.MediaTypeImageManifest, len(rawManifest)+1))
			write(t, filepath.Join(dir, "blobs/sha256", manifestDigest.Hex), string(rawManifest))
		}, wantErr: "descriptor says"},
		{name: "a manifest that does not match its digest", setup: func(dir string) {
			write(t, filepath.Join(dir, "index.json"), index(manifestDigest.String(), ocispec.MediaTypeImageManifest, len(rawManifest)))
			write(t, filepath.Join(dir, "blobs/sha256", manifestDigest.Hex), strings.Repeat("x", len(rawManifest)))
		}, wantErr: "does not match its digest"},
		{name: "an index naming a layer", setup: func(dir string) {
			write(t, filepath.Join(dir, "index.json"), index(manifestDigest.String(), ocispec.MediaTypeImageLayer, len(rawManifest)))
		}, wantErr: "want a manifest or an index"},
		{name: "indexes nested too deep", setup: func(dir string) {
			d, size := digest.Digest("sha256:"+strings.Repeat("0", 64)), 1
			for range maxDepth + 1 {
				doc := `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.index.v1+json","digest":"` + d.String() + `","size":` + itoa(size) + `}]}`
				d, size = digest.FromString(doc), len(doc)
				write(t, filepath.Join(dir, "blobs/sha256", d.Encoded()), doc)
			}
			write(t, filepath.Join(dir, "index.json"), index(d.String(), ocispec.MediaTypeImageIndex, size))
		}, wantErr: "nest deeper"},
		{name: "image.tar that is not a tar", setup: func(dir string) { write(t, filepath.Join(dir, "image.tar"), strings.Repeat("x", 1024)) }, wantErr: "image.tar"},
		{name: "image.tar with neither index", setup: func(dir string) {
			d := t.TempDir()
			write(t, filepath.Join(d, "x"), "y")
			tarDir(t, d, filepath.Join(dir, "image.tar"))
		}, wantErr: "neither"},
		{name: "manifest.json naming a file outside the tar", setup: func(dir string) {
			d := t.TempDir()
			write(t, filepath.Join(d, "manifest.json"), `[{"Config":"../../etc/passwd","Layers":[]}]`)
			tarDir(t, d, filepath.Join(dir, "image.tar"))
		}, wantIs: fs.ErrNotExist},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			tt.setup(dir)
			_, err := Load(context.Background(), newDirFiles(t, dir))
			require.Error(t, err)
			if tt.wantIs != nil {
				assert.ErrorIs(t, err, tt.wantIs)
			}
			if tt.wantErr != "" {
				assert.ErrorContains(t, err, tt.wantErr)
			}
		})
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }
