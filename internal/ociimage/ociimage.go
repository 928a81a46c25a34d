// Package ociimage builds container images without a Docker daemon: each
// image is one layer made from files given in memory, written with its
// config and manifest as an OCI image layout packed in one tar, which
// `ctr images import` (and `skopeo copy oci-archive:`) takes. Builds are
// reproducible: the same files give the same digests, byte for byte.
//
// It serves `make image` (hack/build-image) and the e2e harness, which
// builds every image its cluster runs this way (no registry is reachable
// there). It is build tooling, never imported by the plugin.
package ociimage

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Epoch is every timestamp an image carries: a fixed one, so that a build
// depends on its files alone.
var Epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// File is one entry of an image's layer. Parent dirs are made as needed.
type File struct {
	Path string // relative, slash-separated
	Mode int64  // permission bits (and setuid, sticky)
	Data []byte
	// Link makes the entry a symlink to Link; Dir, a dir.
	Link string
	Dir  bool
}

// Image is one single-layer image.
type Image struct {
	// Name is the reference it is imported as (registry/repo:tag).
	Name       string
	Files      []File
	Entrypoint []string
	Cmd        []string
	Env        []string
	Labels     map[string]string
	// User runs the entrypoint ("" is root).
	User string
}

// Write packs images into one OCI image layout tar at out.
func Write(out string, images ...Image) error {
	dir, err := os.MkdirTemp(filepath.Dir(out), ".oci-layout-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	for _, im := range images {
		img, err := build(im)
		if err != nil {
			return fmt.Errorf("image %s: %w", im.Name, err)
		}
		if err := lp.AppendImage(img, layout.WithAnnotations(map[string]string{
			"org.opencontainers.image.ref.name": im.Name,
			"io.containerd.image.name":          im.Name,
		})); err != nil {
			return fmt.Errorf("image %s: %w", im.Name, err)
		}
	}
	return tarDir(dir, out)
}

func build(im Image) (v1.Image, error) {
	layerTar, err := layerOf(im.Files)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	if img, err = mutate.AppendLayers(img, layer); err != nil {
		return nil, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cfg = cfg.DeepCopy()
	cfg.Architecture, cfg.OS = "amd64", "linux"
	cfg.Created = v1.Time{Time: Epoch}
	cfg.Config.Entrypoint, cfg.Config.Cmd, cfg.Config.Env = im.Entrypoint, im.Cmd, im.Env
	cfg.Config.Labels, cfg.Config.User = im.Labels, im.User
	cfg.History = []v1.History{{Created: v1.Time{Time: Epoch}, CreatedBy: "ociimage"}}
	return mutate.ConfigFile(img, cfg)
}

// layerOf is the layer's tar: entries sorted, parents first, owned by
// root, stamped with Epoch.
func layerOf(files []File) ([]byte, error) {
	entries := map[string]File{}
	for _, f := range files {
		p := path.Clean(strings.TrimPrefix(f.Path, "/"))
		if p == "." || strings.HasPrefix(p, "../") {
			return nil, fmt.Errorf("file %q: want a relative path inside the image", f.Path)
		}
		for d := path.Dir(p); d != "."; d = path.Dir(d) {
			if _, ok := entries[d]; !ok {
				entries[d] = File{Path: d, Dir: true, Mode: 0o755}
			}
		}
		f.Path = p
		entries[p] = f
	}
	names := make([]string, 0, len(entries))
	for n := range entries {
		names = append(names, n)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		f := entries[n]
		hdr := &tar.Header{Name: n, Mode: f.Mode, ModTime: Epoch, Format: tar.FormatPAX}
		switch {
		case f.Dir:
			hdr.Typeflag, hdr.Name = tar.TypeDir, n+"/"
		case f.Link != "":
			hdr.Typeflag, hdr.Linkname, hdr.Mode = tar.TypeSymlink, f.Link, 0o777
		default:
			hdr.Typeflag, hdr.Size = tar.TypeReg, int64(len(f.Data))
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.Data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// tarDir packs an OCI layout dir as one tar, in a fixed order and with
// fixed stamps.
func tarDir(dir, out string) error {
	var names []string
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		names = append(names, filepath.ToSlash(rel))
		return err
	})
	if err != nil {
		return err
	}
	sort.Strings(names)
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	for _, n := range names {
		st, err := os.Stat(filepath.Join(dir, n))
		if err != nil {
			return err
		}
		hdr := &tar.Header{Name: n, Mode: 0o644, ModTime: Epoch, Typeflag: tar.TypeReg, Size: st.Size()}
		if st.IsDir() {
			hdr.Name, hdr.Mode, hdr.Typeflag, hdr.Size = n+"/", 0o755, tar.TypeDir, 0
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if !st.IsDir() {
			data, err := os.ReadFile(filepath.Join(dir, n))
			if err != nil {
				return err
			}
			if _, err := tw.Write(data); err != nil {
				return err
			}
		}
	}
	if err := tw.Close(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Plugin is cowvol's plugin image (what the Dockerfile builds too): the
// static binary, the CA certificates (the controller and the nodes reach
// the API server over TLS) and a /tmp. The plugin mounts with syscalls and
// runs no other program, so the image holds nothing else.
func Plugin(name, version string, binary, caCertificates []byte) Image {
	return Image{
		Name: name,
		Files: []File{
			{Path: "cowvol-plugin", Mode: 0o755, Data: binary},
			{Path: "etc/ssl/certs/ca-certificates.crt", Mode: 0o644, Data: caCertificates},
			{Path: "tmp", Dir: true, Mode: 0o1777},
		},
		Entrypoint: []string{"/cowvol-plugin"},
		Env:        []string{"PATH=/", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"},
		Labels: map[string]string{
			"org.opencontainers.image.title":   "cowvol-plugin",
			"org.opencontainers.image.version": version,
			"org.opencontainers.image.source":  "https://github.com/concourse/cowvol",
		},
	}
}
