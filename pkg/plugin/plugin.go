// Package plugin is cowvol-plugin's composition root: the options, grouped
// by component and validated once; the node engine, the controller's view
// and the CSI services (package driver) the mode asks for, built around
// them; the peer, image, node-API and metrics servers; the glue to the
// API server (Events, step pods, the CSIDriver check, leader election,
// the callers' authentication) and to the controller (the node's
// reports); and the runners that serve them until the process stops.
// Nothing imports it but the binaries and the tests that drive them; it
// never touches a volume itself.
package plugin

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/peerid"
	"github.com/concourse/cowvol/internal/tlsfiles"
	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/controller"
	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/controller/locality"
	"github.com/concourse/cowvol/pkg/controller/owners"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/registry"
	"github.com/concourse/cowvol/pkg/report"
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

// Driver is one plugin process: the services its mode asks for.
type Driver struct {
	opts       Options
	identity   csi.IdentityServer
	node       csi.NodeServer
	controller csi.ControllerServer
	metrics    *metrics
	store      *cache.Store
	engine     *node.Engine
	// view is the controller's picture of the nodes' caches.
	view       *fleet.View
	ctlMetrics *fleet.Metrics
	locality   *locality.Metrics
	// owners destroys the volumes whose owner is gone (nil: no sweep).
	owners *owners.Collector
	// fullReports admits nodes' whole inventories a few at a time, and
	// messages the calls the controller reads at once.
	fullReports *controller.FullReports
	messages    *controller.Messages
	// readOrders are those nodes share through the controller.
	readOrders *fleet.ReadOrders
	nodeEvents controller.NodeEvents
	// leader says whether this controller replica serves.
	leader *leadership
	// ctlConn (node mode) reaches the controller: reports and lookups.
	ctlConn *grpc.ClientConn
	// peerLink (node mode) is how the node proves itself to peers and
	// checks them; peerCert is its certificate from the controller, where
	// the controller signs one.
	peerLink *peerLink
	peerCert *peerid.Kept
	// reports count what the node told the controller.
	reports *report.Metrics
	// peerMetrics count what the node streams to its peers.
	peerMetrics *streamer.Metrics
	// podEvents (node mode) go on step pods and this node's Node object.
	podEvents node.PodEvents
	// imageMetrics count what the node's image registry serves.
	imageMetrics *registry.Metrics
	kube         kubernetes.Interface
	// stopKube ends the API server watches and the event sender.
	stopKube context.CancelFunc
}

// Deps are what a driver works through, built by its caller.
type Deps struct {
	Mounter overlay.Mounter
	// Kube reaches the API server; nil when none is configured.
	Kube kubernetes.Interface
	// Metadata reads any kind's metadata from the same API server (the
	// controller's owner sweep; nil: no sweep).
	Metadata metadata.Interface
}

// New builds a driver. In node mode it opens the state dir, picks the COW
// backend, checks the CSIDriver object (with an API server) and recovers
// whatever a previous process left, before any RPC is served.
func New(opts Options, deps Deps) (*Driver, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	d := &Driver{opts: opts, metrics: newMetrics(), kube: deps.Kube}
	if deps.Kube == nil && (opts.LeaderElection.Enabled || opts.Controller.KubeAuth) {
		return nil, errors.New("--leader-election and --kube-auth need an API server (--kubeconfig, or run in a pod)")
	}
	if deps.Kube == nil && opts.Images.RegistryAddress != "" && opts.Images.RegistryAuth == registry.AuthRequired {
		return nil, fmt.Errorf("--image-registry-auth=%s needs an API server to review pulls' tokens (--kubeconfig, or run in a pod); "+
			"--image-registry-auth=%s serves pulls without credentials", registry.AuthRequired, registry.AuthGrace)
	}
	d.identity = driver.NewIdentity(opts.DriverName, opts.Version, opts.Mode != ModeNode)
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
		d.view = fleet.NewView(opts.Controller.StalledAfter, opts.Controller.ForgetStalledAfter)
		d.view.LimitCopies(opts.Controller.Copies)
		d.leader = &leadership{self: opts.LeaderElection.Identity, followersReady: opts.LeaderElection.LabelPod, callers: newCallerConns()}
		d.leader.leading.Store(!opts.LeaderElection.Enabled)
		d.controller = driver.NewController(d.view)
		d.ctlMetrics = fleet.NewMetrics(d.view)
		d.readOrders = fleet.NewReadOrders(opts.Controller.ReadOrdersMemory)
		d.fullReports = controller.NewFullReports(opts.Controller.FullReportsAtOnce)
		d.messages = controller.NewMessages(controller.MessagesAtOnce)
		d.locality = locality.NewMetrics()
		ownerMetrics := owners.NewMetrics()
		d.metrics.registry.MustRegister(slices.Concat(d.ctlMetrics.Collectors(), d.fullReports.Collectors(),
			d.messages.Collectors(), d.locality.Collectors(), ownerMetrics.Collectors(), []prometheus.Collector{d.readOrders})...)
		if events != nil && deps.Metadata != nil && opts.Controller.OwnerSweepEvery > 0 {
			kubeOwners := newKubeOwners(deps.Metadata, deps.Kube.Discovery(), events)
			d.owners = owners.New(d.view, kubeOwners, kubeOwners, ownerMetrics)
		}
		d.nodeEvents = noNodeEvents{}
		if events != nil {
			d.nodeEvents = events
			d.leader.unsettled = func() []string { return d.view.Unsettled(time.Now()) }
			if opts.Controller.AwaitReportsFor > 0 {
				d.leader.awaitNodes = func(ctx context.Context) {
					awaitNodes(ctx, deps.Kube, d.view, opts.DriverName, opts.Controller.AwaitReportsFor)
				}
			}
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
	store, err := cache.Open(d.opts.Node.StateDir)
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
	if d.opts.Node.ControllerAddress != "" {
		dial, err := controllerDialOptions(d.opts)
		if err != nil {
			return err
		}
		if d.ctlConn, err = grpc.NewClient(d.opts.Node.ControllerAddress, dial...); err != nil {
			return fmt.Errorf("reaching the controller: %w", err)
		}
	}
	var ctl grpc.ClientConnInterface
	if d.ctlConn != nil {
		ctl = d.ctlConn
	}
	if d.peerLink, d.peerCert, err = d.opts.nodeLink(ctl); err != nil {
		return err
	}
	if d.peerCert != nil {
		d.metrics.registry.MustRegister(peerCertificateExpiry(d.peerCert))
		// Before the first publish: a pull without it would fail, and
		// hold its source back for the failure's backoff.
		ctx, cancel := context.WithTimeout(context.Background(), firstPeerCertificateWait)
		if _, err := d.peerCert.Renew(ctx); err != nil {
			klog.ErrorS(err, "This node has no peer certificate yet: it pulls from no peer and serves none until the controller signs one (retried in the background)")
		}
		cancel()
	}
	if d.opts.pulls() {
		cfg.Pulls = d.opts.pullConfig(ctl, d.peerLink)
	}
	d.podEvents = events
	if d.engine, err = node.New(cfg, store, deps.Mounter, events); err != nil {
		return err
	}
	d.peerMetrics = streamer.NewMetrics()
	d.metrics.registry.MustRegister(d.peerMetrics.Collectors()...)
	d.metrics.registry.MustRegister(d.engine.Collectors()...)
	d.imageMetrics = registry.NewMetrics()
	d.metrics.registry.MustRegister(d.imageMetrics.Collectors()...)
	d.reports = report.NewMetrics()
	d.metrics.registry.MustRegister(d.reports.Collectors()...)
	d.node = driver.NewNode(d.opts.NodeID, d.engine, guard)
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
// itself, and the socket is removed. Every server the mode asks for is
// started first, each binding what it serves: one that cannot start stops
// the plugin before any serves, and one that stops serving stops the others,
// so the process exits with its error instead of running half.
func (d *Driver) Run(ctx context.Context) error {
	defer d.Close()
	runners, err := d.runners()
	if err != nil {
		return err
	}
	for i, r := range runners {
		if err := r.start(); err != nil {
			for _, started := range runners[:i] {
				started.abort()
			}
			return fmt.Errorf("%s: %w", r.name, err)
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	for _, r := range runners {
		g.Go(func() error { return r.run(gctx) })
	}
	return g.Wait()
}

// runner is one server or loop of a plugin. start binds what it serves;
// run serves until ctx ends (nil) or it fails; abort releases what start
// bound when a later runner cannot start.
type runner struct {
	name  string
	start func() error
	run   func(ctx context.Context) error
	abort func()
}

// logged logs msg with kv once r has started.
func logged(r runner, msg string, kv ...any) runner {
	start := r.start
	r.start = func() error {
		if err := start(); err != nil {
			return err
		}
		klog.InfoS(msg, kv...)
		return nil
	}
	return r
}

// loopRunner runs a loop that needs nothing bound.
func loopRunner(name string, loop func(ctx context.Context) error) runner {
	return runner{name: name, start: func() error { return nil }, run: loop, abort: func() {}}
}

// serverRunner serves on the listener listen makes, and once ctx ends
// calls stop (after which serve returns). A server that stops by itself is
// an error, so that the plugin stops with it.
func serverRunner(name string, listen func() (net.Listener, error), serve func(net.Listener) error, stop func()) runner {
	var lis net.Listener
	return runner{
		name: name,
		start: func() (err error) {
			lis, err = listen()
			return err
		},
		run: func(ctx context.Context) error {
			served := make(chan error, 1)
			go func() { served <- serve(lis) }()
			select {
			case err := <-served:
				return fmt.Errorf("%s stopped: %v", name, err)
			case <-ctx.Done():
			}
			stop()
			<-served
			return nil
		},
		abort: func() { lis.Close() },
	}
}

// grpcRunner serves srv, stopping it with stop.
func grpcRunner(name string, srv *grpc.Server, listen func() (net.Listener, error), stop func(*grpc.Server)) runner {
	return serverRunner(name, listen, srv.Serve, func() { stop(srv) })
}

// stopHard drops connections and calls in flight: for servers whose
// callers retry (peers, the kubelet's registration watcher).
func stopHard(srv *grpc.Server) { srv.Stop() }

// stopGracefully lets calls in flight finish, for up to within (0: as
// long as they take), then stops hard.
func stopGracefully(within time.Duration) func(*grpc.Server) {
	return func(srv *grpc.Server) {
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		if within <= 0 {
			<-stopped
			return
		}
		select {
		case <-stopped:
		case <-time.After(within):
			klog.InfoS("In-flight RPCs did not finish in time; stopping hard", "timeout", within)
			srv.Stop()
		}
	}
}

// unixListener listens on a unix endpoint with the socket made mode.
func unixListener(endpoint string, mode os.FileMode) func() (net.Listener, error) {
	return func() (net.Listener, error) {
		lis, err := listen(endpoint)
		if err != nil {
			return nil, err
		}
		_, path, _ := parseEndpoint(endpoint)
		if err := os.Chmod(path, mode); err != nil {
			lis.Close()
			return nil, err
		}
		return lis, nil
	}
}

func tcpListener(addr string) func() (net.Listener, error) {
	return func() (net.Listener, error) { return net.Listen("tcp", addr) }
}

// runners are the servers and loops the driver's mode asks for, the CSI
// server first.
func (d *Driver) runners() ([]runner, error) {
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
	csiRunner := grpcRunner("serving CSI", srv, func() (net.Listener, error) { return listen(d.opts.Endpoint) },
		func(srv *grpc.Server) {
			klog.InfoS("Stopping: letting in-flight RPCs finish", "timeout", d.opts.StopTimeout)
			stopGracefully(d.opts.StopTimeout)(srv)
		})
	runners := []runner{logged(csiRunner, "Serving CSI", "endpoint", d.opts.Endpoint, "mode", d.opts.Mode,
		"driver", d.opts.DriverName, "version", d.opts.Version, "node", d.opts.NodeID, "backend", d.Backend())}
	var registration *registrationService
	if d.opts.Node.RegistrationSocket != "" && d.node != nil {
		registration = &registrationService{name: d.opts.DriverName, endpoint: d.opts.Node.kubeletEndpoint(d.opts.Endpoint)}
	}
	if d.opts.MetricsAddress != "" {
		runners = append(runners, d.metricsRunner(registration))
	}
	if d.engine != nil && d.opts.Node.nodeAPIEndpoint(d.opts.Endpoint) != "" {
		api := grpc.NewServer(grpc.ChainUnaryInterceptor(d.metrics.interceptor))
		nodev1.RegisterNodeAPIServer(api, driver.NewNodeAPI(d.engine))
		// Root's alone: it destroys volumes, and has no authentication.
		runners = append(runners, logged(grpcRunner("serving the node API", api, unixListener(d.opts.Node.nodeAPIEndpoint(d.opts.Endpoint), 0o600),
			stopGracefully(0)), "Serving the node API", "endpoint", d.opts.Node.nodeAPIEndpoint(d.opts.Endpoint)))
	}
	if d.engine != nil && d.opts.Peers.Address != "" {
		runners = append(runners, logged(grpcRunner("serving peers", d.peerServer(d.peerMetrics), tcpListener(d.opts.Peers.Address), stopHard),
			"Serving volumes to peers", "address", d.opts.Peers.Address, "advertised", d.opts.Peers.advertised(),
			"mutualTLS", d.peerLink.mutualTLS()))
	}
	if d.peerCert != nil {
		runners = append(runners, loopRunner("keeping the node's peer certificate", func(ctx context.Context) error {
			d.peerCert.Run(ctx)
			return nil
		}))
	}
	if d.engine != nil && d.opts.Images.RegistryAddress != "" {
		images, err := d.imageRunners()
		if err != nil {
			return nil, err
		}
		runners = append(runners, images...)
	}
	if d.engine != nil && d.ctlConn != nil {
		r := report.New(d.engine, controllerv1.NewRegistryClient(d.ctlConn), d.opts.NodeID, d.opts.Peers.advertised(), d.reports)
		runners = append(runners, loopRunner("reporting to the controller", func(ctx context.Context) error {
			klog.InfoS("Reporting the node's cache to the controller", "address", d.opts.Node.ControllerAddress)
			r.Run(ctx)
			return nil
		}))
	}
	if d.view != nil && d.opts.Controller.APIAddress != "" {
		ctl, err := d.controllerRunners()
		if err != nil {
			return nil, err
		}
		runners = append(runners, ctl...)
	}
	if registration != nil {
		// Last, once the CSI socket listens: the kubelet calls it as soon
		// as it has the registration.
		reg := grpc.NewServer()
		registerapi.RegisterRegistrationServer(reg, registration)
		runners = append(runners, logged(grpcRunner("serving kubelet registration", reg,
			func() (net.Listener, error) { return listen("unix://" + d.opts.Node.RegistrationSocket) }, stopHard),
			"Serving kubelet plugin registration", "socket", d.opts.Node.RegistrationSocket, "kubeletEndpoint", d.opts.Node.kubeletEndpoint(d.opts.Endpoint)))
	}
	return runners, nil
}

// apiConnectionAge is how long a caller keeps one connection to the
// controller before it is asked (GOAWAY) to open another: a node reaches
// the leader through its Service, whose choice holds for a connection's
// life. A follower closes a connection as it refuses a call on it
// (callerConns); this bounds what that misses (TestFleet once saw a
// connection, after a rolling update, answered Unavailable every second
// for minutes). Calls in flight may run on for an hour.
const apiConnectionAge = time.Minute

// metricsRunner serves /metrics, the probes and, if asked, profiles. /readyz answers 503 on a
// controller replica that does not lead (unless followers are ready too:
// --leader-election-label-pod), and on a self-registering node
// plugin until the kubelet has taken its registration.
func (d *Driver) metricsRunner(registration *registrationService) runner {
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
	if d.opts.Profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	return serverRunner("serving metrics", tcpListener(d.opts.MetricsAddress), srv.Serve, func() { srv.Close() })
}

// controllerRunners serve the controller's Registry and Cache APIs and run
// its election (or, without one, the tending of its view: tendView).
func (d *Driver) controllerRunners() ([]runner, error) {
	serve, err := controllerServerOptions(d.opts, d.kube, d.metrics.interceptor, d.leader, "/cowvol.controller.", d.messages)
	serve = append(serve, controller.ServerOptions()...)
	if err != nil {
		return nil, fmt.Errorf("serving the controller's APIs: %w", err)
	}
	link, signer, err := d.opts.controllerLink()
	if err != nil {
		return nil, fmt.Errorf("serving the controller's APIs: %w", err)
	}
	var peerCA controller.PeerSigner
	if signer != nil {
		peerCA = signer
	}
	api := grpc.NewServer(append(serve, grpc.KeepaliveParams(keepalive.ServerParameters{
		MaxConnectionAge: apiConnectionAge, MaxConnectionAgeGrace: time.Hour}))...)
	controller.Register(api, controller.Services{View: d.view, Orders: d.readOrders, FullReports: d.fullReports, Metrics: d.ctlMetrics,
		Events: d.nodeEvents, Dial: link.dialer(d.opts.Peers.PullWait), PeerCA: peerCA})
	apiRunner := logged(grpcRunner("serving the controller's APIs", api, d.leader.callers.listen(tcpListener(d.opts.Controller.APIAddress)), stopGracefully(0)),
		"Serving the controller's Registry and Cache APIs", "address", d.opts.Controller.APIAddress,
		"tls", d.opts.Controller.TLSCertFile != "", "tokens", d.opts.Controller.TokensFile != "",
		"stalledAfter", d.opts.Controller.StalledAfter, "forgetStalledAfter", d.opts.Controller.ForgetStalledAfter)
	if !d.opts.LeaderElection.Enabled && d.leader.awaitNodes != nil {
		// A restarted controller knows no more than a new leader does.
		d.leader.awaitNodes(context.Background())
	}
	loop := loopRunner("tending the view", func(ctx context.Context) error { d.tendView(ctx); return nil })
	if d.opts.LeaderElection.Enabled {
		loop = loopRunner("leader election", func(ctx context.Context) error {
			return d.leader.elect(ctx, d.kube, d.opts.LeaderElection, d.tendView)
		})
	}
	runners := []runner{apiRunner, loop}
	if d.opts.Controller.WebhookAddress != "" {
		webhook, err := d.localityRunner()
		if err != nil {
			return nil, err
		}
		runners = append(runners, webhook)
	}
	return runners, nil
}

// localityRunner serves the locality webhook over HTTPS, with the APIs'
// certificate (renewed in its files, as theirs is): the API server calls
// it through the controller's Service, which sends it to the leader. A
// follower, or a leader whose view still settles, places no pod.
func (d *Driver) localityRunner() (runner, error) {
	pair, err := tlsfiles.NewKeyPair(d.opts.Controller.TLSCertFile, d.opts.Controller.TLSKeyFile)
	if err != nil {
		return runner{}, fmt.Errorf("serving the locality webhook: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle(locality.Path, locality.Handler(locality.Config{
		Rank: func(inputs []volume.Ref, namespace string, limit int) []fleet.Placement {
			return d.view.Place(inputs, func(ns string) bool { return ns == namespace }, limit, time.Now())
		},
		Making: func(inputs []volume.Ref, namespace string) []string {
			return d.view.Making(inputs, func(ns string) bool { return ns == namespace }, time.Now())
		},
		CacheInputs: func(caches []volume.CacheRef) []volume.Ref {
			return d.view.CacheInputs(caches, nil, time.Now()) // the pod's own namespace's keys only
		},
		Ready:      func() bool { return d.leader.refuse(controllerv1.Cache_Place_FullMethodName) == nil },
		Registries: d.opts.Controller.LocalityRegistries,
		Metrics:    d.locality,
	}))
	// The API server gives a webhook seconds (the chart: 2) and retries
	// nothing; a slow caller's connection goes.
	srv := &http.Server{Handler: mux, TLSConfig: tlsfiles.ServerConfig(pair, nil), ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout: 10 * time.Second, WriteTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10}
	return logged(serverRunner("serving the locality webhook", tcpListener(d.opts.Controller.WebhookAddress),
		func(lis net.Listener) error { return srv.ServeTLS(lis, "", "") },
		func() { _ = srv.Close() }),
		"Serving the locality webhook", "address", d.opts.Controller.WebhookAddress, "path", locality.Path,
		"imageRegistries", d.opts.Controller.LocalityRegistries), nil
}

// copyPassEvery is how often the controller assigns copies.
const copyPassEvery = time.Second

// tendView is what the controller (the leader, where it elects one) does
// of its own: it tells of stalled nodes and forgets those stalled long
// ago, has nodes copy the volumes that lack copies, and destroys those
// whose owner is gone.
func (d *Driver) tendView(ctx context.Context) {
	tick := time.NewTicker(d.opts.Controller.StalledAfter)
	defer tick.Stop()
	copyPass := time.NewTicker(copyPassEvery)
	defer copyPass.Stop()
	if d.owners != nil {
		go d.owners.Run(ctx, d.opts.Controller.OwnerSweepEvery)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-copyPass.C:
			d.view.AssignCopies(time.Now())
			continue
		case <-tick.C:
		}
		stalled, forgotten := d.view.Sweep(time.Now())
		for _, id := range stalled {
			klog.InfoS("A node stopped reporting: left out of lookups and placement", "node", id, "after", d.opts.Controller.StalledAfter)
			d.nodeEvents.NodeEventOn(id, corev1.EventTypeWarning, "CowvolNodeStalled", fmt.Sprintf(
				"cowvol's controller heard nothing from the node for %s: its cached volumes are left out of lookups and placement", d.opts.Controller.StalledAfter))
		}
		for _, id := range forgotten {
			klog.InfoS("Forgot a node that stopped reporting", "node", id, "after", d.opts.Controller.ForgetStalledAfter)
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
