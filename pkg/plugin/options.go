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

	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/controller/locality"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/pull"
	"github.com/concourse/cowvol/pkg/registry"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// Options configure a plugin process, grouped by component: the
// process's own (every mode), then each component's, registered and
// validated only in the modes that run it (AddFlags, Validate): the node
// engine, step images and peer pulls in node and all modes, the
// controller in controller and all modes, leader election in controller
// mode. The peer certificates are every mode's: the controller presents
// them to read and upload volumes.
type Options struct {
	Endpoint       string
	Mode           Mode
	DriverName     string
	Version        string
	MetricsAddress string // host:port for /metrics; empty serves none
	// Profiling serves Go's /debug/pprof/ beside /metrics: off by
	// default, as what the plugin does is shown to whoever reaches the
	// port.
	Profiling   bool
	StopTimeout time.Duration
	// Kubeconfig reaches the API server (Events, the CSIDriver check);
	// empty means in-cluster when run in a pod, and none otherwise.
	Kubeconfig string
	// NodeID names the process: the node's ID in node mode, and the
	// instance reporting its Kubernetes Events in every mode.
	NodeID string

	Node           NodeOptions
	Images         ImageOptions
	Peers          PeerOptions
	Controller     ControllerOptions
	LeaderElection LeaderElection
}

// NodeOptions are the node plugin's: its cache, the kubelet's side, and
// its reports to the controller.
type NodeOptions struct {
	StateDir     string
	Backend      string // auto or an overlay.Kind
	FlattenDepth int    // chains deeper than this are flattened
	// RegistrationSocket, if set, is where the plugin serves the kubelet's
	// plugin-registration API itself (no node-driver-registrar sidecar),
	// typically /var/lib/kubelet/plugins_registry/<driver>-reg.sock.
	RegistrationSocket string
	// KubeletEndpoint is the CSI socket path as the kubelet sees it, told
	// to the kubelet at registration; empty: the endpoint's path.
	KubeletEndpoint string
	// KubeletDir is the kubelet's root dir: every target path must lie
	// below it in the kubelet's inline-volume layout.
	KubeletDir string
	// DefaultSizeLimit caps a writable step volume that names no
	// sizeLimit, and MaxSizeLimit caps any (bytes; 0: none).
	DefaultSizeLimit, MaxSizeLimit int64
	// AllowSetuid keeps setuid/setgid bits, file capabilities and device
	// nodes in captures and pulls, and mounts step volumes without nosuid.
	AllowSetuid bool
	// NodeAPIEndpoint is where the node API is served, a unix socket;
	// empty: node-api.sock beside a unix CSI endpoint.
	NodeAPIEndpoint string
	// HighWatermark and LowWatermark are percent of the state dir's
	// filesystem (bytes and inodes): over high, the node evicts until
	// under low, and refuses captures while it cannot.
	HighWatermark, LowWatermark int
	// EvictionGrace spares from eviction a volume used more recently.
	EvictionGrace time.Duration
	// CaptureWait is how long a publish whose source is a step's output
	// still being captured here waits for it before answering Unavailable.
	CaptureWait time.Duration
	// OutputCopies is how many nodes a captured volume that names no
	// copies attribute is kept on.
	OutputCopies int
	// CacheVersions is how many versions of a cache key the node keeps,
	// the current one among them.
	CacheVersions int
	// ControllerAddress is the controller's host:port that the node
	// reports its cache to (empty: none); TokenFile holds the token the
	// node presents, and TLSCAFile verifies the controller.
	ControllerAddress, TokenFile, TLSCAFile string

	// bootIDFile names the kernel's boot ID; tests point it elsewhere to
	// pretend a reboot.
	bootIDFile string
}

// ImageOptions are the node's step images.
type ImageOptions struct {
	// RegistryAddress is the loopback host:port where the node serves the
	// images its cached volumes hold to its container runtime (package
	// registry); empty serves none.
	RegistryAddress string
	// RegistryAuth is registry.AuthRequired (every pull proves its pod's
	// namespace with the token the kubelet's cowvol credential provider
	// hands the runtime) or registry.AuthGrace (a pull without one is
	// served as its path says, logged and counted: for the roll of the
	// credential provider onto existing nodes).
	RegistryAuth string
	// SnapshotterEndpoint is the unix socket where the node serves
	// containerd its cowvol snapshotter (package snapshotter), which runs
	// step images on cached volumes' layers; empty serves none. Its root
	// is snapshotter/ in the state dir.
	SnapshotterEndpoint string
	// ContainerdAddress (with the registry) is containerd's socket: the
	// images it keeps of volumes the node no longer serves are deleted,
	// and with the snapshotter, it is asked whether its config uses it;
	// empty asks nothing.
	ContainerdAddress string
}

// ControllerOptions are the controller's: its APIs, their callers, and how
// it treats silent nodes.
type ControllerOptions struct {
	// APIAddress is the host:port the controller serves its Registry and
	// Cache APIs on; empty serves none.
	APIAddress string
	// StalledAfter is how long a node may go without reporting before it
	// is left out of lookups and placement; ForgetStalledAfter, before the
	// controller forgets it.
	StalledAfter, ForgetStalledAfter time.Duration
	// AwaitReportsFor bounds how long a controller that begins to lead (or
	// starts) waits for the registered nodes' inventories before it
	// answers the Cache API (0: it answers at once, from what reached it).
	AwaitReportsFor time.Duration
	// TokensFile lists the callers of the controller's APIs,
	// "token,user,namespaces[,node]" a line; KubeAuth checks callers' tokens with
	// TokenReviews and each call with a SubjectAccessReview instead.
	TokensFile string
	KubeAuth   bool
	// TLSCertFile and TLSKeyFile serve the APIs over TLS.
	TLSCertFile, TLSKeyFile string
	// ReadOrdersMemory bounds the bytes of names the read orders nodes
	// share take in the controller's memory.
	ReadOrdersMemory int64
	// FullReportsAtOnce bounds the nodes' whole inventories the controller
	// reads at once; the rest are told to send theirs again a little later.
	FullReportsAtOnce int
	// Copies bound the copies volumes are granted: the most nodes one is
	// kept on, and each namespace's budget of extra copies.
	Copies fleet.CopyLimits
	// WebhookAddress is where the locality webhook is served over HTTPS,
	// with the APIs' certificate (empty: none); LocalityRegistries are the
	// hosts the nodes serve step images at, whose images are inputs too.
	WebhookAddress     string
	LocalityRegistries []string
	// OwnerSweepEvery is how often the controller destroys the volumes
	// whose owner (owner: controller) is gone (0: never).
	OwnerSweepEvery time.Duration
}

// runsNode and runsController say which components a mode runs.
func (m Mode) runsNode() bool       { return m == ModeNode || m == ModeAll }
func (m Mode) runsController() bool { return m == ModeController || m == ModeAll }

// Defaults are the options a plugin runs with where no flag says otherwise.
// Each default is written here and nowhere else: AddFlags shows them as
// the flags' defaults, and callers that build Options in code start from
// them.
func Defaults() Options {
	host, _ := os.Hostname()
	return Options{
		Endpoint: "unix:///csi/csi.sock", Mode: ModeNode, DriverName: driver.DefaultDriverName, Version: "dev",
		StopTimeout: 30 * time.Second, NodeID: host,
		Node: NodeOptions{StateDir: "/var/lib/cowvol", Backend: "auto", FlattenDepth: 64,
			KubeletDir:    "/var/lib/kubelet",
			HighWatermark: node.DefaultWatermarks.High, LowWatermark: node.DefaultWatermarks.Low, EvictionGrace: node.DefaultWatermarks.Grace,
			CaptureWait: node.DefaultCaptureWait, OutputCopies: 1, CacheVersions: node.DefaultCacheVersions},
		Images: ImageOptions{RegistryAuth: registry.AuthRequired},
		Controller: ControllerOptions{StalledAfter: 30 * time.Second, ForgetStalledAfter: 10 * time.Minute, FullReportsAtOnce: 4,
			Copies:          fleet.CopyLimits{Max: volume.MaxCopies, PerNamespace: 1000},
			AwaitReportsFor: 30 * time.Second, ReadOrdersMemory: 64 << 20, OwnerSweepEvery: time.Minute},
		LeaderElection: LeaderElection{
			Namespace: os.Getenv("POD_NAMESPACE"), Name: "cowvol-controller", Identity: firstOf(os.Getenv("POD_NAME"), host),
			LeaseDuration: 15 * time.Second, RenewDeadline: 10 * time.Second, RetryPeriod: 2 * time.Second,
		},
		Peers: PeerOptions{ServerName: DefaultPeerServerName, Encoding: string(streamer.S2),
			SizeLimit: streamer.DefaultLimits.Bytes, PullWait: pull.DefaultWait, PullMode: string(pull.Auto),
			ReadOrderRefresh: pull.DefaultReadOrderRefresh, SwarmMinSize: pull.DefaultSwarmMinBytes,
			CertLifetime: 24 * time.Hour, PullIndex: true},
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

// ModeFromArgs is the --mode the command line gives (the default where it
// gives none), read before the flags are registered, since the mode says
// which are.
func ModeFromArgs(args []string, def Mode) Mode {
	mode := def
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			break
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || name != "mode" {
			continue
		}
		if !hasValue && i+1 < len(args) {
			i++
			value = args[i]
		}
		mode = Mode(value)
	}
	return mode
}

// AddFlags registers the flags of every component the mode runs (all
// modes' for an invalid one, which Validate refuses), each defaulting to
// the option's value now (start from Defaults). A flag of another mode is
// not defined, so the command line refuses it.
func (o *Options) AddFlags(fs *flag.FlagSet, mode Mode) {
	valid := mode == ModeNode || mode == ModeController || mode == ModeAll
	fs.StringVar(&o.Endpoint, "endpoint", o.Endpoint, "CSI endpoint: unix:///path or tcp://host:port")
	fs.StringVar((*string)(&o.Mode), "mode", string(o.Mode), "services to serve: node, controller or all")
	fs.StringVar(&o.DriverName, "driver-name", o.DriverName, "CSI driver name")
	fs.StringVar(&o.MetricsAddress, "metrics-address", o.MetricsAddress, "host:port to serve Prometheus /metrics on (empty: none)")
	fs.BoolVar(&o.Profiling, "profiling", o.Profiling, "also serve Go's /debug/pprof/ on --metrics-address")
	fs.DurationVar(&o.StopTimeout, "stop-timeout", o.StopTimeout, "how long in-flight RPCs may run after SIGTERM")
	fs.StringVar(&o.NodeID, "node-id", o.NodeID,
		"this node's ID in node mode, and in every mode the instance that reports its Events (defaults to the host name)")
	fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig,
		"kubeconfig for the API server: step pods (user namespaces, how steps ended), Kubernetes Events, and the CSIDriver check\n"+
			"(default: in-cluster when run in a pod; else none)")
	o.Peers.addTLSFlags(fs)
	if mode.runsNode() || !valid {
		o.Node.AddFlags(fs)
		o.Images.AddFlags(fs)
		o.Peers.AddFlags(fs)
	}
	if mode.runsController() || !valid {
		o.Controller.AddFlags(fs)
		o.Peers.addCAFlags(fs)
	}
	if mode == ModeController || !valid {
		o.LeaderElection.AddFlags(fs)
	}
}

// FlagsOfOtherModes names, for a flag the mode does not define, the modes
// that do: the command line's error says which mode it belongs to.
func FlagsOfOtherModes(mode Mode) map[string]string {
	defined := func(m Mode) map[string]bool {
		o := Defaults()
		fs := flag.NewFlagSet("", flag.ContinueOnError)
		o.AddFlags(fs, m)
		names := map[string]bool{}
		fs.VisitAll(func(f *flag.Flag) { names[f.Name] = true })
		return names
	}
	mine := defined(mode)
	others := map[string]string{}
	for _, m := range []Mode{ModeNode, ModeController, ModeAll} {
		for name := range defined(m) {
			if !mine[name] {
				others[name] = strings.TrimPrefix(others[name]+" or "+string(m), " or ")
			}
		}
	}
	return others
}

// AddFlags registers the node plugin's flags.
func (n *NodeOptions) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&n.StateDir, "state-dir", n.StateDir, "where cached volumes and metadata live (XFS with reflink is best)")
	fs.StringVar(&n.Backend, "cow-backend", n.Backend, "copy-on-write backend: auto, overlay, reflink, btrfs or copy")
	fs.IntVar(&n.FlattenDepth, "flatten-depth", n.FlattenDepth, "layer chains deeper than this are flattened in the background")
	fs.StringVar(&n.RegistrationSocket, "kubelet-registration-socket", n.RegistrationSocket,
		"serve the kubelet's plugin registration on this socket, without the node-driver-registrar sidecar\n"+
			"(e.g. /var/lib/kubelet/plugins_registry/cowvol.concourse-ci.org-reg.sock)")
	fs.StringVar(&n.KubeletEndpoint, "kubelet-endpoint", n.KubeletEndpoint,
		"the CSI socket path as the kubelet sees it, for registration (default: the --endpoint path)")
	fs.StringVar(&n.KubeletDir, "kubelet-dir", n.KubeletDir,
		"the kubelet's root dir: targets must lie below it as pods/<uid>/volumes/kubernetes.io~csi/<name>/mount")
	fs.Var(quantityFlag{&n.DefaultSizeLimit}, "default-size-limit",
		"cap on what a step may write into a volume that names no sizeLimit, as a quantity such as 10Gi (0: none)")
	fs.Var(quantityFlag{&n.MaxSizeLimit}, "max-size-limit",
		"the largest sizeLimit a step volume may ask for, as a quantity such as 100Gi (0: none)")
	fs.BoolVar(&n.AllowSetuid, "allow-setuid", n.AllowSetuid,
		"keep setuid/setgid bits, file capabilities and device nodes in what steps capture and pulls bring, and mount step volumes\n"+
			"without nosuid (they are always nodev); off, all are dropped, since runtimes do not pass a volume's nosuid and nodev into the container")
	fs.StringVar(&n.NodeAPIEndpoint, "node-api-endpoint", n.NodeAPIEndpoint,
		"unix:///path to serve the node API on (default: node-api.sock beside a unix --endpoint)")
	fs.IntVar(&n.HighWatermark, "high-watermark", n.HighWatermark,
		"percent of the state dir's filesystem (bytes or inodes) above which cached volumes are evicted and captures refused")
	fs.IntVar(&n.LowWatermark, "low-watermark", n.LowWatermark, "percent of the state dir's filesystem that eviction brings it under")
	fs.DurationVar(&n.EvictionGrace, "eviction-grace", n.EvictionGrace,
		"a cached volume used (captured, pulled, mounted) more recently is not evicted, however full the disk: a step's output waits for the next step or its scheduler's pin, and captures are refused meanwhile")
	fs.DurationVar(&n.CaptureWait, "capture-wait", n.CaptureWait,
		"how long a publish whose source is a step's output still being captured on this node waits for it before answering Unavailable (the kubelet retries)")
	fs.IntVar(&n.OutputCopies, "output-copies", n.OutputCopies, fmt.Sprintf(
		"how many nodes a captured volume that names no copies attribute is kept on: the controller has other nodes pull it once it is captured (1 to %d; 1: the capturing node alone)", volume.MaxCopies))
	fs.IntVar(&n.CacheVersions, "cache-versions", n.CacheVersions,
		"how many versions of each cache key the node keeps, the current one among them (1 or more): older ones are destroyed as new ones are promoted, once no step reads them (docs/caches.md)")
	fs.StringVar(&n.ControllerAddress, "controller-address", n.ControllerAddress,
		"the controller's host:port to report this node's cache to (plaintext on loopback only; else --tls-ca-file)")
	fs.StringVar(&n.TokenFile, "token-file", n.TokenFile,
		"a file holding the token to present to the controller, read at every call (a projected ServiceAccount token rotates)")
	fs.StringVar(&n.TLSCAFile, "tls-ca-file", n.TLSCAFile, "the CA to verify the controller's certificate with")
}

// AddFlags registers the step images' flags.
func (i *ImageOptions) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&i.RegistryAddress, "image-registry-address", i.RegistryAddress,
		"loopback host:port to serve the images cached volumes hold on, for the kubelet to pull as <host:port>/<namespace>/<handle> (empty: none)")
	fs.StringVar(&i.RegistryAuth, "image-registry-auth", i.RegistryAuth,
		"with --image-registry-address: "+registry.AuthRequired+" (a pull must carry its pod's ServiceAccount token, which the kubelet's cowvol-credential-provider gives; "+
			"needs an API server to review it) or "+registry.AuthGrace+" (a pull without one is served as its path says, logged and counted: for the roll onto nodes whose kubelet lacks the provider)")
	fs.StringVar(&i.SnapshotterEndpoint, "image-snapshotter-endpoint", i.SnapshotterEndpoint,
		"unix:///path to serve containerd the cowvol snapshotter on (proxy_plugins), which runs images named <registry>/<namespace>/<handle>:"+registry.RemoteTag+
			" on the volume's own layers; needs --image-registry-address (empty: none)")
	fs.StringVar(&i.ContainerdAddress, "containerd-address", i.ContainerdAddress,
		"with --image-registry-address: containerd's socket path, to delete the images it keeps of volumes the node no longer serves and, with --image-snapshotter-endpoint, to check (and say on the Node) that its config uses the snapshotter (empty: neither)")
}

// AddFlags registers the controller's flags.
func (c *ControllerOptions) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.APIAddress, "api-address", c.APIAddress,
		"host:port to serve the Registry and Cache APIs on (plaintext on loopback only; else --tls-cert-file)")
	fs.StringVar(&c.WebhookAddress, "webhook-address", c.WebhookAddress,
		"host:port to serve the locality webhook on (HTTPS with --tls-cert-file, path "+locality.Path+"): a pod that names cowvol sources "+
			"and no node of its own is given preferred node affinity toward the nodes that hold them (empty: none)")
	fs.DurationVar(&c.OwnerSweepEvery, "owner-sweep-interval", c.OwnerSweepEvery,
		"how often to destroy the cached volumes captured with owner: controller whose owner (the object that controlled their step's pod) "+
			"is gone, listing each kind of owner once; each holder checks the owner against its own record before it destroys "+
			"(needs an API server, and RBAC to list those kinds; 0: never)")
	fs.Func("locality-image-registry", "with --webhook-address: a host:port the nodes serve step images from volumes at (their --image-registry-address); "+
		"a pod's image there counts as an input (repeat for several)", func(host string) error {
		if _, _, err := net.SplitHostPort(host); err != nil {
			return err
		}
		c.LocalityRegistries = append(c.LocalityRegistries, host)
		return nil
	})
	fs.DurationVar(&c.StalledAfter, "stalled-after", c.StalledAfter,
		"a node silent this long is stalled: left out of lookups and placement")
	fs.DurationVar(&c.AwaitReportsFor, "await-reports-for", c.AwaitReportsFor,
		"how long a replica that begins to lead (or a controller that starts) answers the Cache API Unavailable while "+
			"the nodes the plugin is registered on have not all sent it their inventories (0: answer at once from what reached it)")
	fs.DurationVar(&c.ForgetStalledAfter, "forget-stalled-after", c.ForgetStalledAfter, "a node silent this long is forgotten")
	fs.Int64Var(&c.ReadOrdersMemory, "read-orders-memory", c.ReadOrdersMemory,
		"bytes of file names the read orders nodes share may take in memory (the least recently used go first; 0: none is kept)")
	fs.IntVar(&c.FullReportsAtOnce, "full-reports-at-once", c.FullReportsAtOnce,
		"nodes' whole inventories the controller reads at once (a new leader gets every node's at the same moment): the rest are told to send theirs again a little later")
	fs.IntVar(&c.Copies.Max, "max-copies", c.Copies.Max, fmt.Sprintf(
		"the most nodes a captured volume is kept on, whatever its copies attribute asks: nodes refuse a publish that asks for more (1 to %d)", volume.MaxCopies))
	fs.IntVar(&c.Copies.PerNamespace, "namespace-copies", c.Copies.PerNamespace,
		"the most extra copies (nodes past the first) a namespace's volumes are kept on together: granted in the order they are captured; "+
			"once it is spent, nodes refuse that namespace's publishes that ask for copies (0: no namespace gets any)")
	fs.StringVar(&c.TokensFile, "tokens-file", c.TokensFile,
		"the callers of its APIs, a token,user,namespaces[,node] line each (namespaces * or a;b; a node's line names the node it reports for)")
	fs.BoolVar(&c.KubeAuth, "kube-auth", c.KubeAuth,
		"check callers' bearer tokens with TokenReviews and authorize each call with a SubjectAccessReview\n"+
			"on cachedvolumes.cowvol.concourse-ci.org (namespaced) and cachenodes.cowvol.concourse-ci.org (instead of --tokens-file)")
	fs.StringVar(&c.TLSCertFile, "tls-cert-file", c.TLSCertFile, "the certificate to serve the APIs with (then any address)")
	fs.StringVar(&c.TLSKeyFile, "tls-key-file", c.TLSKeyFile, "the certificate's key")
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
	n := o.Node
	return node.Config{
		NodeID: o.NodeID, StateDir: n.StateDir, Backend: n.Backend, FlattenDepth: n.FlattenDepth,
		KubeletDir: n.KubeletDir, DefaultSizeLimit: n.DefaultSizeLimit, MaxSizeLimit: n.MaxSizeLimit,
		AllowSetuid: n.AllowSetuid, BootIDFile: n.bootIDFile, CaptureWait: n.CaptureWait,
		Watermarks: node.Watermarks{High: n.HighWatermark, Low: n.LowWatermark, Grace: n.EvictionGrace},
		Copies:     n.OutputCopies, CacheVersions: n.CacheVersions,
	}
}

// nodeAPIEndpoint is where the node API is served: as given, or
// node-api.sock beside a unix CSI endpoint (empty: nowhere).
func (n NodeOptions) nodeAPIEndpoint(endpoint string) string {
	if n.NodeAPIEndpoint != "" {
		return n.NodeAPIEndpoint
	}
	if sock := unixPath(endpoint); sock != "" {
		return "unix://" + filepath.Join(filepath.Dir(sock), "node-api.sock")
	}
	return ""
}

// kubeletEndpoint is the CSI socket's path the kubelet is told at
// registration: as given, or a unix endpoint's path ("" if neither).
func (n NodeOptions) kubeletEndpoint(endpoint string) string {
	return firstOf(n.KubeletEndpoint, unixPath(endpoint))
}

// unixPath is a unix endpoint's socket path ("" for any other endpoint).
func unixPath(endpoint string) string {
	if network, addr, err := parseEndpoint(endpoint); err == nil && network == "unix" {
		return addr
	}
	return ""
}

// Validate checks the options of every component the mode runs; it
// changes nothing (Defaults fills in defaults, and what follows from other
// options is derived where it is used).
func (o Options) Validate() error {
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
	if _, _, err := parseEndpoint(o.Endpoint); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, o.Peers.validateTLS()...)
	switch o.Mode {
	case ModeNode, ModeController, ModeAll:
	default:
		errs = append(errs, fmt.Errorf("mode %q is invalid: want node, controller or all", o.Mode))
	}
	if o.Mode.runsNode() {
		if o.NodeID == "" {
			errs = append(errs, errors.New("node ID is required"))
		}
		errs = append(errs, o.Node.validate(o.Endpoint)...)
		errs = append(errs, o.Images.validate()...)
		errs = append(errs, o.Peers.validate()...)
	}
	if o.Mode.runsNode() && o.Peers.FromController && o.Node.ControllerAddress == "" {
		errs = append(errs, errors.New("--peer-certificates-from-controller needs --controller-address"))
	}
	if o.Mode.runsController() {
		errs = append(errs, o.Controller.validate()...)
		errs = append(errs, o.Peers.validateCA()...)
	}
	errs = append(errs, o.LeaderElection.validate(o.Mode)...)
	return errors.Join(errs...)
}

func (n NodeOptions) validate(endpoint string) []error {
	var errs []error
	if n.StateDir == "" || !strings.HasPrefix(n.StateDir, "/") {
		errs = append(errs, fmt.Errorf("state dir %q must be an absolute path", n.StateDir))
	}
	if n.Backend != "auto" {
		if _, err := overlay.ParseKind(n.Backend); err != nil {
			errs = append(errs, fmt.Errorf("%w (or auto)", err))
		}
	}
	if n.KubeletDir == "" || !strings.HasPrefix(n.KubeletDir, "/") {
		errs = append(errs, fmt.Errorf("kubelet dir %q must be an absolute path", n.KubeletDir))
	}
	if n.DefaultSizeLimit < 0 || n.MaxSizeLimit < 0 {
		errs = append(errs, errors.New("size limits cannot be negative"))
	}
	if n.MaxSizeLimit > 0 && n.DefaultSizeLimit > n.MaxSizeLimit {
		errs = append(errs, fmt.Errorf("the default size limit (%d bytes) exceeds the maximum (%d bytes)", n.DefaultSizeLimit, n.MaxSizeLimit))
	}
	if api := n.nodeAPIEndpoint(endpoint); api != "" {
		if network, _, err := parseEndpoint(api); err != nil || network != "unix" {
			errs = append(errs, fmt.Errorf("node API endpoint %q must be unix:///path: it has no authentication of its own", api))
		}
	}
	if n.OutputCopies < 1 || n.OutputCopies > volume.MaxCopies {
		errs = append(errs, fmt.Errorf("--output-copies %d is invalid: want 1 to %d", n.OutputCopies, volume.MaxCopies))
	}
	if n.CacheVersions < 1 {
		errs = append(errs, fmt.Errorf("--cache-versions %d is invalid: a node keeps at least the current version of a key", n.CacheVersions))
	}
	if n.CaptureWait <= 0 {
		errs = append(errs, errors.New("--capture-wait must be positive"))
	}
	if n.EvictionGrace < 0 {
		errs = append(errs, fmt.Errorf("--eviction-grace %s is negative", n.EvictionGrace))
	}
	if n.LowWatermark < 1 || n.HighWatermark > 100 || n.LowWatermark >= n.HighWatermark {
		errs = append(errs, fmt.Errorf("watermarks %d%% (low) and %d%% (high) are invalid: want 1 <= low < high <= 100",
			n.LowWatermark, n.HighWatermark))
	}
	if n.RegistrationSocket != "" && n.kubeletEndpoint(endpoint) == "" {
		errs = append(errs, errors.New("kubelet registration needs a unix endpoint (or the kubelet's endpoint path)"))
	}
	if n.FlattenDepth < 1 || n.FlattenDepth > overlay.MaxLayers-1 {
		errs = append(errs, fmt.Errorf("flatten depth %d is invalid: want 1 to %d (overlayfs stacks at most %d layers)",
			n.FlattenDepth, overlay.MaxLayers-1, overlay.MaxLayers))
	}
	if n.TLSCAFile == "" {
		if err := loopbackOnly(n.ControllerAddress); err != nil {
			errs = append(errs, fmt.Errorf("--controller-address: %w (or give --tls-ca-file)", err))
		}
	} else if n.TokenFile == "" && n.ControllerAddress != "" {
		errs = append(errs, errors.New("reaching the controller over TLS needs --token-file"))
	}
	return errs
}

func (i ImageOptions) validate() []error {
	var errs []error
	// Its repositories name namespaces nobody authenticated: the node's
	// runtime alone may reach it.
	if err := loopbackOnly(i.RegistryAddress); err != nil {
		errs = append(errs, fmt.Errorf("--image-registry-address: %w", err))
	}
	if i.RegistryAuth != registry.AuthRequired && i.RegistryAuth != registry.AuthGrace {
		errs = append(errs, fmt.Errorf("--image-registry-auth %q: want %s or %s", i.RegistryAuth, registry.AuthRequired, registry.AuthGrace))
	}
	if i.SnapshotterEndpoint != "" {
		// The runtime pulls what the snapshotter runs from the registry.
		if i.RegistryAddress == "" {
			errs = append(errs, errors.New("--image-snapshotter-endpoint needs --image-registry-address"))
		}
		if network, _, err := parseEndpoint(i.SnapshotterEndpoint); err != nil || network != "unix" {
			errs = append(errs, fmt.Errorf("--image-snapshotter-endpoint %q: want unix:///path", i.SnapshotterEndpoint))
		}
	}
	if i.ContainerdAddress != "" && i.RegistryAddress == "" {
		errs = append(errs, errors.New("--containerd-address is asked about the images the node serves: it needs --image-registry-address"))
	}
	if i.ContainerdAddress != "" && !filepath.IsAbs(i.ContainerdAddress) {
		errs = append(errs, fmt.Errorf("--containerd-address %q: want the socket's absolute path", i.ContainerdAddress))
	}
	return errs
}

func (c ControllerOptions) validate() []error {
	var errs []error
	if c.StalledAfter <= 0 {
		errs = append(errs, fmt.Errorf("--stalled-after %s must be positive", c.StalledAfter))
	}
	if c.ForgetStalledAfter < c.StalledAfter {
		errs = append(errs, fmt.Errorf("--forget-stalled-after (%s) is shorter than --stalled-after (%s)", c.ForgetStalledAfter, c.StalledAfter))
	}
	if c.AwaitReportsFor < 0 {
		errs = append(errs, fmt.Errorf("--await-reports-for %s is negative", c.AwaitReportsFor))
	}
	if c.ReadOrdersMemory < 0 {
		errs = append(errs, fmt.Errorf("--read-orders-memory %d is negative", c.ReadOrdersMemory))
	}
	if c.Copies.Max < 1 || c.Copies.Max > volume.MaxCopies {
		errs = append(errs, fmt.Errorf("--max-copies %d: want 1 to %d", c.Copies.Max, volume.MaxCopies))
	}
	if c.Copies.PerNamespace < 0 {
		errs = append(errs, fmt.Errorf("--namespace-copies %d: want 0 or more", c.Copies.PerNamespace))
	}
	if c.FullReportsAtOnce < 1 {
		errs = append(errs, fmt.Errorf("--full-reports-at-once %d: want at least 1", c.FullReportsAtOnce))
	}
	if (c.TLSCertFile == "") != (c.TLSKeyFile == "") {
		errs = append(errs, errors.New("--tls-cert-file and --tls-key-file go together"))
	}
	// Plaintext stays on this machine; on the network, TLS and tokens.
	if c.TLSCertFile == "" {
		if err := loopbackOnly(c.APIAddress); err != nil {
			errs = append(errs, fmt.Errorf("--api-address: %w (or give --tls-cert-file and --tls-key-file)", err))
		}
	} else if c.TokensFile == "" && !c.KubeAuth {
		errs = append(errs, errors.New("serving the controller's APIs over TLS needs --tokens-file or --kube-auth: on the network only authenticated callers are served"))
	}
	if c.WebhookAddress != "" && (c.TLSCertFile == "" || c.APIAddress == "") {
		errs = append(errs, errors.New("--webhook-address needs --api-address and --tls-cert-file: the API server calls a webhook over HTTPS only"))
	}
	if c.OwnerSweepEvery < 0 {
		errs = append(errs, errors.New("--owner-sweep-interval must not be negative"))
	}
	if c.WebhookAddress == "" && len(c.LocalityRegistries) > 0 {
		errs = append(errs, errors.New("--locality-image-registry needs --webhook-address"))
	}
	if c.KubeAuth && c.TokensFile != "" {
		errs = append(errs, errors.New("--kube-auth and --tokens-file are two ways to authenticate callers: give one"))
	}
	return errs
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
