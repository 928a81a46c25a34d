// Command cowvol-plugin is cowvol's one binary: the CSI node plugin, the
// controller, or both (--mode), and `cowvol-plugin demo`, which plays a small
// CI pipeline through a plugin of its own on a temporary state dir.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/overlay"
)

// quantityFlag is a byte count given as a Kubernetes quantity (10Gi).
type quantityFlag struct{ bytes *int64 }

func (q quantityFlag) String() string {
	if q.bytes == nil {
		return "0"
	}
	return resource.NewQuantity(*q.bytes, resource.BinarySI).String()
}

func (q quantityFlag) Set(s string) error {
	v, err := resource.ParseQuantity(s)
	if err != nil {
		return fmt.Errorf("want a quantity such as 10Gi: %w", err)
	}
	*q.bytes = v.Value()
	return nil
}

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	if len(os.Args) > 1 && os.Args[1] == "demo" {
		if err := runDemo(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "demo failed:", err)
			os.Exit(1)
		}
		return
	}
	host, _ := os.Hostname()
	opts := driver.Options{Version: version}
	fs := flag.NewFlagSet("cowvol-plugin", flag.ExitOnError)
	fs.StringVar(&opts.Endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint: unix:///path or tcp://host:port")
	mode := fs.String("mode", string(driver.ModeNode), "services to serve: node, controller or all")
	fs.StringVar(&opts.NodeID, "node-id", host, "this node's ID (defaults to the host name)")
	fs.StringVar(&opts.DriverName, "driver-name", driver.DefaultDriverName, "CSI driver name")
	fs.StringVar(&opts.StateDir, "state-dir", "/var/lib/cowvol", "where cached volumes and metadata live (XFS with reflink is best)")
	fs.StringVar(&opts.Backend, "cow-backend", "auto", "copy-on-write backend: auto, overlay, reflink, btrfs or copy")
	fs.IntVar(&opts.FlattenDepth, "flatten-depth", 64, "layer chains deeper than this are flattened in the background")
	fs.StringVar(&opts.MetricsAddress, "metrics-address", "", "host:port to serve Prometheus /metrics on (empty: none)")
	fs.DurationVar(&opts.StopTimeout, "stop-timeout", 0, "how long in-flight RPCs may run after SIGTERM (0: 30s)")
	fs.StringVar(&opts.RegistrationSocket, "kubelet-registration-socket", "",
		"serve the kubelet's plugin registration on this socket, without the node-driver-registrar sidecar\n"+
			"(e.g. /var/lib/kubelet/plugins_registry/cowvol.concourse-ci.org-reg.sock)")
	fs.StringVar(&opts.KubeletEndpoint, "kubelet-endpoint", "",
		"the CSI socket path as the kubelet sees it, for registration (default: the --endpoint path)")
	fs.StringVar(&opts.Kubeconfig, "kubeconfig", "",
		"kubeconfig for the API server: Kubernetes Events on step pods, and the CSIDriver check (default: in-cluster when run in a pod; else none)")
	fs.StringVar(&opts.KubeletDir, "kubelet-dir", "/var/lib/kubelet",
		"the kubelet's root dir: targets must lie below it as pods/<uid>/volumes/kubernetes.io~csi/<name>/mount")
	fs.Var(quantityFlag{&opts.DefaultSizeLimit}, "default-size-limit",
		"cap on what a step may write into a volume that names no sizeLimit, as a quantity such as 10Gi (0: none)")
	fs.Var(quantityFlag{&opts.MaxSizeLimit}, "max-size-limit",
		"the largest sizeLimit a step volume may ask for, as a quantity such as 100Gi (0: none)")
	fs.BoolVar(&opts.AllowSetuid, "allow-setuid", false,
		"keep setuid/setgid bits and device nodes in what steps capture and pulls bring, and mount step volumes without nosuid\n"+
			"(they are always nodev); off, both are dropped, since runtimes do not pass a volume's nosuid and nodev into the container")
	fs.StringVar(&opts.NodeAPIEndpoint, "node-api-endpoint", "",
		"unix:///path to serve the node API on (default: node-api.sock beside a unix --endpoint)")
	fs.StringVar(&opts.ControllerAddress, "controller-address", "",
		"node mode: the controller's host:port to report this node's cache to (plaintext on loopback only; else --tls-ca-file)")
	fs.StringVar(&opts.APIAddress, "api-address", "",
		"controller mode: host:port to serve the Registry and Cache APIs on (plaintext on loopback only; else --tls-cert-file)")
	fs.DurationVar(&opts.StalledAfter, "stalled-after", 30*time.Second,
		"controller mode: a node silent this long is stalled: left out of lookups and placement")
	fs.DurationVar(&opts.ForgetStalledAfter, "forget-stalled-after", 10*time.Minute,
		"controller mode: a node silent this long is forgotten")
	fs.StringVar(&opts.TokensFile, "tokens-file", "",
		"controller mode: the callers of its APIs, a token,user,namespaces line each (namespaces * or a;b)")
	fs.BoolVar(&opts.KubeAuth, "kube-auth", false,
		"controller mode: check callers' bearer tokens with TokenReviews and authorize each call with a SubjectAccessReview\n"+
			"on cachedvolumes.cowvol.concourse-ci.org (namespaced) and cachenodes.cowvol.concourse-ci.org (instead of --tokens-file)")
	fs.StringVar(&opts.TokenFile, "token-file", "",
		"node mode: a file holding the token to present to the controller, read at every call (a projected ServiceAccount token rotates)")
	fs.StringVar(&opts.TLSCertFile, "tls-cert-file", "", "controller mode: the certificate to serve its APIs with (then any address)")
	fs.StringVar(&opts.TLSKeyFile, "tls-key-file", "", "controller mode: the certificate's key")
	fs.StringVar(&opts.TLSCAFile, "tls-ca-file", "", "node mode: the CA to verify the controller's certificate with")
	fs.IntVar(&opts.HighWatermark, "high-watermark", 90,
		"percent of the state dir's filesystem (bytes or inodes) above which cached volumes are evicted and captures refused")
	fs.IntVar(&opts.LowWatermark, "low-watermark", 80, "percent of the state dir's filesystem that eviction brings it under")
	le := &opts.LeaderElection
	fs.BoolVar(&le.Enabled, "leader-election", false,
		"controller mode: elect one serving replica through a Lease; the others answer Unavailable naming the leader, and are not ready")
	fs.StringVar(&le.Namespace, "leader-election-namespace", os.Getenv("POD_NAMESPACE"), "the Lease's namespace (default $POD_NAMESPACE)")
	fs.StringVar(&le.Name, "leader-election-lease", "cowvol-controller", "the Lease's name")
	fs.StringVar(&le.Identity, "leader-election-identity", firstOf(os.Getenv("POD_NAME"), host),
		"this replica's name in the Lease (default $POD_NAME, else the host name)")
	fs.DurationVar(&le.LeaseDuration, "leader-election-lease-duration", 15*time.Second, "how long followers wait before taking over a silent leader's Lease")
	fs.DurationVar(&le.RenewDeadline, "leader-election-renew-deadline", 10*time.Second, "how long the leader tries to renew before it gives up leading (and exits)")
	fs.DurationVar(&le.RetryPeriod, "leader-election-retry-period", 2*time.Second, "how often replicas try to acquire or renew the Lease")
	fs.StringVar(&opts.Peers.Address, "peer-address", "",
		"node mode: host:port to serve cached volumes to pulling peers on (empty: none)")
	fs.StringVar(&opts.Peers.AdvertiseAddress, "peer-advertise-address", "",
		"node mode: host:port peers dial, told to the controller (default: --peer-address)")
	fs.StringVar(&opts.Peers.CertFile, "peer-tls-cert-file", "",
		"the certificate for mutual TLS between peers: nodes serve and present it, the controller presents it to read and upload volumes")
	fs.StringVar(&opts.Peers.KeyFile, "peer-tls-key-file", "", "the key of --peer-tls-cert-file")
	fs.StringVar(&opts.Peers.CAFile, "peer-ca-file", "", "the CA that signs every peer certificate")
	fs.StringVar(&opts.Peers.ServerName, "peer-tls-server-name", driver.DefaultPeerServerName,
		"the DNS name peer certificates carry")
	fs.Func("peers", "node mode, without a controller: peers to pull missing sources from, node=host:port,... ",
		func(v string) error {
			opts.Peers.Static = append(opts.Peers.Static, strings.Split(v, ",")...)
			return nil
		})
	fs.StringVar(&opts.Peers.Encoding, "stream-encoding", "s2", "node mode: how pulled layers travel: raw, zstd, s2 or gzip")
	fs.Var(quantityFlag{&opts.Peers.SizeLimit}, "stream-size-limit",
		"node mode: the largest layer a pull accepts, as a tar stream (a quantity such as 100Gi; default 1Ti)")
	fs.DurationVar(&opts.Peers.PullWait, "pull-wait", 20*time.Second,
		"node mode: how long a publish waits for a pull before answering with its progress (the kubelet retries)")
	showVersion := fs.Bool("version", false, "print the version and exit")
	klog.InitFlags(fs)
	_ = fs.Parse(os.Args[1:])
	if *showVersion {
		fmt.Println("cowvol-plugin", version)
		return
	}
	opts.Mode = driver.Mode(*mode)
	if err := run(opts); err != nil {
		klog.ErrorS(err, "cowvol-plugin failed")
		klog.Flush()
		os.Exit(1)
	}
	klog.Flush()
}

func firstOf(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

func run(opts driver.Options) error {
	kube, err := driver.KubeClient(opts.Kubeconfig)
	if err != nil {
		return err
	}
	d, err := driver.New(opts, driver.Deps{Mounter: overlay.NewSysMounter(), Kube: kube})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	return d.Run(ctx)
}
