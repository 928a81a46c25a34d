package plugin

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"net"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/peerid"
	"github.com/concourse/cowvol/pkg/pull"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// PeerOptions are a node's, for streaming volumes between nodes.
type PeerOptions struct {
	// Address is where the node serves its volumes to peers (host:port;
	// empty: it serves none). AdvertiseAddress is what peers dial,
	// told to the controller; it defaults to Address when that names a
	// host.
	Address, AdvertiseAddress string
	// CertFile and KeyFile are the node's certificate, served and
	// presented to peers; CAFile verifies peers' (mutual TLS). ServerName
	// is the name peers' certificates carry. One certificate for all.
	CertFile, KeyFile, CAFile, ServerName string
	// FromController (a node): a certificate of the node's own instead,
	// whose name is the node's, signed by the controller, which names the
	// authorities peers' must chain to. Peers then check that each is the
	// node the controller listed.
	FromController bool
	// CACertFile and CAKeyFile (the controller): the peer CA that signs
	// nodes' certificates, and the controller's own; CertLifetime is how
	// long one lasts.
	CACertFile, CAKeyFile string
	CertLifetime          time.Duration
	// Static lists peers as node=host:port, for nodes run without a
	// controller; a node with a controller asks it who holds what.
	Static []string
	// Encoding is what pulled layers travel as; SizeLimit bounds each
	// layer's tar stream (bytes).
	Encoding  string
	SizeLimit int64
	// PullWait is how long a publish waits for a pull before answering
	// with its progress.
	PullWait time.Duration
	// PullMode is auto, lazy or eager.
	PullMode string
	// ReadOrderRefresh is how old a read profile's record must be before a
	// lazy pull records it again (0: every time).
	ReadOrderRefresh time.Duration
	// SwarmMinSize is the smallest layer a whole pull joins a swarm for
	// (bytes; 0: none does).
	SwarmMinSize int64
	// FillKeeper is the socket of the process that keeps lazy fills'
	// fanotify group across plugin restarts ("": none).
	FillKeeper string
	// PullIndex has lazy pulls mount an index in place of a stub per
	// file, where the kernel can (the default).
	PullIndex bool
}

// DefaultPeerServerName is the name in the peer certificate a deployment
// provides to every node.
const DefaultPeerServerName = "cowvol-peer"

// addTLSFlags registers the peer certificates' flags, every mode's.
func (p *PeerOptions) addTLSFlags(fs *flag.FlagSet) {
	fs.StringVar(&p.CertFile, "peer-tls-cert-file", p.CertFile,
		"the certificate for mutual TLS between peers: nodes serve and present it, the controller presents it to read and upload volumes")
	fs.StringVar(&p.KeyFile, "peer-tls-key-file", p.KeyFile, "the key of --peer-tls-cert-file")
	fs.StringVar(&p.CAFile, "peer-ca-file", p.CAFile, "the CA that signs every peer certificate")
	fs.StringVar(&p.ServerName, "peer-tls-server-name", p.ServerName, "the DNS name peer certificates carry")
}

// addCAFlags registers the controller's flags for the peer CA.
func (p *PeerOptions) addCAFlags(fs *flag.FlagSet) {
	fs.StringVar(&p.CACertFile, "peer-ca-cert-file", p.CACertFile,
		"the peer CA's certificate: the controller signs each node's peer certificate (named by the node) and its own with it, "+
			"in place of one certificate for all (--peer-tls-cert-file)")
	fs.StringVar(&p.CAKeyFile, "peer-ca-key-file", p.CAKeyFile, "the key of --peer-ca-cert-file; only the controller mounts it")
	fs.DurationVar(&p.CertLifetime, "peer-certificate-lifetime", p.CertLifetime,
		"how long a peer certificate the controller signs lasts (at least 10m; nodes renew half way through)")
}

// AddFlags registers the node's flags for serving and pulling volumes.
func (p *PeerOptions) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&p.Address, "peer-address", p.Address, "host:port to serve cached volumes to pulling peers on (empty: none)")
	fs.StringVar(&p.AdvertiseAddress, "peer-advertise-address", p.AdvertiseAddress,
		"host:port peers dial, told to the controller (default: --peer-address)")
	fs.Func("peers", "without a controller: peers to pull missing sources from, node=host:port,... ", func(v string) error {
		p.Static = append(p.Static, strings.Split(v, ",")...)
		return nil
	})
	fs.BoolVar(&p.FromController, "peer-certificates-from-controller", p.FromController,
		"serve and present on the peer link a certificate of this node's own, whose name is the node's, which the controller signs "+
			"(and renews half way through its life), in place of one certificate for all (--peer-tls-cert-file); peers then check "+
			"that each is the node the controller listed (needs --controller-address, and a controller given --peer-ca-cert-file)")
	fs.StringVar(&p.Encoding, "stream-encoding", p.Encoding, "how pulled layers travel: raw, zstd, s2 or gzip")
	fs.Var(quantityFlag{&p.SizeLimit}, "stream-size-limit",
		"the largest layer a pull accepts, as a tar stream (a quantity such as 100Gi)")
	fs.DurationVar(&p.PullWait, "pull-wait", p.PullWait,
		"how long a publish waits for a pull before answering with its progress (the kubelet retries), "+
			"and how long a reader of a lazily pulled file waits for a holder that stopped sending before it gets EIO")
	fs.StringVar(&p.PullMode, "pull-mode", p.PullMode,
		"how sources this node lacks arrive: lazy (the step starts once the tree is here, each file's data "+
			"arrives when it is opened, the rest behind it; needs the overlay backend and fanotify pre-content events, kernel 6.14+), "+
			"eager (all of it before the step starts) or auto (lazy where the node supports it)")
	fs.DurationVar(&p.ReadOrderRefresh, "read-order-refresh", p.ReadOrderRefresh,
		"how old a read profile's record must be before a lazy pull under it records the step's read order again "+
			"(recording costs each of the step's opens a notification); 0: every time")
	fs.StringVar(&p.FillKeeper, "fill-keeper-socket", p.FillKeeper,
		"the socket of `cowvol-plugin fill-keeper`, which keeps the fanotify group of lazy fills while this plugin restarts: "+
			"a step reading a file not filled yet waits for the next plugin (the keeper's --grace) or gets EIO, never the file's holes (empty: none; "+
			"a plugin's death then lets such readers through)")
	fs.BoolVar(&p.PullIndex, "pull-index", p.PullIndex,
		"have a lazy pull mount an index of the source (an EROFS image learnt from the holder's tree, file-backed, whose data arrives by extent "+
			"as it is read) in place of a stub file per file, so that a volume of any file count is ready at once; where the kernel cannot "+
			"mount EROFS from regular files (before 6.12), or with --pull-index=false, stub trees, as the node's pull mode says (kubectl cowvol nodes)")
	fs.Var(quantityFlag{&p.SwarmMinSize}, "swarm-min-size",
		"the smallest layer a node serving peers (--peer-address) pulls whole as a member of its swarm: from the node that asked its holder "+
			"just before it, relaying it as it arrives to the one after, so that its holder's link carries it once however many nodes pull it "+
			"(a quantity; 0: none)")
}

// sharedTLS says whether the options name one certificate for all.
func (p PeerOptions) sharedTLS() bool { return p.CertFile != "" || p.KeyFile != "" || p.CAFile != "" }

// tls says whether a node's peer link runs over mutual TLS.
func (p PeerOptions) tls() bool { return p.sharedTLS() || p.FromController }

// validateTLS checks the peer certificates' options, every mode's.
func (p PeerOptions) validateTLS() []error {
	var errs []error
	if p.ServerName == "" {
		errs = append(errs, errors.New("--peer-tls-server-name is required"))
	}
	if p.sharedTLS() && (p.CertFile == "" || p.KeyFile == "" || p.CAFile == "") {
		errs = append(errs, errors.New("--peer-tls-cert-file, --peer-tls-key-file and --peer-ca-file go together (mutual TLS)"))
	}
	return errs
}

// validateCA checks the controller's peer CA options.
func (p PeerOptions) validateCA() []error {
	var errs []error
	if (p.CACertFile == "") != (p.CAKeyFile == "") {
		errs = append(errs, errors.New("--peer-ca-cert-file and --peer-ca-key-file go together"))
	}
	if p.CACertFile != "" && p.sharedTLS() {
		errs = append(errs, errors.New("--peer-ca-cert-file gives the controller a certificate of its own: "+
			"drop --peer-tls-cert-file, --peer-tls-key-file and --peer-ca-file"))
	}
	if p.CertLifetime < peerid.MinLifetime {
		errs = append(errs, fmt.Errorf("--peer-certificate-lifetime %s: want at least %s", p.CertLifetime, peerid.MinLifetime))
	}
	return errs
}

// validate checks the node's options for serving and pulling volumes.
func (p PeerOptions) validate() []error {
	var errs []error
	if _, err := streamer.ParseEncoding(p.Encoding); err != nil {
		errs = append(errs, fmt.Errorf("--stream-encoding: %w", err))
	}
	if p.SizeLimit <= 0 {
		errs = append(errs, errors.New("--stream-size-limit must be positive"))
	}
	if p.PullWait <= 0 {
		errs = append(errs, errors.New("--pull-wait must be positive"))
	}
	if p.SwarmMinSize < 0 {
		errs = append(errs, errors.New("--swarm-min-size must not be negative"))
	}
	if p.ReadOrderRefresh < 0 {
		errs = append(errs, errors.New("--read-order-refresh must not be negative"))
	}
	if _, err := pull.ParseMode(p.PullMode); err != nil {
		errs = append(errs, fmt.Errorf("--pull-mode: %w", err))
	}
	if p.FromController && p.sharedTLS() {
		errs = append(errs, errors.New("--peer-certificates-from-controller replaces --peer-tls-cert-file, --peer-tls-key-file and --peer-ca-file: give one or the other"))
	}
	if p.Address == "" && p.AdvertiseAddress != "" {
		errs = append(errs, errors.New("--peer-advertise-address needs --peer-address"))
	}
	if p.Address != "" {
		host, _, err := net.SplitHostPort(p.Address)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("--peer-address %q is not host:port: %w", p.Address, err))
		case p.AdvertiseAddress == "" && (host == "" || net.ParseIP(host).IsUnspecified()):
			errs = append(errs, fmt.Errorf("--peer-address %q names no host peers can dial: give --peer-advertise-address", p.Address))
		}
		if !p.tls() {
			if err := loopbackOnly(p.Address); err != nil {
				errs = append(errs, fmt.Errorf("--peer-address: %w (or give --peer-tls-cert-file, --peer-tls-key-file and --peer-ca-file)", err))
			}
		}
	}
	for _, s := range p.Static {
		id, addr, ok := strings.Cut(s, "=")
		if _, _, err := net.SplitHostPort(addr); !ok || id == "" || err != nil {
			errs = append(errs, fmt.Errorf("--peers entry %q: want node=host:port", s))
			continue
		}
		if !p.tls() {
			if err := loopbackOnly(addr); err != nil {
				errs = append(errs, fmt.Errorf("--peers: %w (or give the peer TLS flags)", err))
			}
		}
	}
	return errs
}

// advertised is the address peers dial: as given, or the served one.
func (p PeerOptions) advertised() string { return firstOf(p.AdvertiseAddress, p.Address) }

// pulls says whether the node pulls sources it lacks: it knows peers,
// from the controller or a static list.
func (o Options) pulls() bool { return o.Node.ControllerAddress != "" || len(o.Peers.Static) > 0 }

// pullConfig is the engine's part of the peer options; ctl reaches the
// controller (nil: the static list is the locator), link the peers.
func (o Options) pullConfig(ctl grpc.ClientConnInterface, link *peerLink) *pull.Config {
	var loc pull.Locator = staticPeers(o.Peers.Static)
	var orders pull.ReadOrderShare
	if ctl != nil {
		loc = controllerLocator{api: controllerv1.NewCacheClient(ctl), nodeID: o.NodeID}
		orders = controllerReadOrders{api: controllerv1.NewRegistryClient(ctl), nodeID: o.NodeID}
	}
	enc, _ := streamer.ParseEncoding(o.Peers.Encoding) // validated
	mode, _ := pull.ParseMode(o.Peers.PullMode)        // validated
	var relay string
	if o.Peers.Address != "" {
		relay = o.Peers.advertised()
	}
	return &pull.Config{Locator: loc, Dial: link.dialer(o.Peers.PullWait), Encoding: enc, Wait: o.Peers.PullWait, Mode: mode, ReadOrderRefresh: o.Peers.ReadOrderRefresh,
		RelayAddress: relay, SwarmMinBytes: o.Peers.SwarmMinSize, FillKeeper: o.Peers.FillKeeper, Index: o.Peers.PullIndex,
		ReadOrders: orders, Limits: streamer.Limits{Bytes: o.Peers.SizeLimit, Entries: streamer.DefaultLimits.Entries, KeepSetuid: o.Node.AllowSetuid}}
}

// controllerReadOrders share read orders through the controller.
type controllerReadOrders struct {
	api    controllerv1.RegistryClient
	nodeID string
}

func (c controllerReadOrders) Share(ctx context.Context, namespace, name string, files []string) error {
	_, err := c.api.ShareReadOrder(ctx, &controllerv1.ShareReadOrderRequest{Order: &controllerv1.ReadOrder{
		Namespace: namespace, Name: name, Files: files, Recorded: timestamppb.Now(), NodeId: c.nodeID}})
	return err
}

func (c controllerReadOrders) Find(ctx context.Context, namespace, name string) ([]string, string, error) {
	o, err := c.api.GetReadOrder(ctx, &controllerv1.GetReadOrderRequest{Namespace: namespace, Name: name})
	if status.Code(err) == codes.NotFound {
		return nil, "", nil
	}
	if err != nil {
		return nil, "", err
	}
	return o.GetFiles(), o.GetNodeId(), nil
}

// A holder that goes silent mid-pull (a machine gone, its link down: no
// reset ever comes) is given up after peerKeepalive without a byte from it
// and peerKeepaliveTimeout more without an answer to a ping; its streams
// fail, and the pull moves to another holder, or its readers get EIO.
// Without these a lazily read file waited on a dead holder for TCP's own
// timeout, a quarter of an hour. The server lets pings come that often.
const (
	peerKeepalive        = 10 * time.Second
	peerKeepaliveTimeout = 5 * time.Second
)

// A stream's flow-control window and socket buffers: gRPC's defaults (a
// 64 KiB window grown by estimate, 32 KiB buffers) are sized for RPCs, not
// for a gigabyte moving between two hosts.
const (
	streamWindow = 8 << 20
	streamBuffer = 1 << 20
)

// peerServer is the node's peer API server, with mutual TLS where the
// link has certificates.
func (d *Driver) peerServer(m *streamer.Metrics) *grpc.Server {
	opts := []grpc.ServerOption{grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(streamWindow),
		grpc.ReadBufferSize(streamBuffer), grpc.WriteBufferSize(streamBuffer),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: peerKeepalive / 2})}
	if creds := d.peerLink.serverCreds(); creds != nil {
		opts = append(opts, grpc.Creds(creds))
	}
	srv := grpc.NewServer(opts...)
	lim := streamer.DefaultLimits
	lim.Bytes, lim.KeepSetuid = d.opts.Peers.SizeLimit, d.opts.Node.AllowSetuid
	streamer.NewServer(d.engine.PeerHolder(), m, lim).Register(srv)
	return srv
}

// staticPeers are the peers of --peers: every one is asked.
type staticPeers []string

func (s staticPeers) Holders(context.Context, string, volume.Ref) ([]pull.Peer, error) {
	var out []pull.Peer
	for _, p := range s {
		id, addr, _ := strings.Cut(p, "=")
		out = append(out, pull.Peer{NodeID: id, Address: addr})
	}
	return out, nil
}

// Vouched knows no digests: no controller gathers them.
func (staticPeers) Vouched(context.Context, []volume.Ref) (map[volume.Ref]volume.Digests, error) {
	return nil, nil
}

// NewestCacheVersion knows none: no controller gathers them.
func (staticPeers) NewestCacheVersion(context.Context, string, string) (pull.CacheVersion, bool, error) {
	return pull.CacheVersion{}, false, nil
}

// controllerLocator asks the controller which nodes hold a volume ready.
type controllerLocator struct {
	api    controllerv1.CacheClient
	nodeID string
}

// lookupTimeout bounds a lookup at the controller.
const lookupTimeout = 10 * time.Second

func (c controllerLocator) Holders(ctx context.Context, namespace string, r volume.Ref) ([]pull.Peer, error) {
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	resp, err := c.api.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{
		Refs: []*controllerv1.VolumeRef{{Namespace: r.Namespace, Handle: r.Handle}}})
	if err != nil {
		return nil, fmt.Errorf("asking the controller: %w", err)
	}
	var out []pull.Peer
	for _, loc := range resp.GetVolumes() {
		// Only the holders of a volume namespace may read: the others
		// would not serve it to this pull, and asking them would tell the
		// pod that another namespace has it.
		if !volume.Readable(r, volume.Scope(loc.GetScope()), namespace) {
			continue
		}
		for i, id := range loc.GetNodes() {
			if i < len(loc.GetPeerAddresses()) {
				out = append(out, pull.Peer{NodeID: id, Address: loc.GetPeerAddresses()[i]})
			}
		}
	}
	// Start at a place of this node's own, so that pulls from many nodes
	// spread over the holders instead of all asking the first.
	if len(out) > 1 {
		h := fnv.New32a()
		_, _ = h.Write([]byte(c.nodeID))
		k := int(h.Sum32() % uint32(len(out)))
		out = append(out[k:], out[:k]...)
	}
	return out, nil
}

// Vouched asks the controller what the makers of refs vouch for them with.
func (c controllerLocator) Vouched(ctx context.Context, refs []volume.Ref) (map[volume.Ref]volume.Digests, error) {
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	resp, err := c.api.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: controllerv1.RefsOf(refs), MaxNodes: 1})
	if err != nil {
		return nil, fmt.Errorf("asking the controller for the digests of %d volumes: %w", len(refs), err)
	}
	out := map[volume.Ref]volume.Digests{}
	for _, loc := range resp.GetVolumes() {
		var d volume.Digests
		if len(loc.GetLayerDigest()) != len(d.Layer) || len(loc.GetViewDigest()) != len(d.View) {
			continue
		}
		copy(d.Layer[:], loc.GetLayerDigest())
		copy(d.View[:], loc.GetViewDigest())
		r := volume.Ref{Namespace: loc.GetRef().GetNamespace(), Handle: loc.GetRef().GetHandle()}
		if d.Known() && slices.Contains(refs, r) {
			out[r] = d
		}
	}
	return out, nil
}

// cacheLookupTimeout bounds the question a cache publish asks: a step
// whose controller is slow to answer forks what the node holds instead.
const cacheLookupTimeout = 2 * time.Second

// NewestCacheVersion asks the controller for the fleet's newest version
// of a cache key.
func (c controllerLocator) NewestCacheVersion(ctx context.Context, namespace, key string) (pull.CacheVersion, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, cacheLookupTimeout)
	defer cancel()
	resp, err := c.api.LookupCaches(ctx, &controllerv1.LookupCachesRequest{Namespace: namespace, Keys: []string{key}, MaxNodes: 1})
	if err != nil {
		return pull.CacheVersion{}, false, fmt.Errorf("asking the controller for cache %s: %w", volume.Quote(key), err)
	}
	if len(resp.GetCaches()) != 1 {
		return pull.CacheVersion{}, false, fmt.Errorf("the controller answered %d caches for one key", len(resp.GetCaches()))
	}
	loc := resp.GetCaches()[0]
	r := volume.Ref{Namespace: loc.GetVersion().GetRef().GetNamespace(), Handle: loc.GetVersion().GetRef().GetHandle()}
	if !loc.GetFound() || r.Namespace != namespace || !volume.IsCacheHandleOf(r.Handle, key) || loc.GetPromotedAt().CheckValid() != nil {
		return pull.CacheVersion{}, false, nil
	}
	return pull.CacheVersion{Ref: r, PromotedAt: loc.GetPromotedAt().AsTime(), PromotedBy: loc.GetPromotedBy()}, true, nil
}
