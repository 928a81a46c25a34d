package peerid

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/klog/v2"
)

// SignFunc asks the peer CA's holder (the controller) to sign a request
// (DER) for this process's identity.
type SignFunc func(ctx context.Context, csr []byte) (*Issued, error)

// Kept is a process's own peer certificate, asked for at start and renewed
// half way through its life, with a new key each time. The key never
// leaves the process.
type Kept struct {
	id   Identity
	sign SignFunc

	mu    sync.Mutex
	cert  *tls.Certificate
	roots *x509.CertPool
}

// ErrNoCertificate says a process has no peer certificate yet.
var ErrNoCertificate = errors.New("no peer certificate yet: the controller has not signed one")

// NewKept keeps a certificate for id, signed through sign; Run gets it.
func NewKept(id Identity, sign SignFunc) *Kept { return &Kept{id: id, sign: sign} }

// Certificate is the certificate as it is now.
func (k *Kept) Certificate() (*tls.Certificate, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.cert == nil {
		return nil, ErrNoCertificate
	}
	return k.cert, nil
}

// Roots are the authorities the signer named with the certificate.
func (k *Kept) Roots() (*x509.CertPool, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.roots == nil {
		return nil, ErrNoCertificate
	}
	return k.roots, nil
}

// Renew asks for a new certificate now.
func (k *Kept) Renew(ctx context.Context) (*x509.Certificate, error) {
	key, err := NewKey()
	if err != nil {
		return nil, err
	}
	csr, err := Request(key)
	if err != nil {
		return nil, err
	}
	issued, err := k.sign(ctx, csr)
	if err != nil {
		return nil, err
	}
	cert, err := assemble(key, issued)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	for _, der := range issued.Authorities {
		ca, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, fmt.Errorf("an authority the signer named: %w", err)
		}
		roots.AddCert(ca)
	}
	// What this process presents must be what its peers accept.
	if _, err := cert.Leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}); err != nil {
		return nil, fmt.Errorf("the signed peer certificate does not chain to the authorities named with it: %w", err)
	}
	if id, err := Of(cert.Leaf); err != nil || id != k.id {
		return nil, fmt.Errorf("the signed peer certificate names %v, not %s (%v)", cert.Leaf.URIs, k.id, err)
	}
	k.mu.Lock()
	k.cert, k.roots = cert, roots
	k.mu.Unlock()
	return cert.Leaf, nil
}

// Retries of a failed signing: from retryMin, doubling up to retryMax.
const (
	retryMin = time.Second
	retryMax = time.Minute
)

// Run gets the certificate (unless Renew got one already) and renews it
// until ctx ends.
func (k *Kept) Run(ctx context.Context) {
	wait := time.Duration(0)
	if c, err := k.Certificate(); err == nil {
		wait = time.Until(renewAt(c.Leaf, time.Now()))
	}
	retry := retryMin
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		leaf, err := k.Renew(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			klog.ErrorS(err, "Getting this process's peer certificate failed; retrying", "identity", k.id.String(), "retryIn", retry)
			wait, retry = retry, min(2*retry, retryMax)
			continue
		}
		retry = retryMin
		next := renewAt(leaf, time.Now())
		klog.InfoS("Got this process's peer certificate", "identity", k.id.String(), "notAfter", leaf.NotAfter, "renewAt", next)
		wait = time.Until(next)
	}
}
