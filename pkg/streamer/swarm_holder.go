package streamer

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	peerv1 "github.com/concourse/cowvol/api/peer/v1"
	"github.com/concourse/cowvol/internal/peerid"
	"github.com/concourse/cowvol/pkg/volume"
)

// swarm_holder.go: the swarm's holder half (who joins, and the relay a
// member serves the next from its spool). The member's half, how a pull
// joins a swarm and checks a relay against the holder, is in
// pkg/pull/swarm_member.go.
//
// A swarm is the pullers of one stream of one layer (whole, its stub tree
// or its data, in one encoding) at about the same time, chained: the
// holder sends the stream to the first, and each member sends what arrives
// to the member after it (the next to join) as it arrives, from its Spool.
// The holder's link carries the stream once, and each member's link once
// each way, however many pull it; every member checks what arrived against
// the digest of the holder's own stream (GetSwarmDigest).
//
// A swarm takes new members while its first stream runs, and for at most
// swarmJoinWindow after the last joined; its digest is answered for
// swarmKeep after. Once the first stream has ended, the chain's members are
// finishing or gone (and a plugin restarted at the same address knows none
// of its old copies): a later puller starts a new swarm rather than chain
// to them.
const (
	swarmJoinWindow = 2 * time.Minute
	swarmKeep       = 10 * time.Minute
)

// swarmKey is what a swarm's members all pull: one stream of one layer.
type swarmKey struct {
	ref volume.Ref
	enc Encoding
	// stream says what the stream holds besides (whole, stubs, data;
	// inlining; the files first).
	stream string
}

// swarmKey is the swarm a request's stream belongs in.
func (p pullRequest) swarmKey() swarmKey {
	h := sha256.New()
	for _, f := range p.first {
		h.Write([]byte(f))
		h.Write([]byte{0})
	}
	return swarmKey{ref: p.ref, enc: p.enc, stream: fmt.Sprintf("%d/%d/%d/%s/%x", p.shape, p.inline.Max, p.inline.Budget, p.inline.Through, h.Sum(nil))}
}

type swarm struct {
	id  string
	key swarmKey
	// The member that joined last: the next to join pulls from it.
	last       member
	joined     time.Time
	sum        *Summary
	failed     bool
	ended      chan struct{} // closed when the first stream ends
	firstTaken bool          // a PullLayer streams the first stream
}

// member is a puller in a swarm: the node it proved to be ("" where peers
// prove none), where it relays, and the token of its copy there.
type member struct{ node, addr, token string }

func (w *swarm) joinable(now time.Time) bool {
	return w.sum == nil && !w.failed && now.Sub(w.joined) < swarmJoinWindow
}

// swarms are the swarms a holder runs.
type swarms struct {
	mu    sync.Mutex
	open  map[swarmKey]*swarm // the one each layer takes members into
	byID  map[string]*swarm
	clock func() time.Time
}

func newSwarms() *swarms {
	return &swarms{open: map[swarmKey]*swarm{}, byID: map[string]*swarm{}, clock: time.Now}
}

// joined is what a join answers: the swarm, and whom to pull from
// (zero: the holder, as the first member).
type joined struct {
	swarm string
	up    member
}

// join adds a puller m to key's open swarm,
// or starts one with it as the first member. A puller whose address joined
// last asks again for a pull of its own (another namespace's, or the layer
// again): it cannot pull from itself, so it starts a new swarm.
func (ss *swarms) join(key swarmKey, m member) joined {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	now := ss.clock()
	// A holder runs for months: what no puller can join or ask about
	// goes.
	for id, w := range ss.byID {
		if !w.joinable(now) && ss.open[w.key] == w {
			delete(ss.open, w.key)
		}
		if now.Sub(w.joined) > swarmKeep {
			delete(ss.byID, id)
		}
	}
	w := ss.open[key]
	if w == nil || !w.joinable(now) || w.last.addr == m.addr {
		w = &swarm{id: newToken(), key: key, last: m, joined: now, ended: make(chan struct{})}
		ss.open[key], ss.byID[w.id] = w, w
		return joined{swarm: w.id}
	}
	up := joined{swarm: w.id, up: w.last}
	w.last, w.joined = m, now
	return up
}

// first says whether a PullLayer that names swarm id streams its first
// member's copy (the one whose digest the others check against), and
// takes it: a swarm has one.
func (ss *swarms) first(id string, key swarmKey) (*swarm, bool) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	w := ss.byID[id]
	if w == nil || w.key != key || w.firstTaken {
		return nil, false
	}
	w.firstTaken = true
	return w, true
}

// ended records how the first stream ended.
func (ss *swarms) ended(w *swarm, sum Summary, err error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if err != nil {
		w.failed = true
	} else {
		w.sum = &sum
	}
	close(w.ended)
}

// ErrSwarmFailed: the swarm's first stream failed; its members' copies
// cannot be checked and are pulled from the holder instead.
var ErrSwarmFailed = errors.New("the swarm's first stream failed")

// digest waits for swarm id's first stream to end and answers its summary.
func (ss *swarms) digest(ctx context.Context, id string, ref volume.Ref) (Summary, error) {
	ss.mu.Lock()
	w := ss.byID[id]
	ss.mu.Unlock()
	if w == nil || w.key.ref != ref {
		return Summary{}, ErrNotHeld
	}
	select {
	case <-w.ended:
	case <-ctx.Done():
		return Summary{}, ctx.Err()
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if w.failed {
		return Summary{}, ErrSwarmFailed
	}
	return *w.sum, nil
}

// newToken is an unguessable name: a swarm's, a relay's copy's.
func newToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// NewRelayToken names a puller's copy of a stream to the relay it joins.
func NewRelayToken() string { return newToken() }

// checkLayer checks that namespace may pull r's layer (via via) here.
func (s *Server) checkLayer(namespace string, r, via volume.Ref) error {
	_, release, err := s.holder.OpenLayer(namespace, r, via)
	if err != nil {
		return err
	}
	release()
	return nil
}

// JoinSwarm adds a puller about to pull a layer's stream to its swarm.
func (s *Server) JoinSwarm(ctx context.Context, req *peerv1.JoinSwarmRequest) (*peerv1.JoinSwarmResponse, error) {
	stream := req.GetStream()
	if stream == nil {
		return nil, status.Error(codes.InvalidArgument, "no stream to join")
	}
	p, err := parsePull(stream)
	if err != nil {
		return nil, err
	}
	switch {
	case len(p.files) > 0 || stream.GetSwarm() != "" || stream.GetRelayToken() != "":
		return nil, status.Error(codes.InvalidArgument, "a swarm's members pull a whole stream: no files, swarm or relay token")
	case req.GetRelayAddress() == "" || len(req.GetRelayAddress()) > 512 || !validToken(req.GetRelayToken()):
		return nil, status.Error(codes.InvalidArgument, "a swarm's member relays: want its address and a token of 32 hex digits")
	}
	if err := s.checkLayer(p.namespace, p.ref, p.via); err != nil {
		return nil, holderError(err)
	}
	j := s.swarms.join(p.swarmKey(), member{node: callerNode(ctx), addr: req.GetRelayAddress(), token: req.GetRelayToken()})
	s.metrics.joined(j)
	klog.V(2).InfoS("A puller joined a layer stream's swarm", "volume", p.ref, "namespace", p.namespace, "stubs", stream.GetStubs(),
		"dataOnly", stream.GetDataOnly(), "swarm", j.swarm, "relay", req.GetRelayAddress(), "upstream", j.up.addr, "upstreamNode", j.up.node)
	return &peerv1.JoinSwarmResponse{Swarm: j.swarm, UpstreamNode: j.up.node, UpstreamAddress: j.up.addr, UpstreamToken: j.up.token}, nil
}

// callerNode is the node a caller proved to be on the peer link ("" where
// peers prove none, or for the controller).
func callerNode(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return ""
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return ""
	}
	id, ok := peerid.FromState(info.State)
	if !ok || id.IsController() {
		return ""
	}
	return id.Node
}

func validToken(t string) bool {
	if len(t) != 32 {
		return false
	}
	_, err := hex.DecodeString(t)
	return err == nil
}

// GetSwarmDigest answers what a swarm's first stream carried.
func (s *Server) GetSwarmDigest(ctx context.Context, req *peerv1.GetSwarmDigestRequest) (*peerv1.Trailer, error) {
	ref, via, err := parseLayerRequest(req.GetNamespace(), req.GetVolume(), req.GetVia())
	if err != nil {
		return nil, err
	}
	if err := s.checkLayer(req.GetNamespace(), ref, via); err != nil {
		return nil, holderError(err)
	}
	sum, err := s.swarms.digest(ctx, req.GetSwarm(), ref)
	if errors.Is(err, ErrSwarmFailed) {
		return nil, status.Error(codes.Aborted, err.Error())
	}
	if err != nil {
		return nil, holderError(err)
	}
	return sum.trailer(), nil
}

// relay serves a puller's copy of a stream it is pulling to the next
// member of its swarm: from the start, as it grows, then the trailer.
func (s *Server) relay(req *peerv1.PullLayerRequest, p pullRequest, stream grpc.ServerStreamingServer[peerv1.PullLayerChunk]) error {
	if req.GetSwarm() != "" {
		return status.Error(codes.InvalidArgument, "a relay's stream names no swarm")
	}
	ref, enc := p.ref, p.enc
	sp, err := s.holder.Relay(p.namespace, ref, p.via, req.GetRelayToken())
	if err != nil {
		return holderError(err)
	}
	if sp.Encoding() != enc {
		return status.Errorf(codes.InvalidArgument, "the relayed stream is encoded %s, not %s", sp.Encoding(), enc)
	}
	r, err := sp.Take()
	if err != nil {
		return status.Error(codes.Unavailable, err.Error())
	}
	defer r.Close()
	start := time.Now()
	w := &chunkWriter{stream: stream}
	buf := make([]byte, maxChunkData)
	for {
		n, sum, err := r.Next(stream.Context(), buf)
		if n > 0 {
			if werr := w.send(buf[:n]); werr != nil {
				err = werr
			}
		}
		switch {
		case errors.Is(err, io.EOF):
			s.metrics.relayed(enc, w.sent, nil)
			klog.V(2).InfoS("Relayed a layer to the next puller of its swarm", "volume", ref, "namespace", req.GetNamespace(),
				"wireBytes", w.sent, "duration", time.Since(start))
			return stream.Send(trailerChunk(*sum))
		case err != nil:
			s.metrics.relayed(enc, w.sent, err)
			return status.Errorf(codes.Unavailable, "relaying %s: %v", ref, err)
		}
	}
}
