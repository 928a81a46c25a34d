package plugin

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/peerid"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// servePeer serves a peer link with no services on loopback: a call that
// gets through the handshake is answered Unimplemented.
func servePeer(t *testing.T, l *peerLink) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.Creds(l.serverCreds()))
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// A puller dials a holder the controller named by its node: a server
// there that proves to be another node, or the controller, is refused
// before a byte of the call is sent.
func TestTheDialerChecksThePeerIsTheNodeAsked(t *testing.T) {
	pki := netlab.NewPKI(t, t.TempDir(), DefaultPeerServerName)
	signer, err := peerid.NewSigner(pki.CA, pki.CAKey, time.Hour)
	require.NoError(t, err)
	nodeLink := func(node string) *peerLink {
		k := peerid.NewKept(peerid.Node(node), func(_ context.Context, csr []byte) (*peerid.Issued, error) {
			return signer.Sign(csr, peerid.Node(node))
		})
		_, err := k.Renew(context.Background())
		require.NoError(t, err)
		return &peerLink{ids: k}
	}
	holderA, impostor := servePeer(t, nodeLink("node-a")), servePeer(t, nodeLink("node-m"))
	controllerAsServer := servePeer(t, &peerLink{ids: signer})
	dial := nodeLink("node-c").dialer(time.Second)

	for _, tc := range []struct {
		name, node, address string
		reached             bool
	}{
		{name: "the node asked for", node: "node-a", address: holderA, reached: true},
		{name: "another node at the address", node: "node-a", address: impostor},
		{name: "the controller at the address", node: "node-a", address: controllerAsServer},
		{name: "a relay a holder named no node for: any node", node: "", address: impostor, reached: true},
		{name: "a relay a holder named no node for: not the controller", node: "", address: controllerAsServer},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, conn, err := dial(tc.node, tc.address)
			require.NoError(t, err)
			defer conn.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err = client.Chain(ctx, "ci", volume.Ref{Namespace: "ci", Handle: "v"})
			var pe *streamer.PeerError
			require.True(t, errors.As(err, &pe), "%v", err)
			if tc.reached {
				require.Equal(t, codes.Unimplemented, pe.Code, "%v", err)
				return
			}
			require.Equal(t, codes.Unavailable, pe.Code, "%v", err)
			require.ErrorContains(t, err, peerid.ErrWrongPeer.Error())
		})
	}
}
