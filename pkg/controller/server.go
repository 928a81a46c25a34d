package controller

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
)

// maxLookup bounds a lookup or placement batch.
const maxLookup = 1000

// Register serves the view's Registry (for nodes) and Cache (for
// schedulers) on srv.
func Register(srv *grpc.Server, v *View) {
	controllerv1.RegisterRegistryServer(srv, &registryServer{view: v})
	controllerv1.RegisterCacheServer(srv, &cacheServer{view: v})
}

func code(err error) error {
	switch {
	case errors.Is(err, ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, ErrUnknownNode):
		return status.Error(codes.NotFound, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

type registryServer struct {
	controllerv1.UnimplementedRegistryServer
	view *View
}

func (s *registryServer) Report(_ context.Context, req *controllerv1.ReportRequest) (*controllerv1.ReportResponse, error) {
	resp, err := s.view.Report(req, time.Now())
	if err != nil {
		return nil, code(err)
	}
	if req.GetFull() {
		klog.V(2).InfoS("A node reported its whole inventory", "node", req.GetNodeId(), "store", req.GetStoreId(),
			"volumes", len(req.GetUpserts()), "revision", req.GetRevision())
	}
	return resp, nil
}

type cacheServer struct {
	controllerv1.UnimplementedCacheServer
	view *View
}

func (s *cacheServer) LookupVolumes(_ context.Context, req *controllerv1.LookupVolumesRequest) (*controllerv1.LookupVolumesResponse, error) {
	if len(req.GetRefs()) > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d volumes in one lookup: at most %d", len(req.GetRefs()), maxLookup)
	}
	locs, err := s.view.Lookup(req.GetRefs(), time.Now())
	if err != nil {
		return nil, code(err)
	}
	return &controllerv1.LookupVolumesResponse{Volumes: locs}, nil
}

func (s *cacheServer) Place(_ context.Context, req *controllerv1.PlaceRequest) (*controllerv1.PlaceResponse, error) {
	if len(req.GetInputs()) > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d inputs: at most %d", len(req.GetInputs()), maxLookup)
	}
	nodes, err := s.view.Place(req.GetInputs(), time.Now())
	if err != nil {
		return nil, code(err)
	}
	return &controllerv1.PlaceResponse{Nodes: nodes}, nil
}

func (s *cacheServer) ListNodes(context.Context, *controllerv1.ListNodesRequest) (*controllerv1.ListNodesResponse, error) {
	return &controllerv1.ListNodesResponse{Nodes: s.view.Nodes(time.Now())}, nil
}

func (s *cacheServer) DestroyVolumes(_ context.Context, req *controllerv1.DestroyVolumesRequest) (*controllerv1.DestroyVolumesResponse, error) {
	if len(req.GetRefs()) > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d volumes in one batch: at most %d", len(req.GetRefs()), maxLookup)
	}
	out, err := s.view.Destroy(req.GetRefs())
	if err != nil {
		return nil, code(err)
	}
	klog.V(2).InfoS("Destroying volumes on the nodes holding them", "volumes", len(out))
	return &controllerv1.DestroyVolumesResponse{Volumes: out}, nil
}

func (s *cacheServer) PinVolumes(_ context.Context, req *controllerv1.PinVolumesRequest) (*controllerv1.PinVolumesResponse, error) {
	if len(req.GetRefs()) > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d volumes in one batch: at most %d", len(req.GetRefs()), maxLookup)
	}
	if u := req.GetUntil(); u != nil && u.CheckValid() != nil {
		return nil, status.Errorf(codes.InvalidArgument, "until: %v", u.CheckValid())
	}
	out, err := s.view.Pin(req.GetRefs(), req.GetUnpin(), req.GetUntil())
	if err != nil {
		return nil, code(err)
	}
	return &controllerv1.PinVolumesResponse{Volumes: out}, nil
}

func (s *cacheServer) SetNodeLifecycle(_ context.Context, req *controllerv1.SetNodeLifecycleRequest) (*controllerv1.NodeStatus, error) {
	st, err := s.view.SetLifecycle(req.GetNodeId(), req.GetAction(), time.Now())
	if err != nil {
		return nil, code(err)
	}
	klog.InfoS("Changed a node's lifecycle", "node", req.GetNodeId(), "action", req.GetAction(), "state", st.State)
	return st, nil
}
