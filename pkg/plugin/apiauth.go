package plugin

import (
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"k8s.io/client-go/kubernetes"

	"github.com/concourse/cowvol/internal/tlsfiles"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/controller"
)

// kubeAuthTTL is how long the controller trusts an API server's answer
// about a token or a grant (the API server's webhook authorizer caches
// allowed answers for 5 minutes; this is shorter, so revocations bite).
const kubeAuthTTL = 10 * time.Second

// apiStreamsAtOnce bounds a connection's calls in flight: a node has a
// report, a few lookups and a pull's reads at once; a scheduler, its
// lookups and placements.
const apiStreamsAtOnce = 128

// controllerServerOptions are the controller's API server's: TLS where a
// certificate is given, bearer tokens checked on every call before its
// message is read where a tokens file or the API server checks them, and
// then the leadership check (after authentication: who leads is for
// callers); no message above controllerv1.MaxMessage, and at most
// apiStreamsAtOnce calls at once on a connection.
func controllerServerOptions(o Options, kube kubernetes.Interface, metrics grpc.UnaryServerInterceptor, leader *leadership, prefix string,
	msgs *controller.Messages) ([]grpc.ServerOption, error) {
	var auth controller.Authenticator
	switch {
	case o.Controller.KubeAuth:
		auth = controller.NewKubeAuth(kube, kubeAuthTTL)
	case o.Controller.TokensFile != "":
		tokens, err := controller.LoadTokens(o.Controller.TokensFile)
		if err != nil {
			return nil, err
		}
		auth = tokens
	}
	opts := []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(metrics, controller.Interceptor(auth), leader.interceptor(prefix)),
		grpc.ChainStreamInterceptor(controller.StreamInterceptor(auth), leader.streamInterceptor(prefix)),
		grpc.InTapHandle(controller.Tap(auth, msgs)),
		grpc.MaxRecvMsgSize(client.MaxMessage),
		grpc.MaxConcurrentStreams(apiStreamsAtOnce),
	}
	if o.Controller.TLSCertFile != "" {
		pair, err := tlsfiles.NewKeyPair(o.Controller.TLSCertFile, o.Controller.TLSKeyFile)
		if err != nil {
			return nil, fmt.Errorf("loading the controller's certificate: %w", err)
		}
		opts = append(opts, grpc.Creds(credentials.NewTLS(tlsfiles.ServerConfig(pair, nil))))
	}
	return opts, nil
}

// controllerDialOptions are a node's, reaching the controller as any
// client does: TLS verified against the CA where one is given, and its
// token on every call (over plaintext only to loopback: Options.Validate
// sees to that).
func controllerDialOptions(o Options) ([]grpc.DialOption, error) {
	return client.DialOptions(client.Options{Address: o.Node.ControllerAddress, TokenFile: o.Node.TokenFile, CAFile: o.Node.TLSCAFile})
}
