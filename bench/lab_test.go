package bench

import (
	"net"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/plugin"
)

// peerTLS are the flags of one peer certificate for all of a bench's
// nodes (mutual TLS between them).
func peerTLS(b *testing.B) []string {
	pki := netlab.NewPKI(b, filepath.Join(b.TempDir(), "pki"), plugin.DefaultPeerServerName)
	return []string{"--peer-tls-cert-file=" + pki.Cert, "--peer-tls-key-file=" + pki.Key, "--peer-ca-file=" + pki.CA}
}

// benchNodeToken is the token the bench controller's nodes present.
const benchNodeToken = "bench-node-token-0123456789"

// benchController is a controller on a lab's network, over TLS with a node
// token: the nodes given nodeArgs report to it, find holders and caches'
// versions and share read orders through it.
type benchController struct {
	p        *plugintest.Plugin
	addr, ca string
	nodeArgs []string
}

func startController(b *testing.B, lab *netlab.Lab) benchController {
	addr := net.JoinHostPort(lab.Self, strings.Split(plugintest.FreeAddr(b), ":")[1])
	pki := netlab.NewPKI(b, filepath.Join(b.TempDir(), "ctl-pki"), "cowvol-controller", lab.Self)
	tokens, nodeToken := filepath.Join(b.TempDir(), "tokens"), filepath.Join(b.TempDir(), "node-token")
	writeFile(b, tokens, benchNodeToken+",system:cowvol-node,*\n")
	writeFile(b, nodeToken, benchNodeToken+"\n")
	p := plugintest.Start(b, plugintest.Config{Mode: "controller", Args: []string{"--api-address=" + addr,
		"--tls-cert-file=" + pki.Cert, "--tls-key-file=" + pki.Key, "--tokens-file=" + tokens}})
	return benchController{p: p, addr: addr, ca: pki.CA,
		nodeArgs: []string{"--controller-address=" + addr, "--tls-ca-file=" + pki.CA, "--token-file=" + nodeToken}}
}

// api is the controller's Cache API, as a node calls it.
func (c benchController) api(b *testing.B) controllerv1.CacheClient {
	creds, err := credentials.NewClientTLSFromFile(c.ca, "")
	if err != nil {
		b.Fatal(err)
	}
	conn, err := grpc.NewClient(c.addr, grpc.WithTransportCredentials(creds),
		grpc.WithPerRPCCredentials(client.Bearer{Token: benchNodeToken, Secure: true}))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	return controllerv1.NewCacheClient(conn)
}

// cachePair is a holder A and the nodes that lack its caches, on hosts of
// their own joined by veths, with mutual TLS between them and a controller
// they find caches' versions through.
type cachePair struct {
	b            *testing.B
	hostA, hostB *netlab.Host
	tlsArgs      []string
	ctl          benchController
	api          controllerv1.CacheClient
}

func startCachePair(b *testing.B) *cachePair {
	lab := netlab.New(b)
	p := &cachePair{b: b, hostA: lab.Host("a"), hostB: lab.Host("b"), tlsArgs: peerTLS(b), ctl: startController(b, lab)}
	p.api = p.ctl.api(b)
	return p
}

// nodeA starts A, which serves its volumes to peers, on stateDir.
func (p *cachePair) nodeA(stateDir string) *node {
	return &node{b: p.b, p: plugintest.Start(p.b, plugintest.Config{Backend: "overlay", NodeID: "a", StateDir: stateDir, Wrap: p.hostA.Command,
		Args: slices.Concat([]string{"--peer-address=" + net.JoinHostPort(p.hostA.IP, "7443")}, p.tlsArgs, p.ctl.nodeArgs)})}
}

// nodeB starts a node named id on B's host, on stateDir, pulling in mode.
func (p *cachePair) nodeB(id, stateDir, mode string, args ...string) *node {
	return &node{b: p.b, p: plugintest.Start(p.b, plugintest.Config{Backend: "overlay", NodeID: id, StateDir: stateDir, Wrap: p.hostB.Command,
		Args: slices.Concat([]string{"--pull-mode=" + mode, "--pull-wait=30m"}, args, p.tlsArgs, p.ctl.nodeArgs)})}
}
