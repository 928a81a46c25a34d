package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/client"
)

// TestPod: a step's pod prefers the ranked nodes in order, avoids the
// nodes its attempts failed on while another is ranked (a pinned one runs
// on its node again), mounts its inputs' volumes by name and
// captures its output under the attempt's handle.
func TestPod(t *testing.T) {
	r := &Runner{Namespace: "ci", Image: "busybox", ServiceAccount: "steps"}
	s := Step{Name: "test", Inputs: []string{"bin", "src"}, Output: "report", Script: "true"}
	tests := []struct {
		name         string
		step         Step
		ranked       []string
		failed       []string
		wantWeights  []int32
		wantRequired []string
		wantSelector map[string]string
	}{
		{name: "ranked", step: s, ranked: []string{"node-2", "node-1", "node-3"}, wantWeights: []int32{100, 50, 25}},
		{name: "many ranked never weigh nothing", step: s, ranked: make([]string, 9), wantWeights: []int32{100, 50, 25, 12, 6, 3, 1, 1, 1}},
		{name: "after failures", step: s, ranked: []string{"node-3"}, failed: []string{"node-1", "node-2"}, wantWeights: []int32{100},
			wantRequired: []string{"node-1", "node-2"}},
		{name: "every ranked node failed: only the last avoided", step: s, ranked: []string{"node-1", "node-2"},
			failed: []string{"node-2", "node-1"}, wantWeights: []int32{100, 50}, wantRequired: []string{"node-1"}},
		{name: "a Go build's caches", step: Step{Name: "compile", Script: "go build ./...", Caches: []StepCache{
			{Path: "/root/.cache/go-build", Key: "go-build/linux-amd64"}, {Path: "/go/pkg/mod", Key: "go-mod"}}}},
		{name: "pinned", step: Step{Name: "get", Node: "node-1", Script: "true"}, wantSelector: map[string]string{"kubernetes.io/hostname": "node-1"}},
		{name: "pinned, failed on its node: runs there again", step: Step{Name: "get", Node: "node-1", Script: "true"},
			ranked: []string{"node-2"}, failed: []string{"node-1"}, wantWeights: []int32{100}, wantSelector: map[string]string{"kubernetes.io/hostname": "node-1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			inputs := []string{"b1-compile-bin-1", "resource-cache-7"}[:len(tt.step.Inputs)]
			output := ""
			if tt.step.Output != "" {
				output = "b1-test-report-2"
			}
			pod := r.pod("b1", tt.step, inputs, output, 2, tt.ranked, tt.failed)
			assert.Equal(t, "b1-"+tt.step.Name+"-2", pod.Name)
			assert.Equal(t, "ci", pod.Namespace)
			assert.Equal(t, corev1.RestartPolicyNever, pod.Spec.RestartPolicy)
			assert.Equal(t, tt.wantSelector, pod.Spec.NodeSelector)
			var weights []int32
			for i, p := range pod.Spec.Affinity.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
				weights = append(weights, p.Weight)
				assert.Equal(t, []string{tt.ranked[i]}, p.Preference.MatchExpressions[0].Values)
			}
			assert.Equal(t, tt.wantWeights, weights)
			required := pod.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution
			if tt.wantRequired == nil {
				assert.Nil(t, required)
			} else {
				require.NotNil(t, required)
				e := required.NodeSelectorTerms[0].MatchExpressions[0]
				assert.Equal(t, corev1.NodeSelectorOpNotIn, e.Operator)
				assert.Equal(t, tt.wantRequired, e.Values)
			}
			mounts := map[string]string{}
			for _, m := range pod.Spec.Containers[0].VolumeMounts {
				mounts[m.MountPath] = m.Name
			}
			attrs := map[string]map[string]string{}
			for _, v := range pod.Spec.Volumes {
				require.NotNil(t, v.CSI)
				assert.Equal(t, Driver, v.CSI.Driver)
				attrs[v.Name] = v.CSI.VolumeAttributes
			}
			for i, in := range tt.step.Inputs {
				assert.Equal(t, map[string]string{"source": inputs[i]}, attrs[mounts["/in/"+in]], in)
			}
			if output != "" {
				assert.Equal(t, map[string]string{"capture": output}, attrs[mounts["/out"]])
			}
			for _, c := range tt.step.Caches {
				assert.Equal(t, map[string]string{"cache": c.Key}, attrs[mounts[c.Path]], c.Path)
			}
			assert.Len(t, pod.Spec.Volumes, len(tt.step.Inputs)+len(tt.step.Caches)+min(len(output), 1))
		})
	}
}

// serveCache serves server as the Cache API on loopback and dials it.
func serveCache(t *testing.T, server controllerv1.CacheServer) *client.Client {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	controllerv1.RegisterCacheServer(srv, server)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	cache, err := client.Dial(client.Options{Address: lis.Addr().String()})
	require.NoError(t, err)
	t.Cleanup(func() { cache.Close() })
	return cache
}

// leaderMoving answers Place as a controller whose leader is moving does
// (Unavailable, from the replica that no longer leads) a number of times,
// then as the new leader, or with another code throughout: a real
// controller cannot be made to answer so on cue.
type leaderMoving struct {
	controllerv1.UnimplementedCacheServer
	unavailable int
	code        codes.Code
	calls       atomic.Int32
	// placed is the last Place's request.
	placed atomic.Pointer[controllerv1.PlaceRequest]
}

func (l *leaderMoving) answer() error {
	n := int(l.calls.Add(1))
	switch {
	case l.code != codes.OK:
		return status.Error(l.code, "refused")
	case n <= l.unavailable:
		return status.Error(codes.Unavailable, "this controller replica does not lead: the leader is none yet; retry")
	}
	return nil
}

func (l *leaderMoving) Place(_ context.Context, req *controllerv1.PlaceRequest) (*controllerv1.PlaceResponse, error) {
	l.placed.Store(req)
	if err := l.answer(); err != nil {
		return nil, err
	}
	return &controllerv1.PlaceResponse{Nodes: []*controllerv1.NodePlacement{{NodeId: "node-2"}, {NodeId: "node-1"}}}, nil
}

func (l *leaderMoving) PinVolumes(context.Context, *controllerv1.PinVolumesRequest) (*controllerv1.PinVolumesResponse, error) {
	if err := l.answer(); err != nil {
		return nil, err
	}
	return &controllerv1.PinVolumesResponse{}, nil
}

// TestPlaceWaitsOutAMovingLeader: a step is placed, and its output kept,
// once the controller answers again; an answer other than Unavailable
// fails it at once.
func TestPlaceWaitsOutAMovingLeader(t *testing.T) {
	tests := []struct {
		name      string
		server    *leaderMoving
		want      []string
		wantCode  codes.Code
		wantCalls int32
	}{
		{name: "leader moving", server: &leaderMoving{unavailable: 3}, want: []string{"node-2", "node-1"}, wantCalls: 4},
		{name: "denied", server: &leaderMoving{code: codes.PermissionDenied}, wantCode: codes.PermissionDenied, wantCalls: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &Runner{Cache: serveCache(t, tt.server), Namespace: "ci", KeepFor: time.Hour}
			got, err := r.place(context.Background(), []string{"src"}, []StepCache{{Key: "go-build", Path: "/cache"}})
			assert.Equal(t, tt.wantCode, status.Code(errors.Unwrap(err)))
			assert.Equal(t, tt.want, got)
			assert.Equal(t, tt.wantCalls, tt.server.calls.Load())
			caches := tt.server.placed.Load().GetCaches()
			require.Len(t, caches, 1, "the step's cache counts in its placement")
			assert.Equal(t, "ci", caches[0].GetNamespace())
			assert.Equal(t, "go-build", caches[0].GetKey())
			tt.server.calls.Store(0)
			err = r.keep(context.Background(), "b1-get-src-1")
			assert.Equal(t, tt.wantCode, status.Code(errors.Unwrap(err)))
			assert.Equal(t, tt.wantCalls, tt.server.calls.Load())
		})
	}
}

// TestFailure: a failed step says why, from the pod's message or how its
// container ended.
func TestFailure(t *testing.T) {
	exited := func(code int32, reason, msg string) []corev1.ContainerStatus {
		return []corev1.ContainerStatus{{Name: "step", State: corev1.ContainerState{
			Terminated: &corev1.ContainerStateTerminated{ExitCode: code, Reason: reason, Message: msg}}}}
	}
	tests := []struct {
		name   string
		status corev1.PodStatus
		want   string
	}{
		{name: "evicted", status: corev1.PodStatus{Message: "The node was low on resource: ephemeral-storage."},
			want: "The node was low on resource: ephemeral-storage."},
		{name: "exited", status: corev1.PodStatus{ContainerStatuses: exited(1, "Error", "")}, want: "container step exited 1 (Error)"},
		{name: "killed, with a message", status: corev1.PodStatus{ContainerStatuses: exited(137, "OOMKilled", "out of memory")},
			want: "container step exited 137 (OOMKilled): out of memory"},
		{name: "no status", want: "no container status"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, failure(&corev1.Pod{Status: tt.status}))
		})
	}
}

// forgetful answers Destroy as a controller whose leader moved before its
// nodes carried the first request out: the volume stays held until it is
// asked again. A real controller cannot be made to lose a request on cue.
type forgetful struct {
	controllerv1.UnimplementedCacheServer
	destroys atomic.Int32
}

func (f *forgetful) DestroyVolumes(context.Context, *controllerv1.DestroyVolumesRequest) (*controllerv1.DestroyVolumesResponse, error) {
	f.destroys.Add(1)
	return &controllerv1.DestroyVolumesResponse{}, nil
}

func (f *forgetful) LookupVolumes(_ context.Context, req *controllerv1.LookupVolumesRequest) (*controllerv1.LookupVolumesResponse, error) {
	resp := &controllerv1.LookupVolumesResponse{}
	for _, r := range req.GetRefs() {
		loc := &controllerv1.VolumeLocation{Ref: r}
		if f.destroys.Load() < 2 {
			loc.Nodes = []string{"node-1"}
		}
		resp.Volumes = append(resp.Volumes, loc)
	}
	return resp, nil
}

// TestDestroyAsksAgainUntilGone: a destroy the controller lost is made
// again, and Destroy returns once no node holds the outputs.
func TestDestroyAsksAgainUntilGone(t *testing.T) {
	defer func(was time.Duration) { destroyRecheck = was }(destroyRecheck)
	destroyRecheck = 300 * time.Millisecond
	server := &forgetful{}
	r := &Runner{Cache: serveCache(t, server), Namespace: "ci"}
	require.NoError(t, r.Destroy(context.Background(), "b1-get-src-1", "b1-test-report-1"))
	assert.Equal(t, int32(2), server.destroys.Load())
}

// twoNodes answers as a controller whose node-1 runs and node-2 is
// stalled, each holding volumes of ci, and records what it is asked to
// destroy.
type twoNodes struct {
	controllerv1.UnimplementedCacheServer
	destroyed []string
}

func (s *twoNodes) ListNodes(context.Context, *controllerv1.ListNodesRequest) (*controllerv1.ListNodesResponse, error) {
	return &controllerv1.ListNodesResponse{Nodes: []*controllerv1.NodeStatus{
		{NodeId: "node-1", State: "running"}, {NodeId: "node-2", State: "stalled"}}}, nil
}

func (s *twoNodes) ListVolumes(_ context.Context, req *controllerv1.ListVolumesRequest) (*controllerv1.ListVolumesResponse, error) {
	held := map[string][]string{"node-1": {"b1-get-src-1", "b2-get-src-1"}, "node-2": {"b1-get-src-1", "b1-test-report-2"}}
	resp := &controllerv1.ListVolumesResponse{}
	for _, h := range held[req.GetNodeId()] {
		resp.Volumes = append(resp.Volumes, &controllerv1.VolumeLocation{Ref: &controllerv1.VolumeRef{Namespace: req.GetNamespace(), Handle: h}})
	}
	return resp, nil
}

func (s *twoNodes) DestroyVolumes(_ context.Context, req *controllerv1.DestroyVolumesRequest) (*controllerv1.DestroyVolumesResponse, error) {
	for _, r := range req.GetRefs() {
		s.destroyed = append(s.destroyed, r.GetHandle())
	}
	return &controllerv1.DestroyVolumesResponse{}, nil
}

// TestReconcile: a GC pass destroys, once each, what no running build
// claims on every node, a stalled one's too.
func TestReconcile(t *testing.T) {
	server := &twoNodes{}
	r := &Runner{Cache: serveCache(t, server), Namespace: "ci"}
	running := func(h string) bool { return strings.HasPrefix(h, "b2-") }
	got, err := r.Reconcile(context.Background(), running)
	require.NoError(t, err)
	want := []string{"b1-get-src-1", "b1-test-report-2"}
	assert.Equal(t, want, got)
	assert.Equal(t, want, server.destroyed)
}

// go-build.json, the example of a build with caches, reads as steps whose
// pods mount the caches.
func TestGoBuildExample(t *testing.T) {
	raw, err := os.ReadFile("go-build.json")
	require.NoError(t, err)
	var steps []Step
	require.NoError(t, json.Unmarshal(raw, &steps))
	require.Len(t, steps, 2)
	test := steps[1]
	require.Equal(t, []StepCache{{Path: "/cache/go-build", Key: "go-build/linux-amd64"}, {Path: "/cache/mod", Key: "go-mod"}}, test.Caches)
	r := &Runner{Namespace: "ci", Image: "golang:1.26"}
	pod := r.pod("b1", test, []string{"b1-get-src-1"}, "b1-test-report-1", 1, nil, nil)
	var caches []string
	for _, v := range pod.Spec.Volumes {
		if key := v.CSI.VolumeAttributes["cache"]; key != "" {
			caches = append(caches, key)
		}
	}
	require.Equal(t, []string{"go-build/linux-amd64", "go-mod"}, caches)
}
