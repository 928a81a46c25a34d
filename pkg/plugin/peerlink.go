package plugin

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/peerid"
	"github.com/concourse/cowvol/internal/tlsfiles"
	"github.com/concourse/cowvol/pkg/streamer"
)

// peerLink is a process's credentials on the peer link: identities (a
// node's certificate, kept from the controller, or the controller's own,
// from its peer CA), one certificate for all (files), or none (plaintext,
// loopback only).
type peerLink struct {
	ids    peerid.Credentials
	shared *sharedTLS
}

// sharedTLS is one certificate for all: the server demands a client
// certificate signed by the CA, and the client checks the server's name.
// Both read their files at each handshake, so a renewed Secret takes
// effect without a restart.
type sharedTLS struct {
	pair       *tlsfiles.KeyPair
	ca         *tlsfiles.CA
	serverName string
}

// loadShared loads the certificate the options name (nil: none).
func loadShared(p PeerOptions) (*sharedTLS, error) {
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
	return &sharedTLS{pair: pair, ca: ca, serverName: p.ServerName}, nil
}

// signTimeout bounds a signing at the controller, and
// firstPeerCertificateWait how long a node's start waits for its first.
const (
	signTimeout              = 10 * time.Second
	firstPeerCertificateWait = 5 * time.Second
)

// nodeLink is a node's link; kept is the certificate the controller signs
// for it (nil where it has none), which the caller must keep running.
func (o Options) nodeLink(ctl grpc.ClientConnInterface) (_ *peerLink, kept *peerid.Kept, _ error) {
	if o.Peers.FromController {
		api := controllerv1.NewRegistryClient(ctl)
		kept = peerid.NewKept(peerid.Node(o.NodeID), func(ctx context.Context, csr []byte) (*peerid.Issued, error) {
			ctx, cancel := context.WithTimeout(ctx, signTimeout)
			defer cancel()
			resp, err := api.SignPeerCertificate(ctx, &controllerv1.SignPeerCertificateRequest{NodeId: o.NodeID, Request: csr})
			if err != nil {
				return nil, fmt.Errorf("asking the controller to sign this node's peer certificate: %w", err)
			}
			return &peerid.Issued{Certificate: resp.GetCertificate(), Authorities: resp.GetAuthorities()}, nil
		})
		return &peerLink{ids: kept}, kept, nil
	}
	shared, err := loadShared(o.Peers)
	return &peerLink{shared: shared}, nil, err
}

// controllerLink is the controller's link: its own certificate from the
// peer CA, which signs nodes' (signer; nil where it has no CA), or the one
// for all.
func (o Options) controllerLink() (_ *peerLink, signer *peerid.Signer, _ error) {
	if o.Peers.CACertFile != "" {
		signer, err := peerid.NewSigner(o.Peers.CACertFile, o.Peers.CAKeyFile, o.Peers.CertLifetime)
		if err != nil {
			return nil, nil, err
		}
		return &peerLink{ids: signer}, signer, nil
	}
	shared, err := loadShared(o.Peers)
	return &peerLink{shared: shared}, nil, err
}

// serverCreds are what a node's peer server serves with (nil: plaintext).
// Any node and the controller may call: what each may read is the
// holder's to decide, per request.
func (l *peerLink) serverCreds() credentials.TransportCredentials {
	switch {
	case l.ids != nil:
		return credentials.NewTLS(peerid.ServerConfig(l.ids, func(peerid.Identity) error { return nil }))
	case l.shared != nil:
		return credentials.NewTLS(tlsfiles.ServerConfig(l.shared.pair, l.shared.ca))
	}
	return nil
}

// expectNode accepts the node asked for; where none is named (a relay that
// a holder without identities named) any node, never the controller.
func expectNode(node string) func(peerid.Identity) error {
	return func(id peerid.Identity) error {
		if id.IsController() || (node != "" && id.Node != node) {
			want := "node " + node
			if node == "" {
				want = "a node"
			}
			return fmt.Errorf("%w: it is %s, not %s", peerid.ErrWrongPeer, id, want)
		}
		return nil
	}
}

// dialer reaches peers' --peer-address: over mutual TLS where the link has
// certificates (with identities, checking the peer is the node asked
// for), else in plaintext to loopback only. wait bounds a pull's calls.
func (l *peerLink) dialer(wait time.Duration) streamer.Dialer {
	return func(node, address string) (*streamer.Client, io.Closer, error) {
		var creds credentials.TransportCredentials
		switch {
		case l.ids != nil:
			creds = credentials.NewTLS(peerid.ClientConfigFor(l.ids, expectNode(node)))
		case l.shared != nil:
			creds = credentials.NewTLS(tlsfiles.ClientConfig(l.shared.pair, l.shared.ca, l.shared.serverName))
		default:
			if err := loopbackOnly(address); err != nil {
				// Plaintext stays on this machine, whoever named the address.
				return nil, nil, fmt.Errorf("peer %s: %w", address, err)
			}
			creds = insecure.NewCredentials()
		}
		conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(creds),
			grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: peerKeepalive, Timeout: peerKeepaliveTimeout}),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(streamer.MaxChunk)),
			grpc.WithInitialWindowSize(streamWindow), grpc.WithInitialConnWindowSize(streamWindow),
			grpc.WithReadBufferSize(streamBuffer), grpc.WithWriteBufferSize(streamBuffer))
		if err != nil {
			return nil, nil, err
		}
		return streamer.NewClient(conn, wait), conn, nil
	}
}

// mutualTLS names how the link authenticates, for the log.
func (l *peerLink) mutualTLS() string {
	switch {
	case l.ids != nil:
		return "identities"
	case l.shared != nil:
		return "shared"
	}
	return "none"
}

// peerCertificateExpiry tells when a node's peer certificate ends.
func peerCertificateExpiry(k *peerid.Kept) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "cowvol_peer_certificate_expiry_timestamp_seconds",
		Help: "When this node's peer certificate, which the controller signs, ends (Unix seconds; 0 before the node has one). " +
			"It is renewed half way through its life: one that ends within the hour has failed to renew, and when it ends the node " +
			"neither pulls from its peers nor serves them.",
	}, func() float64 {
		c, err := k.Certificate()
		if err != nil {
			return 0
		}
		return float64(c.Leaf.NotAfter.Unix())
	})
}
