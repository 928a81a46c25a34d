package controller

import (
	"context"
	"errors"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// PeerDialer reaches a node's peer API (its --peer-address), as a peer:
// the controller's peer certificate, the node's checked.
type PeerDialer = streamer.Dialer

// ReadVolume forwards a read to a node holding the volume ready: the first
// that answers, in the order lookups give them.
func (s *cacheServer) ReadVolume(req *controllerv1.ReadVolumeRequest, stream grpc.ServerStreamingServer[controllerv1.DataChunk]) error {
	ctx := stream.Context()
	if s.dial == nil {
		return status.Error(codes.Unimplemented, "this controller reaches no node's data: give it the peer TLS flags")
	}
	ref, err := refFromWire(req.GetRef())
	if err != nil {
		return code(err)
	}
	format, err := streamer.ParseFormat(req.GetFormat())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	enc, err := streamer.ParseDataEncoding(req.GetEncoding())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if err := streamer.CheckPath(req.GetPath()); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	locs, err := s.lookup(ctx, []*controllerv1.VolumeRef{req.GetRef()}, 0)
	if err != nil {
		return err
	}
	loc := locs[0]
	if len(loc.GetNodes()) == 0 {
		return status.Errorf(codes.NotFound, "volume %s is not held ready by any live node, or is not yours to read", ref)
	}
	var errs []error
	for i, node := range loc.GetNodes() {
		addr := loc.GetPeerAddresses()[i]
		if addr == "" {
			continue
		}
		sent := false
		err := s.readFrom(ctx, node, addr, ref, req.GetPath(), format, enc, func(data []byte, total int64) error {
			msg := &controllerv1.DataChunk{Data: data}
			if !sent {
				msg.TotalBytes, msg.NodeId, sent = total, node, true
			}
			return stream.Send(msg)
		})
		if err == nil {
			klog.V(2).InfoS("Served a volume read", "volume", ref, "path", req.GetPath(), "format", format, "node", node,
				"user", CallerFrom(ctx).User)
			return nil
		}
		if sent || !failover(err) {
			return err
		}
		klog.V(2).InfoS("A holder could not serve a read; trying the next", "volume", ref, "node", node, "err", err)
		errs = append(errs, err)
	}
	if len(errs) > 0 && allNotFound(errs) {
		return errs[0] // not there on any node: the path is missing
	}
	return status.Errorf(codes.Unavailable, "no node holding %s could serve it: %v", ref, errors.Join(errs...))
}

func allNotFound(errs []error) bool {
	for _, err := range errs {
		if status.Code(err) != codes.NotFound {
			return false
		}
	}
	return true
}

// failover says another holder may do better: this one could not be
// reached, or no longer holds the volume.
func failover(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.NotFound, codes.DeadlineExceeded:
		return true
	}
	return false
}

func (s *cacheServer) readFrom(ctx context.Context, node, addr string, ref volume.Ref, path string, format streamer.Format,
	enc streamer.Encoding, chunk func([]byte, int64) error) error {
	client, conn, err := s.dial(node, addr)
	if err != nil {
		return status.Errorf(codes.Unavailable, "reaching %s: %v", addr, err)
	}
	defer conn.Close()
	// The controller checked the caller; the node checks the namespace
	// the controller names, the volume's own.
	_, err = client.ReadVolume(ctx, ref.Namespace, ref, path, format, enc, chunk)
	return err
}

// WriteVolume forwards an upload to a node: the one asked for, or the
// running node with the most room.
func (s *cacheServer) WriteVolume(stream grpc.ClientStreamingServer[controllerv1.WriteVolumeRequest, controllerv1.VolumeLocation]) error {
	ctx := stream.Context()
	if s.dial == nil {
		return status.Error(codes.Unimplemented, "this controller reaches no node's data: give it the peer TLS flags")
	}
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	nv := first.GetVolume()
	if nv == nil {
		return status.Error(codes.InvalidArgument, "the first message must say what volume to make")
	}
	ref, err := refFromWire(nv.GetRef())
	if err != nil {
		return code(err)
	}
	if err := need(ctx, "create", ResourceVolumes, ref.Namespace, "upload volumes"); err != nil {
		return err
	}
	layer := streamer.Layer{Ref: ref, Scope: volume.ScopeNamespace, Properties: nv.GetProperties(), TTL: nv.GetTtl().AsDuration()}
	if nv.GetScope() != "" {
		if layer.Scope, err = volume.ParseScope(nv.GetScope()); err != nil {
			return status.Error(codes.InvalidArgument, err.Error())
		}
	}
	if err := layer.Validate(); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	for k, v := range layer.Properties { // an uploader is not cowvol
		if err := volume.ValidateUserProperty(k, v); err != nil {
			return status.Error(codes.InvalidArgument, err.Error())
		}
	}
	enc, err := streamer.ParseDataEncoding(nv.GetEncoding())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if loc := s.view.Lookup([]volume.Ref{ref}, 0, time.Now())[0]; loc.Found {
		return status.Errorf(codes.AlreadyExists, "volume %s exists (%s)", ref, loc.State)
	}
	node, addr, err := s.uploadNode(nv.GetNodeId())
	if err != nil {
		return err
	}
	client, conn, err := s.dial(node, addr)
	if err != nil {
		return status.Errorf(codes.Unavailable, "reaching node %s: %v", node, err)
	}
	defer conn.Close()
	start := time.Now()
	r := streamer.NewUploadReader(stream.Recv, func(m *controllerv1.WriteVolumeRequest) bool { return m.GetVolume() != nil })
	if err := client.WriteVolume(ctx, layer, enc, r); err != nil {
		if rerr := r.Failed(); rerr != nil {
			return rerr
		}
		return err
	}
	klog.InfoS("Uploaded a volume", "volume", ref, "node", node, "bytes", r.N, "user", CallerFrom(ctx).User,
		"duration", time.Since(start))
	return stream.SendAndClose(toWireLocation(s.awaitReport(ctx, ref, node, layer)))
}

// reportWait bounds how long an upload's answer waits for the node's
// report of the new volume.
const reportWait = 10 * time.Second

// awaitReport answers an upload once the node has reported the volume, so
// that the uploader's next lookup or read finds it; a node slow to report
// gets the answer built from what the upload made.
func (s *cacheServer) awaitReport(ctx context.Context, ref volume.Ref, node string, l streamer.Layer) fleet.Location {
	deadline := time.Now().Add(reportWait)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if loc := s.view.Lookup([]volume.Ref{ref}, 0, time.Now())[0]; slices.Contains(loc.Nodes, node) {
			return loc
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fleet.Location{Ref: ref, Found: true, State: volume.StateReady, SizeBytes: -1,
		Scope: l.Scope, Properties: l.Properties, Nodes: []string{node}, NodeCount: 1, PeerAddresses: []string{s.view.PeerAddress(node)}}
}

// uploadNode is where an upload goes: the node asked for, if it takes
// uploads, or the placement's first node with a peer address.
func (s *cacheServer) uploadNode(asked string) (node, addr string, err error) {
	for _, p := range s.view.Place(nil, nil, 0, time.Now()) {
		if asked != "" && p.NodeID != asked {
			continue
		}
		if addr := s.view.PeerAddress(p.NodeID); addr != "" {
			return p.NodeID, addr, nil
		}
	}
	if asked != "" {
		return "", "", status.Errorf(codes.FailedPrecondition, "node %s takes no uploads: it is not running, is full, or serves no peers", asked)
	}
	return "", "", status.Error(codes.Unavailable, "no running node with room serves uploads (--peer-address)")
}
