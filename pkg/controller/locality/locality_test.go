package locality

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

const registry = "127.0.0.1:7444"

// fleetOf is a view where each node holds the volumes given, ready, with
// their sizes.
func fleetOf(t *testing.T, held map[string][]fleet.Held) *fleet.View {
	v := fleet.NewView(time.Minute, time.Hour)
	for node, vols := range held {
		_, err := v.Report(fleet.Report{NodeID: node, StoreID: node, Revision: 1, Full: true, Upserts: vols, BytesFree: 100 << 30}, time.Now())
		require.NoError(t, err)
	}
	return v
}

func ready(ns, handle string, size int64, scope volume.Scope) fleet.Held {
	return fleet.Held{Ref: volume.Ref{Namespace: ns, Handle: handle}, State: volume.StateReady, SizeBytes: size, Scope: scope}
}

// configOf is the webhook's config over a view, as the controller makes it.
func configOf(v *fleet.View) Config {
	return Config{
		Rank: func(inputs []volume.Ref, namespace string, limit int) []fleet.Placement {
			return v.Place(inputs, func(ns string) bool { return ns == namespace }, limit, time.Now())
		},
		Making: func(inputs []volume.Ref, namespace string) []string {
			return v.Making(inputs, func(ns string) bool { return ns == namespace }, time.Now())
		},
		CacheInputs: func(caches []volume.CacheRef) []volume.Ref { return v.CacheInputs(caches, nil, time.Now()) },
	}
}

// promoted is a version of a cache key, made current ago.
func promoted(t *testing.T, ns, key string, size int64, ago time.Duration) fleet.Held {
	h, err := volume.NewCacheHandle(key)
	require.NoError(t, err)
	held := ready(ns, h, size, "")
	held.Properties = []fleet.Property{{Key: volume.PropertyCacheKey, Value: key},
		{Key: volume.PropertyCachePromotedAt, Value: time.Now().Add(-ago).UTC().Format(time.RFC3339Nano)}}
	return held
}

func csiVolume(name string, attrs map[string]string) corev1.Volume {
	return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{Driver: volume.DriverName, VolumeAttributes: attrs}}}
}

func source(name, handle string) corev1.Volume {
	return csiVolume(name, map[string]string{volume.AttrSource: handle})
}

func podWith(mutate func(*corev1.Pod)) *corev1.Pod {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "step", Namespace: "ci"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "step", Image: "busybox"}}}}
	mutate(pod)
	return pod
}

func requestFor(t *testing.T, pod *corev1.Pod) *admissionv1.AdmissionRequest {
	raw, err := json.Marshal(pod)
	require.NoError(t, err)
	return &admissionv1.AdmissionRequest{UID: "uid-1", Kind: metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
		Operation: admissionv1.Create, Namespace: "ci", Object: runtime.RawExtension{Raw: raw}}
}

// patched is the pod after resp's patch.
func patched(t *testing.T, pod *corev1.Pod, resp *admissionv1.AdmissionResponse) *corev1.Pod {
	t.Helper()
	raw, err := json.Marshal(pod)
	require.NoError(t, err)
	if resp.Patch != nil {
		require.Equal(t, admissionv1.PatchTypeJSONPatch, *resp.PatchType)
		p, err := jsonpatch.DecodePatch(resp.Patch)
		require.NoError(t, err)
		raw, err = p.Apply(raw)
		require.NoError(t, err)
	}
	var out corev1.Pod
	require.NoError(t, json.Unmarshal(raw, &out))
	return &out
}

type preference struct {
	node   string
	weight int32
}

func preferred(pod *corev1.Pod) []preference {
	if pod.Spec.Affinity == nil || pod.Spec.Affinity.NodeAffinity == nil {
		return nil
	}
	var out []preference
	for _, t := range pod.Spec.Affinity.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
		node := "?"
		if len(t.Preference.MatchFields) == 1 && t.Preference.MatchFields[0].Key == "metadata.name" {
			node = strings.Join(t.Preference.MatchFields[0].Values, ",")
		} else if len(t.Preference.MatchExpressions) > 0 {
			node = "own:" + t.Preference.MatchExpressions[0].Key
		}
		out = append(out, preference{node, t.Weight})
	}
	return out
}

// Every shape of pod gets the preferences its inputs earn, beside what it
// had, and is always allowed.
func TestReview(t *testing.T) {
	view := fleetOf(t, map[string][]fleet.Held{
		"node-a": {ready("ci", "repo", 3<<30, ""), ready("ci", "img", 1<<30, ""), ready("other", "private", 50<<30, "")},
		"node-b": {ready("ci", "deps", 1<<30, ""), ready("shared", "tools", 2<<30, volume.ScopeCluster)},
		"node-c": {ready("ci", "repo", 3<<30, ""), ready("ci", "deps", 1<<30, "")},
		"node-d": {promoted(t, "ci", "go-build", 2<<30, time.Hour)},
		"node-f": {promoted(t, "ci", "go-build", 5<<30, 2*time.Hour), promoted(t, "other", "go-build", 9<<30, 0)},
		"node-e": {{Ref: volume.Ref{Namespace: "ci", Handle: "being-made"}, State: volume.StateCreating, SizeBytes: -1},
			{Ref: volume.Ref{Namespace: "ci", Handle: "repo"}, State: volume.StateCreating, SizeBytes: -1},
			{Ref: volume.Ref{Namespace: "other", Handle: "private-made"}, State: volume.StateCreating, SizeBytes: -1}},
	})
	ownAffinity := &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
		RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
			MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "pool", Operator: corev1.NodeSelectorOpIn, Values: []string{"ci"}}}}}},
		PreferredDuringSchedulingIgnoredDuringExecution: []corev1.PreferredSchedulingTerm{{Weight: 7, Preference: corev1.NodeSelectorTerm{
			MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "fast", Operator: corev1.NodeSelectorOpExists}}}}},
	}}
	many := func(p *corev1.Pod) {
		for i := range 1000 {
			p.Spec.Volumes = append(p.Spec.Volumes, source(fmt.Sprintf("in-%d", i), fmt.Sprintf("missing-%d", i)))
		}
		p.Spec.Volumes = append(p.Spec.Volumes, source("last", "repo"))
	}
	tests := []struct {
		name       string
		pod        *corev1.Pod
		ready      bool
		wantResult string
		want       []preference
		check      func(t *testing.T, pod *corev1.Pod)
	}{
		{name: "no cowvol volume", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{{Name: "tmp", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}
		}), wantResult: ResultNoInputs},
		{name: "an output alone", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{csiVolume("out", map[string]string{volume.AttrCapture: "out-1"})}
		}), wantResult: ResultNoInputs},
		{name: "one input on two nodes", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("repo", "repo")}
		}), wantResult: ResultPreferred, want: []preference{{"node-a", 100}, {"node-c", 100}}},
		{name: "inputs from two nodes, weighted by the bytes each holds", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("repo", "repo"), source("deps", "deps"), csiVolume("out", map[string]string{volume.AttrCapture: "x"})}
		}), wantResult: ResultPreferred, want: []preference{{"node-c", 100}, {"node-a", 75}, {"node-b", 25}}},
		{name: "an output over an input counts the input", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{csiVolume("work", map[string]string{volume.AttrCapture: "x", volume.AttrSource: "deps"})}
		}), wantResult: ResultPreferred, want: []preference{{"node-b", 100}, {"node-c", 100}}},
		{name: "its own affinity is kept, the preferences added beside it", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("deps", "deps")}
			p.Spec.Affinity = ownAffinity.DeepCopy()
		}), wantResult: ResultPreferred, want: []preference{{"own:fast", 7}, {"node-b", 100}, {"node-c", 100}},
			check: func(t *testing.T, pod *corev1.Pod) {
				require.Equal(t, ownAffinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution,
					pod.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution)
			}},
		{name: "a pod affinity only", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("deps", "deps")}
			p.Spec.Affinity = &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{}}
		}), wantResult: ResultPreferred, want: []preference{{"node-b", 100}, {"node-c", 100}},
			check: func(t *testing.T, pod *corev1.Pod) { require.NotNil(t, pod.Spec.Affinity.PodAntiAffinity) }},
		{name: "node affinity with no preferences", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("deps", "deps")}
			p.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: ownAffinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution}}
		}), wantResult: ResultPreferred, want: []preference{{"node-b", 100}, {"node-c", 100}}},
		{name: "another namespace's private volume ranks nowhere", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{csiVolume("x", map[string]string{volume.AttrSource: "private", volume.AttrSourceNamespace: "other"})}
		}), wantResult: ResultNoHolders},
		{name: "another namespace's private volume beside an input of its own", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{csiVolume("x", map[string]string{volume.AttrSource: "private", volume.AttrSourceNamespace: "other"}), source("deps", "deps")}
		}), wantResult: ResultPreferred, want: []preference{{"node-b", 100}, {"node-c", 100}}},
		{name: "a cache: the node holding its newest version, not a bigger older one", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{csiVolume("gocache", map[string]string{volume.AttrCache: "go-build"})}
		}), wantResult: ResultPreferred, want: []preference{{"node-d", 100}}},
		{name: "a cache beside a source", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("deps", "deps"), csiVolume("gocache", map[string]string{volume.AttrCache: "go-build"})}
		}), wantResult: ResultPreferred, want: []preference{{"node-d", 100}, {"node-b", 50}, {"node-c", 50}}},
		{name: "a cache no node holds a version of", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{csiVolume("c", map[string]string{volume.AttrCache: "never-used"})}
		}), wantResult: ResultNoHolders},
		{name: "a cache key that is not one", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{csiVolume("c", map[string]string{volume.AttrCache: "../x"})}
		}), wantResult: ResultNoInputs},
		{name: "a volume shared with the cluster", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{csiVolume("x", map[string]string{volume.AttrSource: "tools", volume.AttrSourceNamespace: "shared"})}
		}), wantResult: ResultPreferred, want: []preference{{"node-b", 100}}},
		{name: "a step image from a volume", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Containers[0].Image = registry + "/ci/img:latest"
		}), wantResult: ResultPreferred, want: []preference{{"node-a", 100}}},
		{name: "a step image by digest, of an init container", pod: podWith(func(p *corev1.Pod) {
			p.Spec.InitContainers = []corev1.Container{{Name: "init", Image: registry + "/ci/img@sha256:" + strings.Repeat("0", 64)}}
		}), wantResult: ResultPreferred, want: []preference{{"node-a", 100}}},
		{name: "another namespace's image repository is not the pod's", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Containers[0].Image = registry + "/other/private"
		}), wantResult: ResultNoInputs},
		{name: "an image of another registry", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Containers[0].Image = "registry.example/ci/img:latest"
		}), wantResult: ResultNoInputs},
		{name: "an input a step is writing on a node, held ready nowhere: that node", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("made", "being-made"), source("deps", "deps")}
		}), wantResult: ResultPreferred, want: []preference{{"node-e", 100}, {"node-b", 100}, {"node-c", 100}}},
		{name: "an input being made on one node and ready on others: the ready ones", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("repo", "repo")}
		}), wantResult: ResultPreferred, want: []preference{{"node-a", 100}, {"node-c", 100}}},
		{name: "another namespace's private volume being made steers nothing", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{csiVolume("x", map[string]string{volume.AttrSource: "private-made", volume.AttrSourceNamespace: "other"})}
		}), wantResult: ResultNoHolders},
		{name: "inputs no live node holds", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("gone", "gone")}
		}), wantResult: ResultNoHolders},
		{name: "bound by name", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("repo", "repo")}
			p.Spec.NodeName = "node-d"
		}), wantResult: ResultBound},
		{name: "bound by a nodeSelector on the host", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("repo", "repo")}
			p.Spec.NodeSelector = map[string]string{HostnameLabel: "node-d"}
		}), wantResult: ResultBound},
		{name: "a nodeSelector of a pool still gets preferences", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("repo", "repo")}
			p.Spec.NodeSelector = map[string]string{"pool": "ci"}
		}), wantResult: ResultPreferred, want: []preference{{"node-a", 100}, {"node-c", 100}}},
		{name: "names that are not valid are passed over", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("bad", "../repo"), csiVolume("bad-ns", map[string]string{volume.AttrSource: "repo", volume.AttrSourceNamespace: "NO"}),
				{Name: "other-driver", VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{Driver: "other.example", VolumeAttributes: map[string]string{"source": "repo"}}}}}
		}), wantResult: ResultNoInputs},
		{name: "a thousand sources: the first MaxInputs are ranked", pod: podWith(many), wantResult: ResultNoHolders},
		{name: "a view not ready places nothing", pod: podWith(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{source("repo", "repo")}
		}), ready: false, wantResult: ResultNotReady},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			isReady := tt.wantResult != ResultNotReady || tt.ready
			cfg := configOf(view)
			cfg.Ready, cfg.Registries = func() bool { return isReady }, []string{registry}
			resp, result := Review(cfg, requestFor(t, tt.pod))
			require.True(t, resp.Allowed)
			require.Equal(t, "uid-1", string(resp.UID))
			require.Equal(t, tt.wantResult, result)
			if tt.wantResult != ResultPreferred {
				require.Nil(t, resp.Patch)
			}
			got := patched(t, tt.pod, resp)
			require.Equal(t, tt.want, preferred(got))
			if tt.check != nil {
				tt.check(t, got)
			}
		})
	}
}

// The webhook answers every review it can read with the pod allowed, and
// refuses (400) only what is not a review; it places nothing but a pod's
// create.
func TestHandler(t *testing.T) {
	view := fleetOf(t, map[string][]fleet.Held{"node-a": {ready("ci", "repo", 1<<20, "")}})
	metrics := NewMetrics()
	cfg := configOf(view)
	cfg.Metrics = metrics
	srv := httptest.NewServer(Handler(cfg))
	defer srv.Close()
	post := func(body []byte) (*http.Response, *admissionv1.AdmissionReview) {
		resp, err := http.Post(srv.URL+Path, "application/json", bytes.NewReader(body))
		require.NoError(t, err)
		defer resp.Body.Close()
		var review admissionv1.AdmissionReview
		if resp.StatusCode == http.StatusOK {
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&review))
		}
		return resp, &review
	}
	review := func(req *admissionv1.AdmissionRequest) []byte {
		raw, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"}, Request: req})
		require.NoError(t, err)
		return raw
	}
	pod := podWith(func(p *corev1.Pod) { p.Spec.Volumes = []corev1.Volume{source("repo", "repo")} })

	resp, got := post(review(requestFor(t, pod)))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "AdmissionReview", got.Kind)
	require.True(t, got.Response.Allowed)
	require.Equal(t, []preference{{"node-a", 100}}, preferred(patched(t, pod, got.Response)))

	update := requestFor(t, pod)
	update.Operation = admissionv1.Update
	_, got = post(review(update))
	require.True(t, got.Response.Allowed)
	require.Nil(t, got.Response.Patch, "only a create is placed")

	wrongType := requestFor(t, pod)
	wrongType.Object.Raw = []byte(`{"spec":{"volumes":[{"name":"x","csi":{"driver":"cowvol.concourse-ci.org","volumeAttributes":{"source":5}}}]}}`)
	_, got = post(review(wrongType))
	require.True(t, got.Response.Allowed, "attributes of the wrong type: the pod passes unplaced")
	require.Nil(t, got.Response.Patch)

	for name, body := range map[string][]byte{
		"not JSON":     []byte("{"),
		"no request":   []byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}`),
		"over a limit": append(append([]byte(`{"request":{"uid":"`), bytes.Repeat([]byte("a"), MaxRequestBytes)...), []byte(`"}}`)...),
	} {
		resp, _ := post(body)
		require.Equal(t, http.StatusBadRequest, resp.StatusCode, name)
	}
	getResp, err := http.Get(srv.URL + Path)
	require.NoError(t, err)
	getResp.Body.Close()
	require.Equal(t, http.StatusMethodNotAllowed, getResp.StatusCode)
}
