package plugin

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"

	"github.com/concourse/cowvol/pkg/volume"
)

func terminated(code int32, reason string, started bool) corev1.ContainerStatus {
	t := &corev1.ContainerStateTerminated{ExitCode: code, Reason: reason}
	if started {
		t.StartedAt = metav1.NewTime(time.Unix(1_700_000_000, 0))
	}
	return corev1.ContainerStatus{State: corev1.ContainerState{Terminated: t}}
}

var (
	waiting = corev1.ContainerStatus{State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}}}
	running = corev1.ContainerStatus{State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}
)

func TestStepResult(t *testing.T) {
	deleted := ptr.To(metav1.Now())
	tests := []struct {
		name        string
		phase       corev1.PodPhase
		deleted     *metav1.Time
		init, main  []corev1.ContainerStatus
		want        volume.StepResult
		wantSettled bool
	}{
		{"every container exited 0", corev1.PodSucceeded, nil, nil,
			[]corev1.ContainerStatus{terminated(0, "Completed", true), terminated(0, "Completed", true)}, volume.StepSucceeded, true},
		{"one exited 1", corev1.PodFailed, nil, nil,
			[]corev1.ContainerStatus{terminated(0, "Completed", true), terminated(1, "Error", true)}, volume.StepFailed, true},
		{"the runtime refused to start it", corev1.PodFailed, nil, nil,
			[]corev1.ContainerStatus{terminated(128, "StartError", false)}, volume.StepNotStarted, true},
		{"deleted before its container was created", corev1.PodPending, deleted, nil,
			[]corev1.ContainerStatus{waiting}, volume.StepNotStarted, true},
		{"deleted with no status at all", corev1.PodPending, deleted, nil, nil, volume.StepNotStarted, true},
		{"an init container failed, so the step never ran", corev1.PodFailed, nil,
			[]corev1.ContainerStatus{terminated(2, "Error", true)}, []corev1.ContainerStatus{waiting}, volume.StepFailed, true},
		{"one ran, another never started", corev1.PodFailed, deleted, nil,
			[]corev1.ContainerStatus{terminated(0, "Completed", true), waiting}, volume.StepFailed, true},
		{"killed when its pod was deleted", corev1.PodFailed, deleted, nil,
			[]corev1.ContainerStatus{terminated(137, "Error", true)}, volume.StepFailed, true},
		{"restarting: how it last ended counts", corev1.PodRunning, deleted, nil,
			[]corev1.ContainerStatus{{State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}},
				LastTerminationState: terminated(3, "Error", true).State}}, volume.StepFailed, true},
		{"still running: the kubelet has not posted its end", corev1.PodRunning, deleted, nil,
			[]corev1.ContainerStatus{running}, "", false},
		{"the status lags a pod that is neither done nor deleted", corev1.PodPending, nil, nil,
			[]corev1.ContainerStatus{waiting}, "", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: tc.deleted},
				Status: corev1.PodStatus{Phase: tc.phase, InitContainerStatuses: tc.init, ContainerStatuses: tc.main}}
			got, settled := stepResult(p)
			require.Equal(t, tc.wantSettled, settled)
			require.Equal(t, tc.want, got)
		})
	}
}

func stepPod(name, uid string, hostUsers *bool) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ci", UID: types.UID(uid)},
		Spec:       corev1.PodSpec{NodeName: "node-1", HostUsers: hostUsers},
		Status:     corev1.PodStatus{Phase: corev1.PodPending},
	}
}

func TestKubePodsUserNamespace(t *testing.T) {
	client := fake.NewClientset(
		stepPod("userns", "u1", ptr.To(false)), stepPod("host", "u2", ptr.To(true)), stepPod("unset", "u3", nil))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pods := watchPods(ctx, client, "node-1")
	tests := []struct {
		name, pod, uid string
		want           bool
		wantErr        bool
	}{
		{"hostUsers: false", "userns", "u1", true, false},
		{"hostUsers: true", "host", "u2", false, false},
		{"hostUsers unset shares the host's", "unset", "u3", false, false},
		{"another pod of the same name (another UID)", "userns", "u9", false, true},
		{"no such pod", "gone", "u4", false, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := pods.UserNamespace(ctx, volume.Pod{Namespace: "ci", Name: tc.pod, UID: tc.uid})
			if tc.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

// A capture waits for its pod's status to settle: the kubelet posts it
// around the time it tears the volumes down.
func TestKubePodsStepResultWaitsForTheStatus(t *testing.T) {
	p := stepPod("step", "u1", nil)
	p.Status.ContainerStatuses = []corev1.ContainerStatus{running}
	client := fake.NewClientset(p)
	ctx := context.Background()
	pods := &kubePods{client: client, lister: watchPods(ctx, fake.NewClientset(), "node-1").lister,
		settleWait: 5 * time.Second, settlePoll: 20 * time.Millisecond}
	go func() {
		time.Sleep(200 * time.Millisecond)
		done := p.DeepCopy()
		done.Status.Phase = corev1.PodSucceeded
		done.Status.ContainerStatuses = []corev1.ContainerStatus{terminated(0, "Completed", true)}
		_, err := client.CoreV1().Pods("ci").UpdateStatus(ctx, done, metav1.UpdateOptions{})
		if err != nil {
			panic(err)
		}
	}()
	result, ok := pods.StepResult(ctx, volume.Pod{Namespace: "ci", Name: "step", UID: "u1"})
	require.True(t, ok)
	require.Equal(t, volume.StepSucceeded, result)

	pods.settleWait = 100 * time.Millisecond
	_, ok = pods.StepResult(ctx, volume.Pod{Namespace: "ci", Name: "step", UID: "other"})
	require.False(t, ok, "another pod's status says nothing of this one's step")
}

func TestControllerOf(t *testing.T) {
	const uid = "6f1c4d1e-8a55-4c43-9a3e-1d2b3c4d5e6f"
	ref := func(apiVersion, kind, name string, controller bool) metav1.OwnerReference {
		return metav1.OwnerReference{APIVersion: apiVersion, Kind: kind, Name: name, UID: uid, Controller: ptr.To(controller)}
	}
	tests := []struct {
		name    string
		refs    []metav1.OwnerReference
		want    volume.Owner
		wantOK  bool
		wantErr bool
	}{
		{name: "no owner"},
		{name: "owners, none controlling", refs: []metav1.OwnerReference{ref("argoproj.io/v1alpha1", "Workflow", "wf", false)}},
		{name: "an Argo workflow", refs: []metav1.OwnerReference{ref("v1", "ConfigMap", "cm", false), ref("argoproj.io/v1alpha1", "Workflow", "wf", true)},
			want: volume.Owner{Group: "argoproj.io", Kind: "Workflow", Name: "wf", UID: uid}, wantOK: true},
		{name: "the core group", refs: []metav1.OwnerReference{ref("v1", "ReplicationController", "rc", true)},
			want: volume.Owner{Kind: "ReplicationController", Name: "rc", UID: uid}, wantOK: true},
		{name: "a malformed apiVersion", refs: []metav1.OwnerReference{ref("a/b/c", "Workflow", "wf", true)}, wantErr: true},
		{name: "a kind with a dot", refs: []metav1.OwnerReference{ref("example.com/v1", "Work.flow", "wf", true)}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "step", Namespace: "ci", OwnerReferences: tt.refs}}
			got, ok, err := controllerOf(pod)
			if tt.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.wantOK, ok)
			require.Equal(t, tt.want, got)
		})
	}
}
