package controller

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
)

// A tokens file's line may name the node its token speaks for; one that
// names none speaks for any, and a malformed line is refused.
func TestTokensNameTheirNode(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tokens")
	require.NoError(t, os.WriteFile(path, []byte("node-a-token-0123456789,system:cowvol-node,*,node-a\nany-node-token-01234567,system:cowvol-node,*\n"), 0o600))
	tokens, err := LoadTokens(path)
	require.NoError(t, err)
	ctx := context.Background()
	a, err := tokens.Authenticate(ctx, "node-a-token-0123456789")
	require.NoError(t, err)
	asA := context.WithValue(ctx, callerKey{}, a)
	require.NoError(t, speaksFor(asA, "node-a"))
	require.Equal(t, codes.PermissionDenied, status.Code(speaksFor(asA, "node-b")))
	anyNode, err := tokens.Authenticate(ctx, "any-node-token-01234567")
	require.NoError(t, err)
	require.NoError(t, speaksFor(context.WithValue(ctx, callerKey{}, anyNode), "node-b"))
	require.NoError(t, speaksFor(ctx, "node-b"), "no authentication: loopback's root")

	for _, bad := range []string{"t-0123456789abcdef,u,*,\n", "t-0123456789abcdef,u,*,n,extra\n"} {
		require.NoError(t, os.WriteFile(path, []byte(bad), 0o600))
		_, err := LoadTokens(path)
		require.Error(t, err, "%q", bad)
	}
}

// The tap settles who calls before gRPC reads a message: no token, an
// unknown one, or a scheduler's on the nodes' Registry are turned away
// there, and the caller it found is the one the interceptors see.
func TestTapAuthenticatesBeforeTheRead(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tokens")
	require.NoError(t, os.WriteFile(path, []byte("node-token-0123456789,system:cowvol-node,*,node-a\nci-token-0123456789ab,ci-scheduler,ci\n"), 0o600))
	tokens, err := LoadTokens(path)
	require.NoError(t, err)
	gate := Tap(tokens, nil)
	call := func(method, token string) (context.Context, error) {
		md := metadata.MD{}
		if token != "" {
			md.Set("authorization", "Bearer "+token)
		}
		return gate(context.Background(), &tap.Info{FullMethodName: method, Header: md})
	}
	tests := []struct {
		name, method, token string
		wantCode            codes.Code
		wantUser            string
	}{
		{"no token", controllerv1.Cache_LookupVolumes_FullMethodName, "", codes.Unauthenticated, ""},
		{"an unknown token", controllerv1.Cache_LookupVolumes_FullMethodName, "forged-token-0123456789", codes.Unauthenticated, ""},
		{"a scheduler's lookup", controllerv1.Cache_LookupVolumes_FullMethodName, "ci-token-0123456789ab", codes.OK, "ci-scheduler"},
		{"a scheduler's report", controllerv1.Registry_Report_FullMethodName, "ci-token-0123456789ab", codes.PermissionDenied, ""},
		{"a scheduler's report in parts", controllerv1.Registry_SendReport_FullMethodName, "ci-token-0123456789ab", codes.PermissionDenied, ""},
		{"a node's report", controllerv1.Registry_Report_FullMethodName, "node-token-0123456789", codes.OK, "system:cowvol-node"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, err := call(tc.method, tc.token)
			require.Equal(t, tc.wantCode, status.Code(err), "%v", err)
			if err == nil {
				authed, err := authenticate(ctx, tokens)
				require.NoError(t, err)
				require.Equal(t, tc.wantUser, CallerFrom(authed).User)
			}
		})
	}
	ctx, err := Tap(nil, nil)(context.Background(), &tap.Info{FullMethodName: controllerv1.Registry_Report_FullMethodName})
	require.NoError(t, err, "no authentication configured")
	require.Equal(t, "loopback", CallerFrom(ctx).User)
}
