// Package netlab builds small networks of network namespaces for tests and
// benchmarks that run several node plugins as separate hosts: a switch
// namespace holding a bridge, one namespace per host joined to it by a
// veth pair, and a veth from the test's own namespace so that the test
// reaches every host. It also makes the certificates such a network's
// hosts authenticate each other with. It is test support only, never
// imported by the plugin, and it touches no interface it did not make.
package netlab

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/tb"
	"github.com/concourse/cowvol/internal/testfs"
)

// Lab is a network: hosts on one /24, and the test's own address on it.
type Lab struct {
	tb     tb.TB
	id     string
	subnet int
	// Self is the test namespace's address on the lab's network.
	Self  string
	hosts int
}

// Host is one namespace on the lab's network.
type Host struct {
	Netns string // under /run/netns
	IP    string
	// veth is the host's end in the switch namespace (for tc).
	veth string
	lab  *Lab
}

func run(tb tb.TB, args ...string) {
	tb.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		tb.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// New makes a lab, or skips the test saying what is missing (fails it
// under CI). Everything is removed when the test ends.
func New(tb tb.TB) *Lab {
	tb.Helper()
	testfs.Need(tb, "ip", "nsenter") // iproute2, util-linux; and root
	l := &Lab{tb: tb, id: fmt.Sprintf("%x", os.Getpid()%0xffff)}
	// A /24 of its own per test process, out of the way of real networks.
	l.subnet = 100 + os.Getpid()%100
	sw := l.ns("sw")
	run(tb, "ip", "netns", "add", sw)
	tb.Cleanup(func() { _ = exec.Command("ip", "netns", "del", sw).Run() })
	run(tb, "ip", "-n", sw, "link", "add", "br0", "type", "bridge")
	run(tb, "ip", "-n", sw, "link", "set", "br0", "up")
	// The test's own leg: a veth from this namespace into the switch.
	self := "cvt" + l.id
	run(tb, "ip", "link", "add", self, "type", "veth", "peer", "name", "up0", "netns", sw)
	tb.Cleanup(func() { _ = exec.Command("ip", "link", "del", self).Run() })
	run(tb, "ip", "-n", sw, "link", "set", "up0", "master", "br0", "up")
	l.Self = fmt.Sprintf("10.231.%d.254", l.subnet)
	run(tb, "ip", "addr", "add", l.Self+"/24", "dev", self)
	run(tb, "ip", "link", "set", self, "up")
	return l
}

func (l *Lab) ns(name string) string { return "cowvol-" + l.id + "-" + name }

// Host adds a host namespace with its own address.
func (l *Lab) Host(name string) *Host {
	l.tb.Helper()
	l.hosts++
	h := &Host{Netns: l.ns(name), IP: fmt.Sprintf("10.231.%d.%d", l.subnet, l.hosts), veth: fmt.Sprintf("up%d", l.hosts), lab: l}
	sw := l.ns("sw")
	run(l.tb, "ip", "netns", "add", h.Netns)
	l.tb.Cleanup(func() { _ = exec.Command("ip", "netns", "del", h.Netns).Run() })
	run(l.tb, "ip", "-n", h.Netns, "link", "set", "lo", "up")
	run(l.tb, "ip", "-n", sw, "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.Netns)
	run(l.tb, "ip", "-n", sw, "link", "set", h.veth, "master", "br0", "up")
	run(l.tb, "ip", "-n", h.Netns, "addr", "add", h.IP+"/24", "dev", "eth0")
	run(l.tb, "ip", "-n", h.Netns, "link", "set", "eth0", "up")
	return h
}

// Command runs a program in the host's network namespace only (it shares
// the test's mounts, so what it mounts the test sees).
func (h *Host) Command(name string, args ...string) (string, []string) {
	return "nsenter", append([]string{"--net=/run/netns/" + h.Netns, "--", name}, args...)
}

// Listen opens a TCP listener in the host's namespace, from this process.
func (h *Host) Listen(port int) (net.Listener, error) {
	var l net.Listener
	err := h.inNetns(func() (err error) {
		l, err = net.Listen("tcp", net.JoinHostPort(h.IP, fmt.Sprint(port)))
		return err
	})
	return l, err
}

// DialContext connects from the host's namespace, from this process: to
// reach what a plugin of the host serves on its loopback.
func (h *Host) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := h.inNetns(func() (err error) {
		c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// inNetns runs fn on a thread moved into the host's namespace: a socket
// it makes belongs to the namespace from then on, whichever thread uses it.
func (h *Host) inNetns(fn func() error) error {
	done := make(chan error, 1)
	go func() {
		// A goroutine of its own, locked to its thread: if the thread
		// cannot be moved back, it exits locked and Go ends the thread.
		runtime.LockOSThread()
		self, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			done <- err
			return
		}
		defer self.Close()
		target, err := os.Open("/run/netns/" + h.Netns)
		if err != nil {
			runtime.UnlockOSThread()
			done <- err
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			done <- err
			return
		}
		err = fn()
		if serr := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); serr == nil {
			runtime.UnlockOSThread()
		}
		done <- err
	}()
	return <-done
}

// Throttle limits what the switch sends the host to rate (tc's units, such
// as 200mbit): a slow link, for the tests that must catch a stream
// mid-way.
func (h *Host) Throttle(rate string) {
	h.lab.tb.Helper()
	run(h.lab.tb, "ip", "netns", "exec", h.lab.ns("sw"), "tc", "qdisc", "replace", "dev", h.veth, "root",
		"tbf", "rate", rate, "burst", "256kb", "latency", "400ms")
}

// ShapeLink limits the host's link to rate both ways: what the switch
// sends it (Throttle) and what it sends the switch (its eth0's egress), as
// a node's network card would.
func (h *Host) ShapeLink(rate string) {
	h.lab.tb.Helper()
	h.Throttle(rate)
	run(h.lab.tb, "ip", "netns", "exec", h.Netns, "tc", "qdisc", "replace", "dev", "eth0", "root",
		"tbf", "rate", rate, "burst", "256kb", "latency", "400ms")
}

// Unthrottle undoes Throttle.
func (h *Host) Unthrottle() {
	h.lab.tb.Helper()
	run(h.lab.tb, "ip", "netns", "exec", h.lab.ns("sw"), "tc", "qdisc", "del", "dev", h.veth, "root")
}

// PKI is a CA and a certificate it signed, for mutual TLS between a lab's
// hosts and the test: the certificate names DNSName and IPs. CAKey is the
// CA's key, for a controller that signs peer certificates with it.
type PKI struct {
	CA, CAKey, Cert, Key string
}

// NewPKI writes a CA and one certificate (server and client use) to dir.
func NewPKI(tb tb.TB, dir, dnsName string, ips ...string) PKI {
	tb.Helper()
	must := func(err error) {
		tb.Helper()
		if err != nil {
			tb.Fatal(err)
		}
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(err)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "cowvol test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	must(err)
	caCert, err := x509.ParseCertificate(caDER)
	must(err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: dnsName},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), DNSNames: []string{dnsName},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	for _, ip := range ips {
		tmpl.IPAddresses = append(tmpl.IPAddresses, net.ParseIP(ip))
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	must(err)
	keyDER, err := x509.MarshalECPrivateKey(key)
	must(err)
	caKeyDER, err := x509.MarshalECPrivateKey(caKey)
	must(err)
	p := PKI{CA: filepath.Join(dir, "ca.crt"), CAKey: filepath.Join(dir, "ca.key"), Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key")}
	must(os.MkdirAll(dir, 0o700))
	must(os.WriteFile(p.CA, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o600))
	must(os.WriteFile(p.CAKey, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: caKeyDER}), 0o600))
	must(os.WriteFile(p.Cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	must(os.WriteFile(p.Key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600))
	return p
}

// ClientCert writes to dir a client certificate (and its key) for
// commonName in the groups orgs, signed by the PKI's CA: what a kubelet
// presents as system:node:<name> in system:nodes.
func (p PKI) ClientCert(tb tb.TB, dir, commonName string, orgs ...string) (cert, key string) {
	tb.Helper()
	must := func(err error) {
		tb.Helper()
		if err != nil {
			tb.Fatal(err)
		}
	}
	caCert, caKey := p.loadCA(tb)
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(err)
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	must(err)
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: commonName, Organization: orgs},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &k.PublicKey, caKey)
	must(err)
	keyDER, err := x509.MarshalECPrivateKey(k)
	must(err)
	must(os.MkdirAll(dir, 0o700))
	cert, key = filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key")
	must(os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	must(os.WriteFile(key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600))
	return cert, key
}

// loadCA reads the PKI's CA and its key back.
func (p PKI) loadCA(tb tb.TB) (*x509.Certificate, *ecdsa.PrivateKey) {
	tb.Helper()
	certPEM, err := os.ReadFile(p.CA)
	if err != nil {
		tb.Fatal(err)
	}
	keyPEM, err := os.ReadFile(p.CAKey)
	if err != nil {
		tb.Fatal(err)
	}
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		tb.Fatalf("%s or %s is not PEM", p.CA, p.CAKey)
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		tb.Fatal(err)
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		tb.Fatal(err)
	}
	return cert, key
}
