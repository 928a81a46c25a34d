package plugin

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/tlsfiles"
	"github.com/concourse/cowvol/pkg/node"
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
	// is the name peers' certificates carry.
	CertFile, KeyFile, CAFile, ServerName string
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
}

// DefaultPeerServerName is the name in the peer certificate a deployment
// provides to every node.
const DefaultPeerServerName = "cowvol-peer"

func (p *PeerOptions) validate(o *Options) []error {
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
	if p.ReadOrderRefresh < 0 {
		errs = append(errs, errors.New("--read-order-refresh must not be negative"))
	}
	if _, err := node.ParsePullMode(p.PullMode); err != nil {
		errs = append(errs, fmt.Errorf("--pull-mode: %w", err))
	}
	if p.ServerName == "" {
		errs = append(errs, errors.New("--peer-tls-server-name is required"))
	}
	tlsSet := p.CertFile != "" || p.KeyFile != "" || p.CAFile != ""
	if tlsSet && (p.CertFile == "" || p.KeyFile == "" || p.CAFile == "") {
		errs = append(errs, errors.New("--peer-tls-cert-file, --peer-tls-key-file and --peer-ca-file go together (mutual TLS)"))
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
		case p.AdvertiseAddress == "":
			p.AdvertiseAddress = p.Address
		}
		if !tlsSet {
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
		if !tlsSet {
			if err := loopbackOnly(addr); err != nil {
				errs = append(errs, fmt.Errorf("--peers: %w (or give the peer TLS flags)", err))
			}
		}
	}
	if (p.Address != "" || len(p.Static) > 0) && o.Mode == ModeController {
		errs = append(errs, errors.New("--peer-address and --peers are for node plugins: use --mode=node or all"))
	}
	return errs
}

// peerTLS is the peer link's credentials: the server demands a client
// certificate signed by the CA, and the client checks the server's. Both
// read their files at each handshake, so a renewed Secret takes effect
// without a restart.
type peerTLS struct {
	pair       *tlsfiles.KeyPair
	ca         *tlsfiles.CA
	serverName string
}

// loadTLS loads the peer certificates the options name (nil: none).
func (p PeerOptions) loadTLS() (*peerTLS, error) {
	if p.CertFile == "" {
		return nil, nil
	}
	pair, err := tlsfiles.NewKeyPair(p.CertFile, p.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("loading the peer certificate: %w", err)
	}
	ca, err := tlsfiles.NewCA(p.CAFile)
	if err != nil {
		return nil, fmt.Errorf("reading the peer CA: %w", err)
	}
	return &peerTLS{pair: pair, ca: ca, serverName: p.ServerName}, nil
}

// pulls says whether the node pulls sources it lacks: it knows peers,
// from the controller or a static list.
func (o Options) pulls() bool { return o.ControllerAddress != "" || len(o.Peers.Static) > 0 }

// pullConfig is the engine's part of the peer options; ctl reaches the
// controller (nil: the static list is the locator).
func (o Options) pullConfig(ctl grpc.ClientConnInterface) (*node.PullConfig, error) {
	dial, err := o.Peers.dialer()
	if err != nil {
		return nil, err
	}
	var loc node.Locator = staticPeers(o.Peers.Static)
	if ctl != nil {
		loc = controllerLocator{api: controllerv1.NewCacheClient(ctl), nodeID: o.NodeID}
	}
	enc, _ := streamer.ParseEncoding(o.Peers.Encoding) // validated
	mode, _ := node.ParsePullMode(o.Peers.PullMode)    // validated
	return &node.PullConfig{Locator: loc, Dial: dial, Encoding: enc, Wait: o.Peers.PullWait, Mode: mode, ReadOrderRefresh: o.Peers.ReadOrderRefresh,
		Limits: streamer.Limits{Bytes: o.Peers.SizeLimit, Entries: streamer.DefaultLimits.Entries, KeepSetuid: o.AllowSetuid}}, nil
}

// dialer reaches peers' --peer-address: over mutual TLS where the options
// give certificates, else in plaintext to loopback only.
func (p PeerOptions) dialer() (func(address string) (*streamer.Client, io.Closer, error), error) {
	peerTLS, err := p.loadTLS()
	if err != nil {
		return nil, err
	}
	return func(address string) (*streamer.Client, io.Closer, error) {
		creds := insecure.NewCredentials()
		if peerTLS != nil {
			creds = credentials.NewTLS(tlsfiles.ClientConfig(peerTLS.pair, peerTLS.ca, peerTLS.serverName))
		} else if err := loopbackOnly(address); err != nil {
			// Plaintext stays on this machine, whoever named the address.
			return nil, nil, fmt.Errorf("peer %s: %w", address, err)
		}
		conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(creds),
			grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: peerKeepalive, Timeout: peerKeepaliveTimeout}),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(streamer.MaxChunk)),
			grpc.WithInitialWindowSize(streamWindow), grpc.WithInitialConnWindowSize(streamWindow),
			grpc.WithReadBufferSize(streamBuffer), grpc.WithWriteBufferSize(streamBuffer))
		if err != nil {
			return nil, nil, err
		}
		return streamer.NewClient(conn, p.PullWait), conn, nil
	}, nil
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
// options give certificates.
func (d *Driver) peerServer(m *streamer.Metrics) (*grpc.Server, error) {
	peerTLS, err := d.opts.Peers.loadTLS()
	if err != nil {
		return nil, err
	}
	opts := []grpc.ServerOption{grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(streamWindow),
		grpc.ReadBufferSize(streamBuffer), grpc.WriteBufferSize(streamBuffer),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: peerKeepalive / 2})}
	if peerTLS != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(tlsfiles.ServerConfig(peerTLS.pair, peerTLS.ca))))
	}
	srv := grpc.NewServer(opts...)
	lim := streamer.DefaultLimits
	lim.Bytes, lim.KeepSetuid = d.opts.Peers.SizeLimit, d.opts.AllowSetuid
	streamer.NewServer(d.engine.PeerHolder(), m, lim).Register(srv)
	return srv, nil
}

// staticPeers are the peers of --peers: every one is asked.
type staticPeers []string

func (s staticPeers) Holders(context.Context, string, volume.Ref) ([]node.Peer, error) {
	var out []node.Peer
	for _, p := range s {
		id, addr, _ := strings.Cut(p, "=")
		out = append(out, node.Peer{NodeID: id, Address: addr})
	}
	return out, nil
}

// controllerLocator asks the controller which nodes hold a volume ready.
type controllerLocator struct {
	api    controllerv1.CacheClient
	nodeID string
}

// lookupTimeout bounds a lookup at the controller.
const lookupTimeout = 10 * time.Second

func (c controllerLocator) Holders(ctx context.Context, namespace string, r volume.Ref) ([]node.Peer, error) {
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	resp, err := c.api.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{
		Refs: []*controllerv1.VolumeRef{{Namespace: r.Namespace, Handle: r.Handle}}})
	if err != nil {
		return nil, fmt.Errorf("asking the controller: %w", err)
	}
	var out []node.Peer
	for _, loc := range resp.GetVolumes() {
		// Only the holders of a volume namespace may read: the others
		// would not serve it to this pull, and asking them would tell the
		// pod that another namespace has it.
		if !volume.Readable(r, volume.Scope(loc.GetScope()), namespace) {
			continue
		}
		for i, id := range loc.GetNodes() {
			if i < len(loc.GetPeerAddresses()) {
				out = append(out, node.Peer{NodeID: id, Address: loc.GetPeerAddresses()[i]})
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
