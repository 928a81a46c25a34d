// Package registry serves the images that a node's cached volumes hold to
// the node's container runtime, as a read-only OCI distribution registry
// on loopback: the kubelet pulls `<address>/<namespace>/<handle>` without
// any registry outside the node and without a push.
//
// A repository names who reads and what: `<namespace>/<handle>` is that
// namespace's own volume; `<namespace>/<owner>/<handle>` is a volume of
// owner's that it shared with scope cluster, read by namespace. Every
// request proves its pod's namespace before anything is looked up: the
// kubelet's credential provider (cmd/cowvol-credential-provider) hands the
// runtime the pod's ServiceAccount token, bound to the pod and to
// credential.Audience, and a repository is served only to its reader's namespace.
// Anything else is answered exactly as a repository that does not exist
// is, whatever the other namespace holds, so that nothing reaching the
// node's loopback (a hostNetwork pod, any process) learns or reads
// another namespace's images.
//
// It owns the HTTP API, the images it found and the remote layers it
// minted; volumes are read through Volumes (the node engine), never from
// disk directly. It must only ever listen on loopback.
package registry

import (
	"context"
	"encoding/json"
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
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/singleflight"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/expiring"
	"github.com/concourse/cowvol/pkg/image"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// Volumes reads the node's cached volumes, as a namespace may: each read
// says what it needs of the volume (volume.NeedWhole: ready; NeedTree: a
// volume still arriving lazily will do).
type Volumes interface {
	// Version says which content a volume namespace may read, here as
	// need says, has: the same string for as long as the volume is the
	// same. A volume the namespace may not read, or not here as need
	// says, fails as one that is not held.
	Version(namespace string, r volume.Ref, need volume.Need) (string, error)
	// OpenVolume opens a path inside such a volume.
	OpenVolume(namespace string, r volume.Ref, path string, format streamer.Format, need volume.Need) (streamer.Reading, error)
	// Fetch brings such a volume here as need says from the node's peers
	// if it lacks it, until ctx ends; one no node holds for namespace
	// fails as not held, and one on its way with what the pull has done
	// so far.
	Fetch(ctx context.Context, namespace string, r volume.Ref, need volume.Need) error
}

// RemoteTag names, in a repository of a rootfs-format image, the image
// as the node's cowvol snapshotter runs it: its layer is the volume's
// rootfs/ itself, never sent (package image's LoadRemote). Every other tag
// names the image as any runtime pulls it.
const RemoteTag = "cowvol"

// RemoteLayers says which digests name a remote layer the node's
// snapshotter mounts (its chain ID): the runtime finds such a snapshot by
// that digest alone, so no image found in a volume may name one.
type RemoteLayers interface {
	IsRemoteLayer(ctx context.Context, d digest.Digest) (bool, error)
}

// Options are what the server serves with besides the volumes.
type Options struct {
	// Grants mint remote layers for pulls of RemoteTag (nil: no
	// snapshotter, RemoteTag is a tag like any other); RemoteLayers are
	// the snapshotter's.
	Grants       *image.PullGrants
	RemoteLayers RemoteLayers
	// Auth proves a pull's namespace; Mode is AuthRequired or AuthGrace.
	// Without Auth, only AuthGrace serves anything.
	Auth Authenticator
	Mode string
}

// Server is the registry's HTTP handler.
type Server struct {
	vols    Volumes
	opts    Options
	metrics *Metrics
	loads   singleflight.Group
	mu      sync.Mutex
	images  map[string]*image.Image // by volume version
	order   []string                // versions, oldest first
	// minted are images handed to one pull each, by their blobs'
	// digests, owned by their readers.
	minted *expiring.Set[digest.Digest, minted]
	// Requests for manifests with and without a credential, for
	// Credentials.
	anonymous, authenticated atomic.Uint64
}

// minted is an image with a remote layer, handed to one pull.
type minted struct {
	img  *image.Image
	repo string
}

// remembered is how many images the server keeps found.
const remembered = 64

// New serves the images of vols.
func New(vols Volumes, m *Metrics, opts Options) *Server {
	return &Server{vols: vols, opts: opts, metrics: m, images: map[string]*image.Image{},
		minted: expiring.New[digest.Digest, minted](GrantTTL, mintedPerReader, maxMinted)}
}

// Metrics count the registry's answers.
type Metrics struct {
	requests  *prometheus.CounterVec
	bytes     prometheus.Counter
	anonymous *prometheus.CounterVec
}

// NewMetrics makes the registry's collectors.
func NewMetrics() *Metrics {
	return &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cowvol_image_registry_requests_total",
			Help: "Requests to the node's image registry, by what they asked for and the HTTP status answered."},
			[]string{"kind", "code"}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "cowvol_image_registry_sent_bytes_total",
			Help: "Bytes of blobs and manifests the node's image registry sent."}),
		anonymous: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cowvol_image_registry_anonymous_requests_total",
			Help: "Requests to the node's image registry that carried no credential, by what was done: challenged (refused, asking for one) or served (--image-registry-auth=grace)."},
			[]string{"answer"}),
	}
}

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.requests, m.bytes, m.anonymous}
}

// tagRE is a tag, as the distribution spec allows it.
var tagRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)

// repository is who reads which volume.
type repository struct {
	reader string
	ref    volume.Ref
}

func parseRepository(name string) (repository, error) {
	reader, ref, err := volume.ParseRepository(name)
	return repository{reader: reader, ref: ref}, err
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
		if code == http.StatusUnauthorized {
			w.Header().Set("WWW-Authenticate", `Basic realm="cowvol image registry"`)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		if r.Method != http.MethodHead {
			fmt.Fprintf(w, `{"errors":[{"code":%q,"message":%q}]}`+"\n", ae.code, ae.message)
		}
	}
	s.metrics.requests.WithLabelValues(kind, strconv.Itoa(code)).Inc()
}

// unauthorized is the answer to a request whose credential proves no
// namespace, whatever it asked for.
var unauthorized = apiError{http.StatusUnauthorized, "UNAUTHORIZED",
	"a pull from the node's image registry must carry its pod's credential: the kubelet's cowvol credential provider gives it"}

// caller is the namespace a request proves ("": none, served as its path
// says in grace mode), or the answer to give it instead.
func (s *Server) caller(r *http.Request, kind string) (string, error) {
	user, password, ok := r.BasicAuth()
	if !ok || s.opts.Auth == nil {
		if kind == "manifest" {
			s.anonymous.Add(1)
		}
		if s.opts.Mode == AuthGrace {
			s.metrics.anonymous.WithLabelValues("served").Inc()
			return "", nil
		}
		s.metrics.anonymous.WithLabelValues("challenged").Inc()
		return "", unauthorized
	}
	ns, err := s.opts.Auth.Namespace(r.Context(), user, password)
	switch {
	case errors.Is(err, ErrUnauthenticated):
		return "", unauthorized
	case err != nil:
		return "", apiError{http.StatusServiceUnavailable, "UNAVAILABLE", "the node cannot check the pull's credential now; the runtime retries"}
	}
	if kind == "manifest" {
		s.authenticated.Add(1)
	}
	return ns, nil
}

// Credentials counts the requests for manifests that came without a
// credential and with one that proved a namespace, since the start: a node
// whose runtime pulls without credentials (no credential provider in the
// kubelet's config) shows only the first growing.
func (s *Server) Credentials() (anonymous, authenticated uint64) {
	return s.anonymous.Load(), s.authenticated.Load()
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
	var name, ref string
	switch {
	case p == "":
		kind = "base"
	case strings.LastIndex(p, "/manifests/") > 0:
		i := strings.LastIndex(p, "/manifests/")
		kind, name, ref = "manifest", p[:i], p[i+len("/manifests/"):]
	case strings.LastIndex(p, "/blobs/") > 0:
		i := strings.LastIndex(p, "/blobs/")
		kind, name, ref = "blob", p[:i], p[i+len("/blobs/"):]
	default:
		return "other", apiError{http.StatusNotFound, "NOT_FOUND", "not a registry API path"}
	}
	// Who asks comes first: nothing is looked up for a request that
	// proves no namespace, or another one than the repository's reader.
	caller, err := s.caller(r, kind)
	if err != nil || kind == "base" {
		return kind, err
	}
	repo, err := parseRepository(name)
	if err != nil {
		return kind, apiError{http.StatusNotFound, "NAME_INVALID", err.Error()}
	}
	if caller != "" && caller != repo.reader {
		return kind, nameUnknown(name)
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
		// What a pull of RemoteTag was handed first: its manifest and
		// config are all the runtime asks for.
		var found bool
		if img, found = s.mintedBlob(name, d); found {
			files = volumeFiles{vols: s.vols, repo: repo, need: volume.NeedTree}
			desc, _ = img.Blob(d)
			if img.Remote == d {
				return kind, apiError{http.StatusNotFound, "BLOB_UNKNOWN", fmt.Sprintf("%s: layer %s is the volume's rootfs/ itself, "+
					"which only the node's cowvol snapshotter mounts: run the pod with the cowvol runtime class, or name any tag but %q", name, d, RemoteTag)}
			}
		} else {
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

// version is the version of a repository's volume, here as need says,
// brought from a peer if the node lacks it. A step's image is an input
// like any other: the runtime retries a pull that is still on its way.
func (s *Server) version(ctx context.Context, repo repository, name string, need volume.Need) (string, error) {
	version, err := s.vols.Version(repo.reader, repo.ref, need)
	if errors.Is(err, streamer.ErrNotHeld) {
		if err := s.vols.Fetch(ctx, repo.reader, repo.ref, need); err != nil && !errors.Is(err, streamer.ErrNotHeld) {
			return "", apiError{http.StatusServiceUnavailable, "UNAVAILABLE", fmt.Sprintf("%s: %v", name, err)}
		}
		version, err = s.vols.Version(repo.reader, repo.ref, need)
	}
	if errors.Is(err, streamer.ErrNotHeld) {
		return "", nameUnknown(name)
	}
	return version, err
}

// image finds the image of a repository's volume, remembered by the
// volume's version; as the snapshotter runs it (remote, with a
// snapshotter), a rootfs-format image is minted for this pull alone, and
// its volume need not be all here: the container runs on the volume's own
// layers, which may still be arriving lazily, as a step's input may. Any
// other image is read whole by the runtime, so its volume is brought
// whole first.
func (s *Server) image(ctx context.Context, repo repository, name string, remote bool) (*image.Image, image.Files, error) {
	if remote && s.opts.Grants != nil {
		version, err := s.version(ctx, repo, name, volume.NeedTree)
		if err != nil {
			return nil, nil, err
		}
		files := volumeFiles{vols: s.vols, repo: repo, need: volume.NeedTree}
		img, err := s.mint(files, repo, name, version)
		if err != nil || img != nil {
			return img, files, err
		}
	}
	version, err := s.version(ctx, repo, name, volume.NeedWhole)
	if err != nil {
		return nil, nil, err
	}
	files := volumeFiles{vols: s.vols, repo: repo, need: volume.NeedWhole}
	s.mu.Lock()
	img, ok := s.images[version]
	s.mu.Unlock()
	if !ok {
		v, err, _ := s.loads.Do(version, func() (any, error) {
			// Found once for every pull that asks meanwhile, on behalf
			// of none of them: a pull that gives up must not fail the
			// others.
			img, err := image.Load(context.WithoutCancel(ctx), files)
			if err != nil {
				return nil, err
			}
			s.remember(version, img)
			klog.InfoS("Found an image in a volume", "volume", repo.ref, "format", img.Format, "root", img.Root.Digest)
			return img, nil
		})
		if err != nil {
			return nil, nil, loadError(name, err)
		}
		img = v.(*image.Image)
	}
	if err := s.refuseRemoteLayers(ctx, img, name); err != nil {
		return nil, nil, err
	}
	return img, files, nil
}

// loadError is the answer for an image that could not be found.
func loadError(name string, err error) error {
	switch {
	case errors.Is(err, streamer.ErrNotHeld):
		return nameUnknown(name)
	case errors.Is(err, image.ErrNoImage):
		return apiError{http.StatusNotFound, "MANIFEST_UNKNOWN", fmt.Sprintf("%s: %v", name, err)}
	}
	var ae apiError
	if errors.As(err, &ae) {
		return err
	}
	return apiError{http.StatusNotFound, "MANIFEST_INVALID", fmt.Sprintf("%s: the volume's image cannot be served: %v", name, err)}
}

// refuseRemoteLayers refuses an image found in a volume that names, as a
// layer, a remote layer handed to a pull or mounted by the snapshotter:
// the runtime would find that layer's snapshot by its digest and run the
// image on another volume.
func (s *Server) refuseRemoteLayers(ctx context.Context, img *image.Image, name string) error {
	if s.opts.Grants == nil {
		return nil
	}
	for _, d := range img.LayerIDs() {
		claimed := s.opts.Grants.Pending(d)
		if !claimed && s.opts.RemoteLayers != nil {
			var err error
			if claimed, err = s.opts.RemoteLayers.IsRemoteLayer(ctx, d); err != nil {
				return err
			}
		}
		if claimed {
			klog.InfoS("Refused an image that names a remote layer", "repository", name, "layer", d)
			return loadError(name, image.ErrRemoteLayerClaimed)
		}
	}
	return nil
}

// mint makes the image a rootfs-format volume is as the snapshotter runs
// it, for one pull, and keeps it for as long as the pull's grant lasts so
// that the pull can fetch it by digest; nil if the volume is of another
// format.
func (s *Server) mint(files volumeFiles, repo repository, name, version string) (*image.Image, error) {
	rootfs, err := image.HasRootfs(files)
	if err != nil {
		return nil, loadError(name, err)
	}
	if !rootfs {
		return nil, nil
	}
	img, err := image.LoadRemote(files, s.opts.Grants, repo.reader, version)
	if err != nil {
		return nil, loadError(name, err)
	}
	s.minted.Put(repo.reader, append(img.BlobDigests(), img.Remote), minted{img: img, repo: name}, time.Now())
	klog.V(2).InfoS("Handed a pull a step image's remote layer", "volume", repo.ref, "reader", repo.reader, "layer", img.Remote)
	return img, nil
}

// GrantTTL is how long a pull has to take the remote layer it was handed.
const GrantTTL = 2 * time.Minute

// A reader may have at most mintedPerReader images minted for its pulls
// kept (past it, its oldest go first), and the node at most maxMinted:
// one namespace's burst of pulls never leaves another's unfindable.
const (
	mintedPerReader = 256
	maxMinted       = 4096
)

// mintedBlob finds a blob of an image minted for a pull of repository
// name.
func (s *Server) mintedBlob(name string, d digest.Digest) (*image.Image, bool) {
	m, ok := s.minted.Get(d, time.Now())
	if !ok || m.repo != name {
		return nil, false
	}
	return m.img, true
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

// volumeFiles reads a repository's volume as its reader may, here as need
// says.
type volumeFiles struct {
	vols Volumes
	repo repository
	need volume.Need
}

type openFile struct {
	*os.File
	size  int64
	close func()
}

func (f openFile) Size() int64  { return f.size }
func (f openFile) Close() error { f.close(); return nil }

func (v volumeFiles) open(path string, format streamer.Format) (streamer.Reading, error) {
	rd, err := v.vols.OpenVolume(v.repo.reader, v.repo.ref, path, format, v.need)
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
// volume is gone for the namespace reading it, or, as RemoteTag, its
// remote layer names another version of it (manifest reads the image's
// root from the runtime). The runtime can then no longer run it, or would
// run what was destroyed, so the caller deletes it. A repository that is
// not this registry's form is not stale.
func (s *Server) Stale(ctx context.Context, reference string, target digest.Digest, manifest func() ([]byte, error)) (bool, error) {
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
	remote := tag == RemoteTag && s.opts.Grants != nil
	need := volume.NeedWhole
	if remote {
		need = volume.NeedTree // a container may run on it while it fills
	}
	version, err := s.vols.Version(repo.reader, repo.ref, need)
	if errors.Is(err, streamer.ErrNotHeld) {
		return true, nil
	} else if err != nil {
		return false, err
	}
	if !remote {
		return false, nil
	}
	raw, err := manifest()
	if err != nil {
		return false, err
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		return false, fmt.Errorf("%s: its manifest %s: %w", reference, target, err)
	}
	for _, l := range m.Layers {
		if value, ok := l.Annotations[image.RemoteLayerAnnotation]; ok {
			layer, _, err := image.ParseRemoteLayer(value)
			return err != nil || layer.Reader != repo.reader || layer.Version != version, nil
		}
	}
	// An image of another format is the same as any tag's.
	img, _, err := s.image(ctx, repo, name, false)
	var ae apiError
	if errors.As(err, &ae) && ae.status == http.StatusNotFound {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	return img.Root.Digest != target, nil
}
