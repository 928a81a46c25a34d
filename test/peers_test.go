package test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	peerv1 "github.com/concourse/cowvol/api/peer/v1"
	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/peerid"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/plugin"
)

// peerFleet is a controller in the test's namespace and node plugins, each
// a host of its own in a network namespace, authenticating each other with
// mutual TLS: each node with a certificate of its own that the controller
// signs with the fleet's peer CA.
type peerFleet struct {
	t         *testing.T
	lab       *netlab.Lab
	pki       netlab.PKI
	ctlAddr   string
	api       controllerv1.CacheClient
	registry  controllerv1.RegistryClient
	nodeToken string
	nodes     map[string]*peerNode
}

type peerNode struct {
	*env
	host     *netlab.Host
	peerAddr string
}

const peerPort = 7443

func startPeerFleet(t *testing.T) *peerFleet {
	t.Helper()
	testfs.Need(t)
	lab := netlab.New(t)
	dir := t.TempDir()
	f := &peerFleet{t: t, lab: lab, nodes: map[string]*peerNode{},
		pki:     netlab.NewPKI(t, filepath.Join(dir, "pki"), plugin.DefaultPeerServerName, lab.Self),
		ctlAddr: net.JoinHostPort(lab.Self, strconv.Itoa(plugintest.FreePort(t)))}
	tokens := filepath.Join(dir, "tokens")
	require.NoError(t, os.WriteFile(tokens, []byte("node-token-0123456789,system:cowvol-node,*\n"+
		otherTeamToken+",other-team,other\n"), 0o600))
	f.nodeToken = filepath.Join(dir, "node-token")
	require.NoError(t, os.WriteFile(f.nodeToken, []byte("node-token-0123456789\n"), 0o600))
	plugintest.Start(t, plugintest.Config{Mode: "controller", Args: []string{"--api-address=" + f.ctlAddr,
		"--tls-cert-file=" + f.pki.Cert, "--tls-key-file=" + f.pki.Key, "--tokens-file=" + tokens, "--stalled-after=3s",
		"--peer-ca-cert-file=" + f.pki.CA, "--peer-ca-key-file=" + f.pki.CAKey}})
	conn := f.dial("node-token-0123456789")
	f.api, f.registry = controllerv1.NewCacheClient(conn), controllerv1.NewRegistryClient(conn)
	return f
}

// otherTeamToken is a token of the fleet's controller that may read only
// namespace other.
const otherTeamToken = "other-token-0123456789"

// dial connects to the fleet's controller with a token.
func (f *peerFleet) dial(token string) *grpc.ClientConn {
	f.t.Helper()
	creds, err := credentials.NewClientTLSFromFile(f.pki.CA, "")
	require.NoError(f.t, err)
	conn, err := grpc.NewClient(f.ctlAddr, grpc.WithTransportCredentials(creds),
		grpc.WithPerRPCCredentials(client.Bearer{Token: token, Secure: true}))
	require.NoError(f.t, err)
	f.t.Cleanup(func() { conn.Close() })
	return conn
}

// node starts a node plugin on a host of its own, its state dir a fresh
// filesystem of kind and size.
func (f *peerFleet) node(name string, kind testfs.Kind, size int64, extra ...string) *peerNode {
	f.t.Helper()
	h := f.lab.Host(name)
	n := &peerNode{host: h, peerAddr: net.JoinHostPort(h.IP, strconv.Itoa(peerPort))}
	metrics := net.JoinHostPort(h.IP, "9090")
	args := append([]string{"--metrics-address=" + metrics, "--controller-address=" + f.ctlAddr,
		"--tls-ca-file=" + f.pki.CA, "--token-file=" + f.nodeToken, "--peer-address=" + n.peerAddr,
		"--peer-certificates-from-controller", "--pull-wait=1s", "--pull-mode=eager"}, extra...)
	n.env = &env{t: f.t, metrics: metrics, p: plugintest.Start(f.t, plugintest.Config{
		Backend: "overlay", NodeID: name, StateDir: testfs.Mount(f.t, kind, size), KubeletDir: kubeletDir(f.t),
		Args: args, Wrap: h.Command})}
	f.nodes[name] = n
	return n
}

// peerIdentity is a certificate for node, signed by the fleet's controller
// (the fleet's node token names no node: it may ask for any).
func (f *peerFleet) peerIdentity(node string) *peerid.Kept {
	f.t.Helper()
	k := peerid.NewKept(peerid.Node(node), func(ctx context.Context, csr []byte) (*peerid.Issued, error) {
		resp, err := f.registry.SignPeerCertificate(ctx, &controllerv1.SignPeerCertificateRequest{NodeId: node, Request: csr})
		if err != nil {
			return nil, err
		}
		return &peerid.Issued{Certificate: resp.GetCertificate(), Authorities: resp.GetAuthorities()}, nil
	})
	_, err := k.Renew(context.Background())
	require.NoError(f.t, err)
	return k
}

// presented is a certificate (nil: roots' own; empty: none) with roots'
// authorities.
type presented struct {
	cert  *tls.Certificate
	roots peerid.Credentials
}

func (p presented) Certificate() (*tls.Certificate, error) {
	if p.cert == nil {
		return p.roots.Certificate()
	}
	return p.cert, nil
}

func (p presented) Roots() (*x509.CertPool, error) { return p.roots.Roots() }

// holders waits until the controller says which nodes hold a volume ready,
// and returns them once they include want.
func (f *peerFleet) holders(ns, handle string, want ...string) []string {
	f.t.Helper()
	var nodes []string
	eventually(f.t, fmt.Sprintf("the controller to see %s/%s on %v", ns, handle, want), func() bool {
		resp, err := f.api.LookupVolumes(context.Background(), &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref(ns, handle)}})
		if err != nil {
			return false
		}
		nodes = resp.Volumes[0].Nodes
		for _, w := range want {
			if !slices.Contains(nodes, w) {
				return false
			}
		}
		return true
	})
	return nodes
}

// publishWaiting publishes v as the kubelet does, retrying while a pull is
// under way (the answer is Unavailable with the pull's progress), and
// returns the first other answer.
func (e *env) publishWaiting(v kubeletsim.InlineVolume) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		err := e.publish(v)
		if code(err) != codes.Unavailable || !strings.Contains(err.Error(), "is being pulled") || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// metricValue is a sample's value on the node's /metrics (0 if absent).
func metricValue(t *testing.T, e *env, sample string) float64 {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(scrape(t, e)))
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), sample+" "); ok {
			v, err := strconv.ParseFloat(rest, 64)
			require.NoError(t, err)
			return v
		}
	}
	return 0
}

// randomFile writes n bytes that do not compress.
func randomFile(t *testing.T, root, name string, n int, seed uint64) {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for k := range 8 {
			b[i+k] = byte(v >> (8 * k))
		}
	}
	require.NoError(t, os.WriteFile(filepath.Join(root, name), b, 0o644))
}

func fileDigest(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	h := sha256.New()
	_, err = io.Copy(h, f)
	require.NoError(t, err)
	return hex.EncodeToString(h.Sum(nil))
}

const servedOK = `cowvol_peer_layers_served_total{encoding="s2",result="ok"}`

// Node plugins on hosts of their own pull what they lack from each other:
// a volume captured on A is used on B (the same tree, and B's cached volume
// from then on), concurrent publishes make one pull, a child whose parent B
// holds brings only its own layer, a holder killed mid-stream is replaced
// by another, a full disk leaves nothing behind, and peers that are not
// the cluster's, or ask for another namespace's volume, get nothing.
func TestPullsBetweenNodes(t *testing.T) {
	f := startPeerFleet(t)
	a := f.node("node-a", testfs.XFS, 1<<30)
	b := f.node("node-b", testfs.XFS, 1<<30)

	var want testfs.Tree
	a.step("", "base", func(dir string) {
		testfs.LayerTree(t, dir)
		randomFile(t, dir, "random", 8<<20, 1)
	})
	a.read("base", func(dir string) { want = testfs.Describe(t, dir) })
	f.holders("ci", "base", "node-a")

	t.Run("a volume captured on A is published on B", func(t *testing.T) {
		v := b.volume(map[string]string{driver.AttrSource: "base"}, true)
		err := b.publishWaiting(v)
		require.NoError(t, err)
		require.Equal(t, want, testfs.Describe(t, v.Target), "the tree B mounts is A's")
		b.umount(v)
		got, err := b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "base")})
		require.NoError(t, err)
		require.Equal(t, "ready", got.State)
		// Ready before its data is written back (a reboot until then
		// fails it, to be pulled again); the sync round writes it.
		eventually(t, "the pulled volume synced", func() bool {
			got, err := b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "base")})
			return err == nil && got.Synced
		})
		require.Equal(t, "namespace", got.Scope)
		f.holders("ci", "base", "node-a", "node-b")
		// Each node's own certificate, from the controller: it ends a
		// day from now (the default lifetime), renewed half way.
		for _, n := range []*peerNode{a, b} {
			ends := metricValue(t, n.env, "cowvol_peer_certificate_expiry_timestamp_seconds")
			require.InDelta(t, float64(time.Now().Add(24*time.Hour).Unix()), ends, 600, "%s's peer certificate", n.p.NodeID)
		}
		require.Equal(t, 1.0, metricValue(t, a.env, servedOK))
		// From now on B uses its own copy.
		b.read("base", func(dir string) { require.Equal(t, want, testfs.Describe(t, dir)) })
		require.Equal(t, 1.0, metricValue(t, a.env, servedOK), "B's second use pulls nothing")
	})

	t.Run("concurrent publishes of one missing source make one pull", func(t *testing.T) {
		a.step("", "popular", func(dir string) { randomFile(t, dir, "r", 48<<20, 2) })
		f.holders("ci", "popular", "node-a")
		before := metricValue(t, a.env, servedOK)
		var wg sync.WaitGroup
		errs := make([]error, 4)
		vols := make([]kubeletsim.InlineVolume, 4)
		for i := range vols {
			vols[i] = b.volume(map[string]string{driver.AttrSource: "popular"}, true)
		}
		for i := range vols {
			wg.Add(1)
			go func() { defer wg.Done(); errs[i] = b.publishWaiting(vols[i]) }()
		}
		wg.Wait()
		for i, v := range vols {
			require.NoError(t, errs[i])
			b.umount(v)
		}
		require.Equal(t, before+1, metricValue(t, a.env, servedOK), "one layer crossed the wire")
	})

	t.Run("a child whose parent B holds sends only the child's layer", func(t *testing.T) {
		a.step("base", "child", func(dir string) { write(t, dir, "child-only", "small") })
		f.holders("ci", "child", "node-a")
		before := metricValue(t, a.env, servedOK)
		sentBefore := metricValue(t, a.env, `cowvol_peer_sent_bytes_total{encoding="s2"}`)
		v := b.volume(map[string]string{driver.AttrSource: "child"}, true)
		err := b.publishWaiting(v)
		require.NoError(t, err)
		require.Equal(t, "small", readFile(t, v.Target, "child-only"))
		require.Equal(t, fileDigestOf(t, a, "base", "random"), fileDigest(t, filepath.Join(v.Target, "random")))
		b.umount(v)
		require.Equal(t, before+1, metricValue(t, a.env, servedOK), "only the child's layer was sent")
		sent := metricValue(t, a.env, `cowvol_peer_sent_bytes_total{encoding="s2"}`) - sentBefore
		require.Less(t, sent, float64(64<<10), "the parent's 8 MiB stayed home")
		got, err := b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "child")})
		require.NoError(t, err)
		require.Equal(t, "base", got.GetBase().GetHandle(), "B's child stacks on B's own base")
	})

	t.Run("peers that are not the cluster's, or ask for another namespace, get nothing", func(t *testing.T) {
		a.captureIn("other", "private", nil)
		f.holders("other", "private", "node-a")
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		ask := func(creds credentials.TransportCredentials, ns, volNS, handle string) error {
			conn, err := grpc.NewClient(a.peerAddr, grpc.WithTransportCredentials(creds))
			require.NoError(t, err)
			defer conn.Close()
			_, err = peerv1.NewPeerClient(conn).GetChain(ctx, &peerv1.GetChainRequest{Namespace: ns,
				Volume: &peerv1.VolumeRef{Namespace: volNS, Handle: handle}})
			return err
		}
		// A node of the cluster proves its name with a certificate the
		// controller signed; the peer CA signed the one for all of old
		// (named by DNS) as well.
		node := f.peerIdentity("node-t")
		shared, err := tls.LoadX509KeyPair(f.pki.Cert, f.pki.Key)
		require.NoError(t, err)
		rogue := netlab.NewPKI(t, t.TempDir(), plugin.DefaultPeerServerName)
		rogueCert, err := tls.LoadX509KeyPair(rogue.Cert, rogue.Key)
		require.NoError(t, err)
		presenting := func(cert *tls.Certificate, want string) credentials.TransportCredentials {
			return credentials.NewTLS(peerid.ClientConfig(presented{cert: cert, roots: node}, peerid.Node(want)))
		}
		asPeer := presenting(nil, "node-a")
		require.Error(t, ask(insecure.NewCredentials(), "ci", "ci", "base"), "plaintext")
		require.Error(t, ask(presenting(&tls.Certificate{}, "node-a"), "ci", "ci", "base"), "no client certificate")
		require.Error(t, ask(presenting(&rogueCert, "node-a"), "ci", "ci", "base"), "a certificate of another CA")
		require.Error(t, ask(presenting(&shared, "node-a"), "ci", "ci", "base"), "a certificate the peer CA signed for no node")
		require.ErrorContains(t, ask(presenting(nil, "node-b"), "ci", "ci", "base"), peerid.ErrWrongPeer.Error(),
			"node-a where node-b was asked for")
		require.NoError(t, ask(asPeer, "ci", "ci", "base"), "a node of the cluster")

		private := ask(asPeer, "ci", "other", "private")
		missing := ask(asPeer, "ci", "other", "no-such-volume")
		require.Equal(t, codes.NotFound, code(private))
		require.Equal(t, codes.NotFound, code(missing))
		require.Equal(t, status.Convert(missing).Message(),
			strings.ReplaceAll(status.Convert(private).Message(), "private", "no-such-volume"),
			"another namespace's volume and a missing one look alike")
		require.NoError(t, ask(asPeer, "other", "other", "private"), "its own namespace may")

		// The node that holds it answers a publish naming it, by a pod of
		// another namespace, as it does one naming nothing: both ask the
		// peers, and both are refused alike.
		// So does a node that lacks it: it asks no holder that would not
		// serve it to that namespace.
		for _, n := range []*peerNode{a, b} {
			publishAs := func(handle string) error {
				return n.publish(n.volumeIn("ci", map[string]string{driver.AttrSource: handle, driver.AttrSourceNamespace: "other"}, true))
			}
			private, missing := publishAs("private"), publishAs("no-such-volume")
			require.Equal(t, codes.NotFound, code(private))
			require.Equal(t, status.Convert(missing).Message(),
				strings.ReplaceAll(status.Convert(private).Message(), "private", "no-such-volume"),
				"%s tells another namespace's volume from a missing one", n.p.NodeID)
		}

		// A lazy puller's requests are answered as the pull's are: ci may
		// not read other's private volume's files, alone, nor through a
		// volume of its own.
		read := func(ns string, vol, via *peerv1.VolumeRef, path string) error {
			conn, err := grpc.NewClient(a.peerAddr, grpc.WithTransportCredentials(asPeer))
			require.NoError(t, err)
			defer conn.Close()
			api := peerv1.NewPeerClient(conn)
			file, err := api.ReadLayerFile(ctx, &peerv1.ReadLayerFileRequest{Namespace: ns, Volume: vol, Via: via, Path: path, Length: 10})
			if err == nil {
				_, err = file.Recv()
			}
			if err != nil {
				return err
			}
			files, err := api.PullLayer(ctx, &peerv1.PullLayerRequest{Namespace: ns, Volume: vol, Via: via, Files: []string{path}, Encoding: "raw"})
			if err == nil {
				_, err = files.Recv()
			}
			return err
		}
		ciBase := &peerv1.VolumeRef{Namespace: "ci", Handle: "base"}
		otherPrivate := &peerv1.VolumeRef{Namespace: "other", Handle: "private"}
		require.NoError(t, read("ci", ciBase, nil, "random"), "a file of its own namespace's volume")
		require.Equal(t, codes.NotFound, code(read("ci", otherPrivate, nil, "random")))
		require.Equal(t, codes.NotFound, code(read("ci", otherPrivate, ciBase, "random")), "via a volume it does not stack on")
		require.Equal(t, codes.InvalidArgument, code(read("ci", ciBase, nil, "../private/random")), "a path out of the layer")

		// A read order only orders a stream of the whole layer's data,
		// bounded; names that are not its files are skipped. Records are
		// a stub tree's form, of nothing else.
		ordered := func(req *peerv1.PullLayerRequest) error {
			conn, err := grpc.NewClient(a.peerAddr, grpc.WithTransportCredentials(asPeer))
			require.NoError(t, err)
			defer conn.Close()
			req.Namespace, req.Volume, req.Encoding = "ci", ciBase, "raw"
			stream, err := peerv1.NewPeerClient(conn).PullLayer(ctx, req)
			for err == nil {
				_, err = stream.Recv()
			}
			return err
		}
		require.ErrorIs(t, ordered(&peerv1.PullLayerRequest{First: []string{"nope", "random", "random"}}), io.EOF)
		require.ErrorIs(t, ordered(&peerv1.PullLayerRequest{First: []string{"random"}, DataOnly: true}), io.EOF)
		for name, req := range map[string]*peerv1.PullLayerRequest{
			"with stubs":       {First: []string{"random"}, Stubs: true},
			"with files":       {First: []string{"random"}, Files: []string{"random"}},
			"out of the layer": {First: []string{"../private/random"}},
			"too many":         {First: make([]string, 50_001)},
			"data of stubs":    {Stubs: true, DataOnly: true},
			"records of data":  {Records: true},
			"records of files": {Records: true, Files: []string{"random"}},
		} {
			require.Equal(t, codes.InvalidArgument, code(ordered(req)), name)
		}

		// Through a publish: B asks A for ci's pod, A refuses, B says not found.
		v := b.volumeIn("ci", map[string]string{driver.AttrSource: "private", driver.AttrSourceNamespace: "other"}, true)
		err = b.publishWaiting(v)
		require.Equal(t, codes.NotFound, code(err), "%v", err)
		_, err = b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("other", "private")})
		require.Equal(t, codes.NotFound, code(err), "nothing of it reached B")

		// other shares a volume stacked on its private one: ci's pod on B
		// mounts the whole chain, as it would on A; the private layer comes
		// only through the shared one, and B never names it to ci.
		top := a.volumeIn("other", map[string]string{driver.AttrSource: "private", driver.AttrCapture: "shared-top",
			driver.AttrScope: "cluster"}, false)
		require.NoError(t, a.publish(top))
		write(t, top.Target, "top", "shared")
		a.umount(top)
		f.holders("other", "shared-top", "node-a")
		v = b.volumeIn("ci", map[string]string{driver.AttrSource: "shared-top", driver.AttrSourceNamespace: "other"}, true)
		require.NoError(t, b.publishWaiting(v))
		require.Equal(t, "shared", readFile(t, v.Target, "top"))
		require.Equal(t, "other/private", readFile(t, v.Target, "file"), "the private layer under it, merged")
		b.umount(v)
		v = b.volumeIn("ci", map[string]string{driver.AttrSource: "private", driver.AttrSourceNamespace: "other"}, true)
		err = b.publishWaiting(v)
		require.Equal(t, codes.NotFound, code(err), "B holds it now, and still serves it to ci only merged: %v", err)
		pull := func(via *peerv1.VolumeRef) error {
			conn, err := grpc.NewClient(a.peerAddr, grpc.WithTransportCredentials(asPeer))
			require.NoError(t, err)
			defer conn.Close()
			stream, err := peerv1.NewPeerClient(conn).PullLayer(ctx, &peerv1.PullLayerRequest{Namespace: "ci",
				Volume: &peerv1.VolumeRef{Namespace: "other", Handle: "private"}, Via: via, Encoding: "raw"})
			require.NoError(t, err)
			for {
				if _, err := stream.Recv(); err != nil {
					return err
				}
			}
		}
		require.ErrorIs(t, pull(&peerv1.VolumeRef{Namespace: "other", Handle: "shared-top"}), io.EOF, "through the shared volume")
		require.Equal(t, codes.NotFound, code(pull(nil)), "alone")
		require.Equal(t, codes.NotFound, code(pull(&peerv1.VolumeRef{Namespace: "ci", Handle: "base"})), "through a volume not on it")
	})

	t.Run("a full disk fails the pull and leaves nothing", func(t *testing.T) {
		small := f.node("node-small", testfs.Ext4, 40<<20)
		v := small.volume(map[string]string{driver.AttrSource: "popular"}, true)
		err := small.publishWaiting(v)
		require.Equal(t, codes.Unavailable, code(err), "%v", err)
		require.Contains(t, err.Error(), "no space left on device")
		_, err = small.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "popular")})
		require.Equal(t, codes.NotFound, code(err), "no partial cached volume")
		staged, err := os.ReadDir(filepath.Join(small.p.StateDir, "staging"))
		require.NoError(t, err)
		require.Empty(t, staged)
		leftover, _ := os.ReadDir(filepath.Join(small.p.StateDir, "volumes", "ci"))
		require.Empty(t, leftover)
		err = small.publishWaiting(v)
		require.Contains(t, err.Error(), "retry after", "the handle backs off as failed volumes do")
	})

	t.Run("a holder killed mid-stream is replaced by another", func(t *testing.T) {
		c := f.node("node-c", testfs.XFS, 1<<30)
		a.step("", "large", func(dir string) { randomFile(t, dir, "r", 64<<20, 3) })
		wantDigest := fileDigestOf(t, a, "large", "r")
		cv := c.volume(map[string]string{driver.AttrSource: "large"}, true)
		f.holders("ci", "large", "node-a")
		err := c.publishWaiting(cv)
		require.NoError(t, err)
		c.umount(cv)
		f.holders("ci", "large", "node-a", "node-c")

		servedBefore := map[string]float64{"node-a": metricValue(t, a.env, servedOK), "node-c": metricValue(t, c.env, servedOK)}
		d := f.node("node-d", testfs.XFS, 1<<30)
		d.host.Throttle("100mbit") // 64 MiB takes some 5 s: time to kill the sender
		v := d.volume(map[string]string{driver.AttrSource: "large"}, true)
		var from string
		eventually(t, "the pull to be under way", func() bool {
			err := d.publish(v)
			msg := status.Convert(err).Message()
			if code(err) != codes.Unavailable || strings.Contains(msg, " 0.0 MiB received") {
				return false
			}
			_, rest, _ := strings.Cut(msg, "from node ")
			from, _, _ = strings.Cut(rest, ":")
			return from != ""
		})
		require.Contains(t, []string{"node-a", "node-c"}, from)
		f.nodes[from].p.Kill()
		err = d.publishWaiting(v)
		require.NoError(t, err, "the other holder delivers")
		other := map[string]string{"node-a": "node-c", "node-c": "node-a"}[from]
		require.Equal(t, servedBefore[other]+1, metricValue(t, f.nodes[other].env, servedOK),
			"%s sent the volume after %s died mid-stream", other, from)
		require.Equal(t, wantDigest, fileDigest(t, filepath.Join(v.Target, "r")))
		d.umount(v)
	})
}

// fileDigestOf reads a file of a volume on a node.
func fileDigestOf(t *testing.T, n *peerNode, handle, name string) string {
	t.Helper()
	var sum string
	n.read(handle, func(dir string) { sum = fileDigest(t, filepath.Join(dir, name)) })
	return sum
}

// tcpProxy accepts TCP connections and hands each, with one dialled to
// addr, to relay, which copies between them as it likes.
func tcpProxy(t *testing.T, addr string, relay func(in, out net.Conn)) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { lis.Close() })
	go func() {
		for {
			in, err := lis.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", addr)
			if err != nil {
				in.Close()
				continue
			}
			go relay(in, out)
		}
	}()
	return lis.Addr().String()
}

// corruptingProxy forwards TCP to addr, flipping one byte of what comes
// back after the first occurrence of marker past skip bytes.
func corruptingProxy(t *testing.T, addr string, marker []byte, skip int) string {
	return tcpProxy(t, addr, func(in, out net.Conn) {
		go func() { _, _ = io.Copy(out, in); out.Close() }()
		defer in.Close()
		buf := make([]byte, 64<<10)
		seen, flipped := 0, false
		for {
			n, err := out.Read(buf)
			if n > 0 {
				if i := bytes.Index(buf[:n], marker); !flipped && seen+n > skip && i >= 0 {
					buf[i+len(marker)/2] ^= 0xff
					flipped = true
				}
				seen += n
				if _, werr := in.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	})
}

// A byte changed in transit is caught by the digest: nothing becomes ready
// and the handle backs off. (Plaintext on loopback, so that the change
// reaches the data: TLS would refuse it one layer down.)
func TestCorruptStreamIsDetected(t *testing.T) {
	testfs.Need(t)
	peerAddr := plugintest.FreeAddr(t)
	a := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
		Args: []string{"--peer-address=" + peerAddr}})
	marker := bytes.Repeat([]byte("cowvol-corrupt-me."), 64)
	a.step("", "victim", func(dir string) {
		require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), bytes.Repeat(marker, 8<<10), 0o644))
	})
	proxy := corruptingProxy(t, peerAddr, marker, 1<<20)
	b := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-b", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
		Args: []string{"--peers=node-a=" + proxy, "--stream-encoding=raw", "--pull-wait=1s", "--pull-mode=eager"}})
	v := b.volume(map[string]string{driver.AttrSource: "victim"}, true)
	err := b.publishWaiting(v)
	require.Equal(t, codes.Unavailable, code(err), "%v", err)
	require.Contains(t, err.Error(), "arrived corrupt")
	_, err = b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "victim")})
	require.Equal(t, codes.NotFound, code(err), "nothing became ready")
	staged, err := os.ReadDir(filepath.Join(b.p.StateDir, "staging"))
	require.NoError(t, err)
	require.Empty(t, staged)
}

// A pulling node killed between the steps of a pull comes back with
// nothing half-pulled visible and nothing left behind, and the kubelet's
// retry pulls again.
func TestPullCrashPoints(t *testing.T) {
	testfs.Need(t)
	peerAddr := plugintest.FreeAddr(t)
	a := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", Args: []string{"--peer-address=" + peerAddr}})
	a.step("", "src", func(dir string) { testfs.LayerTree(t, dir) })
	var want testfs.Tree
	a.read("src", func(dir string) { want = testfs.Describe(t, dir) })
	for _, form := range pullForms {
		for _, point := range []string{"pull-extracted", "pull-renamed"} {
			t.Run(form.name+" "+point, func(t *testing.T) { pullCrashPoint(t, peerAddr, want, form, point) })
		}
	}
}

func pullCrashPoint(t *testing.T, peerAddr string, want testfs.Tree, form pullForm, point string) {
	b := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-b",
		Args: append([]string{"--peers=node-a=" + peerAddr, "--pull-wait=1s"}, form.args()...)})
	form.require(t, b)
	b.p.Restart("COWVOL_CRASH_AT=" + point)
	v := b.volume(map[string]string{driver.AttrSource: "src"}, true)
	require.Error(t, b.publishWaiting(v), "the plugin dies in the pull")
	require.NoError(t, b.p.Wait(10*time.Second), "the plugin stopped at the crash point")
	b.p.Restart()
	_, err := b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "src")})
	require.Equal(t, codes.NotFound, code(err), "the half-pulled volume was dropped")
	leftover, _ := os.ReadDir(filepath.Join(b.p.StateDir, "volumes", "ci"))
	require.Empty(t, leftover)
	require.NoError(t, b.publishWaiting(v), "the retry pulls again")
	require.Equal(t, want, testfs.Describe(t, v.Target))
	b.umount(v)
	form.settled(t, b)
	b.noLeaks(t)
}
