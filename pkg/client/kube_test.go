package client

import (
	"testing"

	"github.com/stretchr/testify/require"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
)

// The pod DialKube reaches is the Lease's holder; with no Lease (one
// replica, no election), a ready pod the selector finds; with a Lease
// that has no holder (a failover under way), none: a ready follower would
// answer every call Unavailable for the connection's life (TestFleet saw
// a client stuck on one for a minute after the leader's pod was deleted).
func TestForwarderLeader(t *testing.T) {
	holder := func(name string) *coordinationv1.Lease {
		l := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: "cowvol", Name: "cowvol-controller"}}
		if name != "-" {
			l.Spec.HolderIdentity = &name
		}
		return l
	}
	readyPod := func(name string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "cowvol", Name: name, Labels: map[string]string{"app": "cowvol-controller"}},
			Status: corev1.PodStatus{Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}}
	}
	tests := []struct {
		name    string
		objects []runtime.Object
		want    string
		wantErr string
	}{
		{name: "the Lease's holder", objects: []runtime.Object{holder("leader-pod"), readyPod("follower-pod")}, want: "leader-pod"},
		{name: "a Lease let go", objects: []runtime.Object{holder(""), readyPod("follower-pod")}, wantErr: "has no holder"},
		{name: "a Lease never held", objects: []runtime.Object{holder("-"), readyPod("follower-pod")}, wantErr: "has no holder"},
		{name: "no Lease: the ready pod", objects: []runtime.Object{readyPod("only-pod")}, want: "only-pod"},
		{name: "no Lease, no ready pod", wantErr: "no ready controller pod"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := KubeOptions{}
			o.defaults()
			f := &forwarder{kube: fake.NewClientset(tc.objects...), o: o}
			got, err := f.leader(t.Context())
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}
