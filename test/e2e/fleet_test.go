//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/concourse/cowvol/examples/scheduler"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/driver"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
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
	host       *netlab.Host
	containerd string // its runtime's socket
	kubeletDir string
	plugin     *plugintest.Plugin // cowvol's node plugin, once installed
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
			dir: filepath.Join(work, name), cgroupRoot: "/cowvol-e2e-" + name}, host: host}
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
	f.installCowvol()
	f.fleetBuild()
	f.schedulerBuild()
	f.fleetDrain()
	f.fleetTenancy()
	report(t, fmt.Sprintf("a fleet of %d real kubelets, each in a network namespace of its own: kube-scheduler bound 6 pods each to the node it preferred, "+
		"and a pod on node-2 reached node-1's address over the bridge but not its loopback\n", len(f.nodes)))
	f.deleteSteps("ci")
}

// installCowvol runs cowvol on the fleet: the controller in the test's
// namespace, serving TLS on the lab, and a node plugin in each node's
// namespace, registered with that node's kubelet, its state dir a
// filesystem of its own (XFS with reflink; the last node's btrfs),
// reporting to the controller and pulling from its peers over mutual TLS
// across the bridge. The scheduler's client of the Cache API is f.cache.
func (f *fleet) installCowvol() {
	t := f.t
	f.mustKubectl("", "apply", "-f", "../../deploy/csi/base/namespace.yaml", "-f", "../../deploy/csi/base/csidriver.yaml")
	dir := filepath.Join(f.work, "cowvol")
	pki := netlab.NewPKI(t, filepath.Join(dir, "pki"), driver.DefaultPeerServerName, f.lab.Self)
	tokens, nodeToken := filepath.Join(dir, "tokens"), filepath.Join(dir, "node-token")
	writeFile(t, tokens, "fleet-node-token-0123456789,system:cowvol-node,*\nfleet-scheduler-token-0123,ci-scheduler,*\n")
	writeFile(t, nodeToken, "fleet-node-token-0123456789\n")
	f.controllerAddr = net.JoinHostPort(f.lab.Self, strconv.Itoa(plugintest.FreePort(t)))
	f.controller = plugintest.Start(t, plugintest.Config{Mode: "controller", NodeID: "cowvol-controller", Args: []string{
		"--api-address=" + f.controllerAddr, "--tls-cert-file=" + pki.Cert, "--tls-key-file=" + pki.Key, "--tokens-file=" + tokens,
		"--kubeconfig=" + f.kubeconfig}})
	cache, err := client.Dial(client.Options{Address: f.controllerAddr, CAFile: pki.CA, Token: "fleet-scheduler-token-0123"})
	require.NoError(t, err)
	t.Cleanup(func() { cache.Close() })
	f.cache = cache
	for i := range f.nodes {
		n := &f.nodes[i]
		kind := testfs.XFS
		if i == len(f.nodes)-1 {
			kind = testfs.Btrfs
		}
		n.plugin = plugintest.Start(t, plugintest.Config{NodeID: n.name, StateDir: testfs.Mount(t, kind, 3<<30), KubeletDir: n.kubeletDir,
			Wrap: n.host.Command, Args: []string{"--kubeconfig=" + f.kubeconfig,
				"--kubelet-registration-socket=" + filepath.Join(n.kubeletDir, "plugins_registry", driverName+"-reg.sock"),
				"--controller-address=" + f.controllerAddr, "--tls-ca-file=" + pki.CA, "--token-file=" + nodeToken,
				"--peer-address=" + net.JoinHostPort(n.address, "7443"),
				"--peer-tls-cert-file=" + pki.Cert, "--peer-tls-key-file=" + pki.Key, "--peer-ca-file=" + pki.CA}})
	}
	// Pods are deleted while the plugins can still unpublish.
	t.Cleanup(func() { f.deletePods() })
	for _, n := range f.nodes {
		f.until("cowvol to register with "+n.name+"'s kubelet", time.Minute, func() bool {
			out, err := f.kubectl("", "get", "csinode", n.name, "-o", "jsonpath={.spec.drivers[*].name}")
			return err == nil && strings.Contains(out, driverName)
		})
	}
}

// node is the fleet's node of that name.
func (f *fleet) node(name string) *fleetNode {
	for i := range f.nodes {
		if f.nodes[i].name == name {
			return &f.nodes[i]
		}
	}
	f.t.Fatalf("no node %s", name)
	return nil
}

// waitCapturedOn waits until node's plugin has captured ns/handle.
func (f *fleet) waitCapturedOn(node, ns, handle string) {
	f.t.Helper()
	p := f.node(node).plugin
	f.until("capture of "+ns+"/"+handle+" on "+node, 3*time.Minute, func() bool {
		for _, line := range strings.Split(p.Log(), "\n") {
			if strings.Contains(line, `"Captured step volume"`) && strings.Contains(line, `volume="`+ns+"/"+handle+`"`) {
				return true
			}
		}
		return false
	})
}

// startedAfterBound is how long a pod's container took to start once
// kube-scheduler bound it (whole seconds: what pod status tells).
func (f *fleet) startedAfterBound(ns, name string) time.Duration {
	f.t.Helper()
	out := f.mustKubectl("", "get", "pod", "-n", ns, name, "-o",
		`jsonpath={.status.conditions[?(@.type=="PodScheduled")].lastTransitionTime} {.status.containerStatuses[0].state.terminated.startedAt}`)
	fields := strings.Fields(out)
	require.Len(f.t, fields, 2, "%q", out)
	bound, err := time.Parse(time.RFC3339, fields[0])
	require.NoError(f.t, err)
	started, err := time.Parse(time.RFC3339, fields[1])
	require.NoError(f.t, err)
	return started.Sub(bound)
}

// fleetBuild: a get step on node-1 captures an input (files and a
// program); the Cache API places the next step on node-1, and
// kube-scheduler binds it there; a step pinned to node-3 gets the input
// from node-1 across the bridge, reads the same bytes and runs the
// program from it. Each step's time from bound to started is reported.
func (f *fleet) fleetBuild() {
	t := f.t
	const files = 2000 // of 100 KiB: 200 MiB
	f.createPodWith("ci", "get", fmt.Sprintf(`set -e; cd /out; mkdir -p bin data
		cp /bin/busybox bin/echo; yes cowvol | head -c 102400 > /tmp/block
		for i in $(seq %d); do { echo $i; cat /tmp/block; } > data/f$i; done`, files),
		[]podOpt{onNode("node-1")}, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "res-1")})
	f.mustSucceed("ci", "get")
	f.waitCapturedOn("node-1", "ci", "res-1")
	ctx := context.Background()
	ref := cowvolume.Ref{Namespace: "ci", Handle: "res-1"}
	var first string
	f.until("the controller to place a step on res-1", 30*time.Second, func() bool {
		nodes, err := f.cache.Place(ctx, ref)
		if err != nil || len(nodes) == 0 {
			return false
		}
		first = nodes[0].NodeId
		return first == "node-1"
	})
	read := `set -e; cd /in; find data -type f | sort | xargs md5sum | md5sum; ls data | wc -l; ./bin/echo ran-from-the-input`
	input := volume{name: "in", mountPath: "/in", attrs: attrs("source", "res-1"), readOnly: true}
	f.createPodWith("ci", "near", read, []podOpt{preferring(first)}, input)
	near := f.mustSucceed("ci", "near")
	require.Equal(t, "node-1", f.podOn("ci", "near"), "kube-scheduler bound the step where Place ranked first")
	f.createPodWith("ci", "far", read, []podOpt{onNode("node-3")}, input)
	far := f.mustSucceed("ci", "far")
	require.Equal(t, "node-3", f.podOn("ci", "far"))
	require.Equal(t, near, far, "the step on node-3 read node-1's bytes")
	require.Contains(t, far, fmt.Sprintf("\n%d\nran-from-the-input\n", files))
	f.until("the controller to see res-1 on node-3 too", 30*time.Second, func() bool {
		locs, err := f.cache.Lookup(ctx, ref)
		return err == nil && len(locs) == 1 && len(locs[0].Nodes) == 2
	})
	report(t, fmt.Sprintf("fleet: a step placed by the Cache API next to its %d-file, 200 MiB input started %s after kube-scheduler bound it; "+
		"one pinned to another node got the input from node-1 across the bridge and started %s after it was bound (whole seconds)\n",
		files, f.startedAfterBound("ci", "near"), f.startedAfterBound("ci", "far")))
}

// schedulerBuild runs a build of seven steps over the fleet with the
// example scheduler (examples/scheduler), as a CI would: three gets pinned
// to the three nodes, a compile placed next to its input, a test whose
// three inputs live on three nodes, a step that fails on its first node
// and is run again on another, and a package; then a CI's GC pins the
// package and destroys the rest.
func (f *fleet) schedulerBuild() {
	t := f.t
	cfg, err := clientcmd.BuildConfigFromFlags("", f.kubeconfig)
	require.NoError(t, err)
	kube, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	r := &scheduler.Runner{Kube: kube, Cache: f.cache, Namespace: "ci", Image: busyboxImage, ServiceAccount: stepsServiceAccount,
		Timeout: 3 * time.Minute, Logf: t.Logf}
	steps := []scheduler.Step{
		{Name: "get-a", Output: "src-a", Node: "node-1", Script: "echo alpha > /out/a"},
		{Name: "get-b", Output: "src-b", Node: "node-2", Script: "echo beta > /out/b"},
		{Name: "get-c", Output: "src-c", Node: "node-3", Script: "echo gamma > /out/c"},
		{Name: "compile", Inputs: []string{"src-a"}, Output: "bin", Script: "tr a-z A-Z < /in/src-a/a > /out/a.bin"},
		{Name: "test", Inputs: []string{"bin", "src-b", "src-c"}, Output: "report",
			Script: "cat /in/bin/a.bin /in/src-b/b /in/src-c/c > /out/report"},
		// Fails on its first attempt (the pod's name ends in -1).
		{Name: "flaky", Inputs: []string{"report"}, Output: "checked",
			Script: `case $(hostname) in *-1) exit 1;; esac; wc -l < /in/report/report > /out/lines`},
		{Name: "package", Inputs: []string{"report", "checked"}, Output: "pkg",
			Script: "cat /in/report/report /in/checked/lines | tee /out/pkg"},
	}
	ctx := context.Background()
	started := time.Now()
	results, err := r.Run(ctx, "b1", steps)
	require.NoError(t, err)
	took := time.Since(started)
	byStep := map[string]scheduler.Result{}
	for _, res := range results {
		byStep[res.Step] = res
	}
	require.Equal(t, "ALPHA\nbeta\ngamma\n3\n", byStep["package"].Log)
	for _, s := range steps {
		res := byStep[s.Name]
		switch {
		case s.Node != "":
			require.Equal(t, s.Node, res.Node, "pinned step %s", s.Name)
		case s.Name != "flaky":
			require.NotEmpty(t, res.Ranked, s.Name)
			require.Equal(t, res.Ranked[0], res.Node, "kube-scheduler bound %s where Place ranked first", s.Name)
		}
	}
	require.Equal(t, "node-1", byStep["compile"].Node, "compile runs next to its input")
	require.Equal(t, 2, byStep["flaky"].Attempts, "the failed step ran again")
	require.NotEqual(t, "", byStep["flaky"].Handle)
	handles := func(names ...string) []string {
		var hs []string
		for _, n := range names {
			hs = append(hs, byStep[n].Handle)
		}
		return hs
	}
	require.NoError(t, r.Pin(ctx, time.Now().Add(time.Hour), handles("package")...))
	gone := handles("get-a", "get-b", "get-c", "compile", "test", "flaky")
	// The failed attempt's output was destroyed already.
	gone = append(gone, strings.TrimSuffix(byStep["flaky"].Handle, "-2")+"-1")
	require.NoError(t, r.Destroy(ctx, gone...))
	f.until("the destroyed outputs to be gone from every node", time.Minute, func() bool {
		for _, h := range gone {
			locs, err := f.cache.Lookup(ctx, cowvolume.Ref{Namespace: "ci", Handle: h})
			if err != nil || (len(locs) == 1 && len(locs[0].Nodes) != 0) {
				return false
			}
		}
		return true
	})
	locs, err := f.cache.Lookup(ctx, cowvolume.Ref{Namespace: "ci", Handle: byStep["package"].Handle})
	require.NoError(t, err)
	require.NotEmpty(t, locs[0].Nodes, "the pinned package stays")
	report(t, fmt.Sprintf("fleet: the example scheduler ran a 7-step build over 3 nodes in %s: each unpinned step bound where Place ranked it first, "+
		"a test read three inputs held on three nodes, a step that failed ran again on another node, and the CI's GC pinned the package and destroyed the rest\n",
		took.Round(100*time.Millisecond)))
}

// fleetDrain: a node drained during a build takes no new step, and a
// volume only it holds stays pullable while it lands; uncordoned, it is
// back in service.
func (f *fleet) fleetDrain() {
	t := f.t
	ctx := context.Background()
	f.createPodWith("ci", "before-drain", "echo held-by-node-1 > /out/f", []podOpt{onNode("node-1")},
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "drain-src")})
	f.mustSucceed("ci", "before-drain")
	f.waitCapturedOn("node-1", "ci", "drain-src")
	state := func(node string) string {
		nodes, err := f.cache.Nodes(ctx)
		require.NoError(t, err)
		for _, n := range nodes {
			if n.NodeId == node {
				return n.State
			}
		}
		return ""
	}
	f.mustKubectl("", "drain", "node-1", "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=90s")
	f.until("the controller to take node-1 out of service", 30*time.Second, func() bool {
		s := state("node-1")
		return s == "landing" || s == "landed"
	})
	ref := cowvolume.Ref{Namespace: "ci", Handle: "drain-src"}
	placed, err := f.cache.Place(ctx, ref)
	require.NoError(t, err)
	for _, p := range placed {
		require.NotEqual(t, "node-1", p.NodeId, "a step placed on a drained node")
	}
	read := volume{name: "in", mountPath: "/in", attrs: attrs("source", "drain-src"), readOnly: true}
	f.createPodWith("ci", "during-drain", "cat /in/f", []podOpt{preferring("node-1")}, read)
	require.Equal(t, "held-by-node-1\n", f.mustSucceed("ci", "during-drain"), "the draining node's volume is pulled")
	require.NotEqual(t, "node-1", f.podOn("ci", "during-drain"))
	f.mustKubectl("", "uncordon", "node-1")
	f.until("the controller to put node-1 back in service", 30*time.Second, func() bool { return state("node-1") == "running" })
	f.createPodWith("ci", "after-drain", "cat /in/f", []podOpt{preferring("node-1")}, read)
	require.Equal(t, "held-by-node-1\n", f.mustSucceed("ci", "after-drain"))
	require.Equal(t, "node-1", f.podOn("ci", "after-drain"))
	report(t, "fleet: a node drained during a build took no step, its volume was pulled from it while it landed, and uncordoned it was placed on again\n")
}

// fleetTenancy: another namespace's pod on any node, naming ci's private
// volume (as its own, or as ci's with sourceNamespace), is answered as it
// is for a volume that does not exist, and never reads it.
func (f *fleet) fleetTenancy() {
	t := f.t
	for _, node := range []string{"node-1", "node-2", "node-3"} {
		for name, a := range map[string]map[string]string{
			"own":     attrs("source", "drain-src"),
			"as-ci":   attrs("source", "drain-src", "sourceNamespace", "ci"),
			"missing": attrs("source", "no-such-volume", "sourceNamespace", "ci"),
		} {
			pod := "steal-" + name + "-" + node
			f.createPodWith("other", pod, "cat /in/f", []podOpt{onNode(node)}, volume{name: "in", mountPath: "/in", attrs: a, readOnly: true})
		}
	}
	for _, node := range []string{"node-1", "node-2", "node-3"} {
		var said []string
		for _, name := range []string{"own", "as-ci", "missing"} {
			pod := "steal-" + name + "-" + node
			var msg string
			f.until("the publish of "+pod+" to be refused", time.Minute, func() bool {
				for _, line := range strings.Split(f.events("other", pod), "\n") {
					if strings.HasPrefix(line, "FailedMount: ") {
						msg = line
						return true
					}
				}
				return false
			})
			require.Equal(t, "Pending", f.phase("other", pod), pod)
			said = append(said, strings.ReplaceAll(strings.ReplaceAll(msg, "no-such-volume", "drain-src"), pod, "POD"))
		}
		require.Contains(t, said[0], "not found", node)
		require.Equal(t, said[2], said[1], "on %s, ci's volume is told from a missing one", node)
	}
	report(t, "fleet: another namespace's pods on every node naming ci's private volume, as their own or as ci's, were answered as for a volume that does not exist\n")
}
