package peerid

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"sync"
	"time"

	"github.com/concourse/cowvol/internal/tlsfiles"
)

// Issued is a certificate the signer made, and the authorities a peer's
// must chain to (the peer CA as it is now, and as it was before within
// this process while that one is still valid: a CA renewed while nodes
// hold certificates from the old one).
type Issued struct {
	Certificate []byte   // DER
	Authorities [][]byte // DER, the current first
}

// ErrBadRequest says a signing request is not one the signer takes.
var ErrBadRequest = errors.New("a signing request the peer CA does not take")

// MaxRequest bounds a signing request's size (bytes): a P-256 request is
// about 250.
const MaxRequest = 4 << 10

// MinLifetime is the shortest life a peer certificate may be given: nodes
// renew half way, and a renewal may be retried for minutes.
const MinLifetime = 10 * time.Minute

// clockSkew backdates what is signed, for peers whose clocks run behind.
const clockSkew = time.Minute

// Signer signs peer certificates with the deployment's peer CA, read from
// its files at each signing.
//
// A CA renewed in its files (a new key, as cert-manager's rotationPolicy
// Always makes) is not used at once: a node knows the authorities it was
// told when it last renewed, and would refuse the new CA's certificates.
// The signer names both to every node from then on and keeps signing with
// the old one (its key kept in memory) until every node has renewed since
// (settle: half a lifetime, and a margin for retries), or the old one
// expires. A controller restarted meanwhile knows only the new one.
type Signer struct {
	ca       *tlsfiles.KeyPair
	lifetime time.Duration
	settle   time.Duration

	mu sync.Mutex
	// authorities are the CAs loaded so far, the newest first; self is
	// the controller's own certificate.
	authorities []authority
	roots       *x509.CertPool // of authorities; nil: to be made again
	self        *tls.Certificate
	selfRenew   time.Time
}

// authority is a CA the signer has loaded, since seen.
type authority struct {
	cert *x509.Certificate
	key  crypto.Signer
	seen time.Time
}

// settleMargin is how much longer than half a lifetime a renewed CA waits
// before it signs: a node's renewal may be retried for that long.
const settleMargin = 5 * time.Minute

// NewSigner loads the peer CA from certFile and keyFile, failing if it is
// not a CA that may sign certificates. Certificates live for lifetime.
func NewSigner(certFile, keyFile string, lifetime time.Duration) (*Signer, error) {
	if lifetime < MinLifetime {
		return nil, fmt.Errorf("a peer certificate lifetime of %s: want at least %s", lifetime, MinLifetime)
	}
	pair, err := tlsfiles.NewKeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("loading the peer CA: %w", err)
	}
	s := &Signer{ca: pair, lifetime: lifetime, settle: lifetime/2 + settleMargin}
	if _, _, err := s.current(); err != nil {
		return nil, err
	}
	return s, nil
}

// current loads the CA as its files are now among the authorities, and
// answers the one that signs.
func (s *Signer) current() (*x509.Certificate, crypto.Signer, error) {
	pair := s.ca.Certificate() // the files are read again only when they change
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	// A handshake asks for the roots: the CA is parsed and checked once
	// per change of its files, not at each.
	if len(s.authorities) == 0 || !bytes.Equal(s.authorities[0].cert.Raw, pair.Certificate[0]) {
		ca, err := x509.ParseCertificate(pair.Certificate[0])
		if err != nil {
			return nil, nil, fmt.Errorf("the peer CA: %w", err)
		}
		if !ca.IsCA || (ca.KeyUsage != 0 && ca.KeyUsage&x509.KeyUsageCertSign == 0) {
			return nil, nil, fmt.Errorf("the peer CA %q is not a CA that signs certificates (basic constraints CA, key usage cert sign)", ca.Subject)
		}
		key, ok := pair.PrivateKey.(crypto.Signer)
		if !ok {
			return nil, nil, errors.New("the peer CA's key cannot sign")
		}
		s.authorities, s.roots = append([]authority{{cert: ca, key: key, seen: now}}, s.authorities...), nil
	}
	newest := s.authorities[0].cert
	kept := s.authorities[:0]
	for _, a := range s.authorities {
		if now.Before(a.cert.NotAfter) {
			kept = append(kept, a)
		}
	}
	if len(kept) < len(s.authorities) {
		s.roots = nil
	}
	s.authorities = kept
	if len(kept) == 0 {
		return nil, nil, fmt.Errorf("the peer CA %q expired at %s", newest.Subject, newest.NotAfter)
	}
	if s.roots == nil {
		s.roots = x509.NewCertPool()
		for _, a := range kept {
			s.roots.AddCert(a.cert)
		}
	}
	signer := kept[len(kept)-1] // the oldest, where none has settled
	for _, a := range kept {
		if now.Sub(a.seen) >= s.settle {
			signer = a
			break
		}
	}
	return signer.cert, signer.key, nil
}

// Sign makes a certificate for id from a signing request (DER), whatever
// names the request asks for: the identity is the caller's word, checked
// by whoever calls this.
func (s *Signer) Sign(csrDER []byte, id Identity) (*Issued, error) {
	if len(csrDER) > MaxRequest {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", ErrBadRequest, len(csrDER), MaxRequest)
	}
	csr, err := x509.ParseCertificateRequest(csrDER)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("%w: its signature: %w", ErrBadRequest, err)
	}
	if err := checkKey(csr.PublicKey); err != nil {
		return nil, err
	}
	return s.sign(csr.PublicKey, id)
}

// checkKey takes the keys peers make: ECDSA on P-256 or P-384, Ed25519.
func checkKey(pub any) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		if k.Curve == elliptic.P256() || k.Curve == elliptic.P384() {
			return nil
		}
	case ed25519.PublicKey:
		return nil
	}
	return fmt.Errorf("%w: a %T key: want ECDSA P-256 or P-384, or Ed25519", ErrBadRequest, pub)
}

func (s *Signer) sign(pub any, id Identity) (*Issued, error) {
	ca, key, err := s.current()
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	now := time.Now()
	notAfter := now.Add(s.lifetime)
	if notAfter.After(ca.NotAfter) {
		notAfter = ca.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: id.URI().String()},
		URIs:         []*url.URL{id.URI()},
		NotBefore:    now.Add(-clockSkew),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, pub, key)
	if err != nil {
		return nil, fmt.Errorf("signing a peer certificate for %s: %w", id, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := &Issued{Certificate: der}
	for _, a := range s.authorities {
		out.Authorities = append(out.Authorities, a.cert.Raw)
	}
	return out, nil
}

// Certificate is the controller's own peer certificate, made with a new
// key and renewed at half its life.
func (s *Signer) Certificate() (*tls.Certificate, error) {
	s.mu.Lock()
	if s.self != nil && time.Now().Before(s.selfRenew) {
		defer s.mu.Unlock()
		return s.self, nil
	}
	s.mu.Unlock()
	key, err := NewKey()
	if err != nil {
		return nil, err
	}
	issued, err := s.sign(key.Public(), Controller)
	if err != nil {
		return nil, err
	}
	cert, err := assemble(key, issued)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.self, s.selfRenew = cert, renewAt(cert.Leaf, time.Now())
	return s.self, nil
}

// Roots are the authorities a peer's certificate may chain to.
func (s *Signer) Roots() (*x509.CertPool, error) {
	if _, _, err := s.current(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.roots, nil
}

// NewKey makes a peer's key.
func NewKey() (*ecdsa.PrivateKey, error) { return ecdsa.GenerateKey(elliptic.P256(), rand.Reader) }

// Request is a signing request (DER) for key.
func Request(key crypto.Signer) ([]byte, error) {
	return x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
}

// assemble makes a TLS certificate of key and what was issued for it,
// checking that it is key's.
func assemble(key crypto.Signer, issued *Issued) (*tls.Certificate, error) {
	leaf, err := x509.ParseCertificate(issued.Certificate)
	if err != nil {
		return nil, fmt.Errorf("the issued peer certificate: %w", err)
	}
	pub, ok := leaf.PublicKey.(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(key.Public()) {
		return nil, errors.New("the issued peer certificate is not for this process's key")
	}
	return &tls.Certificate{Certificate: [][]byte{issued.Certificate}, PrivateKey: key, Leaf: leaf}, nil
}

// renewAt is when a certificate is renewed: half way through what is left
// of it at now.
func renewAt(leaf *x509.Certificate, now time.Time) time.Time {
	return now.Add(leaf.NotAfter.Sub(now) / 2)
}
