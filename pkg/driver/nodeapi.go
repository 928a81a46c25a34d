package driver

import (
	"context"
	"encoding/base64"
	"errors"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/volume"
)

// nodeAPIService serves the node API (api/node/v1): it validates each call,
// hands it to the node engine and maps the answer, as the CSI Node service
// does for the kubelet.
type nodeAPIService struct {
	nodev1.UnimplementedNodeAPIServer
	engine *node.Engine
}

// Listing pages: the default and the most a caller may ask for.
const (
	defaultPageSize = 500
	maxPageSize     = 5000
	maxBatch        = 1000
)

func parseRef(r *nodev1.VolumeRef) (volume.Ref, error) {
	ref := volume.Ref{Namespace: r.GetNamespace(), Handle: r.GetHandle()}
	if err := ref.Validate(); err != nil {
		return ref, invalid("volume: %v", err)
	}
	return ref, nil
}

func toRef(r volume.Ref) *nodev1.VolumeRef {
	if r.IsZero() {
		return nil
	}
	return &nodev1.VolumeRef{Namespace: r.Namespace, Handle: r.Handle}
}

func toVolume(v node.VolumeInfo) *nodev1.Volume {
	out := &nodev1.Volume{
		Ref: toRef(v.Ref()), State: string(v.State), SizeBytes: v.SizeBytes, Inodes: v.Inodes,
		Parent: toRef(v.Parent), Base: toRef(v.Base), Scope: string(v.Scope), Properties: v.Properties,
		CreatedAt: timestamppb.New(v.CreatedAt), LastUsed: timestamppb.New(v.LastUsed),
		Pinned: v.Pin.Pinned, HoldingStepVolumes: v.Holders.Views, HoldingImages: v.Holders.Images, Synced: v.Synced,
		HoldingStreams: int32(v.Holders.Streams), HoldingFills: int32(v.Holders.Fillers),
	}
	if !v.Pin.Until.IsZero() {
		out.PinnedUntil = timestamppb.New(v.Pin.Until)
	}
	if v.TTL > 0 {
		out.Ttl = durationpb.New(v.TTL)
	}
	for _, c := range v.Holders.Children {
		out.HoldingChildren = append(out.HoldingChildren, toRef(c))
	}
	return out
}

func (s *nodeAPIService) GetNode(context.Context, *nodev1.GetNodeRequest) (*nodev1.Node, error) {
	i, err := s.engine.Info()
	if err != nil {
		return nil, engineError(err)
	}
	return &nodev1.Node{
		NodeId: i.NodeID, StoreId: i.StoreID, Backend: i.Backend, SizeLimits: i.SizeLimits,
		BytesTotal: i.BytesTotal, BytesFree: i.BytesFree, InodesTotal: i.InodesTotal, InodesFree: i.InodesFree,
		UsedPercent: int32(i.UsedPercent), HighWatermark: int32(i.Watermarks.High), LowWatermark: int32(i.Watermarks.Low),
		OverHighWatermark: i.OverHighWatermark, BytesHeldForChildren: i.BytesHeldForChildren,
		Revision: i.Revision, Volumes: int32(i.Volumes), CapturesRefused: i.CapturesRefused,
		PullMode: string(i.PullMode), PullModeReason: i.PullModeWhy,
	}, nil
}

func (s *nodeAPIService) ListVolumes(_ context.Context, req *nodev1.ListVolumesRequest) (*nodev1.ListVolumesResponse, error) {
	q := node.Query{Namespace: req.GetNamespace(), Selector: req.GetSelector(), Limit: int(req.GetPageSize()),
		IncludeDestroyed: req.GetIncludeDestroyed()}
	if q.Namespace != "" {
		if err := volume.ValidateNamespace(q.Namespace); err != nil {
			return nil, invalid("%v", err)
		}
	}
	switch {
	case q.Limit < 0:
		return nil, invalid("page size %d is negative", q.Limit)
	case q.Limit == 0:
		q.Limit = defaultPageSize
	case q.Limit > maxPageSize:
		q.Limit = maxPageSize
	}
	if tok := req.GetPageToken(); tok != "" {
		after, err := base64.RawURLEncoding.DecodeString(tok)
		if err != nil {
			return nil, invalid("page token %s is not one this API handed out", volume.Quote(tok))
		}
		q.After = string(after)
	}
	vols, next, rev, err := s.engine.Volumes(q)
	if errors.Is(err, node.ErrBadPageToken) {
		return nil, invalid("%v", err)
	}
	if err != nil {
		return nil, engineError(err)
	}
	resp := &nodev1.ListVolumesResponse{Revision: rev}
	if next != "" {
		resp.NextPageToken = base64.RawURLEncoding.EncodeToString([]byte(next))
	}
	for _, v := range vols {
		resp.Volumes = append(resp.Volumes, toVolume(v))
	}
	return resp, nil
}

func (s *nodeAPIService) GetVolume(_ context.Context, req *nodev1.GetVolumeRequest) (*nodev1.Volume, error) {
	r, err := parseRef(req.GetRef())
	if err != nil {
		return nil, err
	}
	v, err := s.engine.Volume(r)
	if err != nil {
		return nil, engineError(err)
	}
	return toVolume(v), nil
}

func (s *nodeAPIService) DestroyVolumes(_ context.Context, req *nodev1.DestroyVolumesRequest) (*nodev1.DestroyVolumesResponse, error) {
	if len(req.GetRefs()) > maxBatch {
		return nil, invalid("%d volumes in one batch: at most %d", len(req.GetRefs()), maxBatch)
	}
	refs := make([]volume.Ref, len(req.GetRefs()))
	for i, r := range req.GetRefs() {
		var err error
		if refs[i], err = parseRef(r); err != nil {
			return nil, err
		}
	}
	resp := &nodev1.DestroyVolumesResponse{}
	for _, r := range refs {
		res := &nodev1.DestroyResult{Ref: toRef(r)}
		if err := s.engine.Destroy(r); err != nil {
			res.Error = err.Error()
		}
		resp.Results = append(resp.Results, res)
	}
	return resp, nil
}

func (s *nodeAPIService) PinVolume(_ context.Context, req *nodev1.PinVolumeRequest) (*nodev1.Volume, error) {
	r, err := parseRef(req.GetRef())
	if err != nil {
		return nil, err
	}
	var until time.Time // zero: for good
	if req.GetUntil() != nil {
		if err := req.GetUntil().CheckValid(); err != nil {
			return nil, invalid("until: %v", err)
		}
		until = req.GetUntil().AsTime()
	}
	v, err := s.engine.Pin(r, until)
	if err != nil {
		return nil, engineError(err)
	}
	return toVolume(v), nil
}

func (s *nodeAPIService) UnpinVolume(_ context.Context, req *nodev1.UnpinVolumeRequest) (*nodev1.Volume, error) {
	r, err := parseRef(req.GetRef())
	if err != nil {
		return nil, err
	}
	v, err := s.engine.Unpin(r)
	if err != nil {
		return nil, engineError(err)
	}
	return toVolume(v), nil
}
