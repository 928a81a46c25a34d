package peerid_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/peerid"
)

func newSigner(t *testing.T, dir string) (*peerid.Signer, netlab.PKI) {
	t.Helper()
	pki := netlab.NewPKI(t, dir, "cowvol-peer")
	s, err := peerid.NewSigner(pki.CA, pki.CAKey, time.Hour)
	require.NoError(t, err)
	return s, pki
}

// kept is a node's certificate, signed by s.
func kept(t *testing.T, s *peerid.Signer, node string) *peerid.Kept {
	t.Helper()
	k := peerid.NewKept(peerid.Node(node), func(_ context.Context, csr []byte) (*peerid.Issued, error) {
		return s.Sign(csr, peerid.Node(node))
	})
	_, err := k.Renew(context.Background())
	require.NoError(t, err)
	return k
}

// handshake runs one TLS handshake between a server and a client config
// on loopback, and answers the client's and the server's errors.
func handshake(server, client *tls.Config) (clientErr, serverErr error) {
	l, err := tls.Listen("tcp", "127.0.0.1:0", server)
	if err != nil {
		return err, err
	}
	defer l.Close()
	done := make(chan error, 1)
	go func() {
		conn, err := l.Accept()
		if err == nil {
			// TLS 1.3 checks the client's certificate after the client's
			// handshake has returned: the server's handshake says.
			err = conn.(*tls.Conn).Handshake()
			conn.Close()
		}
		done <- err
	}()
	c, clientErr := tls.Dial("tcp", l.Addr().String(), client)
	if clientErr == nil {
		c.Close()
	}
	return clientErr, <-done
}

// mixed presents cert's certificate and trusts roots' authorities.
type mixed struct{ cert, roots peerid.Credentials }

func (m mixed) Certificate() (*tls.Certificate, error) { return m.cert.Certificate() }
func (m mixed) Roots() (*x509.CertPool, error)         { return m.roots.Roots() }

func anyNode(id peerid.Identity) error {
	if id.IsController() {
		return peerid.ErrWrongPeer
	}
	return nil
}

func TestPeersProveTheirNode(t *testing.T) {
	s, _ := newSigner(t, t.TempDir())
	a, b := kept(t, s, "node-a"), kept(t, s, "node-b")
	other, _ := newSigner(t, t.TempDir())
	stranger := kept(t, other, "node-b")

	for _, tc := range []struct {
		name       string
		server     peerid.Credentials
		accept     func(peerid.Identity) error
		client     peerid.Credentials
		want       peerid.Identity
		clientFail bool
		serverFail bool
	}{
		{name: "the node asked for", server: b, accept: anyNode, client: a, want: peerid.Node("node-b")},
		{name: "another node than the one asked for", server: b, accept: anyNode, client: a, want: peerid.Node("node-c"), clientFail: true},
		{name: "a server under another CA naming the node", server: stranger, accept: anyNode, client: a, want: peerid.Node("node-b"), clientFail: true},
		{name: "a client under another CA", server: b, accept: anyNode, client: mixed{cert: stranger, roots: b}, want: peerid.Node("node-b"), serverFail: true},
		{name: "the controller as a client", server: b, accept: anyNode, client: s, want: peerid.Node("node-b"), serverFail: true},
		{name: "the controller where it is taken", server: b, accept: func(peerid.Identity) error { return nil }, client: s, want: peerid.Node("node-b")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cerr, serr := handshake(peerid.ServerConfig(tc.server, tc.accept), peerid.ClientConfig(tc.client, tc.want))
			if tc.clientFail {
				require.Error(t, cerr)
				return
			}
			require.NoError(t, cerr)
			if tc.serverFail {
				require.Error(t, serr)
			} else {
				require.NoError(t, serr)
			}
		})
	}
}

// A certificate the CA signed for another use (the shared peer certificate
// of old, named by DNS) proves no node.
func TestACertificateWithoutAnIdentityProvesNone(t *testing.T) {
	s, pki := newSigner(t, t.TempDir())
	b := kept(t, s, "node-b")
	shared, err := tls.LoadX509KeyPair(pki.Cert, pki.Key)
	require.NoError(t, err)
	_, serr := handshake(peerid.ServerConfig(b, anyNode), &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true, //nolint:gosec // the server is not under test
		Certificates: []tls.Certificate{shared}})
	require.ErrorIs(t, serr, peerid.ErrNotAPeer)
}

func TestSignTakesOnlyWellFormedRequests(t *testing.T) {
	s, _ := newSigner(t, t.TempDir())
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	rsaCSR, err := peerid.Request(rsaKey)
	require.NoError(t, err)
	key, err := peerid.NewKey()
	require.NoError(t, err)
	// A request that asks for names of its own: they are not given.
	asks, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{DNSNames: []string{"cowvol-peer"},
		URIs: []*url.URL{peerid.Node("node-x").URI(), peerid.Controller.URI()}}, key)
	require.NoError(t, err)
	tampered := append([]byte{}, asks...)
	tampered[len(tampered)-5] ^= 1

	for _, tc := range []struct {
		name    string
		csr     []byte
		wantErr bool
	}{
		{name: "garbage", csr: []byte("not a request"), wantErr: true},
		{name: "too big", csr: make([]byte, peerid.MaxRequest+1), wantErr: true},
		{name: "an RSA key", csr: rsaCSR, wantErr: true},
		{name: "a broken signature", csr: tampered, wantErr: true},
		{name: "names of its own", csr: asks},
	} {
		t.Run(tc.name, func(t *testing.T) {
			issued, err := s.Sign(tc.csr, peerid.Node("node-a"))
			if tc.wantErr {
				require.ErrorIs(t, err, peerid.ErrBadRequest)
				return
			}
			require.NoError(t, err)
			cert, err := x509.ParseCertificate(issued.Certificate)
			require.NoError(t, err)
			id, err := peerid.Of(cert)
			require.NoError(t, err)
			assert.Equal(t, peerid.Node("node-a"), id)
			assert.Empty(t, cert.DNSNames)
			assert.True(t, cert.PublicKey.(*ecdsa.PublicKey).Equal(key.Public()))
			assert.LessOrEqual(t, time.Until(cert.NotAfter), time.Hour)
		})
	}
}

func TestSignerNeedsACA(t *testing.T) {
	pki := netlab.NewPKI(t, t.TempDir(), "cowvol-peer")
	_, err := peerid.NewSigner(pki.Cert, pki.Key, time.Hour) // a leaf, not a CA
	require.ErrorContains(t, err, "not a CA")
	_, err = peerid.NewSigner(pki.CA, pki.CAKey, time.Minute)
	require.ErrorContains(t, err, "lifetime")
}

// A CA renewed under the controller: nodes keep getting certificates from
// the old one, and learn the new one beside it, until all have renewed.
func TestARenewedCASignsOnlyOnceNodesKnowIt(t *testing.T) {
	dir := t.TempDir()
	s, pki := newSigner(t, dir)
	old := kept(t, s, "node-a")
	renewed := netlab.NewPKI(t, filepath.Join(dir, "renewed"), "cowvol-peer")
	replaceCA(t, pki, renewed)
	fresh := kept(t, s, "node-b")
	for _, pair := range [][2]*peerid.Kept{{old, fresh}, {fresh, old}} {
		cerr, serr := handshake(peerid.ServerConfig(pair[0], anyNode), peerid.ClientConfig(pair[1], identityOf(t, pair[0])))
		require.NoError(t, cerr, "a node that has not renewed since the CA changed and one that has")
		require.NoError(t, serr)
	}
	c, err := fresh.Certificate()
	require.NoError(t, err)
	roots := x509.NewCertPool()
	raw, err := os.ReadFile(renewed.CA)
	require.NoError(t, err)
	require.True(t, roots.AppendCertsFromPEM(raw))
	_, err = c.Leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	require.Error(t, err, "signed by the old CA while nodes may not know the new one")
}

// replaceCA puts next's CA in place of pki's, as a renewed Secret does.
func replaceCA(t *testing.T, pki, next netlab.PKI) {
	t.Helper()
	for from, to := range map[string]string{next.CA: pki.CA, next.CAKey: pki.CAKey} {
		raw, err := os.ReadFile(from)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(to+".new", raw, 0o600))
		require.NoError(t, os.Rename(to+".new", to))
		// The files' stamp is their size and mtime: make sure it moves.
		later := time.Now().Add(time.Second)
		require.NoError(t, os.Chtimes(to, later, later))
	}
}

func identityOf(t *testing.T, k *peerid.Kept) peerid.Identity {
	t.Helper()
	c, err := k.Certificate()
	require.NoError(t, err)
	id, err := peerid.Of(c.Leaf)
	require.NoError(t, err)
	return id
}

func TestIdentityOfACertificate(t *testing.T) {
	for _, tc := range []struct {
		uris    []string
		want    peerid.Identity
		wantErr bool
	}{
		{uris: []string{"spiffe://cowvol/node/ip-10-0-0-1.ec2.internal"}, want: peerid.Node("ip-10-0-0-1.ec2.internal")},
		{uris: []string{"spiffe://cowvol/controller"}, want: peerid.Controller},
		{uris: nil, wantErr: true},
		{uris: []string{"spiffe://cowvol/node/a", "spiffe://cowvol/node/b"}, wantErr: true},
		{uris: []string{"spiffe://other/node/a"}, wantErr: true},
		{uris: []string{"spiffe://cowvol/node/"}, wantErr: true},
		{uris: []string{"spiffe://cowvol/node/a/../b"}, wantErr: true},
		{uris: []string{"spiffe://cowvol/node/UPPER"}, wantErr: true},
		{uris: []string{"spiffe://cowvol/controller?x=1"}, wantErr: true},
	} {
		cert := &x509.Certificate{}
		for _, u := range tc.uris {
			parsed, err := url.Parse(u)
			require.NoError(t, err)
			cert.URIs = append(cert.URIs, parsed)
		}
		id, err := peerid.Of(cert)
		if tc.wantErr {
			assert.ErrorIs(t, err, peerid.ErrNotAPeer, "%v", tc.uris)
			continue
		}
		require.NoError(t, err, "%v", tc.uris)
		assert.Equal(t, tc.want, id)
	}
}
