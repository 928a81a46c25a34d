package streamer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"k8s.io/klog/v2"

	peerv1 "github.com/concourse/cowvol/api/peer/v1"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
	"github.com/concourse/cowvol/pkg/volume"
)

// Layer is a cached volume as a peer describes it to a puller: what the
// puller records of its copy.
type Layer struct {
	Ref, Parent, Base volume.Ref
	Scope             volume.Scope
	Properties        map[string]string
	TTL               time.Duration
	// SizeBytes is what the layer holds on disk (-1: not measured).
	SizeBytes int64
	// Destroyed: kept on the peer only as the base of what stacks on it.
	Destroyed bool
}

// What a Holder answers with, mapped to gRPC codes here.
var (
	// ErrNotHeld is the one answer for a volume the node lacks and for
	// one the asking namespace may not read: the two must look alike.
	ErrNotHeld = errors.New("not held here")
	// ErrNoPath: the path is not in the volume.
	ErrNoPath = errors.New("no such file or directory in the volume")
	// ErrWrongKind: a file read of a dir, a tar of a file.
	ErrWrongKind = errors.New("not of the kind the format reads")
	// ErrExists: an upload to a handle that is taken.
	ErrExists = errors.New("already exists")
	// ErrRetry: not now (the handle is backing off); retry later.
	ErrRetry = errors.New("not now")
)

// Holder is what a node serves its peers (and the controller) from.
type Holder interface {
	// Chain describes a ready volume namespace may read, and the volumes
	// its layer stacks on, top first.
	Chain(namespace string, r volume.Ref) ([]Layer, error)
	// OpenLayer returns a ready volume's own layer, held (not freed, not
	// pruned) until release is called: a volume namespace may read, or one
	// in the chain of via, which it may read.
	OpenLayer(namespace string, r, via volume.Ref) (l LayerFiles, release func(), err error)
	// OpenVolume opens what a read of a volume namespace may read
	// serves: the path inside it, resolved within it, as the format
	// reads it.
	OpenVolume(namespace string, r volume.Ref, path string, format Format) (Reading, error)
	// Receive makes a new cached volume of l from what fill extracts into
	// an empty dir.
	Receive(l Layer, fill func(dir string) (Summary, error)) error
	// Rotten says that this node's copy of r's layer is not what it was
	// captured with (ErrRotten): it serves it no more, and says so.
	Rotten(r volume.Ref, err error)
	// Relay returns this node's copy of the stream of r's layer it is
	// pulling as a member of a swarm, which it joined under token: for
	// a volume namespace may read, or one in the chain of via, which it
	// may read (ErrNotHeld alike for none and for one it may not read).
	Relay(namespace string, r, via volume.Ref, token string) (*Spool, error)
}

// LayerFiles is a layer as a holder serves it: its dir, and its files'
// sums as they were when it was captured, which go with every file sent
// and which the puller checks its bytes against.
type LayerFiles struct {
	Dir  string
	Sums *filesum.Table
	// Kept is where the layer's stub tree may be kept as a stream
	// (KeepStubs): a pull of its stubs is served from there if it is.
	Kept string
	// Walked (if set) is told that a pull of the layer's stubs walked the
	// layer, nothing kept serving it: the holder may keep it now.
	Walked func()
	// swarm: the stream is a swarm's, its digest SHA-256 (see counter).
	swarm bool
}

// Format is how a volume read serves a path.
type Format string

const (
	// FormatTar: a tar of a dir's tree.
	FormatTar Format = "tar"
	// FormatFile: the bytes of one regular file.
	FormatFile Format = "file"
)

// ParseFormat checks a read format ("" is tar).
func ParseFormat(s string) (Format, error) {
	switch f := Format(s); f {
	case "":
		return FormatTar, nil
	case FormatTar, FormatFile:
		return f, nil
	}
	return "", fmt.Errorf("format %q: want tar or file", s)
}

// Reading is an open volume read: a tree to tar, or a file's bytes.
type Reading struct {
	Dir  string
	File *os.File
	// Size is the file's size, or the tree's on disk (-1: unknown).
	Size  int64
	Close func()
}

// Server serves the peer API (api/peer/v1) from a Holder.
type Server struct {
	peerv1.UnimplementedPeerServer
	holder  Holder
	metrics *Metrics
	limits  Limits
	swarms  *swarms
}

// NewServer serves h's volumes; m counts what is served (nil: nothing);
// lim bounds what an upload may bring.
func NewServer(h Holder, m *Metrics, lim Limits) *Server {
	return &Server{holder: h, metrics: m, limits: lim, swarms: newSwarms()}
}

// Register adds the peer API to a gRPC server.
func (s *Server) Register(g *grpc.Server) { peerv1.RegisterPeerServer(g, s) }

func parseRequest(namespace string, r *peerv1.VolumeRef) (volume.Ref, error) {
	if err := volume.ValidateNamespace(namespace); err != nil {
		return volume.Ref{}, status.Errorf(codes.InvalidArgument, "namespace: %v", err)
	}
	ref := volume.Ref{Namespace: r.GetNamespace(), Handle: r.GetHandle()}
	if err := ref.Validate(); err != nil {
		return volume.Ref{}, status.Errorf(codes.InvalidArgument, "volume: %v", err)
	}
	return ref, nil
}

// trailer is what a stream's trailer says of sum; trailerChunk, the chunk
// that carries it; summaryOf, what a trailer says.
func (s Summary) trailer() *peerv1.Trailer {
	return &peerv1.Trailer{Bytes: s.Bytes, Entries: s.Entries, Digest: s.Digest}
}

func trailerChunk(s Summary) *peerv1.PullLayerChunk {
	return &peerv1.PullLayerChunk{Part: &peerv1.PullLayerChunk_Trailer{Trailer: s.trailer()}}
}

func summaryOf(t *peerv1.Trailer) Summary {
	return Summary{Bytes: t.GetBytes(), Entries: t.GetEntries(), Digest: t.GetDigest()}
}

// Same says whether two summaries are of the same stream: its size,
// entries and digest.
func (s Summary) Same(o Summary) bool {
	return s.Bytes == o.Bytes && s.Entries == o.Entries && s.Digest == o.Digest
}

// parseLayerRequest checks what a request for a layer names: the namespace
// it is for, the volume, and the volume on top it is used via (if any).
func parseLayerRequest(namespace string, r, via *peerv1.VolumeRef) (ref, viaRef volume.Ref, err error) {
	if ref, err = parseRequest(namespace, r); err != nil || via == nil {
		return ref, volume.Ref{}, err
	}
	viaRef, err = parseRequest(namespace, via)
	return ref, viaRef, err
}

func holderError(err error) error {
	code := codes.Internal
	switch {
	case errors.Is(err, ErrNotHeld), errors.Is(err, ErrNoPath):
		code = codes.NotFound
	case errors.Is(err, ErrWrongKind):
		code = codes.FailedPrecondition
	case errors.Is(err, ErrExists):
		code = codes.AlreadyExists
	case errors.Is(err, ErrRetry):
		code = codes.Unavailable
	case errors.Is(err, ErrRefused), errors.Is(err, ErrCorrupt):
		code = codes.InvalidArgument
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		code = codes.ResourceExhausted
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	}
	return status.Error(code, err.Error())
}

func toPeerRef(r volume.Ref) *peerv1.VolumeRef {
	if r.IsZero() {
		return nil
	}
	return &peerv1.VolumeRef{Namespace: r.Namespace, Handle: r.Handle}
}

func fromPeerRef(r *peerv1.VolumeRef) volume.Ref {
	return volume.Ref{Namespace: r.GetNamespace(), Handle: r.GetHandle()}
}

// GetChain describes a volume's chain to a puller.
func (s *Server) GetChain(_ context.Context, req *peerv1.GetChainRequest) (*peerv1.GetChainResponse, error) {
	ref, err := parseRequest(req.GetNamespace(), req.GetVolume())
	if err != nil {
		return nil, err
	}
	layers, err := s.holder.Chain(req.GetNamespace(), ref)
	if err != nil {
		return nil, holderError(err)
	}
	out := &peerv1.GetChainResponse{}
	for _, l := range layers {
		pl := &peerv1.LayerVolume{Ref: toPeerRef(l.Ref), Parent: toPeerRef(l.Parent), Base: toPeerRef(l.Base),
			Scope: string(l.Scope), Properties: l.Properties, SizeBytes: l.SizeBytes, Destroyed: l.Destroyed}
		if l.TTL > 0 {
			pl.Ttl = durationpb.New(l.TTL)
		}
		out.Layers = append(out.Layers, pl)
	}
	return out, nil
}

// pullRequest is a PullLayer's request, checked.
type pullRequest struct {
	namespace string
	ref, via  volume.Ref
	enc       Encoding
	shape     Shape
	inline    Inline
	// files and first as cleaned names.
	files, first []string
}

// parsePull checks a PullLayer's request (or the stream a JoinSwarm names).
func parsePull(req *peerv1.PullLayerRequest) (pullRequest, error) {
	ref, via, err := parseLayerRequest(req.GetNamespace(), req.GetVolume(), req.GetVia())
	if err != nil {
		return pullRequest{}, err
	}
	p := pullRequest{namespace: req.GetNamespace(), ref: ref, via: via, shape: SparseTar}
	if p.enc, err = ParseEncoding(req.GetEncoding()); err != nil {
		return pullRequest{}, status.Error(codes.InvalidArgument, err.Error())
	}
	files := req.GetFiles()
	if len(files) > maxReadahead || (len(files) > 0 && req.GetStubs()) {
		return pullRequest{}, status.Errorf(codes.InvalidArgument, "%d files (at most %d, and not with stubs)", len(files), maxReadahead)
	}
	if err := checkFirst(req.GetFirst(), len(files) > 0 || req.GetStubs()); err != nil {
		return pullRequest{}, err
	}
	p.inline = Inline{Max: req.GetInlineMax(), Budget: req.GetInlineBudget()}
	if err := p.inline.Check(); err != nil {
		return pullRequest{}, status.Error(codes.InvalidArgument, err.Error())
	}
	if through := req.GetInlinedThrough(); through != "" {
		if req.GetStubs() || len(files) > 0 {
			return pullRequest{}, status.Error(codes.InvalidArgument, "inlined_through leaves files out of a stream of the whole layer's data: not with stubs or files")
		}
		if p.inline.Through, err = cleanName(through); err != nil || p.inline.Through == "." {
			return pullRequest{}, status.Errorf(codes.InvalidArgument, "inlined_through %s: want a path below the layer's root", volume.Quote(through))
		}
	}
	if p.files, err = cleanNames(files); err == nil {
		p.first, err = cleanNames(req.GetFirst())
	}
	if err != nil {
		return pullRequest{}, err
	}
	switch {
	case req.GetStubs() && req.GetDataOnly():
		return pullRequest{}, status.Error(codes.InvalidArgument, "data_only fills stubs: not with stubs")
	case req.GetRecords() && !req.GetStubs():
		return pullRequest{}, status.Error(codes.InvalidArgument, "records are a stub tree's form: only with stubs")
	case req.GetRecords():
		p.shape = StubRecords
	case req.GetStubs():
		p.shape = StubTar
	case req.GetDataOnly():
		p.shape = DataTar
	}
	return p, nil
}

// cleanNames cleans the names of files below a layer's root.
func cleanNames(names []string) ([]string, error) {
	out := make([]string, 0, len(names))
	for _, f := range names {
		name, err := cleanName(f)
		if err != nil || name == "." {
			return nil, status.Errorf(codes.InvalidArgument, "file %s: want a path below the layer's root", volume.Quote(f))
		}
		out = append(out, name)
	}
	return out, nil
}

// PullLayer streams a volume's own layer, then its size and digest.
func (s *Server) PullLayer(req *peerv1.PullLayerRequest, stream grpc.ServerStreamingServer[peerv1.PullLayerChunk]) error {
	p, err := parsePull(req)
	if err != nil {
		return err
	}
	if (req.GetRelayToken() != "" || req.GetSwarm() != "") && len(p.files) > 0 {
		return status.Error(codes.InvalidArgument, "a swarm's members pull a whole stream: no files")
	}
	if req.GetRelayToken() != "" {
		return s.relay(req, p, stream)
	}
	var recording *swarm // the swarm whose first stream this is
	if id := req.GetSwarm(); id != "" {
		// Not the first stream (a member asking the holder after its
		// relay failed it names no swarm): streamed as any other.
		recording, _ = s.swarms.first(id, p.swarmKey())
	}
	layer, release, err := s.holder.OpenLayer(p.namespace, p.ref, p.via)
	if err != nil {
		if recording != nil {
			s.swarms.ended(recording, Summary{}, err)
		}
		return holderError(err)
	}
	defer release()
	layer.swarm = req.GetSwarm() != ""
	start := time.Now()
	w := &chunkWriter{stream: stream}
	var sum Summary
	kept := false
	if len(p.files) > 0 {
		if sum, err = PackFiles(stream.Context(), layer, p.files, w, p.enc, p.shape); errors.Is(err, ErrNoPath) || errors.Is(err, ErrWrongKind) {
			return status.Error(codes.InvalidArgument, err.Error()) // the puller asked for what its stubs do not have
		}
	} else {
		sum, kept, err = s.packFirst(stream.Context(), layer, p, w)
	}
	if recording != nil {
		s.swarms.ended(recording, sum, err)
	}
	s.metrics.served(p.enc, w.sent, err)
	if errors.Is(err, ErrRotten) {
		s.holder.Rotten(p.ref, err)
	}
	if err != nil {
		klog.ErrorS(err, "Serving a layer to a peer", "volume", p.ref, "namespace", p.namespace, "sent", w.sent)
		return holderError(err)
	}
	klog.V(2).InfoS("Served a layer to a peer", "volume", p.ref, "namespace", p.namespace, "encoding", p.enc, "stubs", req.GetStubs(),
		"kept", kept, "tarBytes", sum.Bytes, "wireBytes", w.sent, "entries", sum.Entries, "duration", time.Since(start))
	return stream.Send(trailerChunk(sum))
}

// packFirst streams the layer as p asks (PackFirst), a stub tree from
// where it is kept if it is (kept says so).
func (s *Server) packFirst(ctx context.Context, layer LayerFiles, p pullRequest, w io.Writer) (sum Summary, kept bool, err error) {
	if p.shape.stubs() && layer.Kept != "" {
		sum, err = ServeKept(layer.Kept, p.inline, p.shape, w, p.enc, layer.swarm)
		if !errors.Is(err, ErrNotKept) {
			s.metrics.stubTree(true, p.shape)
			return sum, true, err
		}
	}
	if p.shape == StubRecords {
		sum, err = PackRecords(ctx, layer, w, p.enc, p.inline)
	} else {
		sum, err = PackFirst(ctx, layer, p.first, w, p.enc, p.shape, p.inline)
	}
	if p.shape.stubs() {
		s.metrics.stubTree(false, p.shape)
		if layer.Walked != nil {
			layer.Walked()
		}
	}
	return sum, false, err
}

// maxReadahead is the most files one PullLayer of named files sends.
const maxReadahead = 4096

// The most names a PullLayer's first may hold, and their bytes: a read
// order as a node records it (cache.MaxReadOrderFiles and Bytes), with
// room for the names' framing.
const (
	maxFirst      = 50_000
	maxFirstBytes = 1<<20 + maxFirst
)

// checkFirst bounds a PullLayer's first, which only a stream of the whole
// layer's data takes.
func checkFirst(first []string, notWhole bool) error {
	size := 0
	for _, f := range first {
		size += len(f)
	}
	switch {
	case len(first) > 0 && notWhole:
		return status.Error(codes.InvalidArgument, "first orders a stream of the whole layer's data: not with stubs or files")
	case len(first) > maxFirst || size > maxFirstBytes:
		return status.Errorf(codes.InvalidArgument, "first names %d files (%d bytes): at most %d (%d bytes)", len(first), size, maxFirst, maxFirstBytes)
	}
	return nil
}

// ReadLayerFile streams a range of one regular file of a volume's own
// layer, then how many bytes it sent.
func (s *Server) ReadLayerFile(req *peerv1.ReadLayerFileRequest, stream grpc.ServerStreamingServer[peerv1.PullLayerChunk]) error {
	ref, via, err := parseLayerRequest(req.GetNamespace(), req.GetVolume(), req.GetVia())
	if err != nil {
		return err
	}
	rel, err := cleanName(req.GetPath())
	if err != nil || rel == "." || req.GetOffset() < 0 || req.GetLength() < 0 {
		return status.Errorf(codes.InvalidArgument, "path %q, offset %d, length %d: want a file below the layer's root and a range from 0",
			req.GetPath(), req.GetOffset(), req.GetLength())
	}
	layer, release, err := s.holder.OpenLayer(req.GetNamespace(), ref, via)
	if err != nil {
		return holderError(err)
	}
	defer release()
	f, err := openInLayer(layer.Dir, rel)
	if err != nil {
		return holderError(err)
	}
	defer f.Close()
	length := req.GetLength()
	if length == 0 {
		length = math.MaxInt64
	}
	w, c := &chunkWriter{stream: stream}, newCounter(false)
	n, err := io.CopyBuffer(io.MultiWriter(w, c), io.NewSectionReader(f, req.GetOffset(), length), make([]byte, maxChunkData))
	s.metrics.served(Raw, w.sent, err)
	if err != nil {
		return holderError(err)
	}
	sum := c.summary(1)
	return stream.Send(&peerv1.PullLayerChunk{Part: &peerv1.PullLayerChunk_Trailer{Trailer: &peerv1.Trailer{Bytes: n, Entries: 1, Digest: sum.Digest}}})
}

// openInLayer opens the regular file rel below a layer's dir, following
// no symlink on the way.
func openInLayer(dir, rel string) (*os.File, error) {
	root, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	parent, st, err := regularBeneath(root, rel)
	if err != nil {
		return nil, err
	}
	defer unix.Close(parent)
	fd, err := unix.Openat(parent, path.Base(rel), unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", rel, ErrNoPath)
	}
	var got unix.Stat_t
	if err := unix.Fstat(fd, &got); err != nil || got.Dev != st.Dev || got.Ino != st.Ino {
		unix.Close(fd)
		return nil, fmt.Errorf("%s is not a regular file: %w", rel, ErrWrongKind)
	}
	return os.NewFile(uintptr(fd), rel), nil
}

// chunkWriter sends what Pack writes as data chunks (Pack buffers, so each
// write is up to streamBuffer bytes).
type chunkWriter struct {
	stream grpc.ServerStreamingServer[peerv1.PullLayerChunk]
	sent   int64
	// total is told on the first chunk (a read's size, for progress).
	total   int64
	started bool
}

func (w *chunkWriter) Write(p []byte) (int, error) {
	written := 0
	for len(p) > 0 {
		n := min(len(p), maxChunkData)
		if err := w.send(p[:n]); err != nil {
			return written, err
		}
		written += n
		p = p[n:]
	}
	return written, nil
}

func (w *chunkWriter) send(p []byte) error {
	msg := &peerv1.PullLayerChunk{Part: &peerv1.PullLayerChunk_Data{Data: p}}
	if !w.started {
		msg.TotalBytes, w.started = w.total, true
	}
	// SendMsg has encoded the chunk when it returns: p may be reused.
	if err := w.stream.Send(msg); err != nil {
		return err
	}
	w.sent += int64(len(p))
	return nil
}

// maxChunkData is the most data a chunk carries; MaxChunk, the most a
// chunk message takes on the wire (what a client must accept).
const (
	maxChunkData = 1 << 20
	MaxChunk     = maxChunkData + 4<<10
)

// Dialer reaches a node's peer API at address, checking (where peers
// prove their node) that it is node.
type Dialer func(node, address string) (*Client, io.Closer, error)

// Client pulls layers from one peer.
type Client struct {
	api   peerv1.PeerClient
	stall time.Duration
}

// NewClient pulls through conn, a connection to a peer's --peer-address.
// A stream that brings nothing for stall (0: no bound) is broken off with
// ErrStalled: a peer that hangs, or a link that drops every packet, would
// otherwise hold a pull, and the readers waiting for it, until TCP gives
// up (a quarter of an hour).
func NewClient(conn grpc.ClientConnInterface, stall time.Duration) *Client {
	return &Client{api: peerv1.NewPeerClient(conn), stall: stall}
}

// ErrStalled: the peer sent nothing for the client's stall.
var ErrStalled = errors.New("the peer sent nothing")

// recvWithin is recv, which breaks the stream off (through cancel, the
// cancel of its context) if nothing comes within the client's stall.
func recvWithin[M any](c *Client, recv func() (M, error), cancel context.CancelCauseFunc) (M, error) {
	if c.stall <= 0 {
		return recv()
	}
	t := time.AfterFunc(c.stall, func() { cancel(fmt.Errorf("%w for %s", ErrStalled, c.stall)) })
	defer t.Stop()
	return recv()
}

// stalled is err, or the stall that caused it.
func stalled(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); errors.Is(cause, ErrStalled) {
		return cause
	}
	return err
}

// Chain asks the peer for a volume's chain, for a pod of namespace.
func (c *Client) Chain(ctx context.Context, namespace string, r volume.Ref) ([]Layer, error) {
	resp, err := c.api.GetChain(ctx, &peerv1.GetChainRequest{Namespace: namespace, Volume: toPeerRef(r)})
	if err != nil {
		return nil, peerError(err)
	}
	var out []Layer
	for _, l := range resp.GetLayers() {
		layer := layerOf(l)
		if err := layer.Validate(); err != nil {
			return nil, fmt.Errorf("the peer described %s: %w", r, err)
		}
		out = append(out, layer)
	}
	if len(out) == 0 || out[0].Ref != r || out[0].Destroyed {
		return nil, fmt.Errorf("the peer described another chain than %s's", r)
	}
	for i := 1; i < len(out); i++ {
		if out[i-1].Base != out[i].Ref {
			return nil, fmt.Errorf("the peer described a broken chain for %s (%s's base is %s, then comes %s)", r, out[i-1].Ref, out[i-1].Base, out[i].Ref)
		}
	}
	if !out[len(out)-1].Base.IsZero() {
		return nil, fmt.Errorf("the peer described a chain for %s that ends in a diff", r)
	}
	return out, nil
}

// Validate checks what is said of a layer (by a peer, an uploader): it
// becomes metadata where it lands.
func (l Layer) Validate() error {
	for _, r := range []volume.Ref{l.Parent, l.Base} {
		if !r.IsZero() {
			if err := r.Validate(); err != nil {
				return err
			}
		}
	}
	if err := l.Ref.Validate(); err != nil {
		return err
	}
	if _, err := volume.ParseScope(string(l.Scope)); err != nil {
		return err
	}
	if l.TTL < 0 {
		return fmt.Errorf("a negative TTL")
	}
	return volume.ValidateProperties(l.Properties)
}

// ReadableBy says whether pods of namespace may use the layer's volume
// itself, not only through one above it.
func (l Layer) ReadableBy(namespace string) bool { return volume.Readable(l.Ref, l.Scope, namespace) }

// ErrCorrupt: what arrived is not what the peer sent.
var ErrCorrupt = errors.New("the stream arrived corrupt")

// LayerStream is a stream of one volume's own layer that a puller asks a
// holder (or a relay) for: what it holds names its swarm.
type LayerStream struct {
	// Namespace is the pod's, Ref the layer, Via the volume it is pulled
	// for (the top of the chain Ref is in).
	Namespace string
	Ref, Via  volume.Ref
	Encoding  Encoding
	// Shape is SparseTar (the whole layer), StubTar (its tree with the
	// files as stubs, but the small ones Inline's Max and Budget carry
	// whole), StubRecords (the same tree as records) or DataTar (its
	// files' data, First first, leaving out those a stub tree carried:
	// Inline's Max and Through).
	Shape  Shape
	Inline Inline
	First  []string
}

// request is the PullLayer of s (of names only, if any), in sw's swarm.
func (s LayerStream) request(sw Swarmed, names []string) *peerv1.PullLayerRequest {
	req := &peerv1.PullLayerRequest{Namespace: s.Namespace, Volume: toPeerRef(s.Ref), Via: toPeerRef(s.Via), Encoding: string(s.Encoding),
		Stubs: s.Shape.stubs(), Records: s.Shape == StubRecords, DataOnly: s.Shape == DataTar, First: s.First, Files: names, Swarm: sw.Swarm,
		RelayToken: sw.RelayToken}
	switch {
	case s.Shape.stubs():
		req.InlineMax, req.InlineBudget = s.Inline.Max, s.Inline.Budget
	case s.Inline.Through != "":
		req.InlineMax, req.InlinedThrough = s.Inline.Max, s.Inline.Through
	}
	return req
}

// Swarmed is how a member of a stream's swarm pulls it: from the holder as
// the first member (Swarm), or from a relay (RelayToken, the copy the
// member before it makes); each wire chunk also goes to Spool, if any, the
// copy it relays to the member after it. The zero Swarmed is a pull of
// the holder's outside any swarm.
type Swarmed struct {
	Swarm, RelayToken string
	Spool             *Spool
}

// swarmed says a stream is a swarm's: from its holder as its first
// member, or from a relay.
func (sw Swarmed) swarmed() bool { return sw.Swarm != "" || sw.RelayToken != "" }

func (sw Swarmed) tee() func([]byte) {
	if sw.Spool == nil {
		return nil
	}
	return sw.Spool.Append
}

// PullLayer streams a volume's own layer, its files whole (s's shape is
// SparseTar), into dir (an empty dir), and checks the size and digest the
// peer sent after it: a member that pulled from a relay checks them against
// the holder's too (SwarmDigest). progress is told of each wire chunk's
// size.
func (c *Client) PullLayer(ctx context.Context, s LayerStream, sw Swarmed, dir string, lim Limits, progress func(int64)) (Summary, error) {
	return c.pullLayer(ctx, s.request(sw, nil), progress, sw.tee(), func(ctx context.Context, in io.Reader) (Summary, error) {
		lim.Summed, lim.Swarmed = true, sw.swarmed()
		return Unpack(ctx, in, s.Encoding, dir, lim)
	})
}

// PullLayerStubs pulls a layer as PullLayer does, its files as stubs (s's
// shape is StubTar) but the small ones s's Inline asks for, each stub handed
// to stub as it is made (see UnpackStubs).
func (c *Client) PullLayerStubs(ctx context.Context, s LayerStream, sw Swarmed, dir string, lim Limits, progress func(int64),
	stub StubFunc) (Summary, error) {
	return c.pullLayer(ctx, s.request(sw, nil), progress, sw.tee(), func(ctx context.Context, in io.Reader) (Summary, error) {
		lim.Summed, lim.Swarmed = true, sw.swarmed()
		return UnpackStubs(ctx, in, s.Encoding, dir, lim, s.Inline, stub)
	})
}

// PullLayerIndex pulls a layer's stub tree as PullLayerStubs does (s's
// shape is StubRecords, or StubTar), but makes nothing on disk but its
// index: it writes the tree's index into image as it comes (see
// IndexStubs), which the caller mounts, and what aside asks for beside it.
func (c *Client) PullLayerIndex(ctx context.Context, s LayerStream, sw Swarmed, lim Limits, progress func(int64), image *os.File,
	aside IndexAside) (*index.Layout, Summary, error) {
	var layout *index.Layout
	tee := sw.tee()
	if aside.Records != nil {
		tee = aside.Records.tee(s, tee)
	}
	sum, err := c.pullLayer(ctx, s.request(sw, nil), progress, tee, func(ctx context.Context, in io.Reader) (Summary, error) {
		lim.Summed, lim.Swarmed = true, sw.swarmed()
		var err error
		var sum Summary
		layout, sum, err = IndexStubs(ctx, in, s.Encoding, lim, s.Inline, image, aside.Sums)
		return sum, err
	})
	if err != nil {
		return nil, sum, err
	}
	return layout, sum, nil
}

// IndexAside is what an index pull writes aside as its stream arrives, for
// its caller to keep once the pull is checked (either may be nil): the
// stream's records, as received (Records), and the layer's table of sums,
// as its records said them (Sums).
type IndexAside struct {
	Records *ReceivedRecords
	Sums    *filesum.TableWriter
}

// PullLayerFiles streams a volume's own layer's files' data (s's shape is
// DataTar), only the files named if any, and hands each regular file with
// data to file (see Files) instead of extracting the tree: how a lazily
// pulled layer's stubs are filled, at the speed of a pull. A holder that
// knows nothing of DataTar sends the files' metadata and the rest of the
// tree too, which Files skips.
//
// With no names, the files s puts first come first, in that order (see
// PackFirst), and those a stub tree carried (s's Inline) are left out.
func (c *Client) PullLayerFiles(ctx context.Context, s LayerStream, sw Swarmed, names []string, lim Limits,
	file func(name string, size int64, write func(w io.WriterAt) error) error) (Summary, error) {
	return c.pullLayer(ctx, s.request(sw, names), nil, sw.tee(), func(ctx context.Context, in io.Reader) (Summary, error) {
		lim.Swarmed = sw.swarmed()
		return Files(ctx, in, s.Encoding, lim, file)
	})
}

// pullLayer streams a layer to consume and checks what consume read
// against the size and digest the peer sent after it; tee (if any) is
// handed each wire chunk as it arrives.
func (c *Client) pullLayer(ctx context.Context, req *peerv1.PullLayerRequest, progress func(int64), tee func([]byte),
	consume func(ctx context.Context, in io.Reader) (Summary, error)) (Summary, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil) // stops the peer sending if extraction fails
	stream, err := c.api.PullLayer(ctx, req, chunkCall)
	if err != nil {
		return Summary{}, peerError(err)
	}
	var trailer *peerv1.Trailer
	var held *peerv1.PullLayerChunk // the chunk being read: its data is lent
	defer func() {
		if held != nil {
			releaseChunk(held)
		}
	}()
	cr := NewMessageReader(func() ([]byte, error) {
		if held != nil { // read to its end: the reader asks for the next
			releaseChunk(held)
			held = nil
		}
		if trailer != nil {
			return nil, io.EOF
		}
		msg, err := recvWithin(c, stream.Recv, cancel)
		switch {
		case errors.Is(err, io.EOF):
			return nil, io.ErrUnexpectedEOF // no trailer: cut short
		case err != nil:
			return nil, err
		}
		if t := msg.GetTrailer(); t != nil {
			trailer = t
			return nil, io.EOF
		}
		if progress != nil {
			progress(int64(len(msg.GetData())))
		}
		if tee != nil {
			tee(msg.GetData())
		}
		held = msg
		return msg.GetData(), nil
	})
	sum, err := consume(ctx, cr)
	if err != nil {
		if rerr := cr.Failed(); rerr != nil {
			return Summary{}, stalled(ctx, peerError(rerr))
		}
		var errno syscall.Errno
		if errors.Is(err, ErrRefused) || errors.As(err, &errno) || ctx.Err() != nil {
			return Summary{}, err // refused, or failed here (a full disk): not the stream's fault
		}
		return Summary{}, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	// The encoded stream may end before its trailer has been read; data
	// after the archive's end is corruption.
	if n, err := io.Copy(io.Discard, cr); err != nil {
		return Summary{}, peerError(err)
	} else if n > 0 {
		return Summary{}, fmt.Errorf("%w: %d bytes after the archive's end", ErrCorrupt, n)
	}
	if trailer == nil {
		return Summary{}, fmt.Errorf("%w: the peer sent no trailer", ErrCorrupt)
	}
	if sent := summaryOf(trailer); !sent.Same(sum) {
		return Summary{}, fmt.Errorf("%w: the peer sent %d bytes (%d entries, %s), %d arrived (%d entries, %s)",
			ErrCorrupt, sent.Bytes, sent.Entries, sent.Digest, sum.Bytes, sum.Entries, sum.Digest)
	}
	return sum, nil
}

// Upstream is where a swarm's member pulls from: Swarm, and the member
// before it (Address empty: the holder), the node it proved to be to the
// holder (empty where peers prove no node) and its relay token.
type Upstream struct{ Swarm, Node, Address, Token string }

// JoinSwarm asks the holder of a layer to add this puller, about to pull
// stream s and relaying what it pulls at relayAddress under token, to the
// stream's swarm.
func (c *Client) JoinSwarm(ctx context.Context, s LayerStream, relayAddress, token string) (Upstream, error) {
	resp, err := c.api.JoinSwarm(ctx, &peerv1.JoinSwarmRequest{Stream: s.request(Swarmed{}, nil), RelayAddress: relayAddress, RelayToken: token})
	if err != nil {
		return Upstream{}, peerError(err)
	}
	if resp.GetUpstreamAddress() != "" && !validToken(resp.GetUpstreamToken()) {
		return Upstream{}, fmt.Errorf("the holder named a relay with a malformed token")
	}
	return Upstream{Swarm: resp.GetSwarm(), Node: resp.GetUpstreamNode(), Address: resp.GetUpstreamAddress(), Token: resp.GetUpstreamToken()}, nil
}

// SwarmDigest asks the holder of r's layer what its swarm's first stream
// carried, waiting for it to end.
func (c *Client) SwarmDigest(ctx context.Context, namespace string, r, via volume.Ref, swarm string) (Summary, error) {
	t, err := c.api.GetSwarmDigest(ctx, &peerv1.GetSwarmDigestRequest{Namespace: namespace, Volume: toPeerRef(r), Via: toPeerRef(via), Swarm: swarm})
	if err != nil {
		return Summary{}, peerError(err)
	}
	return summaryOf(t), nil
}

// ReadLayerFile writes length bytes (0: to the end) of the file rel of r's
// own layer from offset into w at the same offsets, for a pod of namespace
// that uses r via via, and returns how many arrived.
func (c *Client) ReadLayerFile(ctx context.Context, namespace string, r, via volume.Ref, rel string, offset, length int64, w io.WriterAt) (int64, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stream, err := c.api.ReadLayerFile(ctx, &peerv1.ReadLayerFileRequest{Namespace: namespace, Volume: toPeerRef(r), Via: toPeerRef(via),
		Path: rel, Offset: offset, Length: length}, chunkCall)
	if err != nil {
		return 0, peerError(err)
	}
	var n int64
	got := newCounter(false)
	for {
		msg, err := recvWithin(c, stream.Recv, cancel)
		switch {
		case errors.Is(err, io.EOF):
			return n, fmt.Errorf("%w: %s ended with no trailer after %d bytes", ErrCorrupt, rel, n)
		case err != nil:
			return n, stalled(ctx, peerError(err))
		}
		if t := msg.GetTrailer(); t != nil {
			if sum := got.summary(1); t.GetBytes() != n || t.GetDigest() != sum.Digest {
				return 0, fmt.Errorf("%w: the peer sent %d bytes of %s (%s), %d arrived (%s)", ErrCorrupt, t.GetBytes(), rel, t.GetDigest(), n, sum.Digest)
			}
			return n, nil
		}
		data := msg.GetData()
		if length > 0 && n+int64(len(data)) > length {
			return n, fmt.Errorf("%w: more of %s than asked for", ErrCorrupt, rel)
		}
		if _, err := w.WriteAt(data, offset+n); err != nil {
			return n, err
		}
		_, _ = got.Write(data)
		n += int64(len(data))
		releaseChunk(msg) // w and got keep none of it
	}
}

// peerError keeps a peer's status, for callers that tell NotFound from a
// dead link.
func peerError(err error) error {
	if s, ok := status.FromError(err); ok {
		return fmt.Errorf("peer: %s: %w", s.Message(), &PeerError{Code: s.Code()})
	}
	return err
}

// PeerError is a peer's answer that was not a success.
type PeerError struct{ Code codes.Code }

func (e *PeerError) Error() string { return e.Code.String() }

// NotHeld says the peer does not hold the volume (or will not say it for
// this namespace).
func NotHeld(err error) bool {
	var pe *PeerError
	return errors.As(err, &pe) && pe.Code == codes.NotFound
}

// MessageReader reads a stream of messages' data as one byte stream.
type MessageReader struct {
	next func() ([]byte, error)
	buf  []byte
	err  error
	// N counts the bytes read.
	N int64
}

// NewMessageReader reads what next returns, message by message, until it
// fails (io.EOF: the end).
func NewMessageReader(next func() ([]byte, error)) *MessageReader {
	return &MessageReader{next: next}
}

func (r *MessageReader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		if r.err != nil {
			return 0, r.err
		}
		r.buf, r.err = r.next()
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	r.N += int64(n)
	return n, nil
}

// Failed is what broke the stream: nil while it runs and at a clean end
// (io.EOF), so that a caller tells the stream's failure from the reader's.
func (r *MessageReader) Failed() error {
	if errors.Is(r.err, io.EOF) {
		return nil
	}
	return r.err
}

// NewUploadReader reads an upload's data messages, those after its header,
// as one byte stream; a second header breaks it.
func NewUploadReader[M interface{ GetData() []byte }](recv func() (M, error), isHeader func(M) bool) *MessageReader {
	return NewMessageReader(func() ([]byte, error) {
		msg, err := recv()
		if err == nil && isHeader(msg) {
			err = status.Error(codes.InvalidArgument, "a second header in one upload")
		}
		return msg.GetData(), err
	})
}
