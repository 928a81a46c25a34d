// Package tlsfiles reads TLS certificates, keys and CAs from files that may
// be replaced while the process runs (cert-manager renews a Secret, and the
// kubelet swaps the Secret's volume under the pod): every handshake sees
// the files as they are then, and a pair that does not load (read halfway
// through a swap) leaves the last good one in use until the next change.
//
// It reads the files it is given and nothing else.
package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"sync"

	"k8s.io/klog/v2"
)

// stamp says whether files changed: each one's size and modification
// time (through symlinks, as a Secret volume's files are).
func stamp(files ...string) string {
	s := ""
	for _, f := range files {
		if st, err := os.Stat(f); err == nil {
			s += fmt.Sprintf("%d/%d;", st.Size(), st.ModTime().UnixNano())
		} else {
			s += "missing;"
		}
	}
	return s
}

// reloading is a value loaded from files again whenever they change.
type reloading[T any] struct {
	files []string
	load  func() (T, error)
	mu    sync.Mutex
	stamp string
	value T
}

func newReloading[T any](load func() (T, error), files ...string) (*reloading[T], error) {
	r := &reloading[T]{files: files, load: load, stamp: stamp(files...)}
	v, err := load()
	if err != nil {
		return nil, err
	}
	r.value = v
	return r, nil
}

func (r *reloading[T]) get() T {
	now := stamp(r.files...)
	r.mu.Lock()
	defer r.mu.Unlock()
	if now == r.stamp {
		return r.value
	}
	v, err := r.load()
	if err != nil {
		klog.ErrorS(err, "Keeping the TLS files loaded before: the new ones do not load", "files", r.files)
		return r.value
	}
	klog.InfoS("Loaded changed TLS files", "files", r.files)
	r.value, r.stamp = v, now
	return r.value
}

// KeyPair is a certificate and its key.
type KeyPair struct{ r *reloading[*tls.Certificate] }

// NewKeyPair loads the pair, failing if it does not load now.
func NewKeyPair(certFile, keyFile string) (*KeyPair, error) {
	r, err := newReloading(func() (*tls.Certificate, error) {
		c, err := tls.LoadX509KeyPair(certFile, keyFile)
		return &c, err
	}, certFile, keyFile)
	if err != nil {
		return nil, err
	}
	return &KeyPair{r}, nil
}

// Certificate is the pair as the files hold it now.
func (k *KeyPair) Certificate() *tls.Certificate { return k.r.get() }

// CA is a pool of CA certificates.
type CA struct{ r *reloading[*x509.CertPool] }

// NewCA loads the CA file, failing if it holds no certificate now.
func NewCA(file string) (*CA, error) {
	r, err := newReloading(func() (*x509.CertPool, error) {
		pem, err := os.ReadFile(file)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("the CA file %s holds no certificate", file)
		}
		return pool, nil
	}, file)
	if err != nil {
		return nil, err
	}
	return &CA{r}, nil
}

// Pool is the CA as the file holds it now.
func (c *CA) Pool() *x509.CertPool { return c.r.get() }

// ServerConfig serves pair, and with clientCA demands a client certificate
// it signed: both as their files are at each handshake.
func ServerConfig(pair *KeyPair, clientCA *CA) *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS13, GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
		c := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{*pair.Certificate()}}
		if clientCA != nil {
			c.ClientCAs, c.ClientAuth = clientCA.Pool(), tls.RequireAndVerifyClientCert
		}
		return c, nil
	}}
}

// ClientConfig verifies a server named serverName against ca as the file
// is now, presenting pair (if not nil) as its file is at each handshake. A
// long-lived client makes a new config for each connection it dials.
func ClientConfig(pair *KeyPair, ca *CA, serverName string) *tls.Config {
	c := &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: ca.Pool(), ServerName: serverName}
	if pair != nil {
		c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return pair.Certificate(), nil }
	}
	return c
}
