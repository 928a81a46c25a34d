package driver

import (
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/controller"
)

// controllerServerOptions are the controller's API server's: TLS where a
// certificate is given, and bearer tokens checked on every call where a
// tokens file is.
func controllerServerOptions(o Options, metrics grpc.UnaryServerInterceptor) ([]grpc.ServerOption, error) {
	var tokens *controller.Tokens
	if o.TokensFile != "" {
		var err error
		if tokens, err = controller.LoadTokens(o.TokensFile); err != nil {
			return nil, err
		}
	}
	opts := []grpc.ServerOption{grpc.ChainUnaryInterceptor(metrics, tokens.Interceptor), grpc.MaxRecvMsgSize(client.MaxMessage)}
	if o.TLSCertFile != "" {
		creds, err := credentials.NewServerTLSFromFile(o.TLSCertFile, o.TLSKeyFile)
		if err != nil {
			return nil, fmt.Errorf("loading the controller's certificate: %w", err)
		}
		opts = append(opts, grpc.Creds(creds))
	}
	return opts, nil
}

// controllerDialOptions are a node's, reaching the controller as any
// client does: TLS verified against the CA where one is given, and its
// token on every call (over plaintext only to loopback: Options.Validate
// sees to that).
func controllerDialOptions(o Options) ([]grpc.DialOption, error) {
	return client.DialOptions(client.Options{Address: o.ControllerAddress, TokenFile: o.TokenFile, CAFile: o.TLSCAFile})
}
