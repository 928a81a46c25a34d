//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/testfs"
)

// fleet is several real nodes on one machine. Each node is a network
// namespace of its own with an address on the lab's bridge (internal/netlab),
// where its containerd and kubelet run, with its own kubelet root dir,
// containerd root, cgroup root and pod logs; one etcd, API server,
// controller manager and kube-scheduler serve them all from the test's own
// namespace, the API server on the test's address on the lab, which is how
// the nodes reach it. Pods on different nodes reach each other only over
// the bridge, as over a real network.
type fleet struct {
	*cluster
	nodes []fleetNode
}

// fleetNode is one of a fleet's nodes.
type fleetNode struct {
	nodeHost
	containerd string // its runtime's socket
	kubeletDir string
}

// startFleet brings up the control plane and n nodes, node-1 to node-<n>,
// each Ready with the harness's images in its runtime, and registers
// their teardown: nothing of them is left.
func startFleet(t *testing.T, n int) *fleet {
	testfs.Need(t, "containerd", "containerd-shim-runc-v2", "runc", "etcd", "ctr", "busybox", "ip", "nsenter")
	bin := kubeBin(t)
	// Made first, so that it goes last: the nodes' namespaces outlive
	// their processes.
	lab := netlab.New(t)
	work, err := os.MkdirTemp("", "cowvol-fleet-")
	require.NoError(t, err)
	// Traversable, as /var/lib and /run are (see startNodeOn).
	require.NoError(t, os.Chmod(work, 0o711))
	c := &cluster{t: t, work: work, bin: bin, procs: map[string]*proc{}, sysctls: map[string]string{}, links: linkNames(t), lab: lab}
	for _, s := range kubeletSysctls {
		v, err := os.ReadFile("/proc/sys/" + s)
		require.NoError(t, err)
		c.sysctls[s] = strings.TrimSpace(string(v))
	}
	t.Cleanup(c.teardown)
	require.NoError(t, os.MkdirAll(filepath.Join(work, "logs"), 0o755))
	c.startEtcd()
	c.startAPIServer(true)
	c.startControllers()
	f := &fleet{cluster: c}
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("node-%d", i)
		host := lab.Host(name)
		node := fleetNode{nodeHost: nodeHost{name: name, address: host.IP, netns: host.Netns,
			dir: filepath.Join(work, name), cgroupRoot: "/cowvol-e2e-" + name}}
		f.makeCgroupRoot(node.cgroupRoot)
		node.containerd = c.startRuntime(node.nodeHost, filepath.Join(node.dir, "cowvol-snapshotter.sock"))
		c.runtimes = append(c.runtimes, node.containerd)
		c.importImagesInto(node.containerd)
		node.kubeletDir = c.startKubeletOn(node.nodeHost, node.containerd)
		f.nodes = append(f.nodes, node)
	}
	c.until("every node to be Ready", 2*time.Minute, func() bool {
		out, err := c.kubectl("", "get", "nodes", "-o", `jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{" "}{end}`)
		return err == nil && strings.Count(out, "True") == n
	})
	for _, ns := range []string{"ci", "other"} {
		c.mustKubectl("", "create", "namespace", ns)
		c.mustKubectl("", "create", "serviceaccount", stepsServiceAccount, "-n", ns)
	}
	c.until("the default ServiceAccounts", time.Minute, func() bool {
		_, err := c.kubectl("", "get", "serviceaccount", "default", "-n", "ci")
		return err == nil
	})
	return f
}

// makeCgroupRoot makes the cgroup a node's pods go under, in every
// hierarchy (the kubelet refuses a root that does not exist).
func (f *fleet) makeCgroupRoot(root string) {
	hierarchies, err := os.ReadDir("/sys/fs/cgroup")
	require.NoError(f.t, err)
	for _, h := range hierarchies {
		dir := filepath.Join("/sys/fs/cgroup", h.Name())
		if st, err := os.Lstat(dir); err != nil || !st.IsDir() {
			continue
		}
		require.NoError(f.t, os.MkdirAll(dir+root, 0o755))
	}
	f.cgroupRoots = append(f.cgroupRoots, root)
}

// podOn says which node a pod was bound to.
func (f *fleet) podOn(ns, name string) string {
	return strings.TrimSpace(f.mustKubectl("", "get", "pod", "-n", ns, name, "-o", "jsonpath={.spec.nodeName}"))
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
// namespace. kube-scheduler spreads pods over them; each pod runs in its
// node's namespace (its address is the node's); a pod on one node reaches
// a server on another node's address over the bridge, and not on that
// node's loopback, which is its own.
func TestFleet(t *testing.T) {
	f := startFleet(t, 3)

	// Two pods preferring each node: kube-scheduler binds each there, and
	// it runs in that node's network namespace.
	placed := map[string]string{}
	for i := range 6 {
		name, node := fmt.Sprintf("placed-%d", i), f.nodes[i%3].name
		placed[name] = node
		f.createPodWith("ci", name, "ip -4 -o addr show eth0", []podOpt{preferring(node)})
	}
	for name, node := range placed {
		out := f.mustSucceed("ci", name)
		require.Equal(t, node, f.podOn("ci", name), "kube-scheduler bound %s where it was preferred", name)
		var ip string
		for _, n := range f.nodes {
			if n.name == node {
				ip = n.address
			}
		}
		require.Contains(t, out, " "+ip+"/24", "pod %s runs in its node's network namespace", name)
	}

	// A server on node-1; a client on node-2 reaches it at node-1's
	// address, over the bridge, and finds nothing at its own loopback,
	// which is not node-1's.
	n1 := f.nodes[0]
	f.createPodWith("ci", "server", `(echo over-the-bridge | nc -l -p 8080) & (echo loopback | nc -l -p 8081) & sleep 60`,
		[]podOpt{onNode(n1.name)})
	f.until("the server to run", time.Minute, func() bool { return f.phase("ci", "server") == "Running" })
	f.createPodWith("ci", "client", `for i in $(seq 30); do nc -w 2 `+n1.address+` 8080 2>/dev/null && break; sleep 1; done
		nc -w 2 127.0.0.1 8081 2>/dev/null || echo "no loopback of node-1's here"`, []podOpt{onNode("node-2")})
	require.Equal(t, "over-the-bridge\nno loopback of node-1's here\n", f.mustSucceed("ci", "client"))
	require.Equal(t, "node-2", f.podOn("ci", "client"))
	report(t, fmt.Sprintf("a fleet of %d real kubelets, each in a network namespace of its own: kube-scheduler bound 6 pods each to the node it preferred, "+
		"and a pod on node-2 reached node-1's address over the bridge but not its loopback\n", len(f.nodes)))
	f.deleteSteps("ci")
}
