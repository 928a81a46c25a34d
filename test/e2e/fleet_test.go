//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/examples/scheduler"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/plugin"
	"github.com/concourse/cowvol/pkg/registry"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
)

// fleet is several real nodes on one machine. Each node is a network
// namespace of its own with an address on the lab's bridge (internal/netlab),
// and a mount namespace of its own, where its containerd, kubelet and
// kube-proxy run, with its own kubelet root dir, containerd root, cgroup
// root, pod logs and cowvol state filesystem; one etcd, API server,
// controller manager and kube-scheduler serve them all from the test's own
// namespace, the API server on the test's address on the lab, which is how
// the nodes reach it. Pods use their node's network (there is no CNI):
// pods on different nodes reach each other only over the bridge, as over a
// real network, and Services through each node's kube-proxy.
type fleet struct {
	*cluster
	nodes []fleetNode
	// hosts is every node's /etc/hosts: where a cluster's DNS would
	// answer, it names the Services cowvol's pods dial.
	hosts string
	// helmValues are cowvol's install's.
	helmValues map[string]any
	// figures are what the scenarios measured, for the table TestFleet
	// prints at its end.
	figures [][2]string
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
	fmt.Fprintf(&b, "fleet figures (%d real kubelets, one run):\n", len(f.nodes))
	for _, r := range f.figures {
		fmt.Fprintf(&b, "  %-*s  %s\n", width, r[0], r[1])
	}
	return b.String()
}

// fleetNode is one of a fleet's nodes.
type fleetNode struct {
	nodeHost
	host       *netlab.Host
	containerd string // its runtime's socket
	kubeletDir string // as its processes see it
	state      string // its cowvol state filesystem, as the test sees it
}

// fleetView is where every node's processes find their node's dir (the
// node's kubelet root dir and cowvol state dir are below it), in the
// node's mount namespace.
func fleetView(work string) string { return filepath.Join(work, "node") }

// startFleet brings up the control plane and n nodes, node-1 to node-<n>,
// each Ready with the harness's images in its runtime, and registers
// their teardown: nothing of them is left. Each node's state filesystem
// is XFS with reflink, the last one's btrfs.
func startFleet(t *testing.T, n int) *fleet {
	testfs.Need(t, "containerd", "containerd-shim-runc-v2", "runc", "etcd", "ctr", "busybox", "ip", "nsenter", "unshare", "iptables")
	bin := kubeBin(t)
	// Made first, so that they go last: the nodes' namespaces and
	// filesystems outlive their processes.
	lab := netlab.New(t)
	states := make([]string, n)
	for i := range states {
		kind := testfs.XFS
		if i == n-1 {
			kind = testfs.Btrfs
		}
		states[i] = testfs.Mount(t, kind, 3<<30)
	}
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
	f := &fleet{cluster: c, hosts: filepath.Join(work, "hosts")}
	writeFile(t, f.hosts, "127.0.0.1 localhost\n")
	require.NoError(t, os.MkdirAll(fleetView(work), 0o755))
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("node-%d", i)
		host := lab.Host(name)
		node := fleetNode{nodeHost: nodeHost{name: name, address: host.IP, netns: host.Netns,
			dir: filepath.Join(work, name), cgroupRoot: "/" + filepath.Base(work) + "-" + name, view: fleetView(work)}, host: host, state: states[i-1]}
		f.makeCgroupRoot(node.cgroupRoot)
		f.boot(&node)
		c.runtimes = append(c.runtimes, node.containerd)
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

// boot starts a node from its disks: its mount namespace, runtime (the
// harness's images imported the first time), kubelet and kube-proxy.
func (f *fleet) boot(n *fleetNode) {
	f.makeMountns(n)
	// Services' cluster IPs are reached through eth0, where kube-proxy's
	// rules send them on to their pods.
	run(f.t, "ip", "-n", n.netns, "route", "replace", serviceCIDR, "dev", "eth0")
	first := n.containerd == ""
	// containerd finds the cowvol snapshotter where the chart's
	// images.snapshotter.socketDir puts it (installCowvol).
	n.containerd = f.startRuntime(n.nodeHost, filepath.Join(n.view, "snapshotter", "snapshotter.sock"))
	if first {
		f.importImagesInto(n.containerd)
	}
	n.kubeletDir = f.startKubeletOn(n.nodeHost, n.containerd)
	f.startKubeProxy(n.nodeHost)
}

// kill kills a node as a power cut does: every process of it at once
// (its kubelet, kube-proxy, runtime, shims and whatever runs in its pods,
// cowvol's plugin among them), its mounts gone with its mount namespace,
// and its network link down, so that its peers' connections to it hear
// nothing back, as from a machine that is gone. Its disks stay.
func (f *fleet) kill(n *fleetNode) {
	run(f.t, "ip", "-n", n.netns, "link", "set", "eth0", "down")
	for _, name := range []string{"kubelet", "kube-proxy", "containerd"} {
		f.procs[n.proc(name)].Stop(syscall.SIGKILL, 10*time.Second)
	}
	f.killShims(n.containerd)
	killCgroupProcs(n.cgroupRoot)
	f.procs[n.proc("mountns")].Stop(syscall.SIGKILL, 10*time.Second)
}

// revive brings a killed node back: its link up, and it boots from its
// disks, its cowvol store wiped first if asked (a node replaced, or its
// disk lost).
func (f *fleet) revive(n *fleetNode, wipe bool) {
	if wipe {
		entries, err := os.ReadDir(n.state)
		require.NoError(f.t, err)
		for _, e := range entries {
			require.NoError(f.t, os.RemoveAll(filepath.Join(n.state, e.Name())))
		}
	}
	run(f.t, "ip", "-n", n.netns, "link", "set", "eth0", "up")
	f.boot(n)
}

// run runs a command the harness needs to succeed.
func run(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// makeMountns gives the node a mount namespace of its own, held by a
// process that only sleeps (as a machine's disks outlive its processes):
// there its dir is at its view, a shared mount (the plugin's Bidirectional
// mounts reach the kubelet and the pods through it), its state filesystem
// at view/cowvol and the fleet's hosts file at /etc/hosts.
func (f *fleet) makeMountns(n *fleetNode) {
	require.NoError(f.t, os.MkdirAll(filepath.Join(n.dir, "cowvol"), 0o755))
	script := fmt.Sprintf(`set -e
mount --rbind %[1]s %[2]s
mount --bind %[3]s %[2]s/cowvol
mount --make-rshared %[2]s
mount --bind %[4]s /etc/hosts
exec sleep infinity`, n.dir, n.view, n.state, f.hosts)
	p := f.startOn(nodeHost{name: n.name, netns: n.netns}, n.proc("mountns"), nil, "unshare", "--mount", "--propagation", "private", "sh", "-c", script)
	mountinfo := fmt.Sprintf("/proc/%d/mountinfo", p.PID())
	f.until(n.name+"'s mount namespace", 10*time.Second, func() bool {
		b, err := os.ReadFile(mountinfo)
		return err == nil && strings.Contains(string(b), " /etc/hosts ")
	})
	n.mountns = fmt.Sprintf("/proc/%d/ns/mnt", p.PID())
}

// startKubeProxy runs kube-proxy on the node, in iptables mode in the
// node's own network namespace; it leaves the machine-wide conntrack
// settings alone.
func (f *fleet) startKubeProxy(n nodeHost) {
	config := filepath.Join(n.dir, "kube-proxy.yaml")
	writeFile(f.t, config, fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: %q}
hostnameOverride: %s
mode: iptables
bindAddress: %s
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: [primary]
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
`, f.kubeconfig, n.name, n.address))
	f.startOn(n, n.proc("kube-proxy"), nil, filepath.Join(f.bin, "kube-proxy"), "--config="+config, "--v=2")
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
	f.fleetLargeInput()
	f.fleetStepImage()
	f.schedulerBuild()
	f.fleetFailover()
	f.fleetUpgrade()
	f.fleetDrain()
	f.fleetTenancy()
	// Last: the dead node's second return (its store wiped) leaves its
	// registrar sidecar in crash-loop back-off for a minute or two.
	f.fleetNodeDeath()
	report(t, f.figureTable())
	report(t, fmt.Sprintf("a fleet of %d real kubelets, each in a network namespace of its own: kube-scheduler bound 6 pods each to the node it preferred, "+
		"and a pod on node-2 reached node-1's address over the bridge but not its loopback\n", len(f.nodes)))
	f.deleteSteps("ci")
}

// installCowvol installs cowvol on the fleet with its Helm chart, as a
// user does: the TLS Secrets made as docs/install.md says, the chart's
// DaemonSet (with the upstream registrar) on every node and its
// controller's two replicas electing a leader, the plugin's image (make
// image's) in every node's runtime. What a cluster without a CNI needs
// is set as values: cowvol's pods on their nodes' network; the nodes find
// the controller's Service by its name in their hosts file, where a
// cluster's DNS would answer. The scheduler's client of the Cache API is
// f.cache, through DialKube.
func (f *fleet) installCowvol() {
	t := f.t
	helm := os.Getenv("COWVOL_E2E_HELM_BINARY")
	if helm == "" {
		t.Fatal("COWVOL_E2E_HELM_BINARY is not set: run make e2e (it builds helm)")
	}
	for _, n := range f.nodes {
		f.importRegistrarInto(n.containerd)
	}
	pki := filepath.Join(f.work, "cowvol-pki")
	ctl := netlab.NewPKI(t, filepath.Join(pki, "controller"), "cowvol-controller.cowvol.svc")
	peer := netlab.NewPKI(t, filepath.Join(pki, "peer"), plugin.DefaultPeerServerName)
	view := fleetView(f.work)
	f.helmValues = map[string]any{
		"kubeletDir": filepath.Join(view, "kubelet"), "stateDir": filepath.Join(view, "cowvol"),
		"image":      map[string]any{"repository": "cowvol.test/cowvol-plugin", "tag": "e2e"},
		"controller": map[string]any{"hostNetwork": true},
		"node":       map[string]any{"hostNetwork": true},
		// Step images from volumes, served on each node's loopback; the
		// kubelets have the credential provider (startKubeletOn).
		"images": map[string]any{"registry": map[string]any{"enabled": true,
			"credentialProviderBinDir": filepath.Join(view, "credential-providers"),
			"containerdSocket":         filepath.Join(view, "containerd", "containerd.sock")},
			// And on their volumes' own layers, through the snapshotter the
			// nodes' containerd is configured for (boot).
			"snapshotter": map[string]any{"enabled": true, "socketDir": filepath.Join(view, "snapshotter")}},
	}
	// Helm makes the namespace; the Secrets may come after the install:
	// the pods start once the kubelet can mount them.
	f.helm(helm, "install", "cowvol", "../../deploy/helm/cowvol", "--namespace", "cowvol", "--create-namespace")
	for name, p := range map[string]netlab.PKI{"cowvol-controller-tls": ctl, "cowvol-peer-tls": peer} {
		f.mustKubectl("", "create", "secret", "generic", name, "-n", "cowvol",
			"--from-file=tls.crt="+p.Cert, "--from-file=tls.key="+p.Key, "--from-file=ca.crt="+p.CA)
	}
	// Pods are deleted while the plugins can still unpublish; before
	// that, a failed run says what cowvol's pods saw.
	t.Cleanup(func() { f.deletePods() })
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, args := range [][]string{
			{"get", "pods", "-A", "-o", "wide"},
			{"get", "events", "-A", "--sort-by=.lastTimestamp"},
			{"logs", "-n", "cowvol", "-l", "app=cowvol-node", "-c", "cowvol", "--prefix", "--tail=80"},
			{"logs", "-n", "cowvol", "-l", "app=cowvol-controller", "--prefix", "--tail=40"},
		} {
			out, _ := f.kubectl("", args...)
			t.Logf("kubectl %s:\n%s", strings.Join(args, " "), out)
		}
	})
	ip := strings.TrimSpace(f.mustKubectl("", "get", "service", "cowvol-controller", "-n", "cowvol", "-o", "jsonpath={.spec.clusterIP}"))
	writeFile(t, f.hosts, fmt.Sprintf("127.0.0.1 localhost\n%s cowvol-controller.cowvol.svc cowvol-controller.cowvol.svc.cluster.local\n", ip))
	f.waitFleetInstalled("e2e")
	cfg, err := clientcmd.BuildConfigFromFlags("", f.kubeconfig)
	require.NoError(t, err)
	cache, err := client.DialKube(context.Background(), cfg, client.KubeOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { cache.Close() })
	f.cache = cache
	f.until("every node to report to the controller", time.Minute, func() bool {
		nodes, err := cache.Nodes(context.Background())
		if err != nil || len(nodes) != len(f.nodes) {
			return false
		}
		for _, n := range nodes {
			if n.State != "running" {
				return false
			}
		}
		return true
	})
}

// helm runs helm with the fleet's values.
func (f *fleet) helm(helm string, args ...string) {
	f.t.Helper()
	raw, err := json.Marshal(f.helmValues)
	require.NoError(f.t, err)
	values := filepath.Join(f.work, "helm-values.json")
	writeFile(f.t, values, string(raw))
	out, err := exec.Command(helm, append(args, "-f", values, "--kubeconfig", f.kubeconfig)...).CombinedOutput()
	require.NoError(f.t, err, "helm %s: %s", strings.Join(args, " "), out)
}

// waitFleetInstalled waits until every node's DaemonSet pod runs the
// image of tag, ready, and has registered the plugin with its kubelet,
// and the controller's Deployment has its replicas on that image, one
// of them leading.
func (f *fleet) waitFleetInstalled(tag string) {
	f.t.Helper()
	image := "cowvol.test/cowvol-plugin:" + tag
	f.until("the DaemonSet's pods on "+tag+" to register the plugin with every kubelet", 3*time.Minute, func() bool {
		pods, err := f.kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-node",
			"-o", "jsonpath={range .items[*]}{.spec.containers[0].image} {.status.containerStatuses[*].ready}{\"\\n\"}{end}")
		if err != nil || strings.Count(pods, image+" true true\n") != len(f.nodes) || strings.Count(pods, "\n") != len(f.nodes) {
			return false
		}
		for _, n := range f.nodes {
			out, err := f.kubectl("", "get", "csinode", n.name, "-o", "jsonpath={.spec.drivers[*].name}")
			if err != nil || !strings.Contains(out, driverName) {
				return false
			}
		}
		return true
	})
	f.until("the controller's Deployment on "+tag+" to lead", 2*time.Minute, func() bool {
		out, err := f.kubectl("", "get", "deployment", "cowvol-controller", "-n", "cowvol",
			"-o", "jsonpath={.status.updatedReplicas} {.status.replicas} {.status.readyReplicas} {.spec.template.spec.containers[0].image}")
		if err != nil || out != "2 2 2 "+image {
			return false
		}
		// The Service's one endpoint is the leader's pod, which the
		// Lease names.
		leader := f.leader()
		out, err = f.kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-controller,"+plugin.LeaderLabel+"=true", "-o", "jsonpath={.items[*].metadata.name}")
		return err == nil && leader != "" && out == leader
	})
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

// waitCapturedOn waits until the controller lists node as a holder of
// ns/handle: the step's output was captured there and reported.
func (f *fleet) waitCapturedOn(node, ns, handle string) {
	f.t.Helper()
	f.until("capture of "+ns+"/"+handle+" on "+node, 3*time.Minute, func() bool {
		return slices.Contains(f.holders(ns, handle), node)
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
	nearStart, farStart := f.startedAfterBound("ci", "near"), f.startedAfterBound("ci", "far")
	f.figure("200 MiB input: step placed next to it, bound to started", nearStart)
	f.figure("200 MiB input: step on another node (lazy), bound to started", farStart)
	report(t, fmt.Sprintf("fleet: a step placed by the Cache API next to its %d-file, 200 MiB input started %s after kube-scheduler bound it; "+
		"one pinned to another node got the input from node-1 across the bridge and started %s after it was bound (whole seconds)\n",
		files, nearStart, farStart))
}

// fleetLargeInput: a get on node-1 captures 1 GiB in 50,000 files and a
// program; a step next to it (placed by the Cache API) and a step pinned
// to node-2, which gets the input lazily from node-1, read every byte of
// it alike and run the program from it. Their times from bound to
// started are reported side by side.
func (f *fleet) fleetLargeInput() {
	t := f.t
	const files, size = 50000, 21475 // 1.0 GiB
	f.createPodWith("ci", "big-get", fmt.Sprintf("mktree /out %d %d", files, size),
		[]podOpt{onNode("node-1")}, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "big")})
	f.mustSucceed("ci", "big-get")
	f.waitCapturedOn("node-1", "ci", "big")
	ranked, err := f.cache.Place(context.Background(), cowvolume.Ref{Namespace: "ci", Handle: "big"})
	require.NoError(t, err)
	require.NotEmpty(t, ranked)
	require.Equal(t, "node-1", ranked[0].NodeId, "Place ranks the holder first")
	read := `set -e; cd /in; ./bin/hello; find data -type f | sort | xargs md5sum | md5sum; find data -type f | wc -l`
	input := volume{name: "in", mountPath: "/in", attrs: attrs("source", "big"), readOnly: true}
	f.createPodWith("ci", "big-near", read, []podOpt{preferring(ranked[0].NodeId)}, input)
	near := f.mustSucceed("ci", "big-near")
	require.Equal(t, "node-1", f.podOn("ci", "big-near"))
	f.createPodWith("ci", "big-far", read, []podOpt{onNode("node-2")}, input)
	far := f.mustSucceed("ci", "big-far")
	require.Equal(t, near, far, "the step on node-2 read node-1's bytes")
	require.True(t, strings.HasPrefix(far, "hello\n") && strings.HasSuffix(far, fmt.Sprintf("\n%d\n", files)), "%q", far)
	// node-3's state dir is btrfs, whose views copy their layers: it
	// pulls eagerly (--pull-mode auto), all of the input before the step
	// starts.
	f.createPodWith("ci", "big-eager", read, []podOpt{onNode("node-3")}, input)
	require.Equal(t, near, f.mustSucceed("ci", "big-eager"), "the step on node-3 read node-1's bytes")
	nearStart, lazyStart, eagerStart := f.startedAfterBound("ci", "big-near"), f.startedAfterBound("ci", "big-far"), f.startedAfterBound("ci", "big-eager")
	report(t, fmt.Sprintf("fleet, 1 GiB in %d files: the step next to its input started %s after it was bound; one on another node "+
		"getting it lazily across the bridge %s, and one getting it eagerly %s (whole seconds); each read every byte alike and ran a program from it\n",
		files, nearStart, lazyStart, eagerStart))
	f.figure("1 GiB input: step on its node, bound to started", nearStart)
	f.figure("1 GiB input: step on another node, lazy pull (XFS), bound to started", lazyStart)
	f.figure("1 GiB input: step on another node, eager pull (btrfs), bound to started", eagerStart)
	for _, pod := range []string{"big-near", "big-far", "big-eager"} {
		f.deletePod("ci", pod)
	}
	// Room for the scenarios that follow.
	_, err = f.cache.Destroy(context.Background(), cowvolume.Ref{Namespace: "ci", Handle: "big"})
	require.NoError(t, err)
}

// fleetStepImage: a get on node-1 leaves a rootfs-format image in a
// volume; a task on node-3 runs on it, the kubelet pulling it from
// node-3's loopback registry, which brings the volume from node-1. A task
// on node-2 runs on it through the snapshotter (the RuntimeClass cowvol,
// the image's :cowvol tag): node-2's plugin brings the volume from node-1,
// and the container's layer is the volume, its blob never fetched.
func (f *fleet) fleetStepImage() {
	t := f.t
	f.createPodWith("ci", "img-get", rootfsImageScript, []podOpt{onNode("node-1")},
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "fleet-img")})
	f.mustSucceed("ci", "img-get")
	f.waitCapturedOn("node-1", "ci", "fleet-img")
	start := time.Now()
	f.createPodWith("ci", "img-far", rootfsImageTask, []podOpt{onNode("node-3"), withImage(imageRegistry + "/ci/fleet-img:latest")})
	require.Equal(t, rootfsImageSays, f.mustSucceed("ci", "img-far"))
	took := time.Since(start)
	require.Equal(t, "node-3", f.podOn("ci", "img-far"))
	require.Contains(t, f.holders("ci", "fleet-img"), "node-3", "node-3's registry brought the image's volume")

	start = time.Now()
	f.createPodWith("ci", "img-snap", rootfsImageTask, []podOpt{onNode("node-2"),
		withImage(imageRegistry + "/ci/fleet-img:" + registry.RemoteTag), func(spec, _ map[string]any) { spec["runtimeClassName"] = "cowvol" }})
	require.Equal(t, rootfsImageSays, f.mustSucceed("ci", "img-snap"))
	snapTook := time.Since(start)
	require.Contains(t, f.holders("ci", "fleet-img"), "node-2", "node-2's plugin brought the image's volume")
	n2 := f.node("node-2")
	out, err := exec.Command("ctr", "--address", n2.containerd, "-n", "k8s.io", "snapshots", "--snapshotter", "cowvol", "ls").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Greater(t, strings.Count(strings.TrimSpace(string(out)), "\n"), 0, "the container runs on the cowvol snapshotter: %s", out)
	f.figure("step image from another node, loopback registry: created to done", took)
	f.figure("step image from another node, snapshotter: created to done", snapTook)
	report(t, fmt.Sprintf("fleet: tasks ran on a step image whose volume was on node-1: on node-3 through its loopback registry, done %s after it was created; "+
		"on node-2 through the snapshotter (the volume is the container's layer), done %s after it was created\n",
		took.Round(100*time.Millisecond), snapTook.Round(100*time.Millisecond)))
}

// schedulerBuild runs a build of seven steps over the fleet with the
// example scheduler (examples/scheduler), as a CI would: three gets pinned
// to the three nodes, a compile placed next to its input, a test whose
// three inputs live on three nodes, a step that fails on its first node
// and is run again on another, and a package; then a CI's GC pins the
// package and destroys the rest.
func (f *fleet) schedulerBuild() {
	t := f.t
	r := f.runner()
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

// runner is the example scheduler, running steps in ci through the
// fleet's API server and the scheduler's client of the Cache API.
func (f *fleet) runner() *scheduler.Runner {
	cfg, err := clientcmd.BuildConfigFromFlags("", f.kubeconfig)
	require.NoError(f.t, err)
	kube, err := kubernetes.NewForConfig(cfg)
	require.NoError(f.t, err)
	return &scheduler.Runner{Kube: kube, Cache: f.cache, Namespace: "ci", Image: busyboxImage, ServiceAccount: stepsServiceAccount,
		Timeout: 3 * time.Minute, Logf: f.t.Logf}
}

// chainBuild is a build of a get pinned to node and steps each reading
// the last one's output and adding a line to it, slowly enough that
// something can happen to the cluster meanwhile; the last step prints
// what the chain made.
func chainBuild(node string, steps int) ([]scheduler.Step, string) {
	build := []scheduler.Step{{Name: "get", Output: "s0", Node: node, Script: "echo 0 > /out/lines"}}
	want := "0\n"
	for i := 1; i <= steps; i++ {
		build = append(build, scheduler.Step{Name: fmt.Sprintf("s%d", i), Inputs: []string{fmt.Sprintf("s%d", i-1)},
			Output: fmt.Sprintf("s%d", i), Script: fmt.Sprintf("sleep 3; cat /in/s%d/lines > /out/lines; echo %d >> /out/lines", i-1, i)})
		want += fmt.Sprintf("%d\n", i)
	}
	build = append(build, scheduler.Step{Name: "show", Inputs: []string{fmt.Sprintf("s%d", steps)}, Script: fmt.Sprintf("cat /in/s%d/lines", steps)})
	return build, want
}

// buildInBackground runs a build with the example scheduler while the
// caller does something to the cluster; wait returns how it ended.
func (f *fleet) buildInBackground(name string, steps []scheduler.Step) (wait func() ([]scheduler.Result, error)) {
	r := f.runner()
	type ended struct {
		results []scheduler.Result
		err     error
	}
	done := make(chan ended, 1)
	go func() {
		res, err := r.Run(context.Background(), name, steps)
		done <- ended{res, err}
	}()
	return func() ([]scheduler.Result, error) {
		select {
		case e := <-done:
			return e.results, e.err
		case <-time.After(10 * time.Minute):
			f.t.Fatalf("build %s did not end in 10 minutes", name)
			return nil, nil
		}
	}
}

// leader is the controller replica the Lease names.
func (f *fleet) leader() string {
	out, _ := f.kubectl("", "get", "lease", "cowvol-controller", "-n", "cowvol", "-o", "jsonpath={.spec.holderIdentity}")
	return strings.TrimSpace(out)
}

// viewComplete says whether the controller the scheduler reaches knows
// every node running and each of want's volumes on the nodes given.
func (f *fleet) viewComplete(want map[cowvolume.Ref][]string) bool {
	nodes, err := f.cache.Nodes(context.Background())
	if err != nil || len(nodes) != len(f.nodes) {
		return false
	}
	for _, n := range nodes {
		if n.State != "running" {
			return false
		}
	}
	for ref, holders := range want {
		if !slices.Equal(f.holders(ref.Namespace, ref.Handle), holders) {
			return false
		}
	}
	return true
}

// heldNow is where the controller says each of refs is held now.
func (f *fleet) heldNow(refs ...cowvolume.Ref) map[cowvolume.Ref][]string {
	held := map[cowvolume.Ref][]string{}
	for _, ref := range refs {
		nodes := f.holders(ref.Namespace, ref.Handle)
		require.NotEmpty(f.t, nodes, "%s is held somewhere", ref)
		held[ref] = nodes
	}
	return held
}

// fleetFailover: the controller's leading replica's pod is deleted while
// a build runs. The other replica leads; its view (every node running,
// the volumes where they are) is complete within seconds; the
// scheduler's client, through DialKube, follows it; the build ends with
// the right outputs.
func (f *fleet) fleetFailover() {
	t := f.t
	steps, want := chainBuild("node-2", 4)
	wait := f.buildInBackground("fo", steps)
	f.waitCapturedOn("node-2", "ci", "fo-get-s0-1")
	known := f.heldNow(cowvolume.Ref{Namespace: "ci", Handle: "res-1"}, cowvolume.Ref{Namespace: "ci", Handle: "fo-get-s0-1"})
	old := f.leader()
	require.NotEmpty(t, old)
	deleted := time.Now()
	f.mustKubectl("", "delete", "pod", "-n", "cowvol", old, "--wait=false")
	var led time.Duration
	f.until("another replica to lead", time.Minute, func() bool {
		now := f.leader()
		led = time.Since(deleted)
		return now != "" && now != old
	})
	f.until("the new leader's view to be complete", time.Minute, func() bool { return f.viewComplete(known) })
	complete := time.Since(deleted)
	results, err := wait()
	require.NoError(t, err, "no step is lost to the leader's move")
	last := results[len(results)-1]
	require.Equal(t, want, last.Log)
	for _, r := range results {
		require.Equal(t, 1, r.Attempts, "step %s ran once", r.Step)
	}
	f.figure("controller failover: leader pod deleted to another replica leading", led)
	f.figure("controller failover: leader pod deleted to a complete view", complete)
	report(t, fmt.Sprintf("fleet: the controller's leader deleted mid-build: another replica led after %s and its view was complete (3 nodes running, the volumes where they were) %s after the delete; "+
		"the scheduler's client followed it and the %d-step build ended right, each step run once\n",
		led.Round(100*time.Millisecond), complete.Round(100*time.Millisecond), len(steps)))
}

// fleetUpgrade: helm upgrade to a new image while a build runs: the
// DaemonSet rolls node by node and the controller's replicas roll (its
// leader moves), and no step fails.
func (f *fleet) fleetUpgrade() {
	t := f.t
	// The new image: this one under another tag, in every node's runtime.
	for _, n := range f.nodes {
		run(t, "ctr", "--address", n.containerd, "-n", "k8s.io", "images", "tag", "--force", pluginImage, "cowvol.test/cowvol-plugin:e2e-next")
	}
	steps, want := chainBuild("node-3", 6)
	wait := f.buildInBackground("up", steps)
	f.waitCapturedOn("node-3", "ci", "up-get-s0-1")
	helm := os.Getenv("COWVOL_E2E_HELM_BINARY")
	f.helmValues["image"] = map[string]any{"repository": "cowvol.test/cowvol-plugin", "tag": "e2e-next"}
	start := time.Now()
	f.helm(helm, "upgrade", "cowvol", "../../deploy/helm/cowvol", "--namespace", "cowvol")
	f.waitFleetInstalled("e2e-next")
	rolled := time.Since(start)
	results, err := wait()
	require.NoError(t, err, "no step fails while cowvol rolls")
	require.Equal(t, want, results[len(results)-1].Log)
	for _, r := range results {
		require.Equal(t, 1, r.Attempts, "step %s ran once", r.Step)
	}
	f.figure("helm upgrade: 3 nodes' plugins and 2 controller replicas rolled", rolled)
	report(t, fmt.Sprintf("fleet: helm upgrade to a new image rolled 3 nodes' plugins and the controller's 2 replicas in %s during a %d-step build; no step failed or ran twice\n",
		rolled.Round(100*time.Millisecond), len(steps)))
}

// nodeState is the state the controller gives node ("" if it knows no
// such node, or cannot be asked).
func (f *fleet) nodeState(node string) string {
	st, _ := f.nodeStatus(node)
	return st
}

// nodeStatus is the state the controller gives node and the store it
// reports.
func (f *fleet) nodeStatus(node string) (state, store string) {
	nodes, err := f.cache.Nodes(context.Background())
	if err != nil {
		return "", ""
	}
	for _, n := range nodes {
		if n.NodeId == node {
			return n.State, n.StoreId
		}
	}
	return "", ""
}

// holders lists the nodes the controller says hold ns/handle ready.
func (f *fleet) holders(ns, handle string) []string {
	locs, err := f.cache.Lookup(context.Background(), cowvolume.Ref{Namespace: ns, Handle: handle})
	if err != nil || len(locs) != 1 {
		return nil
	}
	nodes := append([]string(nil), locs[0].Nodes...)
	slices.Sort(nodes)
	return nodes
}

// fleetNodeDeath: a node dies (every process of it at once, its link
// down) while a step on another node lazily reads an input only it
// holds. The read fails with EIO and the step fails, without hanging;
// the controller marks the node stalled; the scheduler's loop runs the
// step again on another node, which gets the input once the node is back
// with its store, and the build ends with the right output. Killed again
// and back with its store wiped, the node's old volumes are forgotten.
func (f *fleet) fleetNodeDeath() {
	t := f.t
	sum := "find data -type f | sort | xargs md5sum | md5sum"
	// 40 MiB the stream cannot compress, on node-1, which dies.
	f.createPodWith("ci", "nd-src", "set -e; mktree /out 2000 20480; cd /out; "+sum,
		[]podOpt{onNode("node-1")}, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "nd-src")})
	srcSum := f.mustSucceed("ci", "nd-src")
	// More input bytes on node-2 (XFS: its pulls are lazy) than anywhere:
	// Place ranks it first for a step reading both.
	f.createPodWith("ci", "nd-local", "head -c 67108864 /dev/urandom > /out/blob; md5sum < /out/blob",
		[]podOpt{onNode("node-2")}, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "nd-local")})
	blobSum := f.mustSucceed("ci", "nd-local")
	f.waitCapturedOn("node-1", "ci", "nd-src")
	f.waitCapturedOn("node-2", "ci", "nd-local")
	victim, reader := f.node("node-1"), f.node("node-2")
	// node-2's link slow: the lazy pull of 40 MiB takes about 40 s there,
	// and node-1 dies mid-way.
	reader.host.Throttle("8mbit")
	defer reader.host.Unthrottle()
	_, store := f.nodeStatus(victim.name)
	wait := f.buildInBackground("nd", []scheduler.Step{{Name: "read", Inputs: []string{"nd-src", "nd-local"},
		Script: "set -eo pipefail; cd /in/nd-src; " + sum + "; md5sum < /in/nd-local/blob"}})
	f.until("the step to read its input lazily on "+reader.name, 2*time.Minute, func() bool {
		return f.phase("ci", "nd-read-1") == "Running"
	})
	require.Equal(t, reader.name, f.podOn("ci", "nd-read-1"), "Place ranked the node with the most input bytes first")
	time.Sleep(3 * time.Second) // a few files in
	killed := time.Now()
	f.kill(victim)
	var endedAfter, stalledAfter time.Duration
	f.until("the step reading from the dead node to end", 3*time.Minute, func() bool {
		endedAfter = time.Since(killed)
		return f.phase("ci", "nd-read-1") != "Running"
	})
	f.until("the controller to mark "+victim.name+" stalled", 2*time.Minute, func() bool {
		stalledAfter = time.Since(killed)
		return f.nodeState(victim.name) == "stalled"
	})
	require.Empty(t, f.holders("ci", "nd-src"), "a stalled node's volumes are not offered")

	// Back with its store: it serves its volumes again, and the step's
	// second attempt, away from node-2, gets its input from it.
	f.revive(victim, false)
	f.until(victim.name+" back, serving its volumes", 2*time.Minute, func() bool {
		st, s := f.nodeStatus(victim.name)
		return st == "running" && s == store && slices.Contains(f.holders("ci", "nd-src"), victim.name)
	})
	results, err := wait()
	require.NoError(t, err, "the build ends")
	res := results[0]
	require.Equal(t, 2, res.Attempts, "the step ran again")
	require.Len(t, res.Failures, 1)
	require.Equal(t, reader.name, res.Failures[0].Node)
	require.Contains(t, res.Failures[0].Log, "Input/output error", "the read of what the dead node did not send fails with EIO")
	require.NotEqual(t, reader.name, res.Node, "the step ran again on another node")
	require.Equal(t, srcSum+blobSum, res.Log, "the step read the right bytes")

	// Back with its store wiped: its old volumes are forgotten.
	f.kill(victim)
	f.revive(victim, true)
	f.until(victim.name+" back with a new store, its old volumes forgotten", 2*time.Minute, func() bool {
		st, s := f.nodeStatus(victim.name)
		return st == "running" && s != store && !slices.Contains(f.holders("ci", "nd-src"), victim.name)
	})
	if res.Node != victim.name {
		require.Contains(t, f.holders("ci", "nd-src"), res.Node, "the copy the second attempt pulled stays")
	}
	rebooted := time.Now()
	f.until(victim.name+"'s plugin to be registered with its kubelet again", 5*time.Minute, func() bool {
		pods, err := f.kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-node", "--field-selector", "spec.nodeName="+victim.name,
			"-o", "jsonpath={.items[*].status.containerStatuses[*].ready}")
		if err != nil || pods != "true true" {
			return false
		}
		ready, err := f.kubectl("", "get", "csinode", victim.name, "-o", "jsonpath={.spec.drivers[*].name}")
		return err == nil && strings.Contains(ready, driverName)
	})
	t.Logf("%s's plugin was registered again %s after it came back with a wiped store", victim.name, time.Since(rebooted).Round(time.Second))
	f.figure("node killed: to the step reading from it failing", endedAfter)
	f.figure("node killed: to the controller marking it stalled", stalledAfter)
	report(t, fmt.Sprintf("fleet: %s killed (every process, link down) while a step on %s lazily read a 40 MiB input only it held: "+
		"the step failed with EIO %s after the kill, the controller marked %s stalled after %s; back with its store it served again and the step's "+
		"second attempt (on %s) read the right bytes; back with a wiped store its old volumes were forgotten\n",
		victim.name, reader.name, endedAfter.Round(time.Second), victim.name, stalledAfter.Round(time.Second), res.Node))
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
	f.mustKubectl("", "drain", "node-1", "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=90s")
	f.until("the controller to take node-1 out of service", 30*time.Second, func() bool {
		s := f.nodeState("node-1")
		return s == "landing" || s == "landed"
	})
	ref := cowvolume.Ref{Namespace: "ci", Handle: "drain-src"}
	// The drain may have taken the controller's leader with it: a new
	// one answers once the nodes have reported to it.
	var placed []*controllerv1.NodePlacement
	f.until("the controller to place a step", time.Minute, func() bool {
		var err error
		placed, err = f.cache.Place(ctx, ref)
		return err == nil
	})
	for _, p := range placed {
		require.NotEqual(t, "node-1", p.NodeId, "a step placed on a drained node")
	}
	read := volume{name: "in", mountPath: "/in", attrs: attrs("source", "drain-src"), readOnly: true}
	f.createPodWith("ci", "during-drain", "cat /in/f", []podOpt{preferring("node-1")}, read)
	require.Equal(t, "held-by-node-1\n", f.mustSucceed("ci", "during-drain"), "the draining node's volume is pulled")
	require.NotEqual(t, "node-1", f.podOn("ci", "during-drain"))
	f.mustKubectl("", "uncordon", "node-1")
	f.until("the controller to put node-1 back in service", 30*time.Second, func() bool { return f.nodeState("node-1") == "running" })
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
