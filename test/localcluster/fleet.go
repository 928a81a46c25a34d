package localcluster

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/tb"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/plugin"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/tools/clientcmd"
)

// Node is one of a fleet's nodes.
type Node struct {
	NodeHost
	Host       *netlab.Host
	Containerd string // its runtime's socket
	KubeletDir string // as its processes see it
	State      string // its cowvol state filesystem, as the test sees it
}

// fleetView is where every node's processes find their node's dir (the
// node's kubelet root dir and cowvol state dir are below it), in the
// node's mount namespace.
func fleetView(work string) string { return filepath.Join(work, "node") }

// startFleet brings up the control plane and n nodes, node-1 to node-<n>,
// each Ready with the harness's images in its runtime, and registers
// their teardown: nothing of them is left. Each node's state filesystem
// is XFS with reflink, the last one's btrfs.
func StartFleet(t tb.TB, n int) *Cluster {
	testfs.Need(t, "containerd", "containerd-shim-runc-v2", "runc", "etcd", "ctr", "busybox", "ip", "nsenter", "unshare", "iptables")
	bin := KubeBin(t)
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
	c := &Cluster{T: t, Work: work, Bin: bin, Procs: map[string]*proc{}, sysctls: map[string]string{}, links: linkNames(t), lab: lab}
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
	c.hosts = filepath.Join(work, "hosts")
	f := c
	WriteFile(t, f.hosts, "127.0.0.1 localhost\n")
	require.NoError(t, os.MkdirAll(fleetView(work), 0o755))
	// Every node's address and pod subnet first: each routes the others'.
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("node-%d", i)
		host := lab.Host(name)
		f.Nodes = append(f.Nodes, Node{NodeHost: NodeHost{Name: name, Address: host.IP, Netns: host.Netns,
			Dir: filepath.Join(work, name), CgroupRoot: "/" + filepath.Base(work) + "-" + name, view: fleetView(work),
			PodCIDR: fmt.Sprintf("10.100.%d.0/24", i)}, Host: host, State: states[i-1]})
	}
	for i := range f.Nodes {
		node := &f.Nodes[i]
		f.makeCgroupRoot(node.CgroupRoot)
		f.boot(node)
		c.runtimes = append(c.runtimes, node.Containerd)
	}
	c.Until("every node to be Ready", 2*time.Minute, func() bool {
		out, err := c.Kubectl("", "get", "nodes", "-o", `jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{" "}{end}`)
		return err == nil && strings.Count(out, "True") == n
	})
	c.CreateStepNamespaces(true)
	c.Until("the default ServiceAccounts", time.Minute, func() bool {
		_, err := c.Kubectl("", "get", "serviceaccount", "default", "-n", "ci")
		return err == nil
	})
	return f
}

// boot starts a node from its disks: its mount namespace, runtime (the
// harness's images imported the first time), kubelet and kube-proxy.
func (f *Cluster) boot(n *Node) {
	f.makeMountns(n)
	// Services' cluster IPs are reached through eth0, where kube-proxy's
	// rules send them on to their pods.
	Run(f.T, "ip", "-n", n.Netns, "route", "replace", serviceCIDR, "dev", "eth0")
	f.routePods(n)
	first := n.Containerd == ""
	// Containerd finds the cowvol snapshotter where the chart's
	// images.snapshotter.socketDir puts it (installCowvol).
	n.Containerd = f.startRuntime(n.NodeHost, filepath.Join(n.view, "snapshotter", "snapshotter.sock"))
	if first {
		f.importImagesInto(n.Containerd)
	}
	n.KubeletDir = f.StartKubeletOn(n.NodeHost, n.Containerd)
	f.startKubeProxy(n.NodeHost)
}

// PodCIDR is the fleet's pod range: node-<i>'s pods have addresses of
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
func (f *Cluster) routePods(n *Node) {
	masquerade := fmt.Sprintf("POSTROUTING -s %s ! -d %s -j MASQUERADE", n.PodCIDR, podCIDR)
	script := "set -e\necho 1 > /proc/sys/net/ipv4/ip_forward\n" +
		"ip addr replace " + podGateway + "/32 dev lo\n" +
		"iptables -t nat -C " + masquerade + " 2>/dev/null || iptables -t nat -A " + masquerade + "\n"
	for _, o := range f.Nodes {
		if o.Name != n.Name {
			script += fmt.Sprintf("ip route replace %s via %s dev eth0\n", o.PodCIDR, o.Address)
		}
	}
	Run(f.T, "ip", "netns", "exec", n.Netns, "sh", "-c", script)
}

// Kill kills a node as a power cut does: every process of it at once
// (its kubelet, kube-proxy, runtime, shims and whatever runs in its pods,
// cowvol's plugin among them), its mounts gone with its mount namespace,
// and its network link down, so that its peers' connections to it hear
// nothing back, as from a machine that is gone. Its disks stay.
func (f *Cluster) Kill(n *Node) {
	Run(f.T, "ip", "-n", n.Netns, "link", "set", "eth0", "down")
	for _, name := range []string{"kubelet", "kube-proxy", "containerd"} {
		f.Procs[n.Proc(name)].Stop(syscall.SIGKILL, 10*time.Second)
	}
	f.killShims(n.Containerd)
	killCgroupProcs(n.CgroupRoot)
	f.Procs[n.Proc("mountns")].Stop(syscall.SIGKILL, 10*time.Second)
}

// Revive brings a killed node back: its link up, and it boots from its
// disks, its cowvol store wiped first if asked (a node replaced, or its
// disk lost).
func (f *Cluster) Revive(n *Node, wipe bool) {
	if wipe {
		entries, err := os.ReadDir(n.State)
		require.NoError(f.T, err)
		for _, e := range entries {
			require.NoError(f.T, os.RemoveAll(filepath.Join(n.State, e.Name())))
		}
	}
	Run(f.T, "ip", "-n", n.Netns, "link", "set", "eth0", "up")
	f.boot(n)
}

// Run runs a command the harness needs to succeed.
func Run(t tb.TB, args ...string) {
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
func (f *Cluster) makeMountns(n *Node) {
	require.NoError(f.T, os.MkdirAll(filepath.Join(n.Dir, "cowvol"), 0o755))
	script := fmt.Sprintf(`set -e
mount --rbind %[1]s %[2]s
mount --bind %[3]s %[2]s/cowvol
mount --make-rshared %[2]s
mount --bind %[4]s /etc/hosts
exec sleep infinity`, n.Dir, n.view, n.State, f.hosts)
	p := f.startOn(NodeHost{Name: n.Name, Netns: n.Netns}, n.Proc("mountns"), nil, "unshare", "--mount", "--propagation", "private", "sh", "-c", script)
	mountinfo := fmt.Sprintf("/proc/%d/mountinfo", p.PID())
	f.Until(n.Name+"'s mount namespace", 10*time.Second, func() bool {
		b, err := os.ReadFile(mountinfo)
		return err == nil && strings.Contains(string(b), " /etc/hosts ")
	})
	n.Mountns = fmt.Sprintf("/proc/%d/ns/mnt", p.PID())
}

// startKubeProxy runs kube-proxy on the node, in iptables mode in the
// node's own network namespace; it leaves the machine-wide conntrack
// settings alone.
func (f *Cluster) startKubeProxy(n NodeHost) {
	config := filepath.Join(n.Dir, "kube-proxy.yaml")
	WriteFile(f.T, config, fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: %q}
hostnameOverride: %s
mode: iptables
bindAddress: %s
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: [primary]
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
`, f.Kubeconfig, n.Name, n.Address))
	f.startOn(n, n.Proc("kube-proxy"), nil, filepath.Join(f.Bin, "kube-proxy"), "--config="+config, "--v=2")
}

// makeCgroupRoot makes the cgroup a node's pods go under, in every
// hierarchy (the kubelet refuses a root that does not exist).
func (f *Cluster) makeCgroupRoot(root string) {
	hierarchies, err := os.ReadDir("/sys/fs/cgroup")
	require.NoError(f.T, err)
	for _, h := range hierarchies {
		dir := filepath.Join("/sys/fs/cgroup", h.Name())
		if st, err := os.Lstat(dir); err != nil || !st.IsDir() {
			continue
		}
		require.NoError(f.T, os.MkdirAll(dir+root, 0o755))
	}
	f.cgroupRoots = append(f.cgroupRoots, root)
}

// InstallCowvol installs cowvol on the fleet with its Helm chart, as a
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
func (f *Cluster) InstallCowvol() {
	t := f.T
	helm := os.Getenv("COWVOL_E2E_HELM_BINARY")
	if helm == "" {
		t.Fatal("COWVOL_E2E_HELM_BINARY is not set: run make e2e (it builds helm)")
	}
	for _, n := range f.Nodes {
		f.importRegistrarInto(n.Containerd)
	}
	pki := filepath.Join(f.Work, "cowvol-pki")
	ctl := netlab.NewPKI(t, filepath.Join(pki, "controller"), "cowvol-controller.cowvol.svc")
	peer := netlab.NewPKI(t, filepath.Join(pki, "peer"), plugin.DefaultPeerServerName)
	view := fleetView(f.Work)
	f.HelmValues = map[string]any{
		"kubeletDir": filepath.Join(view, "kubelet"), "stateDir": filepath.Join(view, "cowvol"),
		"image": map[string]any{"repository": "cowvol.test/cowvol-plugin", "tag": "e2e"},
		// A deleted Workflow's volumes go within seconds (fleetArgo).
		"controller": map[string]any{"hostNetwork": true, "ownerSweep": map[string]any{"enabled": true, "interval": "3s"}},
		"node":       map[string]any{"hostNetwork": true},
		// The locality webhook, for namespaces that opt in (fleetLocality).
		"locality": map[string]any{"enabled": true, "caBundle": base64.StdEncoding.EncodeToString(MustRead(t, ctl.CA))},
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
	f.Helm(helm, "install", "cowvol", Repo(f.T, "deploy/helm/cowvol"), "--namespace", "cowvol", "--create-namespace")
	f.MustKubectl("", "create", "secret", "generic", "cowvol-controller-tls", "-n", "cowvol",
		"--from-file=tls.crt="+ctl.Cert, "--from-file=tls.key="+ctl.Key, "--from-file=ca.crt="+ctl.CA)
	f.MustKubectl("", PeerCASecret("cowvol-peer-ca", peer)...)
	// Pods are deleted while the plugins can still unpublish; before
	// that, a failed run says what cowvol's pods saw.
	t.Cleanup(func() { f.DeletePods() })
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
			out, _ := f.Kubectl("", args...)
			t.Logf("kubectl %s:\n%s", strings.Join(args, " "), out)
		}
	})
	ip := strings.TrimSpace(f.MustKubectl("", "get", "service", "cowvol-controller", "-n", "cowvol", "-o", "jsonpath={.spec.clusterIP}"))
	WriteFile(t, f.hosts, fmt.Sprintf("127.0.0.1 localhost\n%s cowvol-controller.cowvol.svc cowvol-controller.cowvol.svc.cluster.local\n", ip))
	f.WaitFleetInstalled("e2e")
	cfg, err := clientcmd.BuildConfigFromFlags("", f.Kubeconfig)
	require.NoError(t, err)
	cache, err := client.DialKube(context.Background(), cfg, client.KubeOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { cache.Close() })
	f.Cache = cache
	f.Until("every node to report to the controller", time.Minute, func() bool {
		nodes, err := cache.Nodes(context.Background())
		if err != nil || len(nodes) != len(f.Nodes) {
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

// Helm runs helm with the fleet's values.
func (f *Cluster) Helm(helm string, args ...string) {
	f.T.Helper()
	raw, err := json.Marshal(f.HelmValues)
	require.NoError(f.T, err)
	values := filepath.Join(f.Work, "helm-values.json")
	WriteFile(f.T, values, string(raw))
	out, err := exec.Command(helm, append(args, "-f", values, "--kubeconfig", f.Kubeconfig)...).CombinedOutput()
	require.NoError(f.T, err, "helm %s: %s", strings.Join(args, " "), out)
}

// WaitFleetInstalled waits until every node's DaemonSet pod runs the
// image of tag, ready, and has registered the plugin with its kubelet,
// and the controller's Deployment has its replicas on that image, one
// of them leading.
func (f *Cluster) WaitFleetInstalled(tag string) {
	f.T.Helper()
	image := "cowvol.test/cowvol-plugin:" + tag
	f.Until("the DaemonSet's pods on "+tag+" to register the plugin with every kubelet", 3*time.Minute, func() bool {
		pods, err := f.Kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-node",
			"-o", "jsonpath={range .items[*]}{.spec.containers[0].image} {.status.containerStatuses[*].ready}{\"\\n\"}{end}")
		if err != nil || strings.Count(pods, image+" true true\n") != len(f.Nodes) || strings.Count(pods, "\n") != len(f.Nodes) {
			return false
		}
		for _, n := range f.Nodes {
			out, err := f.Kubectl("", "get", "csinode", n.Name, "-o", "jsonpath={.spec.drivers[*].name}")
			if err != nil || !strings.Contains(out, DriverName) {
				return false
			}
		}
		return true
	})
	f.Until("the controller's Deployment on "+tag+" to lead", 2*time.Minute, func() bool {
		out, err := f.Kubectl("", "get", "deployment", "cowvol-controller", "-n", "cowvol",
			"-o", "jsonpath={.status.updatedReplicas} {.status.replicas} {.status.readyReplicas} {.spec.template.spec.containers[0].image}")
		if err != nil || out != "2 2 2 "+image {
			return false
		}
		// The Service's one endpoint is the leader's pod, which the
		// Lease names.
		leader := f.Leader()
		out, err = f.Kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-controller,"+plugin.LeaderLabel+"=true", "-o", "jsonpath={.items[*].metadata.name}")
		return err == nil && leader != "" && out == leader
	})
}

// Node is the fleet's node of that name.
func (f *Cluster) Node(name string) *Node {
	for i := range f.Nodes {
		if f.Nodes[i].Name == name {
			return &f.Nodes[i]
		}
	}
	f.T.Fatalf("no node %s", name)
	return nil
}

// MustRead is a file's bytes.
func MustRead(t tb.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}

// Leader is the controller replica the Lease names.
func (f *Cluster) Leader() string {
	out, _ := f.Kubectl("", "get", "lease", "cowvol-controller", "-n", "cowvol", "-o", "jsonpath={.spec.holderIdentity}")
	return strings.TrimSpace(out)
}
