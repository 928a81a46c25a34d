package driver

import (
	"maps"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// InlineVolume describes an inline volume the way the kubelet hands it over.
type InlineVolume struct {
	VolumeID, Target string
	Attributes       map[string]string
	ReadOnly         bool
	PodName, PodUID  string
	PodNamespace     string
}

// PublishRequest is the NodePublishVolume call the kubelet makes for v, with
// the pod info keys of podInfoOnMount.
func (v InlineVolume) PublishRequest() *csi.NodePublishVolumeRequest {
	ctx := maps.Clone(v.Attributes)
	if ctx == nil {
		ctx = map[string]string{}
	}
	ctx[ctxEphemeral] = "true"
	if v.PodNamespace != "" {
		ctx[ctxPodNamespace] = v.PodNamespace
	}
	if v.PodName != "" {
		ctx[ctxPodName] = v.PodName
	}
	if v.PodUID != "" {
		ctx[ctxPodUID] = v.PodUID
	}
	return &csi.NodePublishVolumeRequest{
		VolumeId:   v.VolumeID,
		TargetPath: v.Target,
		Readonly:   v.ReadOnly,
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		},
		VolumeContext: ctx,
	}
}

// UnpublishRequest is the matching NodeUnpublishVolume call.
func (v InlineVolume) UnpublishRequest() *csi.NodeUnpublishVolumeRequest {
	return &csi.NodeUnpublishVolumeRequest{VolumeId: v.VolumeID, TargetPath: v.Target}
}
