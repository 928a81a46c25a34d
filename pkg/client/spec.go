package client

import (
	"fmt"
	"maps"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

func inline(name string, attrs map[string]string, readOnly bool) corev1.Volume {
	ro := readOnly
	return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
		Driver: volume.DriverName, ReadOnly: &ro, VolumeAttributes: attrs,
	}}}
}

// sourceAttrs names src as seen from a pod of podNamespace.
func sourceAttrs(src volume.Ref, podNamespace string) map[string]string {
	attrs := map[string]string{volume.AttrSource: src.Handle}
	if src.Namespace != podNamespace {
		attrs[volume.AttrSourceNamespace] = src.Namespace
	}
	return attrs
}

// Input is a step's read-only copy-on-write view of a cached volume, for a
// pod of podNamespace (another namespace's volume must have been shared).
func Input(name string, src volume.Ref, podNamespace string) corev1.Volume {
	return inline(name, sourceAttrs(src, podNamespace), true)
}

// WithReadProfile names the order in which the step reads v's source,
// under name (volume.AttrReadProfile): a node that pulls the source lazily
// records it, and the next lazy pull under that name, in the same
// namespace and on the same node, fetches in that order. Name it after
// what stays the same from build to build (pipeline, job, step, input),
// not after the volume.
func WithReadProfile(v corev1.Volume, name string) corev1.Volume {
	v.CSI.VolumeAttributes = maps.Clone(v.CSI.VolumeAttributes)
	v.CSI.VolumeAttributes[volume.AttrReadProfile] = name
	return v
}

// Output describes a volume a step leaves behind.
type Output struct {
	// Capture is the handle it is captured as, in the pod's namespace.
	Capture string
	// Source, if set, makes it start as that volume's COW view (an output
	// that shares a path with an input).
	Source *volume.Ref
	// Shared lets other namespaces read it (scope: cluster).
	Shared     bool
	Properties map[string]string
	// SizeLimit caps what the step may write (0: the node's default).
	SizeLimit int64
	// TTL destroys it that long after its last use (0: never).
	TTL time.Duration
	// Copies keeps it on that many nodes (0: the node's default).
	Copies int
	// OwnedByController makes it belong to the object that controls the
	// step's pod: the controller destroys it once that object is gone.
	OwnedByController bool
}

// OutputVolume is the inline volume of an output, for a pod of
// podNamespace.
func OutputVolume(name string, o Output, podNamespace string) corev1.Volume {
	attrs := map[string]string{volume.AttrCapture: o.Capture}
	if o.Source != nil {
		maps.Copy(attrs, sourceAttrs(*o.Source, podNamespace))
	}
	if o.Shared {
		attrs[volume.AttrScope] = string(volume.ScopeCluster)
	}
	for k, v := range o.Properties {
		attrs[volume.AttrPropertyPrefix+k] = v
	}
	if o.SizeLimit > 0 {
		attrs[volume.AttrSizeLimit] = resource.NewQuantity(o.SizeLimit, resource.BinarySI).String()
	}
	if o.TTL > 0 {
		attrs[volume.AttrTTL] = o.TTL.String()
	}
	if o.Copies > 0 {
		attrs[volume.AttrCopies] = strconv.Itoa(o.Copies)
	}
	if o.OwnedByController {
		attrs[volume.AttrOwner] = volume.OwnerController
	}
	return inline(name, attrs, false)
}

// TaskCache is a task cache (caches:) for a step: a COW view of the last
// promoted cache (nil on the first run) captured as next. The scheduler
// promotes next only if the step succeeds.
func TaskCache(name string, last *volume.Ref, next string, podNamespace string) corev1.Volume {
	return OutputVolume(name, Output{Capture: next, Source: last}, podNamespace)
}

// PreferredNodes is how many of a placement's best nodes PreferNodes
// weighs (100, 90, ... 10).
const PreferredNodes = 10

// PreferNodes is the node affinity that steers a step to the nodes a
// placement ranked, the best PreferredNodes weighted most first; the
// scheduler may still pick another node (an input then has to be
// fetched). Nodes are matched by name: cowvol's node IDs are Node names.
func PreferNodes(placement []*controllerv1.NodePlacement) *corev1.Affinity {
	if len(placement) == 0 {
		return nil
	}
	var terms []corev1.PreferredSchedulingTerm
	for i, p := range placement[:min(len(placement), PreferredNodes)] {
		weight := int32(100 - 10*i)
		terms = append(terms, corev1.PreferredSchedulingTerm{Weight: weight, Preference: corev1.NodeSelectorTerm{
			MatchFields: []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{p.GetNodeId()}}},
		}})
	}
	return &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{PreferredDuringSchedulingIgnoredDuringExecution: terms}}
}

// Describe says where a placement puts a step, for logs.
func Describe(p *controllerv1.NodePlacement) string {
	return fmt.Sprintf("%s (holds %d bytes of the inputs, lacks %d)", p.GetNodeId(), p.GetInputBytesHeld(), len(p.GetMissing()))
}
