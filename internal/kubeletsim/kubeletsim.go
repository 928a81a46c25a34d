// Package kubeletsim plays the kubelet's side of an inline CSI volume for
// tests, benches and the demo: the pod identities the API server makes,
// the volume IDs and target paths the kubelet derives, and the
// NodePublishVolume and NodeUnpublishVolume calls it makes with the pod
// info of podInfoOnMount. It knows the CSI wire and pkg/volume only; the
// driver it drives is whoever answers those calls.
package kubeletsim

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/concourse/cowvol/pkg/volume"
)

// InlineVolume describes an inline volume the way the kubelet hands it over.
type InlineVolume struct {
	VolumeID, Target string
	Attributes       map[string]string
	ReadOnly         bool
	Pod              volume.Pod
}

// NewPod is a pod identity with a fresh UID, as the API server makes one.
func NewPod(namespace, name string) volume.Pod {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6], b[8] = b[6]&0x0f|0x40, b[8]&0x3f|0x80
	uid := fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
	return volume.Pod{Namespace: namespace, Name: name, UID: uid}
}

// NewInlineVolume is the inline volume named name of pod, with the volume ID
// and target path the kubelet gives it under kubeletDir.
func NewInlineVolume(kubeletDir string, pod volume.Pod, name string, attrs map[string]string) InlineVolume {
	sum := sha256.Sum256([]byte(pod.UID + "/" + name))
	return InlineVolume{
		VolumeID:   "csi-" + hex.EncodeToString(sum[:]),
		Target:     filepath.Join(kubeletDir, "pods", pod.UID, "volumes", "kubernetes.io~csi", name, "mount"),
		Attributes: attrs,
		Pod:        pod,
	}
}

// PublishRequest is the NodePublishVolume call the kubelet makes for v, with
// the pod info keys of podInfoOnMount.
func (v InlineVolume) PublishRequest() *csi.NodePublishVolumeRequest {
	ctx := maps.Clone(v.Attributes)
	if ctx == nil {
		ctx = map[string]string{}
	}
	ctx[volume.KeyEphemeral] = "true"
	ctx[volume.KeyPodNamespace] = v.Pod.Namespace
	ctx[volume.KeyPodName] = v.Pod.Name
	ctx[volume.KeyPodUID] = v.Pod.UID
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
