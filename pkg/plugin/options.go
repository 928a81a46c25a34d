package plugin

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/registry"
	"github.com/concourse/cowvol/pkg/streamer"
)

// Options configure a Driver. Validate is the one place they are checked.
type Options struct {
	Endpoint       string
	Mode           Mode
	NodeID         string
	DriverName     string
	Version        string
	StateDir       string
	Backend        string // auto or an overlay.Kind
	FlattenDepth   int    // chains deeper than this are flattened
	MetricsAddress string // host:port for /metrics; empty serves none
	// Profiling serves Go's /debug/pprof/ beside /metrics: off by
	// default, as what the plugin does is shown to whoever reaches the
	// port.
	Profiling   bool
	StopTimeout time.Duration
	// RegistrationSocket, if set, is where the plugin serves the kubelet's
	// plugin-registration API itself (no node-driver-registrar sidecar),
	// typically /var/lib/kubelet/plugins_registry/<driver>-reg.sock.
	RegistrationSocket string
	// KubeletEndpoint is the CSI socket path as the kubelet sees it, told
	// to the kubelet at registration; it defaults to Endpoint's path.
	KubeletEndpoint string
	// Kubeconfig reaches the API server (Events, the CSIDriver check);
	// empty means in-cluster when run in a pod, and none otherwise.
	Kubeconfig string
	// KubeletDir is the kubelet's root dir: every target path must lie
	// below it in the kubelet's inline-volume layout.
	KubeletDir string
	// DefaultSizeLimit caps a writable step volume that names no
	// sizeLimit, and MaxSizeLimit caps any (bytes; 0: none).
	DefaultSizeLimit, MaxSizeLimit int64
	// AllowSetuid keeps setuid/setgid bits, file capabilities and device
	// nodes in captures and pulls, and mounts step volumes without nosuid.
	AllowSetuid bool
	// NodeAPIEndpoint is where the node API is served: a unix socket, by
	// default node-api.sock beside a unix CSI endpoint.
	NodeAPIEndpoint string
	// ImageRegistryAddress (node mode) is the loopback host:port where the
	// node serves the images its cached volumes hold to its container
	// runtime (package registry); empty serves none.
	ImageRegistryAddress string
	// ImageRegistryAuth is registry.AuthRequired (every pull proves its
	// pod's namespace with the token the kubelet's cowvol credential
	// provider hands the runtime) or registry.AuthGrace (a pull without
	// one is served as its path says, logged and counted: for the roll of
	// the credential provider onto existing nodes).
	ImageRegistryAuth string
	// ImageSnapshotterEndpoint (node mode) is the unix socket where the
	// node serves containerd its cowvol snapshotter (package
	// snapshotter), which runs step images on cached volumes' layers;
	// empty serves none. Its root is snapshotter/ in the state dir.
	ImageSnapshotterEndpoint string
	// ContainerdAddress (with the registry) is containerd's socket: the
	// images it keeps of volumes the node no longer serves are deleted,
	// and with the snapshotter, it is asked whether its config uses it;
	// empty asks nothing.
	ContainerdAddress string
	// ControllerAddress (node mode) is the controller's host:port that the
	// node reports its cache to; empty reports to none.
	ControllerAddress string
	// APIAddress (controller mode) is the host:port the controller serves
	// its Registry and Cache APIs on; empty serves none.
	APIAddress string
	// StalledAfter is how long a node may go without reporting before it
	// is left out of lookups and placement; ForgetStalledAfter, before the
	// controller forgets it.
	StalledAfter, ForgetStalledAfter time.Duration
	// AwaitReportsFor bounds how long a controller that begins to lead (or
	// starts) waits for the registered nodes' inventories before it
	// answers the Cache API (0: it answers at once, from what reached it).
	AwaitReportsFor time.Duration
	// TokensFile (controller) lists the callers of the controller's APIs,
	// "token,user,namespaces" a line; TokenFile (node) holds the token the
	// node presents. TLSCertFile and TLSKeyFile serve the controller's APIs
	// over TLS; TLSCAFile verifies the controller.
	TokensFile, TokenFile              string
	TLSCertFile, TLSKeyFile, TLSCAFile string
	// KubeAuth (controller) checks callers' tokens with TokenReviews and
	// each call with a SubjectAccessReview, instead of a tokens file.
	KubeAuth bool
	// HighWatermark and LowWatermark are percent of the state dir's
	// filesystem (bytes and inodes): over high, the node evicts until
	// under low, and refuses captures while it cannot.
	HighWatermark, LowWatermark int
	// EvictionGrace spares from eviction a volume used more recently.
	EvictionGrace time.Duration
	// LeaderElection (controller mode) elects one serving replica.
	LeaderElection LeaderElection
	// Peers (node mode) streams volumes between nodes.
	Peers PeerOptions

	// bootIDFile names the kernel's boot ID; tests point it elsewhere to
	// pretend a reboot.
	bootIDFile string
}

// Defaults are the options a plugin runs with where no flag says otherwise.
// Each default is written here and nowhere else: AddFlags shows them as
// the flags' defaults, and callers that build Options in code start from
// them.
func Defaults() Options {
	host, _ := os.Hostname()
	return Options{
		Endpoint: "unix:///csi/csi.sock", Mode: ModeNode, NodeID: host, DriverName: driver.DefaultDriverName, Version: "dev",
		StateDir: "/var/lib/cowvol", Backend: "auto", FlattenDepth: 64, StopTimeout: 30 * time.Second,
		KubeletDir: "/var/lib/kubelet", ImageRegistryAuth: registry.AuthRequired,
		StalledAfter: 30 * time.Second, ForgetStalledAfter: 10 * time.Minute, AwaitReportsFor: 30 * time.Second,
		HighWatermark: node.DefaultWatermarks.High, LowWatermark: node.DefaultWatermarks.Low, EvictionGrace: node.DefaultWatermarks.Grace,
		LeaderElection: LeaderElection{
			Namespace: os.Getenv("POD_NAMESPACE"), Name: "cowvol-controller", Identity: firstOf(os.Getenv("POD_NAME"), host),
			LeaseDuration: 15 * time.Second, RenewDeadline: 10 * time.Second, RetryPeriod: 2 * time.Second,
		},
		Peers: PeerOptions{ServerName: DefaultPeerServerName, Encoding: string(streamer.S2),
			SizeLimit: streamer.DefaultLimits.Bytes, PullWait: node.DefaultPullWait, PullMode: string(node.PullAuto),
			ReadOrderRefresh: node.DefaultReadOrderRefresh},
	}
}

func firstOf(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

// AddFlags registers a flag for every option but Version, each defaulting
// to the option's value now (start from Defaults).
func (o *Options) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.Endpoint, "endpoint", o.Endpoint, "CSI endpoint: unix:///path or tcp://host:port")
	fs.StringVar((*string)(&o.Mode), "mode", string(o.Mode), "services to serve: node, controller or all")
	fs.StringVar(&o.NodeID, "node-id", o.NodeID, "this node's ID (defaults to the host name)")
	fs.StringVar(&o.DriverName, "driver-name", o.DriverName, "CSI driver name")
	fs.StringVar(&o.StateDir, "state-dir", o.StateDir, "where cached volumes and metadata live (XFS with reflink is best)")
	fs.StringVar(&o.Backend, "cow-backend", o.Backend, "copy-on-write backend: auto, overlay, reflink, btrfs or copy")
	fs.IntVar(&o.FlattenDepth, "flatten-depth", o.FlattenDepth, "layer chains deeper than this are flattened in the background")
	fs.StringVar(&o.MetricsAddress, "metrics-address", o.MetricsAddress, "host:port to serve Prometheus /metrics on (empty: none)")
	fs.BoolVar(&o.Profiling, "profiling", o.Profiling, "also serve Go's /debug/pprof/ on --metrics-address")
	fs.DurationVar(&o.StopTimeout, "stop-timeout", o.StopTimeout, "how long in-flight RPCs may run after SIGTERM")
	fs.StringVar(&o.RegistrationSocket, "kubelet-registration-socket", o.RegistrationSocket,
		"serve the kubelet's plugin registration on this socket, without the node-driver-registrar sidecar\n"+
			"(e.g. /var/lib/kubelet/plugins_registry/cowvol.concourse-ci.org-reg.sock)")
	fs.StringVar(&o.KubeletEndpoint, "kubelet-endpoint", o.KubeletEndpoint,
		"the CSI socket path as the kubelet sees it, for registration (default: the --endpoint path)")
	fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig,
		"kubeconfig for the API server: step pods (user namespaces, how steps ended), Kubernetes Events, and the CSIDriver check\n"+
			"(default: in-cluster when run in a pod; else none)")
	fs.StringVar(&o.KubeletDir, "kubelet-dir", o.KubeletDir,
		"the kubelet's root dir: targets must lie below it as pods/<uid>/volumes/kubernetes.io~csi/<name>/mount")
	fs.Var(quantityFlag{&o.DefaultSizeLimit}, "default-size-limit",
		"cap on what a step may write into a volume that names no sizeLimit, as a quantity such as 10Gi (0: none)")
	fs.Var(quantityFlag{&o.MaxSizeLimit}, "max-size-limit",
		"the largest sizeLimit a step volume may ask for, as a quantity such as 100Gi (0: none)")
	fs.BoolVar(&o.AllowSetuid, "allow-setuid", o.AllowSetuid,
		"keep setuid/setgid bits, file capabilities and device nodes in what steps capture and pulls bring, and mount step volumes\n"+
			"without nosuid (they are always nodev); off, all are dropped, since runtimes do not pass a volume's nosuid and nodev into the container")
	fs.StringVar(&o.NodeAPIEndpoint, "node-api-endpoint", o.NodeAPIEndpoint,
		"unix:///path to serve the node API on (default: node-api.sock beside a unix --endpoint)")
	fs.StringVar(&o.ImageRegistryAddress, "image-registry-address", o.ImageRegistryAddress,
		"loopback host:port to serve the images cached volumes hold on, for the kubelet to pull as <host:port>/<namespace>/<handle> (empty: none)")
	fs.StringVar(&o.ImageRegistryAuth, "image-registry-auth", o.ImageRegistryAuth,
		"with --image-registry-address: "+registry.AuthRequired+" (a pull must carry its pod's ServiceAccount token, which the kubelet's cowvol-credential-provider gives; "+
			"needs an API server to review it) or "+registry.AuthGrace+" (a pull without one is served as its path says, logged and counted: for the roll onto nodes whose kubelet lacks the provider)")
	fs.StringVar(&o.ImageSnapshotterEndpoint, "image-snapshotter-endpoint", o.ImageSnapshotterEndpoint,
		"unix:///path to serve containerd the cowvol snapshotter on (proxy_plugins), which runs images named <registry>/<namespace>/<handle>:"+registry.RemoteTag+
			" on the volume's own layers; needs --image-registry-address (empty: none)")
	fs.StringVar(&o.ContainerdAddress, "containerd-address", o.ContainerdAddress,
		"with --image-registry-address: containerd's socket path, to delete the images it keeps of volumes the node no longer serves and, with --image-snapshotter-endpoint, to check (and say on the Node) that its config uses the snapshotter (empty: neither)")
	fs.StringVar(&o.ControllerAddress, "controller-address", o.ControllerAddress,
		"node mode: the controller's host:port to report this node's cache to (plaintext on loopback only; else --tls-ca-file)")
	fs.StringVar(&o.APIAddress, "api-address", o.APIAddress,
		"controller mode: host:port to serve the Registry and Cache APIs on (plaintext on loopback only; else --tls-cert-file)")
	fs.DurationVar(&o.StalledAfter, "stalled-after", o.StalledAfter,
		"controller mode: a node silent this long is stalled: left out of lookups and placement")
	fs.DurationVar(&o.AwaitReportsFor, "await-reports-for", o.AwaitReportsFor,
		"controller mode: how long a replica that begins to lead (or a controller that starts) answers the Cache API Unavailable while "+
			"the nodes the plugin is registered on have not all sent it their inventories (0: answer at once from what reached it)")
	fs.DurationVar(&o.ForgetStalledAfter, "forget-stalled-after", o.ForgetStalledAfter,
		"controller mode: a node silent this long is forgotten")
	fs.StringVar(&o.TokensFile, "tokens-file", o.TokensFile,
		"controller mode: the callers of its APIs, a token,user,namespaces line each (namespaces * or a;b)")
	fs.BoolVar(&o.KubeAuth, "kube-auth", o.KubeAuth,
		"controller mode: check callers' bearer tokens with TokenReviews and authorize each call with a SubjectAccessReview\n"+
			"on cachedvolumes.cowvol.concourse-ci.org (namespaced) and cachenodes.cowvol.concourse-ci.org (instead of --tokens-file)")
	fs.StringVar(&o.TokenFile, "token-file", o.TokenFile,
		"node mode: a file holding the token to present to the controller, read at every call (a projected ServiceAccount token rotates)")
	fs.StringVar(&o.TLSCertFile, "tls-cert-file", o.TLSCertFile, "controller mode: the certificate to serve its APIs with (then any address)")
	fs.StringVar(&o.TLSKeyFile, "tls-key-file", o.TLSKeyFile, "controller mode: the certificate's key")
	fs.StringVar(&o.TLSCAFile, "tls-ca-file", o.TLSCAFile, "node mode: the CA to verify the controller's certificate with")
	fs.IntVar(&o.HighWatermark, "high-watermark", o.HighWatermark,
		"percent of the state dir's filesystem (bytes or inodes) above which cached volumes are evicted and captures refused")
	fs.IntVar(&o.LowWatermark, "low-watermark", o.LowWatermark, "percent of the state dir's filesystem that eviction brings it under")
	fs.DurationVar(&o.EvictionGrace, "eviction-grace", o.EvictionGrace,
		"a cached volume used (captured, pulled, mounted) more recently is not evicted, however full the disk: a step's output waits for the next step or its scheduler's pin, and captures are refused meanwhile")
	le := &o.LeaderElection
	fs.BoolVar(&le.Enabled, "leader-election", le.Enabled,
		"controller mode: elect one serving replica through a Lease; the others answer Unavailable naming the leader, and are not ready (but see --leader-election-label-pod)")
	fs.StringVar(&le.Namespace, "leader-election-namespace", le.Namespace, "the Lease's namespace (default $POD_NAMESPACE)")
	fs.StringVar(&le.Name, "leader-election-lease", le.Name, "the Lease's name")
	fs.StringVar(&le.Identity, "leader-election-identity", le.Identity,
		"this replica's name in the Lease (default $POD_NAME, else the host name)")
	fs.BoolVar(&le.LabelPod, "leader-election-label-pod", le.LabelPod,
		"the identity is this replica's pod: label it "+LeaderLabel+"=true while leading, for a Service that selects the leader by it; followers are ready too")
	fs.DurationVar(&le.LeaseDuration, "leader-election-lease-duration", le.LeaseDuration, "how long followers wait before taking over a silent leader's Lease")
	fs.DurationVar(&le.RenewDeadline, "leader-election-renew-deadline", le.RenewDeadline, "how long the leader tries to renew before it gives up leading (and exits)")
	fs.DurationVar(&le.RetryPeriod, "leader-election-retry-period", le.RetryPeriod, "how often replicas try to acquire or renew the Lease")
	p := &o.Peers
	fs.StringVar(&p.Address, "peer-address", p.Address, "node mode: host:port to serve cached volumes to pulling peers on (empty: none)")
	fs.StringVar(&p.AdvertiseAddress, "peer-advertise-address", p.AdvertiseAddress,
		"node mode: host:port peers dial, told to the controller (default: --peer-address)")
	fs.StringVar(&p.CertFile, "peer-tls-cert-file", p.CertFile,
		"the certificate for mutual TLS between peers: nodes serve and present it, the controller presents it to read and upload volumes")
	fs.StringVar(&p.KeyFile, "peer-tls-key-file", p.KeyFile, "the key of --peer-tls-cert-file")
	fs.StringVar(&p.CAFile, "peer-ca-file", p.CAFile, "the CA that signs every peer certificate")
	fs.StringVar(&p.ServerName, "peer-tls-server-name", p.ServerName, "the DNS name peer certificates carry")
	fs.Func("peers", "node mode, without a controller: peers to pull missing sources from, node=host:port,... ", func(v string) error {
		p.Static = append(p.Static, strings.Split(v, ",")...)
		return nil
	})
	fs.StringVar(&p.Encoding, "stream-encoding", p.Encoding, "node mode: how pulled layers travel: raw, zstd, s2 or gzip")
	fs.Var(quantityFlag{&p.SizeLimit}, "stream-size-limit",
		"node mode: the largest layer a pull accepts, as a tar stream (a quantity such as 100Gi)")
	fs.DurationVar(&p.PullWait, "pull-wait", p.PullWait,
		"node mode: how long a publish waits for a pull before answering with its progress (the kubelet retries), "+
			"and how long a reader of a lazily pulled file waits for a holder that stopped sending before it gets EIO")
	fs.StringVar(&p.PullMode, "pull-mode", p.PullMode,
		"node mode: how sources this node lacks arrive: lazy (the step starts once the tree is here, each file's data "+
			"arrives when it is opened, the rest behind it; needs the overlay backend and fanotify pre-content events, kernel 6.14+), "+
			"eager (all of it before the step starts) or auto (lazy where the node supports it)")
	fs.DurationVar(&p.ReadOrderRefresh, "read-order-refresh", p.ReadOrderRefresh,
		"node mode: how old a read profile's record must be before a lazy pull under it records the step's read order again "+
			"(recording costs each of the step's opens a notification); 0: every time")
}

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

// engineConfig is the node engine's part of the options.
func (o Options) engineConfig() node.Config {
	return node.Config{
		NodeID: o.NodeID, StateDir: o.StateDir, Backend: o.Backend, FlattenDepth: o.FlattenDepth,
		KubeletDir: o.KubeletDir, DefaultSizeLimit: o.DefaultSizeLimit, MaxSizeLimit: o.MaxSizeLimit,
		AllowSetuid: o.AllowSetuid, BootIDFile: o.bootIDFile,
		Watermarks: node.Watermarks{High: o.HighWatermark, Low: o.LowWatermark, Grace: o.EvictionGrace},
	}
}

// Validate checks the options, and derives what follows from others (the
// node API's socket beside a unix endpoint, the endpoint the kubelet is
// told at registration). It fills in no defaults: Defaults does.
func (o *Options) Validate() error {
	var errs []error
	if o.DriverName == "" {
		errs = append(errs, errors.New("the driver name is required"))
	}
	if o.StopTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--stop-timeout %s must be positive", o.StopTimeout))
	}
	if o.Profiling && o.MetricsAddress == "" {
		errs = append(errs, errors.New("--profiling serves on --metrics-address: give one"))
	}
	if o.StalledAfter <= 0 {
		errs = append(errs, fmt.Errorf("--stalled-after %s must be positive", o.StalledAfter))
	}
	if o.ForgetStalledAfter < o.StalledAfter {
		errs = append(errs, fmt.Errorf("--forget-stalled-after (%s) is shorter than --stalled-after (%s)", o.ForgetStalledAfter, o.StalledAfter))
	}
	if (o.TLSCertFile == "") != (o.TLSKeyFile == "") {
		errs = append(errs, errors.New("--tls-cert-file and --tls-key-file go together"))
	}
	// Plaintext stays on this machine; on the network, TLS and tokens.
	if o.TLSCertFile == "" {
		if err := loopbackOnly(o.APIAddress); err != nil {
			errs = append(errs, fmt.Errorf("--api-address: %w (or give --tls-cert-file and --tls-key-file)", err))
		}
	} else if o.TokensFile == "" && !o.KubeAuth {
		errs = append(errs, errors.New("serving the controller's APIs over TLS needs --tokens-file or --kube-auth: on the network only authenticated callers are served"))
	}
	if o.KubeAuth && o.TokensFile != "" {
		errs = append(errs, errors.New("--kube-auth and --tokens-file are two ways to authenticate callers: give one"))
	}
	if o.KubeAuth && o.Mode == ModeNode {
		errs = append(errs, errors.New("--kube-auth is the controller's: use --mode=controller or all"))
	}
	if o.TLSCAFile == "" {
		if err := loopbackOnly(o.ControllerAddress); err != nil {
			errs = append(errs, fmt.Errorf("--controller-address: %w (or give --tls-ca-file)", err))
		}
	} else if o.TokenFile == "" && o.ControllerAddress != "" {
		errs = append(errs, errors.New("reaching the controller over TLS needs --token-file"))
	}
	// Its repositories name namespaces nobody authenticated: the node's
	// runtime alone may reach it.
	if err := loopbackOnly(o.ImageRegistryAddress); err != nil {
		errs = append(errs, fmt.Errorf("--image-registry-address: %w", err))
	}
	if o.ImageRegistryAddress != "" && o.Mode == ModeController {
		errs = append(errs, errors.New("--image-registry-address is for node plugins: use --mode=node or all"))
	}
	if o.ImageRegistryAuth != registry.AuthRequired && o.ImageRegistryAuth != registry.AuthGrace {
		errs = append(errs, fmt.Errorf("--image-registry-auth %q: want %s or %s", o.ImageRegistryAuth, registry.AuthRequired, registry.AuthGrace))
	}
	if o.ImageSnapshotterEndpoint != "" {
		// The runtime pulls what the snapshotter runs from the registry.
		if o.ImageRegistryAddress == "" {
			errs = append(errs, errors.New("--image-snapshotter-endpoint needs --image-registry-address"))
		}
		if network, _, err := parseEndpoint(o.ImageSnapshotterEndpoint); err != nil || network != "unix" {
			errs = append(errs, fmt.Errorf("--image-snapshotter-endpoint %q: want unix:///path", o.ImageSnapshotterEndpoint))
		}
	}
	if o.ContainerdAddress != "" && o.ImageRegistryAddress == "" {
		errs = append(errs, errors.New("--containerd-address is asked about the images the node serves: it needs --image-registry-address"))
	}
	if o.ContainerdAddress != "" && !filepath.IsAbs(o.ContainerdAddress) {
		errs = append(errs, fmt.Errorf("--containerd-address %q: want the socket's absolute path", o.ContainerdAddress))
	}
	if o.APIAddress != "" && o.Mode == ModeNode {
		errs = append(errs, errors.New("--api-address is the controller's: use --mode=controller or all"))
	}
	if o.ControllerAddress != "" && o.Mode == ModeController {
		errs = append(errs, errors.New("--controller-address is for node plugins: use --mode=node or all"))
	}
	if _, _, err := parseEndpoint(o.Endpoint); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, o.LeaderElection.validate(o.Mode)...)
	errs = append(errs, o.Peers.validate(o)...)
	switch o.Mode {
	case ModeNode, ModeController, ModeAll:
	default:
		errs = append(errs, fmt.Errorf("mode %q is invalid: want node, controller or all", o.Mode))
	}
	if o.Mode == ModeController && o.RegistrationSocket != "" {
		errs = append(errs, errors.New("kubelet registration is for node plugins: use --mode=node or all"))
	}
	if o.Mode != ModeController {
		if o.NodeID == "" {
			errs = append(errs, errors.New("node ID is required"))
		}
		if o.StateDir == "" || !strings.HasPrefix(o.StateDir, "/") {
			errs = append(errs, fmt.Errorf("state dir %q must be an absolute path", o.StateDir))
		}
		if o.Backend != "auto" {
			if _, err := overlay.ParseKind(o.Backend); err != nil {
				errs = append(errs, fmt.Errorf("%w (or auto)", err))
			}
		}
		if o.KubeletDir == "" || !strings.HasPrefix(o.KubeletDir, "/") {
			errs = append(errs, fmt.Errorf("kubelet dir %q must be an absolute path", o.KubeletDir))
		}
		if o.DefaultSizeLimit < 0 || o.MaxSizeLimit < 0 {
			errs = append(errs, errors.New("size limits cannot be negative"))
		}
		if o.NodeAPIEndpoint == "" {
			if network, addr, err := parseEndpoint(o.Endpoint); err == nil && network == "unix" {
				o.NodeAPIEndpoint = "unix://" + filepath.Join(filepath.Dir(addr), "node-api.sock")
			}
		}
		if o.NodeAPIEndpoint != "" {
			if network, _, err := parseEndpoint(o.NodeAPIEndpoint); err != nil || network != "unix" {
				errs = append(errs, fmt.Errorf("node API endpoint %q must be unix:///path: it has no authentication of its own", o.NodeAPIEndpoint))
			}
		}
		if o.AwaitReportsFor < 0 {
			errs = append(errs, fmt.Errorf("--await-reports-for %s is negative", o.AwaitReportsFor))
		}
		if o.EvictionGrace < 0 {
			errs = append(errs, fmt.Errorf("--eviction-grace %s is negative", o.EvictionGrace))
		}
		if o.LowWatermark < 1 || o.HighWatermark > 100 || o.LowWatermark >= o.HighWatermark {
			errs = append(errs, fmt.Errorf("watermarks %d%% (low) and %d%% (high) are invalid: want 1 <= low < high <= 100",
				o.LowWatermark, o.HighWatermark))
		}
		if o.MaxSizeLimit > 0 && o.DefaultSizeLimit > o.MaxSizeLimit {
			errs = append(errs, fmt.Errorf("the default size limit (%d bytes) exceeds the maximum (%d bytes)", o.DefaultSizeLimit, o.MaxSizeLimit))
		}
		if o.RegistrationSocket != "" && o.KubeletEndpoint == "" {
			if network, addr, err := parseEndpoint(o.Endpoint); err == nil && network == "unix" {
				o.KubeletEndpoint = addr
			} else {
				errs = append(errs, errors.New("kubelet registration needs a unix endpoint (or the kubelet's endpoint path)"))
			}
		}
		if o.FlattenDepth < 1 || o.FlattenDepth > overlay.MaxLayers-1 {
			errs = append(errs, fmt.Errorf("flatten depth %d is invalid: want 1 to %d (overlayfs stacks at most %d layers)",
				o.FlattenDepth, overlay.MaxLayers-1, overlay.MaxLayers))
		}
	}
	return errors.Join(errs...)
}

// loopbackOnly checks a host:port that is served or dialled in plaintext:
// until the APIs carry TLS and authentication, they stay on this machine.
func loopbackOnly(addr string) error {
	if addr == "" {
		return nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q is not host:port: %w", addr, err)
	}
	if ip := net.ParseIP(host); host == "localhost" || (ip != nil && ip.IsLoopback()) {
		return nil
	}
	return fmt.Errorf("%q is not a loopback address: without TLS and authentication the APIs are served and reached on loopback only", addr)
}

// parseEndpoint splits unix:///path or tcp://host:port.
func parseEndpoint(ep string) (network, addr string, err error) {
	u, err := url.Parse(ep)
	if err != nil {
		return "", "", fmt.Errorf("endpoint %q: %w", ep, err)
	}
	switch u.Scheme {
	case "unix":
		addr = u.Path
		if addr == "" {
			addr = u.Opaque
		}
		if addr == "" {
			return "", "", fmt.Errorf("endpoint %q names no socket path", ep)
		}
		return "unix", addr, nil
	case "tcp":
		if u.Host == "" {
			return "", "", fmt.Errorf("endpoint %q names no host:port", ep)
		}
		return "tcp", u.Host, nil
	}
	return "", "", fmt.Errorf("endpoint %q: want unix:///path or tcp://host:port", ep)
}
