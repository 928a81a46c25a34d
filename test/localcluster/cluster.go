package localcluster

import (
	"bytes"
	"cmp"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/ociimage"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/tb"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/snapshotter"
)

const (
	NodeName     = "localhost" // other names make the kubelet look itself up in DNS
	DriverName   = "cowvol.concourse-ci.org"
	adminToken   = "cowvol-e2e-admin-token"
	PauseImage   = "registry.k8s.io/pause:3.10"
	BusyboxImage = "cowvol.test/busybox:e2e"
	// PluginImage is the plugin's image: make e2e builds it with make
	// image, under this name, into $COWVOL_PLUGIN_IMAGE_TAR.
	PluginImage = "cowvol.test/cowvol-plugin:e2e"
	// serviceCIDR holds the Services' cluster IPs.
	serviceCIDR = "10.0.0.0/24"
	// stepPodSecurity is the label of the step namespaces: Pod Security
	// admits no pod beyond baseline there (docs/security.md).
	stepPodSecurity = "pod-security.kubernetes.io/enforce=baseline"
)

// KubernetesServiceIP is the kubernetes Service's cluster IP: the first
// of serviceCIDR.
var KubernetesServiceIP = netip.MustParsePrefix(serviceCIDR).Addr().Next().String()

// sysctls the kubelet rewrites; the harness puts them back.
var kubeletSysctls = []string{"kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory"}

// proc is one process the harness runs, logging to a file.
type proc struct {
	*plugintest.Process
	name string
	log  string
}

func (p *proc) logText() string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// Cluster is a running cluster: its control plane, and either one node
// on loopback (the process's own network namespace) or a fleet of Nodes,
// each in network and mount namespaces of its own on a bridge
// (internal/netlab), with its own containerd, kubelet, kube-proxy, cgroup
// root, pod logs and cowvol state filesystem, routing a pod subnet of its
// own. Its fields are for the code that drives it (test/e2e): T is what it
// runs under, Work its dir (logs in Work/logs), Bin the Kubernetes
// binaries' dir.
type Cluster struct {
	T          tb.TB
	Work       string
	Bin        string
	Kubeconfig string
	APIPort    int // the API server's, on loopback
	// clientCA signs the kubelets' client certificates.
	clientCA   netlab.PKI
	Containerd string // its socket
	KubeletDir string
	StateDir   string
	// Snapshotter is the socket containerd expects the cowvol
	// snapshotter on.
	Snapshotter string
	Procs       map[string]*proc
	Plugin      *plugintest.Plugin
	// controller runs beside the node plugin, which reports to it; cache
	// is a scheduler's client of its Cache API.
	controller     *plugintest.Plugin
	ControllerAddr string
	Cache          *client.Client
	sysctls        map[string]string
	links          []string // network devices before the cluster
	// lab is the network of nodes in namespaces of their own (a fleet's);
	// nil for the one node on loopback.
	lab *netlab.Lab
	// runtimes are the sockets of every node's containerd; cgroupRoots
	// the cgroups their pods go under, besides the root.
	runtimes, cgroupRoots []string
	// Nodes are a fleet's (none for the one node on loopback).
	Nodes []Node
	// hosts is every fleet node's /etc/hosts: where a cluster's DNS would
	// answer, it names the Services cowvol's pods dial.
	hosts string
	// HelmValues are cowvol's install's on a fleet.
	HelmValues map[string]any
	// Current is the scenario running: a failed run names it last, below
	// the processes' logs that push its failure far up the output.
	Current string
}

func linkNames(t tb.TB) []string {
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, i := range ifs {
		names = append(names, i.Name)
	}
	return names
}

func (c *Cluster) start(name string, env []string, args ...string) *proc {
	c.T.Helper()
	return c.startOn(NodeHost{}, name, env, args...)
}

// startOn starts a process in the node's namespaces (none: this
// process's).
func (c *Cluster) startOn(n NodeHost, name string, env []string, args ...string) *proc {
	c.T.Helper()
	if enter := n.enter(); enter != nil {
		// nsenter execs the program once in the namespaces: the
		// process is the program itself.
		args = append(enter, args...)
	}
	p := &proc{name: name, log: filepath.Join(c.Work, "logs", name+".log")}
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		c.T.Fatal(err)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), env...)
	// Its own process group, so that a test's ^C does not reach it
	// before the harness has taken the cluster down in order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if p.Process, err = plugintest.StartProcess(cmd, func() { f.Close() }); err != nil {
		c.T.Fatalf("starting %s: %v", name, err)
	}
	c.Procs[name] = p
	return p
}

// Until polls cond until it holds, failing with what after timeout.
func (c *Cluster) Until(what string, timeout time.Duration, cond func() bool) {
	c.T.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			c.dumpLogs()
			c.T.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (c *Cluster) dumpLogs() {
	for name, p := range c.Procs {
		text := p.logText()
		if len(text) > 6000 {
			text = "..." + text[len(text)-6000:]
		}
		c.T.Logf("---- %s log (tail) ----\n%s", name, text)
	}
}

// Kubectl runs Kubectl against the cluster, feeding stdin if given.
func (c *Cluster) Kubectl(stdin string, args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(c.Bin, "kubectl"), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, errOut.String())
	}
	return out.String(), nil
}

func (c *Cluster) MustKubectl(stdin string, args ...string) string {
	c.T.Helper()
	out, err := c.Kubectl(stdin, args...)
	if err != nil {
		c.T.Fatal(err)
	}
	return out
}

func WriteFile(t tb.TB, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// KubeBin is where make e2e built the Kubernetes release it runs on.
func KubeBin(t tb.TB) string {
	bin := os.Getenv("COWVOL_E2E_KUBE_BIN")
	if bin == "" {
		t.Fatal("COWVOL_E2E_KUBE_BIN is not set: run make e2e (it builds Kubernetes from test/e2e/tools)")
	}
	for _, b := range []string{"kube-apiserver", "kubelet", "kubectl", "kube-controller-manager", "kube-scheduler", "kube-proxy"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			t.Fatalf("%s is not built in %s: run make e2e", b, bin)
		}
	}
	return bin
}

// StartWith brings the whole node up, cowvol's plugin and
// controller running as host processes, with the state dir on a
// filesystem of kind (btrfs, with quotas, enforces size limits) and the
// plugin run with extra args, and registers teardown.
func StartWith(t tb.TB, kind testfs.Kind, pluginArgs ...string) *Cluster {
	c := startNodeOn(t, false, kind)
	// The plugin refuses to serve until the CSIDriver object makes the
	// kubelet vouch for pods.
	c.MustKubectl("", "apply", "-f", Repo(c.T, "deploy/csi/base/namespace.yaml"), "-f", Repo(c.T, "deploy/csi/base/csidriver.yaml"))
	c.startController()
	c.startPlugin(pluginArgs...)
	// Registered after the plugin's own stop, so it runs before it: pods
	// are deleted through the API while the plugin can still unpublish.
	t.Cleanup(c.DeletePods)
	c.Until("cowvol to register with the kubelet", 60*time.Second, func() bool {
		out, err := c.Kubectl("", "get", "csinode", NodeName, "-o", "jsonpath={.spec.drivers[*].name}")
		return err == nil && strings.Contains(out, DriverName)
	})
	c.applyManifests()
	return c
}

// StartNode brings up etcd, the API server, containerd with the images and
// the kubelet; with controllers, the controller manager and the scheduler
// too (Deployments and DaemonSets need them), and ServiceAccounts' tokens.
func StartNode(t tb.TB, controllers bool) *Cluster {
	return startNodeOn(t, controllers, testfs.Btrfs)
}

// startNodeOn brings the node up with cowvol's state dir on a filesystem of
// kind.
func startNodeOn(t tb.TB, controllers bool, kind testfs.Kind) *Cluster {
	testfs.Need(t, "containerd", "containerd-shim-runc-v2", "runc", "etcd", "ctr", "busybox")
	bin := KubeBin(t)
	work, err := os.MkdirTemp("", "cowvol-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	// Traversable, as /var/lib and /run are: a pod with a user namespace
	// of its own is another user to the node, and its runtime reaches its
	// rootfs (in containerd's state dir) as that user.
	if err := os.Chmod(work, 0o711); err != nil {
		t.Fatal(err)
	}
	c := &Cluster{T: t, Work: work, Bin: bin, Procs: map[string]*proc{}, sysctls: map[string]string{}, links: linkNames(t)}
	// Made before the teardown is registered, so that it is unmounted
	// after the teardown has stopped everything that uses it. btrfs with
	// quotas: the state dir enforces step volumes' size limits.
	c.StateDir = testfs.Mount(t, kind, 6<<30)
	if kind == testfs.Btrfs {
		testfs.EnableBtrfsQuota(t, c.StateDir)
	}
	for _, s := range kubeletSysctls {
		v, err := os.ReadFile("/proc/sys/" + s)
		if err != nil {
			t.Fatal(err)
		}
		c.sysctls[s] = strings.TrimSpace(string(v))
	}
	t.Cleanup(c.teardown)
	if err := os.MkdirAll(filepath.Join(work, "logs"), 0o755); err != nil {
		t.Fatal(err)
	}
	c.startEtcd()
	c.startAPIServer(controllers)
	c.startContainerd()
	c.importImages()
	c.startKubelet()
	if controllers {
		c.startControllers()
	}
	return c
}

func (c *Cluster) startEtcd() {
	dir := filepath.Join(c.Work, "etcd")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		c.T.Fatal(err)
	}
	// etcd fsyncs a lot and the root disk is throttled: a tmpfs is enough
	// for a cluster that lives as long as the test.
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=512m"); err != nil {
		c.T.Fatal(err)
	}
	client, peer := plugintest.FreePort(c.T), plugintest.FreePort(c.T)
	cu, pu := fmt.Sprintf("http://127.0.0.1:%d", client), fmt.Sprintf("http://127.0.0.1:%d", peer)
	c.start("etcd", nil, "etcd", "--name=e2e", "--data-dir="+filepath.Join(dir, "data"),
		"--listen-client-urls="+cu, "--advertise-client-urls="+cu,
		"--listen-peer-urls="+pu, "--initial-advertise-peer-urls="+pu, "--initial-cluster=e2e="+pu)
	c.Procs["etcd"].Cmd.Args = append(c.Procs["etcd"].Cmd.Args, cu) // remembered for the apiserver
}

// apiHost is the API server's address: loopback, or with nodes in network
// namespaces of their own, the test's own address on their network.
func (c *Cluster) apiHost() string {
	if c.lab != nil {
		return c.lab.Self
	}
	return "127.0.0.1"
}

// kubeletAddressTypes are how the API server reaches a kubelet: the one
// node is "localhost" on loopback; nodes of their own network by address.
func (c *Cluster) kubeletAddressTypes() string {
	if c.lab != nil {
		return "InternalIP"
	}
	return "Hostname"
}

func (c *Cluster) startAPIServer(serviceAccounts bool) {
	dir := filepath.Join(c.Work, "apiserver")
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		c.T.Fatal(err)
	}
	saKey := filepath.Join(dir, "sa.key")
	WriteFile(c.T, saKey, string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})))
	tokens := filepath.Join(dir, "tokens.csv")
	WriteFile(c.T, tokens, adminToken+",admin,admin,system:masters\n")
	// Each kubelet is itself, as in a real cluster: a client certificate
	// for system:node:<name> in system:nodes (kubeletKubeconfig), which the
	// node authorizer and NodeRestriction hold to its own node and pods.
	c.clientCA = netlab.NewPKI(c.T, filepath.Join(dir, "client-ca"), "cowvol e2e client CA")
	etcdArgs := c.Procs["etcd"].Cmd.Args
	port := plugintest.FreePort(c.T)
	c.APIPort = port
	args := []string{filepath.Join(c.Bin, "kube-apiserver"),
		"--etcd-servers=" + etcdArgs[len(etcdArgs)-1],
		"--bind-address=" + c.apiHost(), "--advertise-address=" + c.apiHost(), "--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + filepath.Join(dir, "certs"),
		"--token-auth-file=" + tokens, "--client-ca-file=" + c.clientCA.CA,
		"--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction", // cowvol --kube-auth asks it
		"--service-account-issuer=https://localhost", "--service-account-key-file=" + saKey,
		"--service-account-signing-key-file=" + saKey,
		// Routed by kube-proxy on a fleet's nodes; never on the one node.
		"--service-cluster-ip-range=" + serviceCIDR,
		"--kubelet-preferred-address-types=" + c.kubeletAddressTypes(),
		"--allow-privileged=true", "--profiling=false"}
	if c.lab != nil {
		// The API server runs beside the nodes, not on one: no kube-proxy
		// routes a Service's cluster IP for it. It calls webhooks (cowvol's
		// locality webhook) at their Service's endpoints instead.
		args = append(args, "--enable-aggregator-routing=true")
	}
	if c.lab == nil {
		// From 1.37 the kubernetes Service's reconciler refuses a loopback
		// advertise address; nothing on the one node reaches it through
		// the Service.
		args = append(args, "--endpoint-reconciler-type=none")
	}
	if !serviceAccounts {
		// No controller manager makes namespaces' default ServiceAccounts.
		args = append(args, "--disable-admission-plugins=ServiceAccount")
	}
	c.start("kube-apiserver", nil, args...)
	c.Kubeconfig = filepath.Join(c.Work, "kubeconfig")
	WriteFile(c.T, c.Kubeconfig, fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: "https://%s:%d", insecure-skip-tls-verify: true}
users:
- name: admin
  user: {token: %s}
contexts:
- name: e2e
  context: {cluster: e2e, user: admin}
current-context: e2e
`, c.apiHost(), port, adminToken))
	c.Until("the apiserver to be ready", 90*time.Second, func() bool {
		out, err := c.Kubectl("", "get", "--raw", "/readyz")
		return err == nil && strings.TrimSpace(out) == "ok"
	})
}

func (c *Cluster) startContainerd() {
	c.Snapshotter = filepath.Join(c.Work, "cowvol-snapshotter.sock")
	c.Containerd = c.startRuntime(NodeHost{Name: NodeName, Dir: c.Work}, c.Snapshotter)
}

// NodeHost is where a node's runtime and kubelet run: the node's name,
// the address its kubelet serves on and reports (empty: loopback, as
// NodeName), the network namespace they run in (empty: the test's own),
// the dir below which they keep their state, and the cgroup their pods go
// under (empty: the root).
type NodeHost struct {
	Name, Address, Netns, Dir, CgroupRoot string
	// PodCIDR is the subnet its pods' addresses are routed from (empty:
	// pods get an address that leads nowhere; see podnet).
	PodCIDR string
	// Mountns is the node's mount namespace (empty: the test's), where
	// its processes see dir at view: so every node's kubelet root dir and
	// cowvol state dir are at the same paths, as a DaemonSet's hostPaths
	// need, and what is mounted there on one node is on no other.
	Mountns, view string
}

// enter is the nsenter command line that runs a program in the node's
// namespaces, or nil where it has none of its own.
func (n NodeHost) enter() []string {
	var args []string
	if n.Netns != "" {
		args = append(args, "--net=/run/netns/"+n.Netns)
	}
	if n.Mountns != "" {
		args = append(args, "--mount="+n.Mountns)
	}
	if args == nil {
		return nil
	}
	return append(append([]string{"nsenter"}, args...), "--")
}

// seen is where the node's own processes find path below its dir.
func (n NodeHost) seen(path ...string) string {
	return filepath.Join(append([]string{cmp.Or(n.view, n.Dir)}, path...)...)
}

// Proc names a process of the node's.
func (n NodeHost) Proc(name string) string {
	if n.Name == NodeName {
		return name
	}
	return name + "-" + n.Name
}

// startRuntime starts the node's containerd, its cowvol snapshotter
// expected at snapshotterSocket, and returns its socket.
func (c *Cluster) startRuntime(n NodeHost, snapshotterSocket string) string {
	dir := filepath.Join(n.Dir, "containerd")
	socket := filepath.Join(dir, "containerd.sock")
	cni, cniBin := filepath.Join(dir, "cni"), filepath.Join(dir, "cni-bin")
	// podnet routes a fleet node's pods through the node (a network
	// namespace of the lab's), and gives the one node's pods, which share
	// the test's namespace with the machine, an interface that leads
	// nowhere: hostNetwork pods need no network, but the CRI reports the
	// network not ready without a CNI config.
	c.BuildStatic("podnet", cniBin)
	podnet, _ := json.Marshal(map[string]any{"type": "podnet", "subnet": n.PodCIDR, "gateway": podGateway, "dataDir": filepath.Join(dir, "podnet")})
	WriteFile(c.T, filepath.Join(cni, "10-e2e.conflist"),
		`{"cniVersion": "0.4.0", "name": "e2e", "plugins": [{"type": "loopback"}, `+string(podnet)+`]}`)
	config := filepath.Join(dir, "config.toml")
	// containerd 2's config schema (version 3): the CRI plugin's images and
	// runtime halves are plugins of their own. The cowvol snapshotter and
	// its runtime handler are as docs/step-images.md has a node configure them
	// (the plugin serves the socket only where a test asks for it).
	WriteFile(c.T, config, fmt.Sprintf(`version = 3
root = %q
state = %q
[grpc]
  address = %q
`+snapshotter.ContainerdConfig(snapshotterSocket, "linux/"+runtime.GOARCH)+`
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  # Any pull of docker.io (an image named by a bare ID or short name)
  # goes to a closed loopback port: no test reaches outside.
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = %q
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = %q
[plugins.'io.containerd.cri.v1.runtime']
  # This machine's root lacks CAP_SYS_RESOURCE: without this every
  # sandbox fails with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [%q, "/usr/lib/cni"]
    conf_dir = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), socket, filepath.Join(dir, "certs.d"), PauseImage, cniBin, cni))
	WriteFile(c.T, filepath.Join(dir, "certs.d", "docker.io", "hosts.toml"), `server = "http://127.0.0.1:9"
[host."http://127.0.0.1:9"]
  capabilities = ["pull", "resolve"]
`)
	c.startOn(n, n.Proc("containerd"), nil, "containerd", "--config", config)
	c.Until(n.Proc("containerd"), 30*time.Second, func() bool {
		return exec.Command("ctr", "--address", socket, "version").Run() == nil
	})
	return socket
}

// BuildStatic builds one of the harness's commands (test/localcluster's
// podnet, pause, euid or mktree) statically into dir and returns the
// binary.
func (c *Cluster) BuildStatic(name, dir string) []byte {
	out := filepath.Join(dir, name)
	build := exec.Command("go", "build", "-o", out, "./test/localcluster/"+name)
	build.Dir = Repo(c.T, "")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := build.CombinedOutput(); err != nil {
		c.T.Fatalf("building %s: %v: %s", name, err, b)
	}
	bin, err := os.ReadFile(out)
	if err != nil {
		c.T.Fatal(err)
	}
	return bin
}

// importImages builds the pause and busybox images here (no registry is
// reachable) and imports them into the CRI's namespace. The busybox image
// also holds euid, which prints the effective user ID it runs with.
func (c *Cluster) importImages() { c.importImagesInto(c.Containerd) }

// importImagesInto imports the harness's images into the runtime at
// socket, building them the first time.
func (c *Cluster) importImagesInto(socket string) {
	dir := filepath.Join(c.Work, "images")
	out := filepath.Join(dir, "images.tar")
	if _, err := os.Stat(out); err != nil {
		c.buildImages(dir, out)
	}
	for _, archive := range []string{out, os.Getenv("COWVOL_PLUGIN_IMAGE_TAR")} {
		if b, err := exec.Command("ctr", "--address", socket, "-n", "k8s.io", "images", "import", archive).CombinedOutput(); err != nil {
			c.T.Fatalf("importing %s: %v: %s", archive, err, b)
		}
	}
}

// buildImages writes the pause and busybox images to out.
func (c *Cluster) buildImages(dir, out string) {
	pauseBin, euidBin, mktreeBin := c.BuildStatic("pause", dir), c.BuildStatic("euid", dir), c.BuildStatic("mktree", dir)
	bbFiles := append(BusyboxFiles(c.T), ociimage.File{Path: "bin/euid", Mode: 0o755, Data: euidBin},
		ociimage.File{Path: "bin/mktree", Mode: 0o755, Data: mktreeBin})
	if os.Getenv("COWVOL_PLUGIN_IMAGE_TAR") == "" {
		c.T.Fatal("COWVOL_PLUGIN_IMAGE_TAR is not set: run make e2e (it builds the plugin's image with make image)")
	}
	if err := ociimage.Write(out,
		ociimage.Image{Name: PauseImage, Files: []ociimage.File{{Path: "pause", Mode: 0o755, Data: pauseBin}}, Cmd: []string{"/pause"}},
		ociimage.Image{Name: BusyboxImage, Files: bbFiles, Cmd: []string{"/bin/sh"}, Env: []string{"PATH=/bin"}},
	); err != nil {
		c.T.Fatal(err)
	}
}

// BusyboxFiles are a busybox image's files: the binary, a link for each
// applet, and /tmp.
func BusyboxFiles(t tb.TB) []ociimage.File {
	busybox, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	applets, err := exec.Command("busybox", "--list").Output()
	if err != nil {
		t.Fatal(err)
	}
	files := []ociimage.File{{Path: "bin/busybox", Mode: 0o755, Data: busybox}, {Path: "tmp", Dir: true, Mode: 0o1777}}
	for _, a := range strings.Fields(string(applets)) {
		if a != "busybox" {
			files = append(files, ociimage.File{Path: "bin/" + a, Link: "busybox"})
		}
	}
	return files
}

// startControllers runs the controller manager (Deployments, DaemonSets,
// ServiceAccounts, the root CA's ConfigMap) and the scheduler.
func (c *Cluster) startControllers() {
	ca := filepath.Join(c.Work, "apiserver", "certs", "apiserver.crt")
	// A fleet's nodes are watched (their not-ready taints lifted and set,
	// as kube-scheduler needs); the one node's pods name their node.
	controllers := "*,-nodeipam,-persistentvolume-binder,-attachdetach"
	args := []string{filepath.Join(c.Bin, "kube-controller-manager"),
		"--kubeconfig=" + c.Kubeconfig, "--leader-elect=false", "--root-ca-file=" + ca,
		"--use-service-account-credentials=false", "--bind-address=127.0.0.1", "--secure-port=0"}
	if c.lab == nil {
		controllers += ",-nodelifecycle"
	} else {
		// A dead node is found unready in 20 s, not 50: the fleet's
		// node deaths are waited for.
		args = append(args, "--node-monitor-grace-period=20s")
	}
	c.start("kube-controller-manager", nil, append(args, "--controllers="+controllers)...)
	c.start("kube-scheduler", nil, filepath.Join(c.Bin, "kube-scheduler"),
		"--kubeconfig="+c.Kubeconfig, "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0")
	c.Until("the default ServiceAccount", 60*time.Second, func() bool {
		_, err := c.Kubectl("", "get", "serviceaccount", "default", "-n", "default")
		return err == nil
	})
}

// CredentialProviderBinary is the kubelet's credential provider that make
// e2e built.
func CredentialProviderBinary(t tb.TB) string {
	bin := os.Getenv("COWVOL_CREDENTIAL_PROVIDER_BINARY")
	if bin == "" {
		t.Fatal("COWVOL_CREDENTIAL_PROVIDER_BINARY is not set: run make e2e (make build builds it)")
	}
	return bin
}

// installCredentialProvider installs cowvol's credential provider as the
// node DaemonSet's init container does, and writes the kubelet's
// CredentialProviderConfig as components/image-registry gives it (but for
// its bin dir); it returns the kubelet's flags for them.
func (c *Cluster) installCredentialProvider(dir string) []string {
	binDir := filepath.Join(dir, "credential-providers")
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		c.T.Fatal(err)
	}
	if out, err := exec.Command(CredentialProviderBinary(c.T), "install", binDir).CombinedOutput(); err != nil {
		c.T.Fatalf("installing the credential provider: %v: %s", err, out)
	}
	config, err := os.ReadFile(Repo(c.T, "deploy/csi/components/image-registry/credential-provider-config.yaml"))
	if err != nil {
		c.T.Fatal(err)
	}
	path := filepath.Join(dir, "credential-provider-config.yaml")
	WriteFile(c.T, path, string(config))
	return []string{"--image-credential-provider-config=" + path, "--image-credential-provider-bin-dir=" + binDir}
}

func (c *Cluster) startKubelet() {
	c.KubeletDir = c.StartKubeletOn(NodeHost{Name: NodeName, Dir: c.Work}, c.Containerd)
}

// StartKubeletOn starts the node's kubelet on its runtime's socket, waits
// for the node to register, and returns the kubelet's root dir.
func (c *Cluster) StartKubeletOn(n NodeHost, containerd string) string {
	kubeletDir := n.seen("kubelet")
	providerFlags := c.installCredentialProvider(n.Dir)
	config := filepath.Join(n.Dir, "kubelet.yaml")
	address, port, nodeIP := "127.0.0.1", plugintest.FreePort(c.T), ""
	if n.Address != "" {
		address, port, nodeIP = n.Address, 10250, "--node-ip="+n.Address
	}
	WriteFile(c.T, config, fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %s
port: %d
readOnlyPort: 0
healthzPort: 0
cgroupDriver: cgroupfs
cgroupRoot: %q
# cgroup v1 here, and no swap to speak of.
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://%s
podLogsDir: %q
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", imagefs.available: "1%%"}
imageGCHighThresholdPercent: 100
serializeImagePulls: false
# Pulls for a runtime class's handler, so that an image pulled for the
# cowvol handler is unpacked by its snapshotter.
featureGates: {RuntimeClassInImageCriApi: true}
resolvConf: ""
syncFrequency: 2s
fileCheckFrequency: 2s
# A container killed again and again (the soak SIGKILLs cowvol's plugin
# every minute or so) restarts within 10 s instead of backing off to 5
# minutes, during which its node could mount no step's volume
# (KubeletCrashLoopBackOffMax, beta and on since 1.35).
crashLoopBackOff: {maxContainerRestartPeriod: 10s}
`, address, port, cmp.Or(n.CgroupRoot, "/"), containerd, filepath.Join(n.Dir, "pod-logs")))
	args := append([]string{filepath.Join(c.Bin, "kubelet"), "--config=" + config, "--kubeconfig=" + c.kubeletKubeconfig(n),
		"--root-dir=" + kubeletDir, "--hostname-override=" + n.Name, "--v=2"}, providerFlags...)
	if nodeIP != "" {
		args = append(args, nodeIP)
	}
	c.startOn(n, n.Proc("kubelet"), nil, args...)
	c.Until("node "+n.Name+" to register", 90*time.Second, func() bool {
		_, err := c.Kubectl("", "get", "node", n.Name)
		return err == nil
	})
	return kubeletDir
}

// kubeletKubeconfig is the kubeconfig of a node's kubelet: the API
// server, and the node's own client certificate (system:node:<name>).
func (c *Cluster) kubeletKubeconfig(n NodeHost) string {
	dir := filepath.Join(n.Dir, "kubelet-identity")
	cert, key := c.clientCA.ClientCert(c.T, dir, "system:node:"+n.Name, "system:nodes")
	path := filepath.Join(dir, "kubeconfig")
	WriteFile(c.T, path, fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: "https://%s:%d", insecure-skip-tls-verify: true}
users:
- name: %s
  user: {client-certificate: %q, client-key: %q}
contexts:
- name: e2e
  context: {cluster: e2e, user: %s}
current-context: e2e
`, c.apiHost(), c.APIPort, n.Name, cert, key, n.Name))
	return path
}

// startPlugin runs cowvol's node plugin on the host, registered with the
// kubelet through its own registration socket (no sidecar): the kubelet
// learns the CSI socket's path from it.
// startController runs cowvol's controller on the host, following the
// cluster's Nodes through the API server, and connects a scheduler's client.
func (c *Cluster) startController() {
	c.ControllerAddr = fmt.Sprintf("127.0.0.1:%d", plugintest.FreePort(c.T))
	c.controller = plugintest.Start(c.T, plugintest.Config{Mode: "controller",
		Args: []string{"--api-address=" + c.ControllerAddr, "--kubeconfig=" + c.Kubeconfig, "--node-id=cowvol-controller"}})
	cache, err := client.Dial(client.Options{Address: c.ControllerAddr})
	if err != nil {
		c.T.Fatal(err)
	}
	c.T.Cleanup(func() { cache.Close() })
	c.Cache = cache
}

func (c *Cluster) startPlugin(extraArgs ...string) {
	// A node that serves its volumes' images runs them on its snapshotter
	// too, where containerd looks for it.
	for _, a := range extraArgs {
		if strings.HasPrefix(a, "--image-registry-address=") {
			extraArgs = append(extraArgs, "--image-snapshotter-endpoint=unix://"+c.Snapshotter, "--containerd-address="+c.Containerd)
			break
		}
	}
	c.Plugin = plugintest.Start(c.T, plugintest.Config{
		StateDir:   filepath.Join(c.StateDir, "cowvol"),
		KubeletDir: c.KubeletDir,
		Args: append([]string{"--node-id=" + NodeName, "--kubeconfig=" + c.Kubeconfig,
			"--kubelet-registration-socket=" + filepath.Join(c.KubeletDir, "plugins_registry", DriverName+"-reg.sock"),
			"--controller-address=" + c.ControllerAddr, "--peer-address=" + plugintest.FreeAddr(c.T),
			// Low enough for the last scenario to cross without filling
			// 6 GiB; the build never gets near it. No eviction grace:
			// that scenario evicts a volume made a moment before.
			"--high-watermark=50", "--low-watermark=40", "--eviction-grace=0s"}, extraArgs...),
	})
}

// CreateStepNamespaces makes the namespaces steps run in, and the
// ServiceAccount that step pods running images from the node's registry
// run as (the kubelet pulls with a token of theirs; withAccount). They
// enforce Pod Security's baseline, as docs/security.md asks of a step
// namespace: no step pod, the Argo executor's included, needs more.
func (c *Cluster) CreateStepNamespaces(withAccount bool) {
	for _, ns := range []string{"ci", "other"} {
		c.MustKubectl("", "create", "namespace", ns)
		c.MustKubectl("", "label", "namespace", ns, stepPodSecurity)
		if withAccount {
			c.MustKubectl("", "create", "serviceaccount", StepsServiceAccount, "-n", ns)
		}
	}
}

func (c *Cluster) applyManifests() {
	c.CreateStepNamespaces(true)
	// The image registry component's RBAC, as its install applies it: the
	// kubelet, system:node:<name> under NodeRestriction, may ask for a
	// pod's token for the registry's audience only with its grant.
	c.MustKubectl("", "apply", "-f", Repo(c.T, "deploy/csi/components/image-registry/rbac.yaml"))
	// What a user applies must be valid against this apiserver: the
	// default install and the example overlay (with the registrar-less
	// component), rendered by kubectl's own kustomize.
	for _, k := range []string{Repo(c.T, "deploy/csi/"), Repo(c.T, "deploy/csi/overlays/example/")} {
		c.MustKubectl("", "apply", "--dry-run=server", "-k", k)
	}
}

// DeletePods deletes every step pod through the API, so that the kubelet
// unpublishes their volumes while the plugin still runs.
func (c *Cluster) DeletePods() {
	for _, ns := range []string{"ci", "other"} {
		_, _ = c.Kubectl("", "delete", "pods", "--all", "-n", ns, "--grace-period=1", "--timeout=90s")
	}
}

// StepsServiceAccount is the ServiceAccount step pods that run images
// from the node's registry run as: the kubelet hands its credential
// provider a token of the pod's ServiceAccount, and a pod without one pulls
// nothing from the registry.
const StepsServiceAccount = "steps"
