package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/netlab"
)

// replace puts src's content at dst by a rename, as the kubelet swaps a
// Secret's files.
func replace(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	require.NoError(t, err)
	tmp := dst + ".new"
	require.NoError(t, os.WriteFile(tmp, b, 0o600))
	require.NoError(t, os.Rename(tmp, dst))
}

func leaf(t *testing.T, certFile string) []byte {
	t.Helper()
	b, err := os.ReadFile(certFile)
	require.NoError(t, err)
	block, _ := pem.Decode(b)
	return block.Bytes
}

// handshake connects a client presenting client (may be nil) and trusting
// roots to a server with cfg, and returns the server's certificate.
func handshake(t *testing.T, cfg *tls.Config, roots *x509.CertPool, client *tls.Certificate) ([]byte, error) {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			_ = c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()
	cc := &tls.Config{RootCAs: roots, ServerName: "cowvol-peer", MinVersion: tls.VersionTLS13}
	if client != nil {
		cc.Certificates = []tls.Certificate{*client}
	}
	conn, err := tls.Dial("tcp", ln.Addr().String(), cc)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	// TLS 1.3 reports a refused client certificate on the first read.
	if _, err := conn.Read(make([]byte, 1)); err != nil && client != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return conn.ConnectionState().PeerCertificates[0].Raw, nil
}

func TestServedFilesAreReadAgainWhenTheyChange(t *testing.T) {
	dir := t.TempDir()
	one := netlab.NewPKI(t, filepath.Join(dir, "one"), "cowvol-peer")
	two := netlab.NewPKI(t, filepath.Join(dir, "two"), "cowvol-peer")
	live := filepath.Join(dir, "live")
	require.NoError(t, os.MkdirAll(live, 0o700))
	cert, key, ca := filepath.Join(live, "tls.crt"), filepath.Join(live, "tls.key"), filepath.Join(live, "ca.crt")
	replace(t, one.Cert, cert)
	replace(t, one.Key, key)
	replace(t, one.CA, ca)
	pair, err := NewKeyPair(cert, key)
	require.NoError(t, err)
	clientCA, err := NewCA(ca)
	require.NoError(t, err)
	cfg := ServerConfig(pair, clientCA)

	roots := x509.NewCertPool()
	for _, p := range []netlab.PKI{one, two} {
		b, err := os.ReadFile(p.CA)
		require.NoError(t, err)
		roots.AppendCertsFromPEM(b)
	}
	clientOne, err := tls.LoadX509KeyPair(one.Cert, one.Key)
	require.NoError(t, err)

	got, err := handshake(t, cfg, roots, &clientOne)
	require.NoError(t, err)
	require.Equal(t, leaf(t, one.Cert), got)

	// Renewed: the next handshake serves the new pair, and checks clients
	// against the new CA.
	replace(t, two.Cert, cert)
	replace(t, two.Key, key)
	replace(t, two.CA, ca)
	_, err = handshake(t, cfg, roots, &clientOne)
	require.Error(t, err, "a client certificate of the CA replaced is refused")
	clientTwo, err := tls.LoadX509KeyPair(two.Cert, two.Key)
	require.NoError(t, err)
	got, err = handshake(t, cfg, roots, &clientTwo)
	require.NoError(t, err)
	require.Equal(t, leaf(t, two.Cert), got)

	// Caught halfway through a swap: the last good pair serves on.
	require.NoError(t, os.WriteFile(cert, []byte("not a certificate"), 0o600))
	got, err = handshake(t, cfg, roots, &clientTwo)
	require.NoError(t, err)
	require.Equal(t, leaf(t, two.Cert), got)
}

func TestMissingOrBadFilesAreRefusedAtStart(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad")
	require.NoError(t, os.WriteFile(bad, []byte("junk"), 0o600))
	_, err := NewKeyPair(filepath.Join(dir, "missing.crt"), bad)
	require.Error(t, err)
	_, err = NewCA(bad)
	require.ErrorContains(t, err, "holds no certificate")
}
