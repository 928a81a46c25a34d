package controller

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/peerid"
)

func TestSignPeerCertificate(t *testing.T) {
	pki := netlab.NewPKI(t, t.TempDir(), "cowvol-peer")
	signer, err := peerid.NewSigner(pki.CA, pki.CAKey, time.Hour)
	require.NoError(t, err)
	key, err := peerid.NewKey()
	require.NoError(t, err)
	csr, err := peerid.Request(key)
	require.NoError(t, err)
	nodeA := Caller{User: "system:serviceaccount:cowvol:cowvol-node", Node: "node-a", nodeBound: true, may: anyone.may}
	for _, tc := range []struct {
		name     string
		caller   *Caller
		peerCA   PeerSigner
		req      *controllerv1.SignPeerCertificateRequest
		wantCode codes.Code
	}{
		{name: "its own", caller: &nodeA, peerCA: signer, req: &controllerv1.SignPeerCertificateRequest{NodeId: "node-a", Request: csr}},
		{name: "another node's", caller: &nodeA, peerCA: signer, req: &controllerv1.SignPeerCertificateRequest{NodeId: "node-b", Request: csr},
			wantCode: codes.PermissionDenied},
		{name: "a name no certificate carries", peerCA: signer, req: &controllerv1.SignPeerCertificateRequest{NodeId: "Node/A", Request: csr},
			wantCode: codes.InvalidArgument},
		{name: "no request", peerCA: signer, req: &controllerv1.SignPeerCertificateRequest{NodeId: "node-a"}, wantCode: codes.InvalidArgument},
		{name: "a controller with no peer CA", req: &controllerv1.SignPeerCertificateRequest{NodeId: "node-a", Request: csr},
			wantCode: codes.FailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			if tc.caller != nil {
				ctx = context.WithValue(ctx, callerKey{}, *tc.caller)
			}
			s := &registryServer{peerCA: tc.peerCA}
			_, err := s.SignPeerCertificate(ctx, tc.req)
			require.Equal(t, tc.wantCode, status.Code(err), "%v", err)
		})
	}
}
