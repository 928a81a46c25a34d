// Package registry serves the images that a node's cached volumes hold to
// the node's container runtime, as a read-only OCI distribution registry
// on loopback: the kubelet pulls `<address>/<namespace>/<handle>` without
// any registry outside the node, without a push and without credentials.
//
// A repository names who reads and what: `<namespace>/<handle>` is that
// namespace's own volume; `<namespace>/<owner>/<handle>` is a volume of
// owner's that it shared with scope cluster, read by namespace. Nothing
// here can tell which pod asked (the runtime pulls for every pod of the
// node), so the namespace a pod may name is enforced at admission; this
// package answers for any other volume exactly as for one that does not
// exist, and must only ever listen on loopback.
//
// It owns the HTTP API and a small memory of images found; volumes are
// read through Volumes (the node engine), never from disk directly.
package registry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/singleflight"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/image"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// Volumes reads the node's ready cached volumes, as a namespace may.
type Volumes interface {
	// Version says which content a volume namespace may read has: the
	// same string for as long as the volume is the same. A volume the
	// namespace may not read fails as one that is not held.
	Version(namespace string, r volume.Ref) (string, error)
	// OpenVolume opens a path inside such a volume.
	OpenVolume(namespace string, r volume.Ref, path string, format streamer.Format) (streamer.Reading, error)
	// Fetch brings such a volume here from the node's peers if it lacks
	// it, until ctx ends; one no node holds for namespace fails as not
	// held, and one on its way with what the pull has done so far.
	Fetch(ctx context.Context, namespace string, r volume.Ref) error
}

// RemoteTag names, in a repository of a rootfs-format image, the image
// as the node's cowvol snapshotter runs it: its layer is the volume's
// rootfs/ itself, never sent (package image's LoadRemote). Every other tag
// names the image as any runtime pulls it.
const RemoteTag = "cowvol"

// Server is the registry's HTTP handler.
type Server struct {
	vols    Volumes
	key     *image.LayerKey // nil: no snapshotter, RemoteTag is a tag like any other
	metrics *Metrics
	loads   singleflight.Group
	mu      sync.Mutex
	images  map[string]*image.Image // by volume version
	order   []string                // versions, oldest first
}

// remembered is how many images the server keeps found.
const remembered = 64

// New serves the images of vols; with key, also as RemoteTag for the
// node's snapshotter.
func New(vols Volumes, m *Metrics, key *image.LayerKey) *Server {
	return &Server{vols: vols, key: key, metrics: m, images: map[string]*image.Image{}}
}

// Metrics count the registry's answers.
type Metrics struct {
	requests *prometheus.CounterVec
	bytes    prometheus.Counter
}

// NewMetrics makes the registry's collectors.
func NewMetrics() *Metrics {
	return &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cowvol_image_registry_requests_total",
			Help: "Requests to the node's image registry, by what they asked for and the HTTP status answered."},
			[]string{"kind", "code"}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "cowvol_image_registry_sent_bytes_total",
			Help: "Bytes of blobs and manifests the node's image registry sent."}),
	}
}

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.requests, m.bytes}
}

// Repository name components, as the distribution spec allows them.
var (
	component = regexp.MustCompile(`^[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*$`)
	tagRE     = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)
)

// repository is who reads which volume.
type repository struct {
	reader string
	ref    volume.Ref
}

func parseRepository(name string) (repository, error) {
	parts := strings.Split(name, "/")
	for _, p := range parts {
		if !component.MatchString(p) {
			return repository{}, fmt.Errorf("repository %s: want <namespace>/<handle> or <namespace>/<owner namespace>/<handle>, lower case", volume.Quote(name))
		}
	}
	var repo repository
	switch len(parts) {
	case 2:
		repo = repository{reader: parts[0], ref: volume.Ref{Namespace: parts[0], Handle: parts[1]}}
	case 3:
		repo = repository{reader: parts[0], ref: volume.Ref{Namespace: parts[1], Handle: parts[2]}}
	default:
		return repository{}, fmt.Errorf("repository %s: want <namespace>/<handle> or <namespace>/<owner namespace>/<handle>", volume.Quote(name))
	}
	if err := errors.Join(volume.ValidateNamespace(repo.reader), repo.ref.Validate()); err != nil {
		return repository{}, err
	}
	return repo, nil
}

// apiError is an answer in the distribution spec's error form.
type apiError struct {
	status  int
	code    string
	message string
}

func (e apiError) Error() string { return e.message }

func nameUnknown(repo string) apiError {
	return apiError{http.StatusNotFound, "NAME_UNKNOWN", fmt.Sprintf("no image volume %s on this node", volume.Quote(repo))}
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	kind, err := s.serve(w, r)
	code := http.StatusOK
	if err != nil {
		var ae apiError
		if !errors.As(err, &ae) {
			klog.ErrorS(err, "Serving an image", "path", r.URL.Path)
			ae = apiError{http.StatusInternalServerError, "UNKNOWN", "the node could not read the image; its log says why"}
		}
		code = ae.status
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		if r.Method != http.MethodHead {
			fmt.Fprintf(w, `{"errors":[{"code":%q,"message":%q}]}`+"\n", ae.code, ae.message)
		}
	}
	s.metrics.requests.WithLabelValues(kind, strconv.Itoa(code)).Inc()
}

// serve answers a request, or says what to answer instead.
func (s *Server) serve(w http.ResponseWriter, r *http.Request) (kind string, err error) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		return "other", apiError{http.StatusMethodNotAllowed, "UNSUPPORTED", "this registry is read-only"}
	}
	w.Header().Set("Docker-Distribution-API-Version", "registry/2.0")
	p, ok := strings.CutPrefix(r.URL.Path, "/v2/")
	if !ok {
		return "other", apiError{http.StatusNotFound, "NOT_FOUND", "not a registry API path"}
	}
	if p == "" {
		return "base", nil
	}
	var name, ref string
	if i := strings.LastIndex(p, "/manifests/"); i > 0 {
		kind, name, ref = "manifest", p[:i], p[i+len("/manifests/"):]
	} else if i := strings.LastIndex(p, "/blobs/"); i > 0 {
		kind, name, ref = "blob", p[:i], p[i+len("/blobs/"):]
	} else {
		return "other", apiError{http.StatusNotFound, "NOT_FOUND", "not a registry API path"}
	}
	repo, err := parseRepository(name)
	if err != nil {
		return kind, apiError{http.StatusNotFound, "NAME_INVALID", err.Error()}
	}
	var desc ocispec.Descriptor
	var img *image.Image
	var files image.Files
	switch {
	case kind == "manifest" && tagRE.MatchString(ref):
		if img, files, err = s.image(r.Context(), repo, name, ref == RemoteTag); err != nil {
			return kind, err
		}
		desc = img.Root
	default:
		d, err := digest.Parse(ref)
		if err != nil {
			return kind, apiError{http.StatusBadRequest, "DIGEST_INVALID", fmt.Sprintf("%s is neither a tag nor a digest", volume.Quote(ref))}
		}
		var found bool
		// The snapshotter's manifest and config first: finding them
		// costs no pass over the image, and they are all it asks for.
		if s.key != nil {
			if img, files, err = s.image(r.Context(), repo, name, true); err != nil {
				return kind, err
			}
			desc, found = img.Blob(d)
			if img.Remote == d {
				return kind, apiError{http.StatusNotFound, "BLOB_UNKNOWN", fmt.Sprintf("%s: layer %s is the volume's rootfs/ itself, "+
					"which only the node's cowvol snapshotter mounts: run the pod with the cowvol runtime class, or name any tag but %q", name, d, RemoteTag)}
			}
		}
		if !found {
			if img, files, err = s.image(r.Context(), repo, name, false); err != nil {
				return kind, err
			}
			desc, found = img.Blob(d)
		}
		if !found || (kind == "manifest" && !image.IsManifest(desc.MediaType)) {
			if kind == "manifest" {
				return kind, apiError{http.StatusNotFound, "MANIFEST_UNKNOWN", fmt.Sprintf("%s has no manifest %s", name, d)}
			}
			return kind, apiError{http.StatusNotFound, "BLOB_UNKNOWN", fmt.Sprintf("%s has no blob %s", name, d)}
		}
	}
	h := w.Header()
	h.Set("Docker-Content-Digest", desc.Digest.String())
	h.Set("Content-Length", strconv.FormatInt(desc.Size, 10))
	h.Set("Content-Type", desc.MediaType)
	if kind == "blob" {
		h.Set("Content-Type", "application/octet-stream")
	}
	if r.Method == http.MethodHead {
		return kind, nil
	}
	sent, err := img.WriteBlob(r.Context(), files, desc.Digest, w)
	s.metrics.bytes.Add(float64(sent))
	if err != nil {
		// The headers are gone: cut the response short, so that the
		// runtime sees a failed pull rather than a wrong blob.
		klog.ErrorS(err, "Serving an image blob", "repository", name, "digest", desc.Digest, "sent", sent)
		panic(http.ErrAbortHandler)
	}
	return kind, nil
}

// image finds the image of a repository's volume (as the snapshotter runs
// it, if remote and the node has one), remembered by the volume's version.
func (s *Server) image(ctx context.Context, repo repository, name string, remote bool) (*image.Image, image.Files, error) {
	remote = remote && s.key != nil
	version, err := s.vols.Version(repo.reader, repo.ref)
	if errors.Is(err, streamer.ErrNotHeld) {
		// Held elsewhere, perhaps: a step's image is an input like any
		// other, brought from a peer before the container starts. The
		// runtime retries a pull that is still on its way.
		if err := s.vols.Fetch(ctx, repo.reader, repo.ref); err != nil && !errors.Is(err, streamer.ErrNotHeld) {
			return nil, nil, apiError{http.StatusServiceUnavailable, "UNAVAILABLE", fmt.Sprintf("%s: %v", name, err)}
		}
		version, err = s.vols.Version(repo.reader, repo.ref)
	}
	if errors.Is(err, streamer.ErrNotHeld) {
		return nil, nil, nameUnknown(name)
	}
	if err != nil {
		return nil, nil, err
	}
	files := volumeFiles{vols: s.vols, repo: repo}
	// As the snapshotter runs it, the same volume is another image for
	// each reader (its remote layer names who reads).
	found := version
	if remote {
		found = repo.reader + " " + version + " " + RemoteTag
	}
	s.mu.Lock()
	img, ok := s.images[found]
	s.mu.Unlock()
	if ok {
		return img, files, nil
	}
	v, err, _ := s.loads.Do(found, func() (any, error) {
		// Found once for every pull that asks meanwhile, on behalf of
		// none of them: a pull that gives up must not fail the others.
		load := image.Load
		if remote {
			layer := image.RemoteLayer{Reader: repo.reader, Version: version}
			load = func(ctx context.Context, files image.Files) (*image.Image, error) {
				return image.LoadRemote(ctx, files, *s.key, layer)
			}
		}
		img, err := load(context.WithoutCancel(ctx), files)
		if err != nil {
			return nil, err
		}
		s.remember(found, img)
		klog.InfoS("Found an image in a volume", "volume", repo.ref, "format", img.Format, "root", img.Root.Digest)
		return img, nil
	})
	switch {
	case errors.Is(err, streamer.ErrNotHeld):
		return nil, nil, nameUnknown(name)
	case errors.Is(err, image.ErrNoImage):
		return nil, nil, apiError{http.StatusNotFound, "MANIFEST_UNKNOWN", fmt.Sprintf("%s: %v", name, err)}
	case err != nil:
		return nil, nil, apiError{http.StatusNotFound, "MANIFEST_INVALID", fmt.Sprintf("%s: the volume's image cannot be served: %v", name, err)}
	}
	return v.(*image.Image), files, nil
}

func (s *Server) remember(version string, img *image.Image) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.images[version]; ok {
		return
	}
	if len(s.order) == remembered {
		delete(s.images, s.order[0])
		s.order = s.order[1:]
	}
	s.images[version] = img
	s.order = append(s.order, version)
}

// volumeFiles reads a repository's volume as its reader may.
type volumeFiles struct {
	vols Volumes
	repo repository
}

type openFile struct {
	*os.File
	size  int64
	close func()
}

func (f openFile) Size() int64  { return f.size }
func (f openFile) Close() error { f.close(); return nil }

func (v volumeFiles) open(path string, format streamer.Format) (streamer.Reading, error) {
	rd, err := v.vols.OpenVolume(v.repo.reader, v.repo.ref, path, format)
	if errors.Is(err, streamer.ErrNoPath) {
		return rd, fmt.Errorf("%s: %w", path, fs.ErrNotExist)
	}
	return rd, err
}

func (v volumeFiles) Open(path string) (image.File, error) {
	rd, err := v.open(path, streamer.FormatFile)
	if err != nil {
		return nil, err
	}
	return openFile{File: rd.File, size: rd.Size, close: rd.Close}, nil
}

func (v volumeFiles) Tree(ctx context.Context, path string, w io.Writer) error {
	rd, err := v.open(path, streamer.FormatTar)
	if err != nil {
		return err
	}
	defer rd.Close()
	_, err = streamer.Pack(ctx, rd.Dir, w, streamer.Raw, streamer.PlainTar)
	return err
}

// Stale says whether an image the runtime keeps under this registry, as
// repository (with a :tag or @digest, the address before it cut off) and
// with its root at target, no longer names what the node serves: its
// volume is gone for the namespace reading it, or, as RemoteTag, is
// another version of it (a remote layer names the version it mounts). The
// runtime can then no longer run it, or would run what was destroyed, so
// the caller deletes it. A repository that is not this registry's form is
// not stale.
func (s *Server) Stale(ctx context.Context, reference string, target digest.Digest) (bool, error) {
	name, tag := reference, ""
	if i := strings.IndexByte(name, '@'); i >= 0 {
		name = name[:i]
	}
	if i := strings.LastIndexByte(name, ':'); i > strings.LastIndexByte(name, '/') {
		name, tag = name[:i], name[i+1:]
	}
	repo, err := parseRepository(name)
	if err != nil {
		return false, nil
	}
	if _, err := s.vols.Version(repo.reader, repo.ref); errors.Is(err, streamer.ErrNotHeld) {
		return true, nil
	} else if err != nil {
		return false, err
	}
	if tag != RemoteTag || s.key == nil {
		return false, nil
	}
	img, _, err := s.image(ctx, repo, name, true)
	var ae apiError
	if errors.As(err, &ae) && ae.status == http.StatusNotFound {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	return img.Root.Digest != target, nil
}
