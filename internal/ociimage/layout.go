package ociimage

import (
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// WriteLayout writes, unpacked into dir, an OCI image layout of one image
// made by hand: its one layer is described by layer (whatever digest,
// size and annotations it claims), its blob data, and its config names
// diffID as the layer's. Tests use it to write the crafted images a
// tenant could leave in a volume.
func WriteLayout(dir string, layer ocispec.Descriptor, data []byte, diffID digest.Digest) error {
	blob := func(d digest.Digest, data []byte) error {
		p := filepath.Join(dir, "blobs", d.Algorithm().String(), d.Encoded())
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		return os.WriteFile(p, data, 0o644)
	}
	add := func(mediaType string, doc any) (ocispec.Descriptor, error) {
		raw, err := json.Marshal(doc)
		if err != nil {
			return ocispec.Descriptor{}, err
		}
		d := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(raw), Size: int64(len(raw))}
		return d, blob(d.Digest, raw)
	}
	if err := blob(layer.Digest, data); err != nil {
		return err
	}
	config, err := add(ocispec.MediaTypeImageConfig, ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: runtime.GOARCH},
		RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{diffID}}})
	if err != nil {
		return err
	}
	manifest, err := add(ocispec.MediaTypeImageManifest, ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest, Config: config, Layers: []ocispec.Descriptor{layer}})
	if err != nil {
		return err
	}
	index, err := json.Marshal(ocispec.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex,
		Manifests: []ocispec.Descriptor{manifest}})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "index.json"), index, 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644)
}
