package driver

import (
	"context"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// controllerService is the CSI controller of a plugin run in controller or
// all mode. Inline volumes never reach it (the kubelet calls the node
// directly), so it creates, deletes and attaches nothing; what it offers is
// the controller's view of the node caches in CSI's terms: every cached
// volume (volume ID "<namespace>/<handle>") with the nodes holding it ready
// as its accessible topology and the nodes where steps mount it as its
// published nodes, and each node's free space.
type controllerService struct {
	csi.UnimplementedControllerServer
	view *fleet.View
}

var controllerCaps = []csi.ControllerServiceCapability_RPC_Type{
	csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
	csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
	csi.ControllerServiceCapability_RPC_GET_CAPACITY,
	csi.ControllerServiceCapability_RPC_GET_VOLUME,
}

func (s *controllerService) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	resp := &csi.ControllerGetCapabilitiesResponse{}
	for _, c := range controllerCaps {
		resp.Capabilities = append(resp.Capabilities, &csi.ControllerServiceCapability{
			Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: c}},
		})
	}
	return resp, nil
}

func topology(nodes []string) []*csi.Topology {
	var out []*csi.Topology
	for _, n := range nodes {
		out = append(out, &csi.Topology{Segments: map[string]string{TopologyKey: n}})
	}
	return out
}

func (s *controllerService) entry(e fleet.Entry) *csi.ListVolumesResponse_Entry {
	return &csi.ListVolumesResponse_Entry{
		Volume: &csi.Volume{VolumeId: e.Ref.String(), CapacityBytes: e.SizeBytes, AccessibleTopology: topology(e.Ready)},
		Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: e.Published},
	}
}

func (s *controllerService) ListVolumes(_ context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	if req.GetMaxEntries() < 0 {
		return nil, invalid("max_entries %d is negative", req.GetMaxEntries())
	}
	after := ""
	if tok := req.GetStartingToken(); tok != "" {
		var err error
		if after, err = fleet.AfterToken(tok); err != nil {
			return nil, status.Errorf(codes.Aborted, "starting_token %s is not one this controller handed out", volume.Quote(tok))
		}
	}
	entries, more := s.view.Volumes(after, int(req.GetMaxEntries()), time.Now())
	resp := &csi.ListVolumesResponse{}
	for _, e := range entries {
		resp.Entries = append(resp.Entries, s.entry(e))
	}
	if more {
		resp.NextToken = fleet.PageToken(entries[len(entries)-1].Ref)
	}
	return resp, nil
}

func (s *controllerService) ControllerGetVolume(_ context.Context, req *csi.ControllerGetVolumeRequest) (*csi.ControllerGetVolumeResponse, error) {
	e, err := s.find(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	le := s.entry(e)
	return &csi.ControllerGetVolumeResponse{Volume: le.Volume,
		Status: &csi.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: e.Published}}, nil
}

// find is the volume with a CSI volume ID, held ready by a live node.
func (s *controllerService) find(id string) (fleet.Entry, error) {
	if id == "" {
		return fleet.Entry{}, invalid("volume ID is required")
	}
	r, err := volume.ParseRef(id)
	if err != nil {
		return fleet.Entry{}, status.Errorf(codes.NotFound, "volume %s does not exist: cowvol's volume IDs are <namespace>/<handle>", volume.Quote(id))
	}
	if e, ok := s.view.Volume(r, time.Now()); ok {
		return e, nil
	}
	return fleet.Entry{}, status.Errorf(codes.NotFound, "volume %s is not held ready by any live node", volume.Quote(id))
}

func (s *controllerService) GetCapacity(_ context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	for _, c := range req.GetVolumeCapabilities() {
		if _, err := validateCapability(c); err != nil {
			return &csi.GetCapacityResponse{}, nil // no room for volumes cowvol cannot make
		}
	}
	node := req.GetAccessibleTopology().GetSegments()[TopologyKey]
	free, ok := s.view.Free(node, time.Now())
	if !ok {
		return &csi.GetCapacityResponse{}, nil // an unknown or stalled node has no room to offer
	}
	return &csi.GetCapacityResponse{AvailableCapacity: free}, nil
}

func (s *controllerService) ValidateVolumeCapabilities(_ context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, invalid("volume ID is required")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, invalid("volume capabilities are required")
	}
	if _, err := s.find(req.GetVolumeId()); err != nil {
		return nil, err
	}
	for _, c := range req.GetVolumeCapabilities() {
		if _, err := validateCapability(c); err != nil {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
		}
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext: req.GetVolumeContext(), VolumeCapabilities: req.GetVolumeCapabilities(), Parameters: req.GetParameters(),
	}}, nil
}
