// Package ociimage builds container images without a Docker daemon: each
// image is one layer made from files given in memory, written with its
// config and manifest as an OCI image layout packed in one tar, which
// `ctr images import` (and `skopeo copy --all oci-archive:`) takes. Images
// of one name for several architectures become one multi-platform image
// (an image index). Builds are reproducible: the same files give the same
// digests, byte for byte.
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
	"runtime"
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
	Name string
	// Arch is the GOARCH its files run on (linux's); "" is this
	// machine's.
	Arch       string
	Files      []File
	Entrypoint []string
	Cmd        []string
	Env        []string
	Labels     map[string]string
	// User runs the entrypoint ("" is root).
	User string
}

// Write packs images into one OCI image layout tar at out. Images that
// share a name, one per architecture, are written as one image index:
// a runtime pulls or unpacks the one for its machine.
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
	var names []string
	byName := map[string][]Image{}
	for _, im := range images {
		if im.Arch == "" {
			im.Arch = runtime.GOARCH
		}
		if byName[im.Name] == nil {
			names = append(names, im.Name)
		}
		for _, other := range byName[im.Name] {
			if other.Arch == im.Arch {
				return fmt.Errorf("image %s: two for %s", im.Name, im.Arch)
			}
		}
		byName[im.Name] = append(byName[im.Name], im)
	}
	for _, name := range names {
		if err := appendNamed(lp, name, byName[name]); err != nil {
			return fmt.Errorf("image %s: %w", name, err)
		}
	}
	return tarDir(dir, out)
}

// appendNamed adds the image of one name to the layout: the image itself,
// or an index of its architectures' images.
func appendNamed(lp layout.Path, name string, images []Image) error {
	named := layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": name,
		"io.containerd.image.name":          name,
	})
	if len(images) == 1 {
		img, err := build(images[0])
		if err != nil {
			return err
		}
		return lp.AppendImage(img, named, layout.WithPlatform(platform(images[0])))
	}
	var manifests []mutate.IndexAddendum
	for _, im := range images {
		img, err := build(im)
		if err != nil {
			return fmt.Errorf("%s: %w", im.Arch, err)
		}
		p := platform(im)
		manifests = append(manifests, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &p}})
	}
	idx := mutate.IndexMediaType(mutate.AppendManifests(empty.Index, manifests...), types.OCIImageIndex)
	return lp.AppendIndex(idx, named)
}

func platform(im Image) v1.Platform { return v1.Platform{OS: "linux", Architecture: im.Arch} }

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
	p := platform(im)
	cfg.Architecture, cfg.OS = p.Architecture, p.OS
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
// static binary, the kubelet's credential provider (nil: none), which the
// node DaemonSet installs on the host, the CA certificates (the controller
// and the nodes reach the API server over TLS) and a /tmp. The plugin
// mounts with syscalls and runs no other program, so the image holds
// nothing else.
func Plugin(name, version string, binary, credentialProvider, caCertificates []byte) Image {
	files := []File{
		{Path: "cowvol-plugin", Mode: 0o755, Data: binary},
		{Path: "etc/ssl/certs/ca-certificates.crt", Mode: 0o644, Data: caCertificates},
		{Path: "tmp", Dir: true, Mode: 0o1777},
	}
	if credentialProvider != nil {
		files = append(files, File{Path: "cowvol-credential-provider", Mode: 0o755, Data: credentialProvider})
	}
	return Image{
		Name:       name,
		Files:      files,
		Entrypoint: []string{"/cowvol-plugin"},
		Env:        []string{"PATH=/", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"},
		Labels: map[string]string{
			"org.opencontainers.image.title":   "cowvol-plugin",
			"org.opencontainers.image.version": version,
			"org.opencontainers.image.source":  "https://github.com/concourse/cowvol",
		},
	}
}
