package plugin

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
)

// TestLeadershipRefuses: a follower refuses every call; a leader whose view
// still awaits nodes' inventories refuses the Cache API's calls but
// ListNodes, and serves the Registry (through which the inventories come).
func TestLeadershipRefuses(t *testing.T) {
	settling := func() []string { return []string{"node-2", "node-3"} }
	settled := func() []string { return nil }
	tests := []struct {
		name      string
		leading   bool
		unsettled func() []string
		method    string
		wantCode  codes.Code
	}{
		{name: "follower", method: controllerv1.Cache_LookupVolumes_FullMethodName, wantCode: codes.Unavailable},
		{name: "follower, registry", method: controllerv1.Registry_Report_FullMethodName, wantCode: codes.Unavailable},
		{name: "leader", leading: true, method: controllerv1.Cache_LookupVolumes_FullMethodName, wantCode: codes.OK},
		{name: "leader without a view to wait for", leading: true, unsettled: nil, method: controllerv1.Cache_DestroyVolumes_FullMethodName, wantCode: codes.OK},
		{name: "settling leader, lookup", leading: true, unsettled: settling, method: controllerv1.Cache_LookupVolumes_FullMethodName, wantCode: codes.Unavailable},
		{name: "settling leader, destroy", leading: true, unsettled: settling, method: controllerv1.Cache_DestroyVolumes_FullMethodName, wantCode: codes.Unavailable},
		{name: "settling leader, place", leading: true, unsettled: settling, method: controllerv1.Cache_Place_FullMethodName, wantCode: codes.Unavailable},
		{name: "settling leader, list nodes", leading: true, unsettled: settling, method: controllerv1.Cache_ListNodes_FullMethodName, wantCode: codes.OK},
		{name: "settling leader, a node's report", leading: true, unsettled: settling, method: controllerv1.Registry_Report_FullMethodName, wantCode: codes.OK},
		{name: "settled leader", leading: true, unsettled: settled, method: controllerv1.Cache_DestroyVolumes_FullMethodName, wantCode: codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &leadership{self: "controller-0", unsettled: tt.unsettled}
			l.leading.Store(tt.leading)
			err := l.refuse(tt.method)
			assert.Equal(t, tt.wantCode, status.Code(err))
			if tt.unsettled != nil && err != nil {
				assert.Contains(t, err.Error(), "2 node(s) (node-2, node-3)")
			}
		})
	}
}

// TestFollowerClosesRefusedCallersConnections: over real TCP, a follower
// closes the connection of a call it refused, so that the caller's next
// call dials again (and a Service sends it to the leader); a leader keeps
// its callers' connections.
func TestFollowerClosesRefusedCallersConnections(t *testing.T) {
	tests := []struct {
		name      string
		leading   bool
		wantCode  codes.Code
		wantConns int32
	}{
		{name: "follower", wantCode: codes.Unavailable, wantConns: 3},
		{name: "leader", leading: true, wantCode: codes.OK, wantConns: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &leadership{self: "controller-1", callers: newCallerConns()}
			l.leading.Store(tt.leading)
			l.leader.Store("controller-0")
			var accepted atomic.Int32
			lis, err := l.callers.listen(func() (net.Listener, error) {
				inner, err := net.Listen("tcp", "127.0.0.1:0")
				return &countingListener{Listener: inner, accepted: &accepted}, err
			})()
			require.NoError(t, err)
			srv := grpc.NewServer(grpc.ChainUnaryInterceptor(l.interceptor("/grpc.health.v1.")))
			healthpb.RegisterHealthServer(srv, health.NewServer())
			go func() { _ = srv.Serve(lis) }()
			t.Cleanup(srv.Stop)
			conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			require.NoError(t, err)
			t.Cleanup(func() { conn.Close() })
			for range 3 {
				_, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
				require.Equal(t, tt.wantCode, status.Code(err), "%v", err)
				time.Sleep(3 * callerCloseDelay)
			}
			assert.Equal(t, tt.wantConns, accepted.Load(), "connections the server accepted for 3 calls")
			l.callers.mu.Lock()
			defer l.callers.mu.Unlock()
			assert.LessOrEqual(t, len(l.callers.conns), 1, "closed connections are forgotten")
		})
	}
}

type countingListener struct {
	net.Listener
	accepted *atomic.Int32
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.accepted.Add(1)
	}
	return c, err
}
