package peerid

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/netlab"
)

// Once a renewed CA has settled, it signs; the old one is still named as
// an authority while it is valid.
func TestARenewedCASignsOnceSettled(t *testing.T) {
	dir := t.TempDir()
	pki := netlab.NewPKI(t, dir, "cowvol-peer")
	s, err := NewSigner(pki.CA, pki.CAKey, time.Hour)
	require.NoError(t, err)
	renewed := netlab.NewPKI(t, filepath.Join(dir, "renewed"), "cowvol-peer")
	for from, to := range map[string]string{renewed.CA: pki.CA, renewed.CAKey: pki.CAKey} {
		raw, err := os.ReadFile(from)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(to, raw, 0o600))
		later := time.Now().Add(time.Second)
		require.NoError(t, os.Chtimes(to, later, later))
	}
	key, err := NewKey()
	require.NoError(t, err)
	csr, err := Request(key)
	require.NoError(t, err)
	issuer := func() string {
		issued, err := s.Sign(csr, Node("n"))
		require.NoError(t, err)
		require.Len(t, issued.Authorities, 2)
		leaf, err := x509.ParseCertificate(issued.Certificate)
		require.NoError(t, err)
		return string(leaf.AuthorityKeyId)
	}
	before := issuer()
	s.mu.Lock()
	s.authorities[0].seen = time.Now().Add(-s.settle)
	newKeyID := string(s.authorities[0].cert.SubjectKeyId)
	s.mu.Unlock()
	require.NotEqual(t, newKeyID, before)
	require.Equal(t, newKeyID, issuer())
}
