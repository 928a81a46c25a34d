// Package driver is cowvol's gRPC surface: the CSI Identity, Node and
// Controller services and the node API, the validation of every request and
// the mapping of every failure to its gRPC code. It composes the services
// the mode asks for around the node engine (package node), which does the
// work; nothing below it imports it, and it never touches a volume itself.
package driver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/controller"
	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// Mode says which CSI services a plugin process serves.
type Mode string

const (
	ModeNode       Mode = "node"
	ModeController Mode = "controller"
	ModeAll        Mode = "all"
)

// DefaultDriverName is the CSI driver name pods refer to.
const DefaultDriverName = volume.DriverName

// TopologyKey is the topology segment NodeGetInfo reports.
const TopologyKey = "topology.cowvol.concourse-ci.org/node"

// StoreTopologyKey is the segment that carries the node's store ID.
const StoreTopologyKey = "topology.cowvol.concourse-ci.org/store"

// maxKernelLayers is what overlayfs stacks at most.
const maxKernelLayers = 500

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
	StopTimeout    time.Duration
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
	// AllowSetuid keeps setuid/setgid bits and device nodes in captures
	// and pulls, and mounts step volumes without nosuid.
	AllowSetuid bool
	// NodeAPIEndpoint is where the node API is served: a unix socket, by
	// default node-api.sock beside a unix CSI endpoint.
	NodeAPIEndpoint string
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
	// LeaderElection (controller mode) elects one serving replica.
	LeaderElection LeaderElection
	// Peers (node mode) streams volumes between nodes.
	Peers PeerOptions

	// bootIDFile names the kernel's boot ID; tests point it elsewhere to
	// pretend a reboot.
	bootIDFile string
}

// engineConfig is the node engine's part of the options.
func (o Options) engineConfig() node.Config {
	return node.Config{
		NodeID: o.NodeID, StateDir: o.StateDir, Backend: o.Backend, FlattenDepth: o.FlattenDepth,
		KubeletDir: o.KubeletDir, DefaultSizeLimit: o.DefaultSizeLimit, MaxSizeLimit: o.MaxSizeLimit,
		AllowSetuid: o.AllowSetuid, BootIDFile: o.bootIDFile,
		Watermarks: node.Watermarks{High: o.HighWatermark, Low: o.LowWatermark},
	}
}

// Validate checks the options and fills in defaults.
func (o *Options) Validate() error {
	var errs []error
	if o.DriverName == "" {
		o.DriverName = DefaultDriverName
	}
	if o.Version == "" {
		o.Version = "dev"
	}
	if o.StopTimeout == 0 {
		o.StopTimeout = 30 * time.Second
	}
	if o.HighWatermark == 0 && o.LowWatermark == 0 {
		o.HighWatermark, o.LowWatermark = 90, 80
	}
	if o.StalledAfter == 0 {
		o.StalledAfter = 30 * time.Second
	}
	if o.ForgetStalledAfter == 0 {
		o.ForgetStalledAfter = 10 * time.Minute
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
		if o.FlattenDepth < 1 || o.FlattenDepth > maxKernelLayers-1 {
			errs = append(errs, fmt.Errorf("flatten depth %d is invalid: want 1 to %d (overlayfs stacks at most %d layers)",
				o.FlattenDepth, maxKernelLayers-1, maxKernelLayers))
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

// Driver is one plugin process: the services its mode asks for.
type Driver struct {
	opts       Options
	identity   *identityService
	node       *nodeService
	controller *controllerService
	metrics    *metrics
	store      *cache.Store
	engine     *node.Engine
	// view is the controller's picture of the nodes' caches.
	view       *controller.View
	ctlMetrics *controller.Metrics
	nodeEvents controller.NodeEvents
	// leader says whether this controller replica serves.
	leader *leadership
	// ctlConn (node mode) reaches the controller: reports and lookups.
	ctlConn *grpc.ClientConn
	// peerMetrics count what the node streams to its peers.
	peerMetrics *streamer.Metrics
	kube        kubernetes.Interface
	// stopKube ends the API server watches and the event sender.
	stopKube context.CancelFunc
}

// Deps are what a driver works through, built by its caller.
type Deps struct {
	Mounter overlay.Mounter
	// Kube reaches the API server; nil when none is configured.
	Kube kubernetes.Interface
}

// New builds a driver. In node mode it opens the state dir, picks the COW
// backend, checks the CSIDriver object (with an API server) and recovers
// whatever a previous process left, before any RPC is served.
func New(opts Options, deps Deps) (*Driver, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	d := &Driver{opts: opts, metrics: newMetrics(), kube: deps.Kube}
	if deps.Kube == nil && (opts.LeaderElection.Enabled || opts.KubeAuth) {
		return nil, errors.New("--leader-election and --kube-auth need an API server (--kubeconfig, or run in a pod)")
	}
	d.identity = &identityService{name: opts.DriverName, version: opts.Version, controller: opts.Mode != ModeNode}
	// One event sender and one context for every API server watch.
	var events *kubeEvents
	kubeCtx := context.Background()
	if deps.Kube != nil {
		var cancel context.CancelFunc
		kubeCtx, cancel = context.WithCancel(context.Background())
		d.stopKube = cancel
		events = newKubeEvents(deps.Kube, opts.DriverName, opts.NodeID)
		go events.run(kubeCtx)
	} else {
		klog.InfoS("No API server configured (--kubeconfig, or run in a pod): no Kubernetes Events, and the CSIDriver object is not checked")
	}
	if opts.Mode != ModeNode {
		d.view = controller.NewView(opts.StalledAfter, opts.ForgetStalledAfter)
		d.leader = &leadership{self: opts.LeaderElection.Identity}
		d.leader.leading.Store(!opts.LeaderElection.Enabled)
		d.controller = &controllerService{view: d.view}
		d.ctlMetrics = controller.NewMetrics(d.view)
		d.metrics.registry.MustRegister(d.ctlMetrics.Collectors()...)
		d.nodeEvents = noNodeEvents{}
		if events != nil {
			d.nodeEvents = events
			if err := followNodes(kubeCtx, deps.Kube, d.view); err != nil {
				d.Close()
				return nil, err
			}
		}
	}
	if opts.Mode != ModeController {
		if err := d.startNode(kubeCtx, deps, events); err != nil {
			d.Close()
			return nil, err
		}
	}
	return d, nil
}

// startNode opens the store, checks the CSIDriver object (with an API
// server) and starts the node engine, which recovers what a previous
// process left.
func (d *Driver) startNode(kubeCtx context.Context, deps Deps, sender *kubeEvents) error {
	store, err := cache.Open(d.opts.StateDir)
	if err != nil {
		return err
	}
	d.store = store
	var events node.PodEvents = node.NoEvents{}
	var guard *csiDriverGuard
	if deps.Kube != nil {
		if guard, err = watchCSIDriver(kubeCtx, deps.Kube, d.opts.DriverName); err != nil {
			return err
		}
		events = sender
	}
	cfg := d.opts.engineConfig()
	if deps.Kube != nil {
		cfg.Pods = watchPods(kubeCtx, deps.Kube, d.opts.NodeID)
	}
	if d.opts.ControllerAddress != "" {
		dial, err := controllerDialOptions(d.opts)
		if err != nil {
			return err
		}
		if d.ctlConn, err = grpc.NewClient(d.opts.ControllerAddress, dial...); err != nil {
			return fmt.Errorf("reaching the controller: %w", err)
		}
	}
	if d.opts.pulls() {
		var ctl grpc.ClientConnInterface
		if d.ctlConn != nil {
			ctl = d.ctlConn
		}
		if cfg.Pulls, err = d.opts.pullConfig(ctl); err != nil {
			return err
		}
	}
	if d.engine, err = node.New(cfg, store, deps.Mounter, events); err != nil {
		return err
	}
	d.peerMetrics = streamer.NewMetrics()
	d.metrics.registry.MustRegister(d.peerMetrics.Collectors()...)
	d.metrics.registry.MustRegister(d.engine.Collectors()...)
	d.node = &nodeService{nodeID: d.opts.NodeID, engine: d.engine, csiDriver: guard}
	return nil
}

// Backend says which COW backend the node engine runs ("" without one).
func (d *Driver) Backend() overlay.Kind {
	if d.engine == nil {
		return ""
	}
	return d.engine.Backend()
}

// Run serves until ctx is done, then stops gracefully: RPCs in flight finish
// (up to StopTimeout), background work is cancelled and cleans up after
// itself, and the socket is removed.
func (d *Driver) Run(ctx context.Context) error {
	defer d.Close()
	lis, err := listen(d.opts.Endpoint)
	if err != nil {
		return err
	}
	interceptors := []grpc.UnaryServerInterceptor{d.metrics.interceptor}
	if d.leader != nil {
		// A follower's view is empty: its CSI controller answers nothing.
		interceptors = append(interceptors, d.leader.interceptor("/csi.v1.Controller/"))
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(interceptors...))
	csi.RegisterIdentityServer(srv, d.identity)
	if d.node != nil {
		csi.RegisterNodeServer(srv, d.node)
	}
	if d.controller != nil {
		csi.RegisterControllerServer(srv, d.controller)
	}
	var registration *registrationService
	if d.opts.RegistrationSocket != "" && d.node != nil {
		registration = &registrationService{name: d.opts.DriverName, endpoint: d.opts.KubeletEndpoint}
	}
	// The servers run as a group: one failing stops the others, and the
	// process exits with its error.
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return srv.Serve(lis) })
	if d.opts.MetricsAddress != "" {
		mlis, err := net.Listen("tcp", d.opts.MetricsAddress)
		if err != nil {
			srv.Stop()
			return fmt.Errorf("serving metrics: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(d.metrics.registry, promhttp.HandlerOpts{}))
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
		mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
			if d.leader != nil {
				d.leader.ready(w, r)
				return
			}
			if registration != nil {
				if why := registration.notReady(); why != "" {
					http.Error(w, why, http.StatusServiceUnavailable)
					return
				}
			}
			_, _ = w.Write([]byte("ok\n"))
		})
		metricsSrv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		g.Go(func() error {
			if err := metricsSrv.Serve(mlis); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("serving metrics: %w", err)
			}
			return nil
		})
		g.Go(func() error { <-gctx.Done(); return metricsSrv.Close() })
	}
	klog.InfoS("Serving CSI", "endpoint", d.opts.Endpoint, "mode", d.opts.Mode, "driver", d.opts.DriverName,
		"version", d.opts.Version, "node", d.opts.NodeID, "backend", d.Backend())
	if d.engine != nil && d.opts.NodeAPIEndpoint != "" {
		apiLis, err := listen(d.opts.NodeAPIEndpoint)
		if err == nil {
			_, path, _ := parseEndpoint(d.opts.NodeAPIEndpoint)
			err = os.Chmod(path, 0o600) // root's alone: it destroys volumes
		}
		if err != nil {
			srv.Stop()
			return errors.Join(fmt.Errorf("serving the node API: %w", err), g.Wait())
		}
		api := grpc.NewServer(grpc.ChainUnaryInterceptor(d.metrics.interceptor))
		nodev1.RegisterNodeAPIServer(api, &nodeAPIService{engine: d.engine})
		g.Go(func() error { return api.Serve(apiLis) })
		g.Go(func() error { <-gctx.Done(); api.GracefulStop(); return nil })
		klog.InfoS("Serving the node API", "endpoint", d.opts.NodeAPIEndpoint)
	}
	if d.engine != nil && d.opts.Peers.Address != "" {
		peerSrv, err := d.peerServer(d.peerMetrics)
		if err == nil {
			var plis net.Listener
			if plis, err = net.Listen("tcp", d.opts.Peers.Address); err == nil {
				g.Go(func() error { return peerSrv.Serve(plis) })
				g.Go(func() error { <-gctx.Done(); peerSrv.Stop(); return nil })
				klog.InfoS("Serving volumes to peers", "address", plis.Addr().String(),
					"advertised", d.opts.Peers.AdvertiseAddress, "mutualTLS", d.opts.Peers.CertFile != "")
			}
		}
		if err != nil {
			srv.Stop()
			return errors.Join(fmt.Errorf("serving peers: %w", err), g.Wait())
		}
	}
	if d.engine != nil && d.ctlConn != nil {
		r := &reporter{engine: d.engine, client: controllerv1.NewRegistryClient(d.ctlConn), nodeID: d.opts.NodeID,
			peerAddress: d.opts.Peers.AdvertiseAddress}
		g.Go(func() error { r.run(gctx); return nil })
		klog.InfoS("Reporting the node's cache to the controller", "address", d.opts.ControllerAddress)
	}
	if d.view != nil && d.opts.APIAddress != "" {
		serve, err := controllerServerOptions(d.opts, d.kube, d.metrics.interceptor, d.leader, "/cowvol.controller.")
		if err != nil {
			srv.Stop()
			return errors.Join(err, g.Wait())
		}
		apiLis, err := net.Listen("tcp", d.opts.APIAddress)
		if err != nil {
			srv.Stop()
			return errors.Join(fmt.Errorf("serving the controller's APIs: %w", err), g.Wait())
		}
		dial, err := d.opts.Peers.dialer()
		if err != nil {
			srv.Stop()
			return errors.Join(err, g.Wait())
		}
		api := grpc.NewServer(serve...)
		controller.Register(api, d.view, d.ctlMetrics, d.nodeEvents, dial)
		g.Go(func() error { return api.Serve(apiLis) })
		g.Go(func() error { <-gctx.Done(); api.GracefulStop(); return nil })
		if d.opts.LeaderElection.Enabled {
			g.Go(func() error { return d.leader.elect(gctx, d.kube, d.opts.LeaderElection, d.forgetStalled) })
		} else {
			g.Go(func() error { d.forgetStalled(gctx); return nil })
		}
		klog.InfoS("Serving the controller's Registry and Cache APIs", "address", apiLis.Addr().String(),
			"tls", d.opts.TLSCertFile != "", "tokens", d.opts.TokensFile != "",
			"stalledAfter", d.opts.StalledAfter, "forgetStalledAfter", d.opts.ForgetStalledAfter)
	}
	if registration != nil {
		// Registered once the CSI socket listens: the kubelet calls it as
		// soon as it has the registration.
		regLis, err := listen("unix://" + d.opts.RegistrationSocket)
		if err != nil {
			srv.Stop()
			return errors.Join(fmt.Errorf("serving kubelet registration: %w", err), g.Wait())
		}
		reg := grpc.NewServer()
		registerapi.RegisterRegistrationServer(reg, registration)
		g.Go(func() error { return reg.Serve(regLis) })
		// Stopping the registration first tells the kubelet the plugin is
		// going away (its watcher sees the socket vanish).
		g.Go(func() error { <-gctx.Done(); reg.Stop(); return nil })
		klog.InfoS("Serving kubelet plugin registration", "socket", d.opts.RegistrationSocket, "kubeletEndpoint", d.opts.KubeletEndpoint)
	}
	g.Go(func() error {
		<-gctx.Done()
		if ctx.Err() != nil {
			klog.InfoS("Stopping: letting in-flight RPCs finish", "timeout", d.opts.StopTimeout)
		}
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(d.opts.StopTimeout):
			klog.InfoS("In-flight RPCs did not finish in time; stopping hard")
			srv.Stop()
		}
		return nil
	})
	return g.Wait()
}

// forgetStalled drops nodes that stopped reporting long ago.
func (d *Driver) forgetStalled(ctx context.Context) {
	tick := time.NewTicker(d.opts.StalledAfter)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		stalled, forgotten := d.view.Sweep(time.Now())
		for _, id := range stalled {
			klog.InfoS("A node stopped reporting: left out of lookups and placement", "node", id, "after", d.opts.StalledAfter)
			d.nodeEvents.NodeEventOn(id, corev1.EventTypeWarning, "CowvolNodeStalled", fmt.Sprintf(
				"cowvol's controller heard nothing from the node for %s: its cached volumes are left out of lookups and placement", d.opts.StalledAfter))
		}
		for _, id := range forgotten {
			klog.InfoS("Forgot a node that stopped reporting", "node", id, "after", d.opts.ForgetStalledAfter)
		}
	}
}

// Close stops background work and closes the store.
func (d *Driver) Close() {
	if d.engine != nil {
		d.engine.Close()
	}
	if d.stopKube != nil {
		d.stopKube()
	}
	if d.ctlConn != nil {
		_ = d.ctlConn.Close()
	}
	if d.store != nil {
		_ = d.store.Close()
	}
}

// listen opens the endpoint. A unix socket left by a dead plugin is removed;
// one a live plugin still answers on is not.
func listen(endpoint string) (net.Listener, error) {
	network, addr, err := parseEndpoint(endpoint)
	if err != nil {
		return nil, err
	}
	if network == "unix" {
		if _, err := os.Stat(addr); err == nil {
			if c, err := net.DialTimeout("unix", addr, time.Second); err == nil {
				c.Close()
				return nil, fmt.Errorf("another process is serving on %s", addr)
			}
			klog.InfoS("Removing stale socket", "path", addr)
			if err := os.Remove(addr); err != nil {
				return nil, err
			}
		}
	}
	return net.Listen(network, addr)
}
