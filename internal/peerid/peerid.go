// Package peerid owns the identities that nodes and the controller prove
// to each other on the peer link: a certificate per node whose URI names
// the node (and one for the controller), signed by the deployment's peer
// CA, whose key only the controller holds. It makes keys and signing
// requests, signs them (the controller's half), keeps a process's own
// certificate renewed (a node's half), and builds the TLS configurations
// that check a peer is the one it was asked to be.
//
// It knows nothing of gRPC services, volumes or the Kubernetes API: who may
// ask for which identity is its caller's to decide.
package peerid

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"
)

// An Identity is what a peer certificate proves: one node, by its name, or
// the controller.
type Identity struct {
	// Node is the node's name ("" for the controller).
	Node string
}

// Controller is the controller's identity: it reads and writes volumes on
// the nodes for its callers.
var Controller = Identity{}

// Node is a node's identity.
func Node(name string) Identity { return Identity{Node: name} }

// IsController says whether the identity is the controller's.
func (id Identity) IsController() bool { return id.Node == "" }

// The URIs identities are written as, in a certificate's one URI SAN
// (SPIFFE's form, in a trust domain of cowvol's own).
const (
	uriScheme      = "spiffe"
	uriHost        = "cowvol"
	nodePrefix     = "/node/"
	controllerPath = "/controller"
)

// URI is the identity as its certificate names it.
func (id Identity) URI() *url.URL {
	if id.IsController() {
		return &url.URL{Scheme: uriScheme, Host: uriHost, Path: controllerPath}
	}
	return &url.URL{Scheme: uriScheme, Host: uriHost, Path: nodePrefix + id.Node}
}

func (id Identity) String() string {
	if id.IsController() {
		return "the controller"
	}
	return "node " + id.Node
}

// ErrNotAPeer says a certificate proves no peer identity.
var ErrNotAPeer = errors.New("not a cowvol peer certificate")

// Of is the identity a certificate names: exactly one URI, of cowvol's
// form.
func Of(cert *x509.Certificate) (Identity, error) {
	if len(cert.URIs) != 1 {
		return Identity{}, fmt.Errorf("%w: it names %d URIs, want 1", ErrNotAPeer, len(cert.URIs))
	}
	u := cert.URIs[0]
	if u.Scheme != uriScheme || u.Host != uriHost || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return Identity{}, fmt.Errorf("%w: %s", ErrNotAPeer, u.Redacted())
	}
	if u.Path == controllerPath {
		return Controller, nil
	}
	name, ok := strings.CutPrefix(u.Path, nodePrefix)
	if !ok || !validNodeName(name) {
		return Identity{}, fmt.Errorf("%w: %s", ErrNotAPeer, u.Redacted())
	}
	return Node(name), nil
}

// validNodeName says whether name can be a Kubernetes node's: a DNS
// subdomain (lower-case letters, digits, '-' and '.', at most 253).
func validNodeName(name string) bool {
	if name == "" || len(name) > 253 {
		return false
	}
	for _, c := range name {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' && c != '.' {
			return false
		}
	}
	return true
}

// CheckNodeName refuses a name no certificate can carry.
func CheckNodeName(name string) error {
	if !validNodeName(name) {
		return fmt.Errorf("node name %q: want a DNS subdomain (a-z, 0-9, '-', '.'; at most 253)", name)
	}
	return nil
}

// Credentials are a process's own peer certificate and the authorities its
// peers' certificates must chain to, both as they are now: a renewal takes
// effect at the next handshake.
type Credentials interface {
	Certificate() (*tls.Certificate, error)
	Roots() (*x509.CertPool, error)
}

// verify checks a presented chain against creds' roots for usage, and
// answers the identity its leaf proves.
func verify(creds Credentials, raw [][]byte, usage x509.ExtKeyUsage) (Identity, error) {
	if len(raw) == 0 {
		return Identity{}, fmt.Errorf("%w: none presented", ErrNotAPeer)
	}
	roots, err := creds.Roots()
	if err != nil {
		return Identity{}, err
	}
	certs := make([]*x509.Certificate, len(raw))
	for i, der := range raw {
		if certs[i], err = x509.ParseCertificate(der); err != nil {
			return Identity{}, fmt.Errorf("%w: %w", ErrNotAPeer, err)
		}
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	if _, err := certs[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{usage},
		CurrentTime: time.Now()}); err != nil {
		return Identity{}, fmt.Errorf("%w: %w", ErrNotAPeer, err)
	}
	return Of(certs[0])
}

// ServerConfig serves creds' certificate and demands a client certificate
// under its roots whose identity accept takes.
func ServerConfig(creds Credentials, accept func(Identity) error) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return creds.Certificate()
		},
		// Verified below, by identity rather than by host name.
		ClientAuth: tls.RequireAnyClientCert,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			id, err := verify(creds, raw, x509.ExtKeyUsageClientAuth)
			if err != nil {
				return err
			}
			return accept(id)
		},
	}
}

// ClientConfig presents creds' certificate and accepts only a server that
// proves to be want.
func ClientConfig(creds Credentials, want Identity) *tls.Config {
	return ClientConfigFor(creds, func(id Identity) error {
		if id != want {
			return fmt.Errorf("%w: the peer is %s, not %s", ErrWrongPeer, id, want)
		}
		return nil
	})
}

// ErrWrongPeer says a peer proved to be another than the one asked for.
var ErrWrongPeer = errors.New("a peer that is not the one asked for")

// ClientConfigFor is ClientConfig for a server whose identity accept takes.
func ClientConfigFor(creds Credentials, accept func(Identity) error) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return creds.Certificate()
		},
		// The chain and the identity are checked below: a peer is named by
		// its node, not by a host name.
		InsecureSkipVerify: true, //nolint:gosec // verified in VerifyPeerCertificate
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			id, err := verify(creds, raw, x509.ExtKeyUsageServerAuth)
			if err != nil {
				return err
			}
			return accept(id)
		},
	}
}

// FromState is the identity a handshake's verified peer proved (false: it
// proved none, as on a link without these certificates).
func FromState(s tls.ConnectionState) (Identity, bool) {
	if len(s.PeerCertificates) == 0 {
		return Identity{}, false
	}
	id, err := Of(s.PeerCertificates[0])
	return id, err == nil
}
