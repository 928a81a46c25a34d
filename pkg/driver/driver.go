// Package driver is cowvol's CSI surface: the Identity, Node and Controller
// gRPC services, the validation of every request and the mapping of every
// failure to its gRPC code. It composes the services the mode asks for and
// orchestrates packages cache (metadata) and overlay (COW mechanics); those
// packages never import it.
package driver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
)

// Mode says which CSI services a plugin process serves.
type Mode string

const (
	ModeNode       Mode = "node"
	ModeController Mode = "controller"
	ModeAll        Mode = "all"
)

// DefaultDriverName is the CSI driver name pods refer to.
const DefaultDriverName = "cowvol.concourse-ci.org"

// TopologyKey is the topology segment NodeGetInfo reports.
const TopologyKey = "topology.cowvol.concourse-ci.org/node"

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
	// AllowSetuid mounts step volumes without nosuid.
	AllowSetuid bool

	// bootIDFile names the kernel's boot ID; tests point it elsewhere to
	// pretend a reboot.
	bootIDFile string
}

func (o Options) bootIDPath() string {
	if o.bootIDFile != "" {
		return o.bootIDFile
	}
	return bootIDPath
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
	if _, _, err := parseEndpoint(o.Endpoint); err != nil {
		errs = append(errs, err)
	}
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
	d := &Driver{opts: opts, metrics: newMetrics()}
	d.identity = &identityService{name: opts.DriverName, version: opts.Version, controller: opts.Mode != ModeNode}
	if opts.Mode != ModeNode {
		d.controller = &controllerService{}
	}
	if opts.Mode != ModeController {
		store, err := cache.Open(opts.StateDir)
		if err != nil {
			return nil, err
		}
		d.store = store
		node, err := newNodeService(opts, store, deps.Mounter, d.metrics, deps.Kube)
		if err != nil {
			store.Close()
			return nil, err
		}
		d.node = node
	}
	return d, nil
}

// Backend says which COW backend the node service runs ("" without one).
func (d *Driver) Backend() overlay.Kind {
	if d.node == nil {
		return ""
	}
	return d.node.backend.Kind()
}

// Run serves until ctx is done, then stops gracefully: RPCs in flight finish
// (up to StopTimeout), background work is cancelled and cleans up after
// itself, and the socket is removed.
func (d *Driver) Run(ctx context.Context) error {
	lis, err := listen(d.opts.Endpoint)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(d.metrics.interceptor))
	csi.RegisterIdentityServer(srv, d.identity)
	if d.node != nil {
		csi.RegisterNodeServer(srv, d.node)
	}
	if d.controller != nil {
		csi.RegisterControllerServer(srv, d.controller)
	}
	var metricsSrv *http.Server
	if d.opts.MetricsAddress != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(d.metrics.registry, promhttp.HandlerOpts{}))
		metricsSrv = &http.Server{Addr: d.opts.MetricsAddress, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := metricsSrv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				klog.ErrorS(err, "Metrics server failed", "address", d.opts.MetricsAddress)
			}
		}()
	}
	klog.InfoS("Serving CSI", "endpoint", d.opts.Endpoint, "mode", d.opts.Mode, "driver", d.opts.DriverName,
		"version", d.opts.Version, "node", d.opts.NodeID, "backend", d.Backend())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	if d.opts.RegistrationSocket != "" && d.node != nil {
		// Registered only once the CSI socket answers: the kubelet calls
		// it as soon as it has the registration.
		regLis, err := listen("unix://" + d.opts.RegistrationSocket)
		if err != nil {
			srv.Stop()
			d.Close()
			return fmt.Errorf("serving kubelet registration: %w", err)
		}
		reg := grpc.NewServer()
		registerapi.RegisterRegistrationServer(reg, &registrationService{name: d.opts.DriverName, endpoint: d.opts.KubeletEndpoint})
		go func() { _ = reg.Serve(regLis) }()
		// Stopping the registration first tells the kubelet the plugin is
		// going away (its watcher sees the socket vanish).
		defer reg.Stop()
		klog.InfoS("Serving kubelet plugin registration", "socket", d.opts.RegistrationSocket, "kubeletEndpoint", d.opts.KubeletEndpoint)
	}
	select {
	case err = <-served:
	case <-ctx.Done():
		klog.InfoS("Stopping: letting in-flight RPCs finish", "timeout", d.opts.StopTimeout)
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(d.opts.StopTimeout):
			klog.InfoS("In-flight RPCs did not finish in time; stopping hard")
			srv.Stop()
		}
	}
	if metricsSrv != nil {
		_ = metricsSrv.Close()
	}
	d.Close()
	return err
}

// Close stops background work and closes the store.
func (d *Driver) Close() {
	if d.node != nil {
		d.node.stop()
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

// inflight refuses a second call for a volume while one is running: the
// kubelet retries, and the retry must not race the original.
type inflight struct {
	mu   sync.Mutex
	busy map[string]bool
}

func (f *inflight) tryLock(key string) (release func(), ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.busy == nil {
		f.busy = map[string]bool{}
	}
	if f.busy[key] {
		return nil, false
	}
	f.busy[key] = true
	return func() {
		f.mu.Lock()
		delete(f.busy, key)
		f.mu.Unlock()
	}, true
}
