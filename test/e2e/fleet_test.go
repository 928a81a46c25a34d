//go:build e2e

package e2e

import (
	"context"
	"encoding/base64"
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
	"k8s.io/client-go/tools/clientcmd"

	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/plugin"
)

// fleet is several real nodes on one machine. Each node is a network
// namespace of its own with an address on the lab's bridge (internal/netlab),
// and a mount namespace of its own, where its containerd, kubelet and
// kube-proxy run, with its own kubelet root dir, containerd root, cgroup
// root, pod logs and cowvol state filesystem; one etcd, API server,
// controller manager and kube-scheduler serve them all from the test's own
// namespace, the API server on the test's address on the lab, which is how
// the nodes reach it. Each node routes a pod subnet of its own (podnet's
// routed mode, set up as a CNI's node agent would): pods on different
// nodes reach each other only over the bridge, as over a real network, and
// Services through each node's kube-proxy.
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
func startFleet(t testing.TB, n int) *fleet {
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
	// Every node's address and pod subnet first: each routes the others'.
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("node-%d", i)
		host := lab.Host(name)
		f.nodes = append(f.nodes, fleetNode{nodeHost: nodeHost{name: name, address: host.IP, netns: host.Netns,
			dir: filepath.Join(work, name), cgroupRoot: "/" + filepath.Base(work) + "-" + name, view: fleetView(work),
			podCIDR: fmt.Sprintf("10.100.%d.0/24", i)}, host: host, state: states[i-1]})
	}
	for i := range f.nodes {
		node := &f.nodes[i]
		f.makeCgroupRoot(node.cgroupRoot)
		f.boot(node)
		c.runtimes = append(c.runtimes, node.containerd)
	}
	c.until("every node to be Ready", 2*time.Minute, func() bool {
		out, err := c.kubectl("", "get", "nodes", "-o", `jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{" "}{end}`)
		return err == nil && strings.Count(out, "True") == n
	})
	c.createStepNamespaces(true)
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
	f.routePods(n)
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

// podCIDR is the fleet's pod range: node-<i>'s pods have addresses of
// 10.100.<i>.0/24 (podnet's routed mode).
const podCIDR = "10.100.0.0/16"

// podGateway is where a pod's default route goes: an address of its
// node's, which the node answers the pod's ARP for.
const podGateway = "169.254.1.1"

// routePods makes the node its pods' router, as a CNI's node agent does:
// it holds the pods' gateway address, forwards, masquerades what its pods
// send outside the pod range (to the API server, or a node's own
// address), and routes each other node's pod subnet to that node over the
// bridge. Again at each boot: the routes went with the link when the node
// was killed.
func (f *fleet) routePods(n *fleetNode) {
	masquerade := fmt.Sprintf("POSTROUTING -s %s ! -d %s -j MASQUERADE", n.podCIDR, podCIDR)
	script := "set -e\necho 1 > /proc/sys/net/ipv4/ip_forward\n" +
		"ip addr replace " + podGateway + "/32 dev lo\n" +
		"iptables -t nat -C " + masquerade + " 2>/dev/null || iptables -t nat -A " + masquerade + "\n"
	for _, o := range f.nodes {
		if o.name != n.name {
			script += fmt.Sprintf("ip route replace %s via %s dev eth0\n", o.podCIDR, o.address)
		}
	}
	run(f.t, "ip", "netns", "exec", n.netns, "sh", "-c", script)
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
func run(t testing.TB, args ...string) {
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
// namespace, routing its pods' subnet. kube-scheduler spreads pods over
// them; each pod has an address of its node's subnet; a pod on one node
// reaches a pod on another over the bridge, and not at its loopback, which
// is its own, and reaches the API server through its Service.
func TestFleet(t *testing.T) {
	f := startFleet(t, 3)

	// Two pods preferring each node: kube-scheduler binds each there, and
	// its address is of that node's pod subnet.
	placed := map[string]fleetNode{}
	for i := range 6 {
		name, node := fmt.Sprintf("placed-%d", i), f.nodes[i%3]
		placed[name] = node
		f.createPodWith("ci", name, "ip -4 -o addr show eth0", []podOpt{preferring(node.name)})
	}
	for name, node := range placed {
		out := f.mustSucceed("ci", name)
		require.Equal(t, node.name, f.podOn("ci", name), "kube-scheduler bound %s where it was preferred", name)
		require.Contains(t, out, " "+strings.TrimSuffix(node.podCIDR, "0/24"), "pod %s has an address of %s's pod subnet", name, node.name)
	}

	// A server pod on node-1; a client pod on node-2 reaches it at its
	// address over the bridge (node-2 routes node-1's pod subnet to
	// node-1), finds nothing at its own loopback, which is not the
	// server's, and reaches the API server through the kubernetes
	// Service (its node's kube-proxy, then masqueraded onto the lab): a
	// plain HTTP request to it is answered by Go's TLS server.
	n1 := f.nodes[0]
	f.createPodWith("ci", "server", `(echo pod-to-pod | nc -l -p 8080) & (echo loopback | nc -l -p 8081) & sleep 60`,
		[]podOpt{onNode(n1.name)})
	f.until("the server to run", time.Minute, func() bool { return f.phase("ci", "server") == "Running" })
	serverIP := f.mustKubectl("", "get", "pod", "server", "-n", "ci", "-o", "jsonpath={.status.podIP}")
	require.True(t, strings.HasPrefix(serverIP, strings.TrimSuffix(n1.podCIDR, "0/24")), "the server's address %q", serverIP)
	f.createPodWith("ci", "client", `for i in $(seq 30); do nc -w 2 `+serverIP+` 8080 2>/dev/null && break; sleep 1; done
		nc -w 2 127.0.0.1 8081 2>/dev/null || echo "no loopback of the server's here"
		printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 5 `+kubernetesServiceIP+` 443 | grep -q 'HTTP request to an HTTPS server' && echo "the API server through its Service"`,
		[]podOpt{onNode("node-2")})
	require.Equal(t, "pod-to-pod\nno loopback of the server's here\nthe API server through its Service\n", f.mustSucceed("ci", "client"))
	require.Equal(t, "node-2", f.podOn("ci", "client"))
	f.scenario("install with the Helm chart", f.installCowvol)
	f.scenario("placement, and an input across the bridge", f.fleetBuild)
	f.scenario("pods no scheduler of ours placed land next to their inputs", f.fleetLocality)
	f.scenario("Argo Workflows builds with cowvol volumes", f.fleetArgo)
	f.scenario("a 1 GiB input across nodes, lazily and eagerly", f.fleetLargeInput)
	f.scenario("step images across nodes", f.fleetStepImage)
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
		"a pod on node-2 reached a pod on node-1 over the bridge but not at its loopback, and the API server through the kubernetes Service\n", len(f.nodes)))
	f.deleteSteps("ci")
}

// installCowvol installs cowvol on the fleet with its Helm chart, as a
// user does: the TLS Secrets made as docs/install.md says, the chart's
// DaemonSet (with the upstream registrar) on every node and its
// controller's two replicas electing a leader, the plugin's image (make
// image's) in every node's runtime. What this cluster lacks is made up
// for by values: cowvol's pods on their nodes' network (the API server,
// beside the nodes, has no route to the pods' subnets, and calls the
// locality webhook at its endpoint); the nodes find the controller's
// Service by its name in their hosts file, where a cluster's DNS would
// answer. The scheduler's client of the Cache API is
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
		"image": map[string]any{"repository": "cowvol.test/cowvol-plugin", "tag": "e2e"},
		// A deleted Workflow's volumes go within seconds (fleetArgo).
		"controller": map[string]any{"hostNetwork": true, "ownerSweep": map[string]any{"enabled": true, "interval": "3s"}},
		"node":       map[string]any{"hostNetwork": true},
		// The locality webhook, for namespaces that opt in (fleetLocality).
		"locality": map[string]any{"enabled": true, "caBundle": base64.StdEncoding.EncodeToString(mustRead(t, ctl.CA))},
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
	f.mustKubectl("", "create", "secret", "generic", "cowvol-controller-tls", "-n", "cowvol",
		"--from-file=tls.crt="+ctl.Cert, "--from-file=tls.key="+ctl.Key, "--from-file=ca.crt="+ctl.CA)
	f.mustKubectl("", peerCASecret("cowvol-peer-ca", peer)...)
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

// mustRead is a file's bytes.
func mustRead(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}
