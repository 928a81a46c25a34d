//go:build e2e

package e2e

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"sort"
	"time"
)

// imageFile is one entry of an image's single layer.
type imageFile struct {
	mode     int64  // permission bits, or 0 for a symlink
	data     []byte // file content
	linkname string // symlink target
}

// ociImage writes an OCI image layout, packed as one tar that
// `ctr images import` takes, holding one single-layer image named name.
// No registry is reachable from the test machine, so images are made here.
func ociImage(out, name string, files map[string]imageFile, cmd []string) error {
	layer, err := tarOf(files)
	if err != nil {
		return err
	}
	layerDigest := digestOf(layer)
	config, err := json.Marshal(map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"created":      time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC),
		"config":       map[string]any{"Cmd": cmd, "Env": []string{"PATH=/bin"}},
		"rootfs":       map[string]any{"type": "layers", "diff_ids": []string{layerDigest}},
	})
	if err != nil {
		return err
	}
	manifest, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        descriptor("application/vnd.oci.image.config.v1+json", config, nil),
		"layers":        []any{descriptor("application/vnd.oci.image.layer.v1.tar", layer, nil)},
	})
	if err != nil {
		return err
	}
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests": []any{descriptor("application/vnd.oci.image.manifest.v1+json", manifest, map[string]string{
			"io.containerd.image.name":          name,
			"org.opencontainers.image.ref.name": name,
		})},
	})
	if err != nil {
		return err
	}
	layout := map[string]imageFile{
		"oci-layout": {mode: 0o644, data: []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		"index.json": {mode: 0o644, data: index},
	}
	for _, blob := range [][]byte{layer, config, manifest} {
		layout["blobs/sha256/"+digestOf(blob)[len("sha256:"):]] = imageFile{mode: 0o644, data: blob}
	}
	packed, err := tarOf(layout)
	if err != nil {
		return err
	}
	return os.WriteFile(out, packed, 0o644)
}

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func descriptor(mediaType string, blob []byte, annotations map[string]string) map[string]any {
	d := map[string]any{"mediaType": mediaType, "digest": digestOf(blob), "size": len(blob)}
	if annotations != nil {
		d["annotations"] = annotations
	}
	return d
}

// tarOf packs files (and the dirs above them) in a stable order.
func tarOf(files map[string]imageFile) ([]byte, error) {
	names := make([]string, 0, len(files))
	dirs := map[string]bool{}
	for name := range files {
		names = append(names, name)
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	for d := range dirs {
		names = append(names, d+"/")
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	when := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, name := range names {
		f, isFile := files[name]
		hdr := &tar.Header{Name: name, ModTime: when, Format: tar.FormatPAX}
		switch {
		case !isFile:
			hdr.Typeflag, hdr.Mode = tar.TypeDir, 0o755
		case f.linkname != "":
			hdr.Typeflag, hdr.Linkname, hdr.Mode = tar.TypeSymlink, f.linkname, 0o777
		default:
			hdr.Typeflag, hdr.Mode, hdr.Size = tar.TypeReg, f.mode, int64(len(f.data))
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, fmt.Errorf("packing %s: %w", name, err)
		}
		if isFile && f.linkname == "" {
			if _, err := tw.Write(f.data); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
