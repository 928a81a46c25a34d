//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/pkg/client"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
	"github.com/concourse/cowvol/test/localcluster"
)

// The RBAC an operator writes: a node's ServiceAccount may report, a
// team's scheduler may read and destroy its namespace's cached volumes.
const kubeAuthRBAC = `
apiVersion: v1
kind: ServiceAccount
metadata: {name: e2e-node, namespace: cowvol}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: e2e-cowvol-node}
rules:
  - apiGroups: [cowvol.concourse-ci.org]
    resources: [cachenodes]
    verbs: [update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: e2e-cowvol-node}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: e2e-cowvol-node}
subjects: [{kind: ServiceAccount, name: e2e-node, namespace: cowvol}]
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: scheduler, namespace: ci}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: cowvol-scheduler, namespace: ci}
rules:
  - apiGroups: [cowvol.concourse-ci.org]
    resources: [cachedvolumes]
    verbs: [get, list, delete]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: cowvol-scheduler, namespace: ci}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: cowvol-scheduler}
subjects: [{kind: ServiceAccount, name: scheduler, namespace: ci}]
`

// kubeAuth: a controller with --kube-auth checks tokens with TokenReviews
// and each call with a SubjectAccessReview, so ordinary RBAC decides who
// may do what in which namespace.
func (c *cluster) kubeAuth() {
	t := c.T
	ctx := context.Background()
	c.MustKubectl(kubeAuthRBAC, "apply", "-f", "-")
	addr := fmt.Sprintf("127.0.0.1:%d", plugintest.FreePort(t))
	plugintest.Start(t, plugintest.Config{Mode: "controller", Args: []string{
		"--api-address=" + addr, "--kubeconfig=" + c.Kubeconfig, "--node-id=ctl-kube-auth", "--kube-auth",
		// The node's plugin reports to the cluster's controller, never to
		// this one: it answers from the test's own reports at once.
		"--await-reports-for=0s"}})
	dial := func(token string) *client.Client {
		cl, err := client.Dial(client.Options{Address: addr, Token: token})
		require.NoError(t, err)
		t.Cleanup(func() { cl.Close() })
		return cl
	}
	registry := func(token string) controllerv1.RegistryClient {
		opts, err := client.DialOptions(client.Options{Address: addr, Token: token})
		require.NoError(t, err)
		conn, err := grpc.NewClient(addr, opts...)
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close() })
		return controllerv1.NewRegistryClient(conn)
	}
	ref := func(ns, handle string) cowvolume.Ref { return cowvolume.Ref{Namespace: ns, Handle: handle} }
	token := func(ns, sa string) string {
		return strings.TrimSpace(c.MustKubectl("", "create", "token", "-n", ns, sa))
	}
	// A node plugin's own token is bound to its pod, on its node: the
	// API server's review names the node, and the token speaks for it
	// alone. A pod of the node's ServiceAccount on this node (its token
	// needs only the object) stands for the plugin's.
	c.MustKubectl(fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: e2e-node-plugin, namespace: cowvol}
spec:
  serviceAccountName: e2e-node
  nodeName: %s
  containers: [{name: pause, image: %q}]
`, localcluster.NodeName, localcluster.PauseImage), "apply", "-f", "-")
	uid := strings.TrimSpace(c.MustKubectl("", "get", "pod", "-n", "cowvol", "e2e-node-plugin", "-o", "jsonpath={.metadata.uid}"))
	nodeToken := strings.TrimSpace(c.MustKubectl("", "create", "token", "-n", "cowvol", "e2e-node",
		"--bound-object-kind=Pod", "--bound-object-name=e2e-node-plugin", "--bound-object-uid="+uid))
	unboundNodeToken, schedulerToken := token("cowvol", "e2e-node"), token("ci", "scheduler")
	scheduler := dial(schedulerToken)
	noToken, badToken := dial(""), dial("not-a-token-the-cluster-knows")

	vol := func(ns, handle, scope string) *controllerv1.VolumeSummary {
		return &controllerv1.VolumeSummary{Ref: &controllerv1.VolumeRef{Namespace: ns, Handle: handle}, State: "ready", SizeBytes: 1, Scope: scope}
	}
	inventory := &controllerv1.ReportRequest{NodeId: localcluster.NodeName, StoreId: "s", Revision: 1, Full: true, Upserts: []*controllerv1.VolumeSummary{
		vol("ci", "mine", "namespace"), vol("other", "private", "namespace"), vol("other", "shared", "cluster")}}
	_, err := registry(schedulerToken).Report(ctx, inventory)
	require.Equal(t, codes.PermissionDenied, status.Code(err), "a scheduler may not report: %v", err)
	require.Contains(t, err.Error(), "cachenodes.cowvol.concourse-ci.org")
	_, err = registry(unboundNodeToken).Report(ctx, inventory)
	require.Equal(t, codes.PermissionDenied, status.Code(err), "a node's token bound to no pod speaks for no node: %v", err)
	other := proto.Clone(inventory).(*controllerv1.ReportRequest)
	other.NodeId = "another-node"
	_, err = registry(nodeToken).Report(ctx, other)
	require.Equal(t, codes.PermissionDenied, status.Code(err), "the node's token speaking for another node: %v", err)
	_, err = registry(nodeToken).Report(ctx, inventory)
	require.NoError(t, err, "the node's ServiceAccount may report for its own node")

	for _, cl := range []*client.Client{noToken, badToken} {
		_, err := cl.Lookup(ctx, ref("ci", "mine"))
		require.Equal(t, codes.Unauthenticated, status.Code(err), "%v", err)
	}
	locs, err := scheduler.Lookup(ctx, ref("ci", "mine"), ref("other", "private"), ref("other", "shared"))
	require.NoError(t, err)
	require.Equal(t, []bool{true, false, true}, []bool{locs[0].Found, locs[1].Found, locs[2].Found},
		"its namespace's volume and a shared one; another namespace's private one is not found")
	listed, err := scheduler.List(ctx, &controllerv1.ListVolumesRequest{})
	require.NoError(t, err)
	require.Len(t, listed, 2, "a listing holds only what the scheduler may see")
	_, err = scheduler.Destroy(ctx, ref("other", "private"))
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	_, err = scheduler.Pin(ctx, time.Time{}, ref("ci", "mine"))
	require.Equal(t, codes.PermissionDenied, status.Code(err), "the Role grants no update: no pins")
	_, err = scheduler.Nodes(ctx)
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	asked, err := scheduler.Destroy(ctx, ref("ci", "mine"))
	require.NoError(t, err)
	require.Equal(t, []string{localcluster.NodeName}, asked[0].Nodes)

	// The operator's CLI presents the kubeconfig's own token (admin here).
	require.Regexp(t, `(?m)^`+localcluster.NodeName+`\s+running\s`, c.kubectlCowvolAt(addr, "nodes"))
	c.MustKubectl("", "delete", "pod", "-n", "cowvol", "e2e-node-plugin", "--grace-period=1")
	report(t, "kube-auth: a namespace's ServiceAccount sees its volumes and shared ones, is refused another's and cluster-wide calls; a node's token speaks for its pod's node alone; kubectl cowvol authenticates with the kubeconfig's token\n")
}
