// Package image finds a container image in a cached volume, in the forms
// Concourse's steps leave one there, and describes it as an OCI registry
// serves it: a root manifest (or index) and the blobs it reaches, each
// with its media type, digest and size.
//
//   - rootfs: rootfs/ and metadata.json (env, user, entrypoint, cmd), as
//     registry-image's `format: rootfs` writes them. The image is one
//     uncompressed layer, a tar of rootfs/, and a config made from
//     metadata.json.
//   - an OCI image layout (oci-layout, index.json, blobs/), at the volume's
//     root, in oci/ (registry-image's `format: oci-layout`) or in image/
//     (oci-build-task's OUTPUT_OCI).
//   - image.tar: an OCI layout packed in one tar (BuildKit's docker and oci
//     exporters) or a `docker save` archive (manifest.json, as
//     registry-image's `format: oci` and go-containerregistry write it).
//
// Everything in a volume is its pod author's: the package reads it through
// Files alone (paths resolved inside the volume by the caller), bounds every
// document it parses, serves only blobs the root reaches and names by digest,
// and never writes. What it returns is all the state it has.
package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path"
	"regexp"
	"runtime"
	"slices"
	"strings"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/concourse/cowvol/pkg/volume"
)

// Files reads a volume. Paths are relative to its root and resolved inside
// it; a path that is not there fails with an error wrapping
// fs.ErrNotExist.
type Files interface {
	// Open opens the regular file at path.
	Open(path string) (File, error)
	// Tree writes the tree of the dir at path to w as a plain tar, the
	// same bytes each time for the same volume.
	Tree(ctx context.Context, path string, w io.Writer) error
}

// File is an open regular file of a volume.
type File interface {
	io.ReaderAt
	io.Closer
	Size() int64
}

// Formats of image a volume may hold.
const (
	FormatRootfs    = "rootfs"
	FormatOCILayout = "oci-layout"
	FormatArchive   = "image.tar"
)

// Docker's media types, which layouts and archives of images pulled from
// Docker Hub keep.
const (
	dockerManifest     = "application/vnd.docker.distribution.manifest.v2+json"
	dockerManifestList = "application/vnd.docker.distribution.manifest.list.v2+json"
	dockerConfig       = "application/vnd.docker.container.image.v1+json"
)

// Bounds on what a volume's author can make the reader read or hold.
const (
	maxDocument = 4 << 20 // a manifest, index, config or metadata.json
	maxBlobs    = 10000   // descriptors an image may reach
	maxDepth    = 4       // indexes within indexes
	maxEntries  = 100000  // entries of an image.tar
)

// ErrNoImage says the volume holds no image in any known format.
var ErrNoImage = errors.New("the volume holds no image: want rootfs/ and metadata.json, an OCI image layout (at its root, in oci/ or in image/), or image.tar")

// Image is a volume's image as a registry serves it.
type Image struct {
	Format string
	// Root is what any tag of the image names: a manifest or an index.
	Root ocispec.Descriptor
	// Remote is the digest of the layer only the snapshotter provides
	// (LoadRemote), if any.
	Remote digest.Digest
	blobs  map[digest.Digest]blob
	// layerIDs are the digests and diff IDs of every layer its
	// manifests and configs name (Load).
	layerIDs []digest.Digest
}

// LayerIDs are the digests and diff IDs of the layers the image names, as
// the runtime will look its snapshots up by them (a layer's chain ID is
// its diff ID when it is an image's first).
func (img *Image) LayerIDs() []digest.Digest { return img.layerIDs }

// blob is where a blob's bytes are: in memory, in a section of a file of
// the volume, or the tar of a dir of the volume.
type blob struct {
	desc ocispec.Descriptor
	data []byte
	file string
	off  int64
	tree string
}

// Blob describes a blob the image reaches.
func (img *Image) Blob(d digest.Digest) (ocispec.Descriptor, bool) {
	b, ok := img.blobs[d]
	return b.desc, ok
}

// BlobDigests are the digests of every blob the image reaches.
func (img *Image) BlobDigests() []digest.Digest {
	ds := make([]digest.Digest, 0, len(img.blobs))
	for d := range img.blobs {
		ds = append(ds, d)
	}
	return ds
}

// IsManifest says whether a media type is a manifest or an index (served
// on a registry's manifests endpoint).
func IsManifest(mediaType string) bool {
	switch mediaType {
	case ocispec.MediaTypeImageManifest, ocispec.MediaTypeImageIndex, dockerManifest, dockerManifestList:
		return true
	}
	return false
}

// WriteBlob writes a blob of the image to w, says how many bytes it wrote,
// and fails if what it read is
// not what the digest names (a tree that changed, a file that shrank):
// then its last byte is never written, so that w never holds a whole
// wrong blob.
func (img *Image) WriteBlob(ctx context.Context, files Files, d digest.Digest, w io.Writer) (written int64, err error) {
	b, ok := img.blobs[d]
	if !ok {
		return 0, fmt.Errorf("blob %s: %w", d, fs.ErrNotExist)
	}
	if b.data != nil {
		n, err := w.Write(b.data)
		return int64(n), err
	}
	held := &holdLast{w: w}
	v := newVerifier(held)
	if b.tree != "" {
		err = files.Tree(ctx, b.tree, v)
	} else {
		err = copySection(files, b.file, b.off, b.desc.Size, v)
	}
	if err != nil {
		return held.n, fmt.Errorf("blob %s: %w", d, err)
	}
	if err := v.check(b.desc); err != nil {
		return held.n, err
	}
	err = held.flush()
	return held.n, err
}

// holdLast writes all but the last byte written to it until flushed, and
// counts what it wrote.
type holdLast struct {
	w    io.Writer
	n    int64
	last [1]byte
	held bool
}

func (h *holdLast) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if err := h.flush(); err != nil {
		return 0, err
	}
	n, err := h.w.Write(p[:len(p)-1])
	h.n += int64(n)
	if err != nil {
		return 0, err
	}
	h.last[0], h.held = p[len(p)-1], true
	return len(p), nil
}

func (h *holdLast) flush() error {
	if !h.held {
		return nil
	}
	h.held = false
	n, err := h.w.Write(h.last[:])
	h.n += int64(n)
	return err
}

// Load finds the image in a volume. Reading a rootfs or an archive costs
// a pass over their bytes (their layers' digests); a layout costs its
// manifests only.
//
// An image that carries cowvol's remote-layer annotation is refused
// (ErrRemoteLayerClaimed): only the node's registry hands remote layers
// out, each to one pull (LoadRemote).
func Load(ctx context.Context, files Files) (*Image, error) {
	img, err := load(ctx, files)
	if err != nil {
		return nil, err
	}
	if err := img.readLayerIDs(files); err != nil {
		return nil, err
	}
	return img, nil
}

func load(ctx context.Context, files Files) (*Image, error) {
	if f, err := files.Open("metadata.json"); err == nil {
		f.Close()
		return loadRootfs(ctx, files)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	for _, dir := range []string{"", "oci/", "image/"} {
		f, err := files.Open(dir + "index.json")
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		f.Close()
		return loadLayout(FormatOCILayout, dirBlobs{vol: files, dir: dir})
	}
	f, err := files.Open("image.tar")
	if errors.Is(err, fs.ErrNotExist) {
		return nil, ErrNoImage
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return loadArchive(files, f)
}

// metadata is registry-image's metadata.json.
type metadata struct {
	Env        []string `json:"env"`
	User       string   `json:"user"`
	Entrypoint []string `json:"entrypoint"`
	Cmd        []string `json:"cmd"`
	WorkingDir string   `json:"working_dir"`
}

func loadRootfs(ctx context.Context, files Files) (*Image, error) {
	meta, err := readMetadata(files)
	if err != nil {
		return nil, err
	}
	v := newVerifier(io.Discard)
	if err := files.Tree(ctx, "rootfs", v); err != nil {
		return nil, fmt.Errorf("rootfs: %w", err)
	}
	return rootfsImage(meta, ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer, Digest: v.digest(), Size: v.n}, "rootfs")
}

func readMetadata(files Files) (metadata, error) {
	var meta metadata
	raw, err := readDocument(files, "metadata.json", 0, -1)
	if err != nil {
		return meta, err
	}
	if err := json.Unmarshal(raw, &meta); err != nil {
		return meta, fmt.Errorf("metadata.json: %w", err)
	}
	return meta, nil
}

// rootfsImage describes a rootfs-format image whose one layer is layer,
// served as the tar of the dir tree ("": a layer never served).
func rootfsImage(meta metadata, layer ocispec.Descriptor, tree string) (*Image, error) {
	config, err := json.Marshal(ocispec.Image{
		Platform: ocispec.Platform{OS: "linux", Architecture: runtime.GOARCH},
		Config: ocispec.ImageConfig{Env: meta.Env, User: meta.User, Entrypoint: meta.Entrypoint, Cmd: meta.Cmd,
			WorkingDir: meta.WorkingDir},
		RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{layer.Digest}},
	})
	if err != nil {
		return nil, err
	}
	img := &Image{Format: FormatRootfs, blobs: map[digest.Digest]blob{}}
	cfg := img.addData(ocispec.MediaTypeImageConfig, config)
	if tree != "" {
		img.blobs[layer.Digest] = blob{desc: layer, tree: tree}
	}
	manifest, err := json.Marshal(ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest, Config: cfg, Layers: []ocispec.Descriptor{layer}})
	if err != nil {
		return nil, err
	}
	img.Root = img.addData(ocispec.MediaTypeImageManifest, manifest)
	return img, nil
}

// addData adds a blob held in memory.
func (img *Image) addData(mediaType string, data []byte) ocispec.Descriptor {
	d := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(data), Size: int64(len(data))}
	img.blobs[d.Digest] = blob{desc: d, data: data}
	return d
}

// layoutBlobs finds an OCI layout's files: index.json and blobs by digest.
type layoutBlobs interface {
	// locate says where a file of the layout is, and its size.
	locate(name string) (file string, off, size int64, err error)
	volume() Files
}

// dirBlobs is a layout as a dir of the volume.
type dirBlobs struct {
	vol Files
	dir string
}

func (l dirBlobs) volume() Files { return l.vol }

func (l dirBlobs) locate(name string) (string, int64, int64, error) {
	f, err := l.vol.Open(l.dir + name)
	if err != nil {
		return "", 0, 0, err
	}
	defer f.Close()
	return l.dir + name, 0, f.Size(), nil
}

// tarBlobs is a layout packed in image.tar: its entries' sections.
type tarBlobs struct {
	vol     Files
	entries map[string][2]int64
}

func (l tarBlobs) volume() Files { return l.vol }

func (l tarBlobs) locate(name string) (string, int64, int64, error) {
	e, ok := l.entries[name]
	if !ok {
		return "", 0, 0, fmt.Errorf("image.tar has no %s: %w", name, fs.ErrNotExist)
	}
	return "image.tar", e[0], e[1], nil
}

// blobName is where a layout keeps a blob: only sha256 digests, whose
// hex is all the name holds.
func blobName(d digest.Digest) (string, error) {
	if err := d.Validate(); err != nil || d.Algorithm() != digest.SHA256 {
		return "", fmt.Errorf("digest %s: want sha256:<64 hex digits>", volume.Quote(string(d)))
	}
	return "blobs/sha256/" + d.Encoded(), nil
}

// loadLayout walks an OCI layout from index.json: every manifest and
// index it reaches is read and checked against its digest; configs and
// layers are checked for size only (the runtime checks their digests as
// it pulls them, and reading them here would cost a pass over the image).
func loadLayout(format string, l layoutBlobs) (*Image, error) {
	img := &Image{Format: format, blobs: map[digest.Digest]blob{}}
	raw, err := readLocated(l, "index.json")
	if err != nil {
		return nil, err
	}
	var index ocispec.Index
	if err := json.Unmarshal(raw, &index); err != nil {
		return nil, fmt.Errorf("index.json: %w", err)
	}
	if len(index.Manifests) == 0 {
		return nil, errors.New("index.json names no manifest")
	}
	// A layout of one image is served as that image's manifest; one of
	// several (platforms, tags) as an index of them all.
	if len(index.Manifests) == 1 {
		img.Root = index.Manifests[0]
		if !IsManifest(img.Root.MediaType) {
			return nil, fmt.Errorf("index.json names a %s: want a manifest or an index", volume.Quote(img.Root.MediaType))
		}
		return img, img.walk(l, img.Root, 0)
	}
	index.MediaType = ocispec.MediaTypeImageIndex
	index.SchemaVersion = 2
	top, err := json.Marshal(index)
	if err != nil {
		return nil, err
	}
	img.Root = img.addData(ocispec.MediaTypeImageIndex, top)
	for _, m := range index.Manifests {
		if err := img.walk(l, m, 0); err != nil {
			return nil, err
		}
	}
	return img, nil
}

// walk adds the blob d names and, for a manifest or an index, what it
// reaches.
func (img *Image) walk(l layoutBlobs, d ocispec.Descriptor, depth int) error {
	if _, seen := img.blobs[d.Digest]; seen {
		return nil
	}
	if len(img.blobs) >= maxBlobs {
		return fmt.Errorf("the image reaches more than %d blobs", maxBlobs)
	}
	name, err := blobName(d.Digest)
	if err != nil {
		return err
	}
	file, off, size, err := l.locate(name)
	if err != nil {
		return err
	}
	if size != d.Size {
		return fmt.Errorf("%s is %d bytes, its descriptor says %d", name, size, d.Size)
	}
	if !IsManifest(d.MediaType) {
		img.blobs[d.Digest] = blob{desc: d, file: file, off: off}
		return nil
	}
	if depth >= maxDepth {
		return fmt.Errorf("indexes nest deeper than %d", maxDepth)
	}
	raw, err := readDocument(l.volume(), file, off, size)
	if err != nil {
		return err
	}
	if digest.FromBytes(raw) != d.Digest {
		return fmt.Errorf("%s does not match its digest", name)
	}
	img.blobs[d.Digest] = blob{desc: d, data: raw}
	var doc struct {
		Config    *ocispec.Descriptor  `json:"config"`
		Layers    []ocispec.Descriptor `json:"layers"`
		Manifests []ocispec.Descriptor `json:"manifests"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	next := doc.Manifests
	if doc.Config != nil {
		next = append(append(next, *doc.Config), doc.Layers...)
	}
	for _, c := range next {
		if err := img.walk(l, c, depth+1); err != nil {
			return err
		}
	}
	return nil
}

// loadArchive reads image.tar: an OCI layout in a tar, or a `docker save`
// archive.
func loadArchive(files Files, f File) (*Image, error) {
	entries, err := tarEntries(f)
	if err != nil {
		return nil, fmt.Errorf("image.tar: %w", err)
	}
	l := tarBlobs{vol: files, entries: entries}
	if _, ok := entries["index.json"]; ok {
		return loadLayout(FormatArchive, l)
	}
	if _, ok := entries["manifest.json"]; !ok {
		return nil, errors.New("image.tar holds neither index.json (an OCI layout) nor manifest.json (docker save)")
	}
	return loadDockerArchive(l)
}

// tarEntries lists the regular files of a tar and where their bytes are.
func tarEntries(f File) (map[string][2]int64, error) {
	sr := io.NewSectionReader(f, 0, f.Size())
	tr := tar.NewReader(sr)
	entries := map[string][2]int64{}
	for n := 0; ; n++ {
		hdr, err := tr.Next()
		if err == io.EOF {
			return entries, nil
		}
		if err != nil {
			return nil, err
		}
		if n >= maxEntries {
			return nil, fmt.Errorf("more than %d entries", maxEntries)
		}
		if hdr.Typeflag != tar.TypeReg {
			continue
		}
		name := path.Clean(strings.TrimPrefix(hdr.Name, "./"))
		if _, dup := entries[name]; dup {
			return nil, fmt.Errorf("%s is in it twice", volume.Quote(name))
		}
		// The reader has consumed the header and nothing of the body.
		off, err := sr.Seek(0, io.SeekCurrent)
		if err != nil {
			return nil, err
		}
		entries[name] = [2]int64{off, hdr.Size}
	}
}

// loadDockerArchive makes a manifest for the first image of a `docker
// save` archive. Its layers are hashed (the archive names them by file,
// not by digest) and typed by their first bytes.
func loadDockerArchive(l tarBlobs) (*Image, error) {
	raw, err := readLocated(l, "manifest.json")
	if err != nil {
		return nil, err
	}
	var saved []struct {
		Config string
		Layers []string
	}
	if err := json.Unmarshal(raw, &saved); err != nil {
		return nil, fmt.Errorf("manifest.json: %w", err)
	}
	if len(saved) == 0 {
		return nil, errors.New("manifest.json names no image")
	}
	if len(saved[0].Layers) > maxBlobs {
		return nil, fmt.Errorf("the image has more than %d layers", maxBlobs)
	}
	img := &Image{Format: FormatArchive, blobs: map[digest.Digest]blob{}}
	config, err := readLocated(l, path.Clean(saved[0].Config))
	if err != nil {
		return nil, err
	}
	cfg := img.addData(ocispec.MediaTypeImageConfig, config)
	var layers []ocispec.Descriptor
	for _, name := range saved[0].Layers {
		file, off, size, err := l.locate(path.Clean(name))
		if err != nil {
			return nil, err
		}
		v := newVerifier(io.Discard)
		if err := copySection(l.vol, file, off, size, v); err != nil {
			return nil, fmt.Errorf("%s: %w", volume.Quote(name), err)
		}
		d := ocispec.Descriptor{MediaType: layerType(v.head), Digest: v.digest(), Size: size}
		img.blobs[d.Digest] = blob{desc: d, file: file, off: off}
		layers = append(layers, d)
	}
	manifest, err := json.Marshal(ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest, Config: cfg, Layers: layers})
	if err != nil {
		return nil, err
	}
	img.Root = img.addData(ocispec.MediaTypeImageManifest, manifest)
	return img, nil
}

// layerType is a layer's media type by its first bytes.
func layerType(head []byte) string {
	switch {
	case bytes.HasPrefix(head, []byte{0x1f, 0x8b}):
		return ocispec.MediaTypeImageLayerGzip
	case bytes.HasPrefix(head, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		return ocispec.MediaTypeImageLayerZstd
	}
	return ocispec.MediaTypeImageLayer
}

// readLocated reads a JSON document of a layout.
func readLocated(l layoutBlobs, name string) ([]byte, error) {
	file, off, size, err := l.locate(name)
	if err != nil {
		return nil, err
	}
	return readDocument(l.volume(), file, off, size)
}

// readDocument reads a section of a file (size -1: the whole file), at
// most maxDocument bytes.
func readDocument(files Files, name string, off, size int64) ([]byte, error) {
	f, err := files.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if size < 0 {
		size = f.Size()
	}
	if size > maxDocument {
		return nil, fmt.Errorf("%s: a document of %d bytes (at most %d)", name, size, maxDocument)
	}
	buf := make([]byte, size)
	if _, err := f.ReadAt(buf, off); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return buf, nil
}

// copySection copies a section of a file of the volume.
func copySection(files Files, name string, off, size int64, w io.Writer) error {
	f, err := files.Open(name)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := io.Copy(w, io.NewSectionReader(f, off, size))
	if err == nil && n != size {
		err = fmt.Errorf("%s: %d bytes where %d were expected", name, n, size)
	}
	return err
}

// verifier hashes and counts what passes to w.
type verifier struct {
	w    io.Writer
	h    hash.Hash
	n    int64
	head []byte
}

func newVerifier(w io.Writer) *verifier {
	return &verifier{w: w, h: sha256.New()}
}

func (v *verifier) Write(p []byte) (int, error) {
	if len(v.head) < 4 {
		v.head = append(v.head, p[:min(len(p), 4-len(v.head))]...)
	}
	n, err := v.w.Write(p)
	v.h.Write(p[:n])
	v.n += int64(n)
	return n, err
}

func (v *verifier) digest() digest.Digest {
	return digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(v.h.Sum(nil)))
}

func (v *verifier) check(d ocispec.Descriptor) error {
	if v.n != d.Size || v.digest() != d.Digest {
		return fmt.Errorf("blob %s changed: %d bytes of %s read", d.Digest, v.n, v.digest())
	}
	return nil
}

// RemoteLayerAnnotation marks, in a manifest the node's registry serves, a
// layer that the runtime never fetches: containerd passes annotations
// under containerd.io/snapshot/ to its snapshotter as labels, and cowvol's
// snapshotter (package snapshotter) mounts the volume's rootfs/ in the
// layer's place. Its value is a RemoteLayer.
const RemoteLayerAnnotation = "containerd.io/snapshot/cowvol.concourse-ci.org/layer"

// annotationPrefix is what every annotation cowvol's snapshotter reads
// starts with: an image found in a volume carrying one is refused.
const annotationPrefix = "containerd.io/snapshot/cowvol."

// ErrRemoteLayerClaimed says an image found in a volume names a layer as
// only the node's registry may: with cowvol's remote-layer annotation, or
// by the digest of a remote layer handed to a pull.
var ErrRemoteLayerClaimed = errors.New("the image claims a remote layer, which only the node's registry hands out")

// RemoteLayer names the root filesystem of a rootfs-format image volume,
// as the namespace Reader reads it, for one pull: Version is the engine's
// name for the volume's content (<namespace>/<handle>@<when it was made>),
// Pull the nonce of the pull it was handed to (empty in the labels of
// snapshots made before remote layers were bound to pulls).
type RemoteLayer struct {
	Reader  string
	Version string
	Pull    string
}

func (l RemoteLayer) String() string {
	if l.Pull == "" {
		return l.Reader + " " + l.Version
	}
	return l.Reader + " " + l.Version + " " + l.Pull
}

// ParseRemoteLayer reads a RemoteLayer annotation.
func ParseRemoteLayer(s string) (RemoteLayer, volume.Ref, error) {
	fields := strings.Split(s, " ")
	bad := func(err error) (RemoteLayer, volume.Ref, error) {
		return RemoteLayer{}, volume.Ref{}, fmt.Errorf("remote layer %s: %w", volume.Quote(s), err)
	}
	if len(fields) != 2 && len(fields) != 3 {
		return bad(errors.New("want <namespace> <volume>@<version> <pull>"))
	}
	l := RemoteLayer{Reader: fields[0], Version: fields[1]}
	if len(fields) == 3 {
		if l.Pull = fields[2]; !pullNonce.MatchString(l.Pull) {
			return bad(errors.New("the pull is not a nonce of the registry's"))
		}
	}
	i := strings.LastIndexByte(l.Version, '@')
	if i < 0 {
		return bad(errors.New("want <namespace> <volume>@<version> <pull>"))
	}
	ref, err := volume.ParseRef(l.Version[:i])
	if err == nil {
		err = volume.ValidateNamespace(l.Reader)
	}
	if err != nil {
		return bad(err)
	}
	return l, ref, nil
}

// pullNonce is the form of the nonces PullGrants mint.
var pullNonce = regexp.MustCompile(`^[0-9a-f]{32}$`)

// LayerKey makes and checks remote layers' digests. A remote layer's
// digest is a MAC of the layer under the node's key, not a hash of its
// bytes (which would cost a pass over the image): anyone may put the
// annotation in a manifest, but only the node's registry can give it the
// digest the snapshotter accepts, so no image from elsewhere can name a
// volume.
type LayerKey [32]byte

// LoadLayerKey reads the node's key from path, making it the first time.
func LoadLayerKey(path string) (LayerKey, error) {
	var k LayerKey
	raw, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		if _, err := rand.Read(k[:]); err != nil {
			return k, err
		}
		tmp := path + ".new"
		if err := os.WriteFile(tmp, k[:], 0o600); err != nil {
			return k, err
		}
		return k, os.Rename(tmp, path)
	}
	if err != nil {
		return k, err
	}
	if len(raw) != len(k) {
		return k, fmt.Errorf("%s: %d bytes, want %d", path, len(raw), len(k))
	}
	copy(k[:], raw)
	return k, nil
}

// Digest is the layer's digest under the key.
func (k LayerKey) Digest(l RemoteLayer) digest.Digest {
	m := hmac.New(sha256.New, k[:])
	m.Write([]byte("cowvol remote layer\x00" + l.Reader + "\x00" + l.Version))
	if l.Pull != "" {
		m.Write([]byte("\x00" + l.Pull))
	}
	return digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(m.Sum(nil)))
}

// Valid says whether d is the layer's digest under the key.
func (k LayerKey) Valid(l RemoteLayer, d digest.Digest) bool {
	want := k.Digest(l)
	return hmac.Equal([]byte(want), []byte(d))
}

// HasRootfs says whether a volume holds a rootfs-format image.
func HasRootfs(files Files) (bool, error) {
	f, err := files.Open("metadata.json")
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	f.Close()
	return true, nil
}

// LoadRemote describes the rootfs-format image in a volume as the
// snapshotter runs it, for one pull of reader's: its one layer is remote
// (never sent, no pass over its bytes), its digest and annotation minted
// by grants for this pull alone.
func LoadRemote(files Files, grants *PullGrants, reader, version string) (*Image, error) {
	meta, err := readMetadata(files)
	if err != nil {
		return nil, err
	}
	layer, d, err := grants.Issue(reader, version)
	if err != nil {
		return nil, err
	}
	desc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer, Digest: d, Size: 0,
		Annotations: map[string]string{RemoteLayerAnnotation: layer.String()}}
	img, err := rootfsImage(meta, desc, "")
	if err != nil {
		return nil, err
	}
	img.Remote = d
	return img, nil
}

// readLayerIDs notes the layers the image's manifests and configs name,
// refusing one that carries cowvol's annotations.
func (img *Image) readLayerIDs(files Files) error {
	seen := map[digest.Digest]bool{}
	note := func(d digest.Digest) {
		if !seen[d] {
			seen[d] = true
			img.layerIDs = append(img.layerIDs, d)
		}
	}
	for _, b := range img.blobs {
		switch {
		case IsManifest(b.desc.MediaType) && b.data != nil:
			var doc struct {
				Annotations map[string]string    `json:"annotations"`
				Config      *ocispec.Descriptor  `json:"config"`
				Layers      []ocispec.Descriptor `json:"layers"`
				Manifests   []ocispec.Descriptor `json:"manifests"`
			}
			if err := json.Unmarshal(b.data, &doc); err != nil {
				return fmt.Errorf("%s: %w", b.desc.Digest, err)
			}
			descs := append(append([]ocispec.Descriptor{b.desc}, doc.Layers...), doc.Manifests...)
			if doc.Config != nil {
				descs = append(descs, *doc.Config)
			}
			for _, d := range append(descs, ocispec.Descriptor{Annotations: doc.Annotations}) {
				for name := range d.Annotations {
					if strings.HasPrefix(name, annotationPrefix) {
						return fmt.Errorf("%w: it carries the annotation %s", ErrRemoteLayerClaimed, name)
					}
				}
			}
			for _, l := range doc.Layers {
				note(l.Digest)
			}
		case b.desc.MediaType == ocispec.MediaTypeImageConfig || b.desc.MediaType == dockerConfig:
			raw := b.data
			if raw == nil {
				var err error
				if raw, err = readDocument(files, b.file, b.off, b.desc.Size); err != nil {
					return err
				}
			}
			var config struct {
				RootFS struct {
					DiffIDs []digest.Digest `json:"diff_ids"`
				} `json:"rootfs"`
			}
			if err := json.Unmarshal(raw, &config); err != nil {
				return fmt.Errorf("config %s: %w", b.desc.Digest, err)
			}
			for _, d := range config.RootFS.DiffIDs {
				note(d)
			}
		}
	}
	slices.Sort(img.layerIDs)
	return nil
}
