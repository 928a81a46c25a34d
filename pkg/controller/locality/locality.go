// Package locality is the controller's mutating admission webhook for the
// pods no scheduler of cowvol's places (a CI engine's, such as Argo
// Workflows'): a pod that names cowvol source volumes and is bound to no
// node gets preferred node affinity toward the nodes that hold its inputs
// ready, weighted by the bytes each holds, before kube-scheduler sees it.
//
// It never requires a node and never refuses a pod: every answer allows
// it, and a request it cannot read, a view not ready (a follower, a leader
// still settling) or inputs no live node holds are answered with no
// patch. It ranks only the volumes the pod's namespace may read (its own,
// and those shared with scope cluster). It owns the AdmissionReview
// exchange and the patch; the ranking is the fleet view's (Config.Rank),
// and where and how it is served (TLS, the address, the namespaces that
// opt in) the plugin's and the chart's.
package locality

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// Path is where the webhook is served.
const Path = "/mutate-pods"

// Limits of what one request may ask for.
const (
	// MaxRequestBytes bounds a review's body: a pod is at most about
	// 1.5 MiB in etcd, and the API server sends it with its old object
	// (none for a create) and options.
	MaxRequestBytes = 4 << 20
	// MaxInputs is how many distinct sources of one pod are ranked: the
	// first, in the order the pod names them. A pod naming more is placed
	// by those (a step with more inputs than that is rare, and each costs
	// the ranking a pass over its holders).
	MaxInputs = 64
	// PreferredNodes is how many nodes a pod is steered to at most, those
	// holding the most of its inputs.
	PreferredNodes = 10
)

// HostnameLabel is the node label a nodeSelector binds a pod to one node
// with.
const HostnameLabel = "kubernetes.io/hostname"

// Config is what the webhook ranks with.
type Config struct {
	// Rank ranks the live nodes that take captures for a pod of namespace
	// with inputs, best first (the fleet view's Place, for namespace).
	Rank func(inputs []volume.Ref, namespace string, limit int) []fleet.Placement
	// Making lists the nodes where a step is writing one of inputs that no
	// node holds ready yet (the fleet view's Making, for namespace): a CI
	// engine starts the next step the moment the last one ends, before
	// its output is captured (nil: none are asked).
	Making func(inputs []volume.Ref, namespace string) []string
	// CacheInputs are the newest versions of caches a pod names that live
	// nodes hold (the fleet view's CacheInputs, for the pod's namespace):
	// each counts as an input (nil: caches count nothing).
	CacheInputs func(caches []volume.CacheRef) []volume.Ref
	// Ready says whether the view may rank (false: a follower, or a
	// leader whose view still settles): otherwise pods pass unplaced.
	Ready func() bool
	// Registries are the hosts (host:port) the node plugins serve step
	// images from volumes at (docs/step-images.md): a container's image
	// there is an input too.
	Registries []string
	Metrics    *Metrics
}

// Results a pod's review ends with, as the metric counts them.
const (
	ResultPreferred = "preferred" // it got preferred node affinity
	ResultNoInputs  = "no_inputs" // it names no cowvol source
	ResultBound     = "bound"     // it is bound to a node of its own
	ResultNoHolders = "no_holders"
	ResultNotReady  = "not_ready"
	ResultIgnored   = "ignored" // not a pod's create
)

// Handler serves the webhook.
func Handler(cfg Config) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		if r.Method != http.MethodPost {
			http.Error(w, "POST an AdmissionReview", http.StatusMethodNotAllowed)
			return
		}
		var review admissionv1.AdmissionReview
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBytes))
		if err == nil {
			err = json.Unmarshal(body, &review)
		}
		if err == nil && review.Request == nil {
			err = fmt.Errorf("an AdmissionReview with no request")
		}
		if err != nil {
			cfg.Metrics.observe("bad_request", start)
			http.Error(w, fmt.Sprintf("reading the AdmissionReview: %v", err), http.StatusBadRequest)
			return
		}
		resp, result := Review(cfg, review.Request)
		out := admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"}, Response: resp}
		w.Header().Set("Content-Type", "application/json")
		if err := json.NewEncoder(w).Encode(out); err != nil {
			klog.V(2).InfoS("Answering an admission review", "err", err)
		}
		cfg.Metrics.observe(result, start)
	})
}

// Review answers one pod's admission: always allowed, with the patch
// that adds its node preferences if it gets any, and says how it ended.
func Review(cfg Config, req *admissionv1.AdmissionRequest) (*admissionv1.AdmissionResponse, string) {
	resp := &admissionv1.AdmissionResponse{UID: req.UID, Allowed: true}
	if req.Kind.Group != "" || req.Kind.Kind != "Pod" || req.Operation != admissionv1.Create || req.SubResource != "" {
		return resp, ResultIgnored
	}
	var pod corev1.Pod
	if err := json.Unmarshal(req.Object.Raw, &pod); err != nil {
		// Not ours to refuse: the API server decides what a pod is.
		klog.V(2).InfoS("A pod the locality webhook cannot read passes unplaced", "namespace", req.Namespace, "err", err)
		return resp, ResultIgnored
	}
	namespace := req.Namespace
	if namespace == "" {
		namespace = pod.Namespace
	}
	inputs, caches := Inputs(&pod, namespace, cfg.Registries), Caches(&pod, namespace)
	switch {
	case len(inputs) == 0 && len(caches) == 0:
		return resp, ResultNoInputs
	case Bound(&pod):
		return resp, ResultBound
	case cfg.Ready != nil && !cfg.Ready():
		return resp, ResultNotReady
	}
	if cfg.CacheInputs != nil && len(caches) > 0 {
		inputs = append(inputs, cfg.CacheInputs(caches)...)
		inputs = inputs[:min(len(inputs), MaxInputs)]
	}
	if len(inputs) == 0 {
		return resp, ResultNoHolders // caches no node holds a version of
	}
	var making []string
	if cfg.Making != nil {
		making = cfg.Making(inputs, namespace)
	}
	terms := Preferences(cfg.Rank(inputs, namespace, PreferredNodes), making)
	if len(terms) == 0 {
		return resp, ResultNoHolders
	}
	patch, err := json.Marshal(Patch(&pod, terms))
	if err != nil {
		return resp, ResultIgnored
	}
	pt := admissionv1.PatchTypeJSONPatch
	resp.Patch, resp.PatchType = patch, &pt
	klog.V(4).InfoS("Steered a pod toward the nodes holding its inputs", "pod", klog.KRef(namespace, pod.Name+pod.GenerateName),
		"inputs", len(inputs), "nodes", len(terms))
	return resp, ResultPreferred
}

// Inputs are the cowvol sources a pod of namespace names (a source's
// view, read-only or an output that starts as one) and the volumes its
// containers' images come from (at one of registries), each once, in the
// order named, at most MaxInputs; a name that is not a valid one is
// passed over (the node refuses it at publish, the registry at the pull).
func Inputs(pod *corev1.Pod, namespace string, registries []string) []volume.Ref {
	var out []volume.Ref
	seen := map[volume.Ref]bool{}
	add := func(r volume.Ref) bool {
		if seen[r] {
			return true
		}
		seen[r] = true
		out = append(out, r)
		return len(out) < MaxInputs
	}
	for _, c := range slices.Concat(pod.Spec.InitContainers, pod.Spec.Containers) {
		if r, ok := imageVolume(c.Image, namespace, registries); ok && !add(r) {
			return out
		}
	}
	for _, v := range pod.Spec.Volumes {
		if v.CSI == nil || v.CSI.Driver != volume.DriverName {
			continue
		}
		attrs := v.CSI.VolumeAttributes
		r := volume.Ref{Namespace: namespace, Handle: attrs[volume.AttrSource]}
		if ns, ok := attrs[volume.AttrSourceNamespace]; ok {
			r.Namespace = ns
		}
		if r.Handle != "" && r.Validate() == nil && !add(r) {
			break
		}
	}
	return out
}

// Caches are the cache keys a pod of namespace names (volume.AttrCache),
// each once, in the order named, at most MaxInputs; a key that is not a
// valid one is passed over (the node refuses it at publish).
func Caches(pod *corev1.Pod, namespace string) []volume.CacheRef {
	var out []volume.CacheRef
	for _, v := range pod.Spec.Volumes {
		if v.CSI == nil || v.CSI.Driver != volume.DriverName {
			continue
		}
		c := volume.CacheRef{Namespace: namespace, Key: v.CSI.VolumeAttributes[volume.AttrCache]}
		if c.Key == "" || volume.ValidateCacheKey(c.Key) != nil || slices.Contains(out, c) {
			continue
		}
		if out = append(out, c); len(out) == MaxInputs {
			break
		}
	}
	return out
}

// imageVolume is the volume an image at one of registries comes from, for
// a pod of namespace (the registry serves a pod only its own namespace's
// repositories).
func imageVolume(image, namespace string, registries []string) (volume.Ref, bool) {
	for _, host := range registries {
		name, ok := strings.CutPrefix(image, host+"/")
		if !ok {
			continue
		}
		name, _, _ = strings.Cut(name, "@")
		if i := strings.LastIndexByte(name, ':'); i > strings.LastIndexByte(name, '/') {
			name = name[:i]
		}
		reader, r, err := volume.ParseRepository(name)
		return r, err == nil && reader == namespace
	}
	return volume.Ref{}, false
}

// Bound says whether a pod is bound to a node of its own: a node name, or
// a nodeSelector naming one host. Its placement is its owner's word.
func Bound(pod *corev1.Pod) bool {
	_, host := pod.Spec.NodeSelector[HostnameLabel]
	return pod.Spec.NodeName != "" || host
}

// Preferences are the node affinity terms that steer a pod to the nodes of
// a ranking that hold any of its inputs, and to those making one (weighted
// 100: the input will be there first), at most PreferredNodes, each ranked
// node weighted by the bytes of its inputs it holds against the node that
// holds the most (100): kube-scheduler adds the weights of the terms a
// node matches into its score. Nodes are matched by name: cowvol's node
// IDs are Node names.
func Preferences(ranking []fleet.Placement, making []string) []corev1.PreferredSchedulingTerm {
	var most int64
	for _, p := range ranking {
		most = max(most, p.InputBytesHeld)
	}
	weights := map[string]int32{}
	var order []string
	prefer := func(node string, weight int32) {
		if w, ok := weights[node]; ok {
			weights[node] = max(w, weight)
			return
		}
		if len(order) < PreferredNodes {
			weights[node] = weight
			order = append(order, node)
		}
	}
	for _, node := range making {
		prefer(node, 100)
	}
	for _, p := range ranking {
		if p.InputBytesHeld > 0 { // the ranking is best first: holders of more come first
			prefer(p.NodeID, max(1, int32((100*p.InputBytesHeld+most/2)/most)))
		}
	}
	terms := make([]corev1.PreferredSchedulingTerm, 0, len(order))
	for _, node := range order {
		terms = append(terms, corev1.PreferredSchedulingTerm{Weight: weights[node], Preference: corev1.NodeSelectorTerm{
			MatchFields: []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{node}}},
		}})
	}
	return terms
}

// Operation is one JSON Patch (RFC 6902) operation.
type Operation struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// Patch adds terms to what a pod prefers, beside whatever affinity it has.
func Patch(pod *corev1.Pod, terms []corev1.PreferredSchedulingTerm) []Operation {
	const preferred = "/spec/affinity/nodeAffinity/preferredDuringSchedulingIgnoredDuringExecution"
	switch a := pod.Spec.Affinity; {
	case a == nil:
		return []Operation{{Op: "add", Path: "/spec/affinity", Value: corev1.Affinity{
			NodeAffinity: &corev1.NodeAffinity{PreferredDuringSchedulingIgnoredDuringExecution: terms}}}}
	case a.NodeAffinity == nil:
		return []Operation{{Op: "add", Path: "/spec/affinity/nodeAffinity", Value: corev1.NodeAffinity{PreferredDuringSchedulingIgnoredDuringExecution: terms}}}
	case len(a.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution) == 0:
		return []Operation{{Op: "add", Path: preferred, Value: terms}}
	}
	ops := make([]Operation, len(terms))
	for i, t := range terms {
		ops[i] = Operation{Op: "add", Path: preferred + "/-", Value: t}
	}
	return ops
}
