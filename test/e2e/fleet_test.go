//go:build e2e

package e2e

import (
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/concourse/cowvol/internal/tb"
	"github.com/concourse/cowvol/test/localcluster"
	"github.com/stretchr/testify/require"
)

// fleet is a cluster of several real nodes (localcluster.StartFleet:
// each in network and mount namespaces of its own, routing a pod subnet
// of its own) with what its scenarios measured.
type fleet struct {
	*cluster
	// figures are what the scenarios measured, for the table TestFleet
	// prints at its end.
	figures [][2]string
}

// startFleet is a fleet of n nodes (localcluster.StartFleet).
func startFleet(t tb.TB, n int) *fleet {
	return &fleet{cluster: &cluster{localcluster.StartFleet(t, n)}}
}

// figure records a measurement for the fleet's table.
func (f *fleet) figure(what string, value time.Duration) {
	f.figures = append(f.figures, [2]string{what, value.Round(100 * time.Millisecond).String()})
}

// figureTable is the fleet's measurements as a table.
func (f *fleet) figureTable() string {
	width := 0
	for _, r := range f.figures {
		width = max(width, len(r[0]))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "fleet figures (%d real kubelets, one run):\n", len(f.Nodes))
	for _, r := range f.figures {
		fmt.Fprintf(&b, "  %-*s  %s\n", width, r[0], r[1])
	}
	return b.String()
}

// podOn says which node a pod was bound to.
func (f *fleet) podOn(ns, name string) string {
	return strings.TrimSpace(f.MustKubectl("", "get", "pod", "-n", ns, name, "-o", "jsonpath={.spec.nodeName}"))
}

// unbound lets kube-scheduler place a step pod (podJSON binds it to the
// one node of the single-node cluster).
func unbound() podOpt {
	return func(spec, _ map[string]any) { delete(spec, "nodeName") }
}

// onNode binds a step pod to a node by its name, as a nodeSelector does.
func onNode(name string) podOpt {
	return func(spec, _ map[string]any) {
		delete(spec, "nodeName")
		spec["nodeSelector"] = map[string]any{"kubernetes.io/hostname": name}
	}
}

// preferring asks kube-scheduler to bind a step pod to node if it can, as
// a scheduler that placed the step next to its inputs does (the Cache
// API's PreferNodes).
func preferring(node string) podOpt {
	return func(spec, _ map[string]any) {
		delete(spec, "nodeName")
		spec["affinity"] = map[string]any{"nodeAffinity": map[string]any{"preferredDuringSchedulingIgnoredDuringExecution": []any{
			map[string]any{"weight": 100, "preference": map[string]any{"matchExpressions": []any{
				map[string]any{"key": "kubernetes.io/hostname", "operator": "In", "values": []string{node}}}}}}}}
	}
}

// TestFleet: three real kubelets on one machine, each in its own network
// namespace, routing its pods' subnet. kube-scheduler spreads pods over
// them; each pod has an address of its node's subnet; a pod on one node
// reaches a pod on another over the bridge, and not at its loopback, which
// is its own, and reaches the API server through its Service.
func TestFleet(t *testing.T) {
	f := startFleet(t, 3)

	// Two pods preferring each node: kube-scheduler binds each there, and
	// its address is of that node's pod subnet.
	placed := map[string]localcluster.Node{}
	for i := range 6 {
		name, node := fmt.Sprintf("placed-%d", i), f.Nodes[i%3]
		placed[name] = node
		f.createPodWith("ci", name, "ip -4 -o addr show eth0", []podOpt{preferring(node.Name)})
	}
	for name, node := range placed {
		out := f.mustSucceed("ci", name)
		require.Equal(t, node.Name, f.podOn("ci", name), "kube-scheduler bound %s where it was preferred", name)
		m := regexp.MustCompile(`inet ([0-9.]+)/`).FindStringSubmatch(out)
		require.NotNil(t, m, "pod %s's eth0: %q", name, out)
		requireInSubnet(t, m[1], node.PodCIDR, "pod "+name+"'s address")
	}

	// A server pod on node-1; a client pod on node-2 reaches it at its
	// address over the bridge (node-2 routes node-1's pod subnet to
	// node-1), finds nothing at its own loopback, which is not the
	// server's, and reaches the API server through the kubernetes
	// Service (its node's kube-proxy, then masqueraded onto the lab): a
	// plain HTTP request to it is answered by Go's TLS server.
	n1 := f.Nodes[0]
	f.createPodWith("ci", "server", `(echo pod-to-pod | nc -l -p 8080) & (echo loopback | nc -l -p 8081) & sleep 60`,
		[]podOpt{onNode(n1.Name)})
	f.Until("the server to run", time.Minute, func() bool { return f.phase("ci", "server") == "Running" })
	serverIP := f.MustKubectl("", "get", "pod", "server", "-n", "ci", "-o", "jsonpath={.status.podIP}")
	requireInSubnet(t, serverIP, n1.PodCIDR, "the server's address")
	f.createPodWith("ci", "client", `for i in $(seq 30); do nc -w 2 `+serverIP+` 8080 2>/dev/null && break; sleep 1; done
		nc -w 2 127.0.0.1 8081 2>/dev/null || echo "no loopback of the server's here"
		printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 5 `+localcluster.KubernetesServiceIP+` 443 | grep -q 'HTTP request to an HTTPS server' && echo "the API server through its Service"`,
		[]podOpt{onNode("node-2")})
	require.Equal(t, "pod-to-pod\nno loopback of the server's here\nthe API server through its Service\n", f.mustSucceed("ci", "client"))
	require.Equal(t, "node-2", f.podOn("ci", "client"))
	f.scenario("install with the Helm chart", f.InstallCowvol)
	f.scenario("placement, and an input across the bridge", f.fleetBuild)
	f.scenario("pods no scheduler of ours placed land next to their inputs", f.fleetLocality)
	f.scenario("Argo Workflows builds with cowvol volumes", f.fleetArgo)
	f.scenario("a 1 GiB input across nodes, lazily and eagerly", f.fleetLargeInput)
	f.scenario("step images across nodes", f.fleetStepImage)
	f.scenario("a cache across three nodes", f.fleetCaches)
	f.scenario("the example scheduler's build", f.schedulerBuild)
	f.scenario("the controller's leader deleted mid-build", f.fleetFailover)
	f.scenario("helm upgrade mid-build", f.fleetUpgrade)
	f.scenario("a drain", f.fleetDrain)
	f.scenario("tenancy on every node", f.fleetTenancy)
	// Last: the dead node's second return (its store wiped) leaves its
	// registrar sidecar in crash-loop back-off for a minute or two.
	f.scenario("a node's death mid-read", f.fleetNodeDeath)
	report(t, f.figureTable())
	report(t, fmt.Sprintf("a fleet of %d real kubelets, each in a network namespace of its own and routing its pods' subnet: kube-scheduler bound 6 pods each to the node it preferred, "+
		"a pod on node-2 reached a pod on node-1 over the bridge but not at its loopback, and the API server through the kubernetes Service\n", len(f.Nodes)))
	f.deleteSteps("ci")
}

// waitCapturedOn waits until the controller lists node as a holder of
// ns/handle: the step's output was captured there and reported.
func (f *fleet) waitCapturedOn(node, ns, handle string) {
	f.T.Helper()
	f.Until("capture of "+ns+"/"+handle+" on "+node, 3*time.Minute, func() bool {
		return slices.Contains(f.holders(ns, handle), node)
	})
}

// startedAfterBound is how long a pod's container took to start once
// kube-scheduler bound it (whole seconds: what pod status tells).
func (f *fleet) startedAfterBound(ns, name string) time.Duration {
	f.T.Helper()
	out := f.MustKubectl("", "get", "pod", "-n", ns, name, "-o",
		`jsonpath={.status.conditions[?(@.type=="PodScheduled")].lastTransitionTime} {.status.containerStatuses[0].state.terminated.startedAt}`)
	fields := strings.Fields(out)
	require.Len(f.T, fields, 2, "%q", out)
	bound, err := time.Parse(time.RFC3339, fields[0])
	require.NoError(f.T, err)
	started, err := time.Parse(time.RFC3339, fields[1])
	require.NoError(f.T, err)
	return started.Sub(bound)
}

// requireInSubnet fails unless addr is an address of cidr.
func requireInSubnet(t tb.TB, addr, cidr, what string) {
	t.Helper()
	a, err := netip.ParseAddr(addr)
	require.NoError(t, err, what)
	require.True(t, netip.MustParsePrefix(cidr).Contains(a), "%s %s is not of %s", what, addr, cidr)
}
