package controller

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// What an API server cannot be made to do on cue in a test: fail. The
// e2e checks KubeAuth against a real one; this checks that a failing API
// server refuses calls (never lets them through), and that answers are
// cached.
func TestKubeAuthFailsClosedAndCaches(t *testing.T) {
	kube := fake.NewSimpleClientset()
	var reviews, accessReviews int
	apiDown := false
	kube.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		reviews++
		if apiDown {
			return true, nil, errors.New("connection refused")
		}
		tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		tr.Status.Authenticated = tr.Spec.Token == "good-token"
		tr.Status.User = authnv1.UserInfo{Username: "system:serviceaccount:ci:scheduler", Groups: []string{"system:serviceaccounts"}}
		return true, tr, nil
	})
	kube.PrependReactor("create", "subjectaccessreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		accessReviews++
		if apiDown {
			return true, nil, errors.New("connection refused")
		}
		sar := a.(k8stesting.CreateAction).GetObject().(*authzv1.SubjectAccessReview)
		attrs := sar.Spec.ResourceAttributes
		sar.Status.Allowed = attrs.Group == APIGroup && attrs.Resource == ResourceVolumes && attrs.Namespace == "ci" && attrs.Verb == "get"
		return true, sar, nil
	})
	auth := NewKubeAuth(kube, time.Minute)
	ctx := context.Background()

	_, err := auth.Authenticate(ctx, "bad-token")
	require.Equal(t, codes.Unauthenticated, status.Code(err))
	c, err := auth.Authenticate(ctx, "good-token")
	require.NoError(t, err)
	require.Equal(t, "system:serviceaccount:ci:scheduler", c.User)
	require.True(t, c.May(ctx, "get", ResourceVolumes, "ci"))
	require.False(t, c.May(ctx, "get", ResourceVolumes, "other"))
	require.False(t, c.May(ctx, "delete", ResourceVolumes, "ci"))
	require.Equal(t, 2, reviews)
	require.Equal(t, 3, accessReviews)

	apiDown = true
	c, err = auth.Authenticate(ctx, "good-token")
	require.NoError(t, err, "a cached review")
	require.True(t, c.May(ctx, "get", ResourceVolumes, "ci"), "a cached grant")
	require.False(t, c.May(ctx, "list", ResourceVolumes, "ci"), "a grant the API server cannot be asked about is refused")
	_, err = auth.Authenticate(ctx, "new-token")
	require.Equal(t, codes.Unavailable, status.Code(err), "a token the API server cannot be asked about is refused, retryably")
}

// A reviewed token speaks for the node of the pod it is bound to, and a
// token bound to no pod (or not a ServiceAccount's) speaks for none.
func TestKubeAuthNodeIsTheBoundPods(t *testing.T) {
	bound := map[string]authnv1.ExtraValue{extraPodName: {"cowvol-node-x1"}, extraNodeName: {"node-a"}}
	tests := []struct {
		name     string
		user     authnv1.UserInfo
		wantNode string
	}{
		{"a node plugin's projected token", authnv1.UserInfo{Username: "system:serviceaccount:cowvol:cowvol-node", Extra: bound}, "node-a"},
		{"a ServiceAccount token bound to no pod", authnv1.UserInfo{Username: "system:serviceaccount:cowvol:cowvol-node"}, ""},
		{"a user that is no ServiceAccount", authnv1.UserInfo{Username: "admin", Extra: bound}, ""},
		{"two nodes", authnv1.UserInfo{Username: "system:serviceaccount:cowvol:cowvol-node",
			Extra: map[string]authnv1.ExtraValue{extraPodName: {"p"}, extraNodeName: {"node-a", "node-b"}}}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			kube := fake.NewSimpleClientset()
			kube.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
				tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
				tr.Status.Authenticated, tr.Status.User = true, tc.user
				return true, tr, nil
			})
			c, err := NewKubeAuth(kube, time.Minute).Authenticate(context.Background(), "token")
			require.NoError(t, err)
			require.Equal(t, tc.wantNode, c.Node)
			ctx := context.WithValue(context.Background(), callerKey{}, c)
			require.Equal(t, codes.PermissionDenied, status.Code(speaksFor(ctx, "node-b")), "speaking for another node")
			if tc.wantNode != "" {
				require.NoError(t, speaksFor(ctx, tc.wantNode))
			}
		})
	}
}
