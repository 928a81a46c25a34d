package client

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/httpstream"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport/spdy"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
)

// KubeOptions say where a cluster's controller runs, as deploy/csi installs
// it (the defaults).
type KubeOptions struct {
	// Namespace holds the controller's pods, its Lease and its TLS Secret
	// (default cowvol).
	Namespace string
	// Lease is the controller's leader-election Lease (default
	// cowvol-controller): its holder is the pod to reach.
	Lease string
	// Selector finds a ready controller pod where there is no Lease (one
	// replica, no election; default app=cowvol-controller).
	Selector string
	// Port is the controller's API port in its pod (default 7070).
	Port int
	// CAFile verifies the controller's certificate. Without it the CA is
	// the ca.crt of TLSSecret (default cowvol-controller-tls) if that
	// Secret exists; if it does not, the controller is taken to serve
	// plaintext on its pod's loopback, which only a port-forward reaches.
	CAFile, TLSSecret string
	// ServerName is the name in the controller's certificate (default
	// cowvol-controller.<namespace>.svc).
	ServerName string
}

func (o *KubeOptions) defaults() {
	if o.Namespace == "" {
		o.Namespace = "cowvol"
	}
	if o.Lease == "" {
		o.Lease = "cowvol-controller"
	}
	if o.Selector == "" {
		o.Selector = "app=cowvol-controller"
	}
	if o.Port == 0 {
		o.Port = 7070
	}
	if o.TLSSecret == "" {
		o.TLSSecret = "cowvol-controller-tls"
	}
	if o.ServerName == "" {
		o.ServerName = "cowvol-controller." + o.Namespace + ".svc"
	}
}

// DialKube reaches the controller of the cluster cfg (a kubeconfig's)
// names, with nothing else: as kubectl port-forward does, through the API
// server to the leading replica's pod, presenting cfg's bearer token
// (which a controller with --kube-auth checks). Every connection gRPC
// makes finds the current leader, so a failover costs one retried call.
func DialKube(ctx context.Context, cfg *rest.Config, o KubeOptions) (*Client, error) {
	opts, err := KubeDialOptions(ctx, cfg, o)
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient("passthrough:///cowvol-controller", opts...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, Cache: controllerv1.NewCacheClient(conn)}, nil
}

// KubeDialOptions are DialKube's, for a connection of one's own (say to
// the Registry API): dial "passthrough:///cowvol-controller" with them.
func KubeDialOptions(ctx context.Context, cfg *rest.Config, o KubeOptions) ([]grpc.DialOption, error) {
	o.defaults()
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	transport := insecure.NewCredentials()
	secure := false
	switch pool, err := controllerCA(ctx, kube, o); {
	case err != nil:
		return nil, err
	case pool != nil:
		transport = credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: o.ServerName, MinVersion: tls.VersionTLS12})
		secure = true
	}
	f := &forwarder{kube: kube, cfg: cfg, o: o}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(transport), grpc.WithContextDialer(f.dial), callLimits}
	if cfg.BearerToken != "" || cfg.BearerTokenFile != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(Bearer{Token: cfg.BearerToken, File: cfg.BearerTokenFile, Secure: secure}))
	}
	return opts, nil
}

// controllerCA is the pool that verifies the controller, or nil when it
// serves plaintext (its TLS Secret does not exist).
func controllerCA(ctx context.Context, kube kubernetes.Interface, o KubeOptions) (*x509.CertPool, error) {
	var pem []byte
	if o.CAFile != "" {
		raw, err := os.ReadFile(o.CAFile)
		if err != nil {
			return nil, fmt.Errorf("loading the controller's CA: %w", err)
		}
		pem = raw
	} else {
		s, err := kube.CoreV1().Secrets(o.Namespace).Get(ctx, o.TLSSecret, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			return nil, nil
		case err != nil:
			return nil, fmt.Errorf("reading the controller's CA from Secret %s/%s (or give its CA file): %w", o.Namespace, o.TLSSecret, err)
		}
		if pem = s.Data["ca.crt"]; len(pem) == 0 {
			return nil, fmt.Errorf("Secret %s/%s has no ca.crt", o.Namespace, o.TLSSecret)
		}
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, errors.New("the controller's CA holds no PEM certificate")
	}
	return pool, nil
}

// portForwardProtocol is the kubelet's port-forward subprotocol (as
// client-go's tools/portforward names it).
const portForwardProtocol = "portforward.k8s.io"

// forwarder opens a port-forward to the leading controller pod for each
// connection gRPC makes.
type forwarder struct {
	kube kubernetes.Interface
	cfg  *rest.Config
	o    KubeOptions
}

// leader is the pod to reach: the Lease's holder, or else (no Lease: one
// replica, no election) a ready pod the selector finds. A Lease with no
// holder is a failover under way (the leader let it go, and no replica
// has taken it yet): that is an error, retried, never a ready follower,
// which would answer every call Unavailable for as long as the
// connection lasts.
func (f *forwarder) leader(ctx context.Context) (string, error) {
	lease, err := f.kube.CoordinationV1().Leases(f.o.Namespace).Get(ctx, f.o.Lease, metav1.GetOptions{})
	switch {
	case err == nil && lease.Spec.HolderIdentity != nil && *lease.Spec.HolderIdentity != "":
		return *lease.Spec.HolderIdentity, nil
	case err == nil:
		return "", fmt.Errorf("the controller's Lease %s/%s has no holder: a leader is being chosen; retry", f.o.Namespace, f.o.Lease)
	case !apierrors.IsNotFound(err):
		return "", fmt.Errorf("finding the controller's leader (Lease %s/%s): %w", f.o.Namespace, f.o.Lease, err)
	}
	pods, err := f.kube.CoreV1().Pods(f.o.Namespace).List(ctx, metav1.ListOptions{LabelSelector: f.o.Selector})
	if err != nil {
		return "", fmt.Errorf("finding the controller's pod (%s in %s): %w", f.o.Selector, f.o.Namespace, err)
	}
	for _, p := range pods.Items {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue && p.DeletionTimestamp == nil {
				return p.Name, nil
			}
		}
	}
	return "", fmt.Errorf("no ready controller pod (%s) in namespace %s, and no Lease %s", f.o.Selector, f.o.Namespace, f.o.Lease)
}

func (f *forwarder) dial(ctx context.Context, _ string) (net.Conn, error) {
	pod, err := f.leader(ctx)
	if err != nil {
		return nil, err
	}
	url := f.kube.CoreV1().RESTClient().Post().Resource("pods").Namespace(f.o.Namespace).Name(pod).SubResource("portforward").URL()
	rt, upgrader, err := spdy.RoundTripperFor(f.cfg)
	if err != nil {
		return nil, err
	}
	streams, proto, err := spdy.NewDialer(upgrader, &http.Client{Transport: rt}, http.MethodPost, url).Dial(portForwardProtocol)
	if err != nil {
		return nil, fmt.Errorf("port-forwarding to controller pod %s/%s: %w", f.o.Namespace, pod, err)
	}
	if proto != portForwardProtocol {
		streams.Close()
		return nil, fmt.Errorf("port-forwarding to %s: the API server speaks %q", pod, proto)
	}
	headers := http.Header{}
	headers.Set(corev1.StreamType, corev1.StreamTypeError)
	headers.Set(corev1.PortHeader, strconv.Itoa(f.o.Port))
	headers.Set(corev1.PortForwardRequestIDHeader, "0")
	errStream, err := streams.CreateStream(headers)
	if err != nil {
		streams.Close()
		return nil, err
	}
	errStream.Close() // nothing to say on it
	headers.Set(corev1.StreamType, corev1.StreamTypeData)
	data, err := streams.CreateStream(headers)
	if err != nil {
		streams.Close()
		return nil, err
	}
	c := &forwardedConn{streams: streams, data: data, pod: pod}
	go func() {
		// The kubelet says on the error stream why a forward failed (the
		// port is closed, say); then the connection is done.
		if msg, _ := io.ReadAll(errStream); len(msg) > 0 {
			c.fail(fmt.Errorf("port-forward to %s: %s", pod, msg))
		}
	}()
	return c, nil
}

// forwardedConn is a connection to the controller's port carried by a
// port-forward's data stream.
type forwardedConn struct {
	streams httpstream.Connection
	data    httpstream.Stream
	pod     string
	once    sync.Once
	// err is why the kubelet ended the forward, if it said.
	err atomic.Value
}

func (c *forwardedConn) Read(b []byte) (int, error) {
	n, err := c.data.Read(b)
	if why, ok := c.err.Load().(error); ok && err != nil {
		err = why
	}
	return n, err
}
func (c *forwardedConn) Write(b []byte) (int, error) { return c.data.Write(b) }
func (c *forwardedConn) Close() error {
	c.once.Do(func() { _ = c.data.Reset(); _ = c.streams.Close() })
	return nil
}
func (c *forwardedConn) fail(err error)                   { c.err.Store(err); _ = c.Close() }
func (c *forwardedConn) LocalAddr() net.Addr              { return forwardAddr("local") }
func (c *forwardedConn) RemoteAddr() net.Addr             { return forwardAddr(c.pod) }
func (c *forwardedConn) SetDeadline(time.Time) error      { return nil }
func (c *forwardedConn) SetReadDeadline(time.Time) error  { return nil }
func (c *forwardedConn) SetWriteDeadline(time.Time) error { return nil }

type forwardAddr string

func (a forwardAddr) Network() string { return "portforward" }
func (a forwardAddr) String() string  { return string(a) }
