package driver

import (
	"context"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/concourse/cowvol/pkg/controller"
)

// maxReport bounds one report: a node's whole inventory (about 100 bytes a
// volume) must fit, 4 MiB (gRPC's default) does not at tens of thousands.
const maxReport = 64 << 20

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
	opts := []grpc.ServerOption{grpc.ChainUnaryInterceptor(metrics, tokens.Interceptor), grpc.MaxRecvMsgSize(maxReport)}
	if o.TLSCertFile != "" {
		creds, err := credentials.NewServerTLSFromFile(o.TLSCertFile, o.TLSKeyFile)
		if err != nil {
			return nil, fmt.Errorf("loading the controller's certificate: %w", err)
		}
		opts = append(opts, grpc.Creds(creds))
	}
	return opts, nil
}

// controllerDialOptions are a node's, reaching the controller: TLS
// verified against the CA where one is given, and its token on every call.
func controllerDialOptions(o Options) ([]grpc.DialOption, error) {
	opts := []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(maxReport)),
		grpc.WithTransportCredentials(insecure.NewCredentials())}
	if o.TLSCAFile != "" {
		creds, err := credentials.NewClientTLSFromFile(o.TLSCAFile, "")
		if err != nil {
			return nil, fmt.Errorf("loading the controller's CA: %w", err)
		}
		opts[1] = grpc.WithTransportCredentials(creds)
	}
	if o.TokenFile != "" {
		raw, err := os.ReadFile(o.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("reading the token file: %w", err)
		}
		opts = append(opts, grpc.WithPerRPCCredentials(bearer{token: strings.TrimSpace(string(raw)), secure: o.TLSCAFile != ""}))
	}
	return opts, nil
}

// bearer presents a token on every call; over plaintext only to loopback
// (Options.Validate sees to that).
type bearer struct {
	token  string
	secure bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

func (b bearer) RequireTransportSecurity() bool { return b.secure }
