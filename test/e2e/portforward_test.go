//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"k8s.io/client-go/tools/clientcmd"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/pkg/client"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
	"github.com/concourse/cowvol/test/localcluster"
)

// controllerPod runs cowvol's controller as a pod (the binary from the
// host, the test's busybox image), electing itself leader through a Lease,
// serving its API on port of the host's loopback (the pod shares the
// host's network, as the e2e's pods do).
func (c *cluster) controllerPod(name, lease string, port int) {
	bin := os.Getenv("COWVOL_PLUGIN_BINARY")
	pod := map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": name, "namespace": "cowvol", "labels": map[string]any{"app": name}},
		"spec": map[string]any{
			"nodeName": localcluster.NodeName, "restartPolicy": "Never", "hostNetwork": true, "dnsPolicy": "Default",
			"automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
			"containers": []any{map[string]any{
				"name": "cowvol", "image": localcluster.BusyboxImage, "imagePullPolicy": "Never",
				"command": []string{"/cowvol/bin/" + filepath.Base(bin), "--mode=controller", "--endpoint=unix:///tmp/csi.sock",
					fmt.Sprintf("--api-address=127.0.0.1:%d", port), "--kubeconfig=/cowvol/kubeconfig/" + filepath.Base(c.Kubeconfig),
					"--leader-election", "--leader-election-namespace=cowvol", "--leader-election-lease=" + lease,
					"--leader-election-identity=" + name,
					// The node's plugin reports elsewhere: answer from the
					// test's own report at once.
					"--await-reports-for=0s"},
				"volumeMounts": []any{
					map[string]any{"name": "bin", "mountPath": "/cowvol/bin", "readOnly": true},
					map[string]any{"name": "kubeconfig", "mountPath": "/cowvol/kubeconfig", "readOnly": true},
				},
			}},
			"volumes": []any{
				map[string]any{"name": "bin", "hostPath": map[string]any{"path": filepath.Dir(bin)}},
				map[string]any{"name": "kubeconfig", "hostPath": map[string]any{"path": filepath.Dir(c.Kubeconfig)}},
			},
		},
	}
	raw, _ := json.Marshal(pod)
	c.MustKubectl(string(raw), "apply", "-f", "-")
	c.T.Cleanup(func() { _, _ = c.Kubectl("", "delete", "pod", "-n", "cowvol", name, "--wait=false") })
	c.Until("the controller pod to lead", 60*time.Second, func() bool {
		out, _ := c.Kubectl("", "get", "lease", "-n", "cowvol", lease, "-o", "jsonpath={.spec.holderIdentity}")
		return strings.TrimSpace(out) == name
	})
}

// reachThroughKubeconfig: a scheduler with nothing but a kubeconfig
// reaches the controller running as a pod, through a port-forward to the
// Lease holder, for the Cache and the Registry APIs; so does kubectl cowvol
// without --controller-address.
func (c *cluster) reachThroughKubeconfig() {
	t := c.T
	ctx := context.Background()
	const name, lease = "cowvol-controller-pf", "cowvol-controller-pf"
	port := plugintest.FreePort(t)
	c.controllerPod(name, lease, port)
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	require.NoError(t, err)
	via := client.KubeOptions{Namespace: "cowvol", Lease: lease, Port: port}

	opts, err := client.KubeDialOptions(ctx, cfg, via)
	require.NoError(t, err)
	conn, err := grpc.NewClient("passthrough:///cowvol-controller", opts...)
	require.NoError(t, err)
	defer conn.Close()
	_, err = controllerv1.NewRegistryClient(conn).Report(ctx, &controllerv1.ReportRequest{NodeId: "pf-node", StoreId: "s", Revision: 1, Full: true,
		Upserts: []*controllerv1.VolumeSummary{{Ref: &controllerv1.VolumeRef{Namespace: "ci", Handle: "through-the-api-server"}, State: "ready", SizeBytes: 7}}})
	require.NoError(t, err)

	cache, err := client.DialKube(ctx, cfg, via)
	require.NoError(t, err)
	defer cache.Close()
	start := time.Now()
	locs, err := cache.Lookup(ctx, cowvolume.Ref{Namespace: "ci", Handle: "through-the-api-server"})
	require.NoError(t, err)
	require.Equal(t, []string{"pf-node"}, locs[0].Nodes)
	report(t, fmt.Sprintf("a scheduler with only a kubeconfig reached the controller pod %s through a port-forward: first lookup %s (connection included)\n",
		name, time.Since(start).Round(time.Millisecond)))

	out, err := c.runKubectlCowvol("volumes", "-n", "ci", fmt.Sprintf("--controller-port=%d", port), "--controller-lease="+lease)
	require.NoError(t, err, out)
	require.Regexp(t, `(?m)^ci\s+through-the-api-server\s+ready\s`, out)

	// A failover: the same client's next connection goes to the new
	// leader (whose view is empty until nodes report).
	c.MustKubectl("", "delete", "pod", "-n", "cowvol", name)
	c.controllerPod(name+"-2", lease, port)
	c.Until("the client to reach the new leader", 60*time.Second, func() bool {
		nodes, err := cache.Nodes(ctx)
		return err == nil && len(nodes) == 0
	})
	c.MustKubectl("", "delete", "pod", "-n", "cowvol", name+"-2")
}
