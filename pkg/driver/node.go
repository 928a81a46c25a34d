package driver

import (
	"context"
	"errors"
	"syscall"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/pull"
	"github.com/concourse/cowvol/pkg/target"
	"github.com/concourse/cowvol/pkg/volume"
)

// nodeService is the CSI Node service: it validates each call, hands it to
// the node engine, and maps the engine's answer to a gRPC code.
type nodeService struct {
	csi.UnimplementedNodeServer
	nodeID string
	engine *node.Engine
	gate   PublishGate
}

func (n *nodeService) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	// Only the node: the kubelet makes each segment a Node label it will
	// never change, and refuses the registration of a driver that reports
	// another value. The store's ID changes with a wiped state dir (the
	// node API, the controller and the start-up log tell it): as a
	// segment it kept a node that came back with a new store from ever
	// registering again.
	return &csi.NodeGetInfoResponse{
		NodeId:             n.nodeID,
		AccessibleTopology: &csi.Topology{Segments: map[string]string{TopologyKey: n.nodeID}},
	}, nil
}

func (n *nodeService) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{
		Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{
			Type: csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		}},
	}}}, nil
}

// parseTarget checks a target path: absolute, clean, and of the kubelet's
// inline-volume layout.
func (n *nodeService) parseTarget(p string) (target.Path, error) {
	if err := validatePath("target path", p); err != nil {
		return target.Path{}, err
	}
	tp, err := n.engine.Layout().Parse(p)
	if err != nil {
		return tp, invalid("%v", err)
	}
	return tp, nil
}

func (n *nodeService) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	tp, err := n.parseTarget(req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	capReadOnly, err := validateCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	if problem := n.gate.Refusal(); problem != "" {
		return nil, status.Errorf(codes.FailedPrecondition, "refusing to publish: %s", problem)
	}
	vr, err := parseVolumeContext(req.GetVolumeContext())
	if err != nil {
		return nil, err
	}
	if tp.PodUID != vr.Pod.UID {
		return nil, invalid("target path %s is not a volume of pod %s", volume.Quote(tp.Full), vr.Pod.UID)
	}
	vr.ReadOnly = req.GetReadonly() || capReadOnly
	if vr.ReadOnly && vr.Capture != "" {
		return nil, invalid("a read-only volume cannot be captured: drop capture or readOnly")
	}
	err = n.engine.Publish(node.PublishRequest{
		VolumeID: req.GetVolumeId(), Target: tp, Source: vr.Source, Capture: vr.Capture, Scope: vr.Scope,
		Properties: vr.Properties, ReadOnly: vr.ReadOnly, Pod: vr.Pod, SizeLimit: vr.SizeLimit, TTL: vr.TTL,
		Copies: vr.Copies, ReadProfile: vr.ReadProfile, OwnedByController: vr.OwnedByController, Cache: vr.Cache,
	})
	if err != nil {
		return nil, engineError(err)
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (n *nodeService) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	tp, err := n.parseTarget(req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	if err := n.engine.Unpublish(req.GetVolumeId(), tp); err != nil {
		return nil, engineError(err)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (n *nodeService) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	if err := validateVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if req.GetVolumePath() == "" {
		return nil, invalid("volume path is required")
	}
	u, err := n.engine.Stats(req.GetVolumeId(), req.GetVolumePath())
	if err != nil {
		return nil, engineError(err)
	}
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: u.TotalBytes, Available: u.AvailableBytes, Used: u.UsedBytes},
		{Unit: csi.VolumeUsage_INODES, Total: u.TotalInodes, Available: u.AvailableInodes, Used: u.UsedInodes},
	}}, nil
}

// engineError maps the engine's answers (its own, the store's, the
// target's and the kernel's) to gRPC codes.
func engineError(err error) error {
	code := codes.Internal
	switch {
	case errors.Is(err, cache.ErrNotFound), errors.Is(err, node.ErrElsewhere):
		code = codes.NotFound
	case errors.Is(err, cache.ErrNotReady), errors.Is(err, cache.ErrBackoff), errors.Is(err, node.ErrOutOfService),
		errors.Is(err, pull.ErrPulling), errors.Is(err, pull.ErrPullFailed), errors.Is(err, node.ErrPodUnknown):
		code = codes.Unavailable // retryable: the capture or pull will finish, the backoff end
	case errors.Is(err, cache.ErrExists), errors.Is(err, node.ErrOtherAttributes):
		code = codes.AlreadyExists
	case errors.Is(err, node.ErrBusy):
		code = codes.Aborted
	case errors.Is(err, node.ErrLimitTooLarge), errors.Is(err, node.ErrTooManyCopies):
		code = codes.InvalidArgument
	case errors.Is(err, cache.ErrUnusable), errors.Is(err, cache.ErrInUse),
		errors.Is(err, cache.ErrHasChildren), errors.Is(err, cache.ErrWrongViewState),
		errors.Is(err, target.ErrUnsafe), errors.Is(err, target.ErrGone),
		errors.Is(err, node.ErrLimitsOff), errors.Is(err, node.ErrNotCowvols), errors.Is(err, overlay.ErrNotIdmappable),
		errors.Is(err, node.ErrNoOwner):
		code = codes.FailedPrecondition
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT), errors.Is(err, node.ErrNodeFull), errors.Is(err, node.ErrCopiesSpent):
		code = codes.ResourceExhausted
	}
	return status.Error(code, err.Error())
}
