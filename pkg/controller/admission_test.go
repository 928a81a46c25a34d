package controller

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/client"
)

// heldRegistry answers a report once the test lets it.
type heldRegistry struct {
	controllerv1.UnimplementedRegistryServer
	entered chan string
	release chan struct{}
}

func (h *heldRegistry) Report(ctx context.Context, req *controllerv1.ReportRequest) (*controllerv1.ReportResponse, error) {
	h.entered <- req.GetNodeId()
	select {
	case <-h.release:
	case <-ctx.Done():
	}
	return &controllerv1.ReportResponse{}, nil
}

// gatedRegistry serves heldRegistry behind gate on loopback.
func gatedRegistry(t *testing.T, gate *FullReports) (controllerv1.RegistryClient, *grpc.ClientConn, *heldRegistry) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	h := &heldRegistry{entered: make(chan string, 10), release: make(chan struct{})}
	srv := grpc.NewServer(grpc.InTapHandle(gate.Tap))
	controllerv1.RegisterRegistryServer(srv, h)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return controllerv1.NewRegistryClient(conn), conn, h
}

func fullCtx(ctx context.Context) context.Context {
	return metadata.AppendToOutgoingContext(ctx, controllerv1.ReportKindHeader, controllerv1.ReportKindFull)
}

// report sends node's report in the background and returns its answer's
// error.
func report(ctx context.Context, reg controllerv1.RegistryClient, node string) <-chan error {
	done := make(chan error, 1)
	go func() {
		_, err := reg.Report(ctx, &controllerv1.ReportRequest{NodeId: node, StoreId: "s", Full: true})
		done <- err
	}()
	return done
}

func entered(t *testing.T, h *heldRegistry, node string) {
	t.Helper()
	select {
	case got := <-h.entered:
		require.Equal(t, node, got)
	case <-time.After(5 * time.Second):
		t.Fatalf("%s's report never reached the handler", node)
	}
}

// With its one slot taken, the gate turns a second full report away before
// reading it, telling it when to come back; a heartbeat passes; the slot
// is free again once the first is answered.
func TestFullReportsAdmitsAFewAtOnce(t *testing.T) {
	gate := NewFullReports(1)
	reg, _, h := gatedRegistry(t, gate)
	ctx := context.Background()

	first := report(fullCtx(ctx), reg, "node-a")
	entered(t, h, "node-a")

	_, err := reg.Report(fullCtx(ctx), &controllerv1.ReportRequest{NodeId: "node-b", StoreId: "s", Full: true})
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	after, ok := client.RetryAfter(err)
	require.True(t, ok, "a RetryInfo in %v", err)
	require.Equal(t, fullReportRetry, after)
	require.Equal(t, 1.0, counted(t, gate, "deferred"))

	heartbeat := report(ctx, reg, "node-c") // no header: not gated
	entered(t, h, "node-c")

	h.release <- struct{}{}
	h.release <- struct{}{}
	require.NoError(t, <-first)
	require.NoError(t, <-heartbeat)
	again := report(fullCtx(ctx), reg, "node-b")
	entered(t, h, "node-b")
	h.release <- struct{}{}
	require.NoError(t, <-again)
	require.Equal(t, 2.0, counted(t, gate, "admitted"))
}

// A caller that gives up gives its slot back at once; one that sends its
// header and stalls, after the longest hold.
func TestFullReportsSlotsComeBack(t *testing.T) {
	tests := []struct {
		name    string
		holdFor time.Duration
		take    func(t *testing.T, reg controllerv1.RegistryClient, conn *grpc.ClientConn, h *heldRegistry)
	}{
		{"the caller cancels", time.Hour, func(t *testing.T, reg controllerv1.RegistryClient, _ *grpc.ClientConn, h *heldRegistry) {
			ctx, cancel := context.WithCancel(fullCtx(t.Context()))
			gone := report(ctx, reg, "node-a")
			entered(t, h, "node-a")
			cancel()
			require.Equal(t, codes.Canceled, status.Code(<-gone))
		}},
		{"the caller stalls after its header", 300 * time.Millisecond, func(t *testing.T, _ controllerv1.RegistryClient, conn *grpc.ClientConn, _ *heldRegistry) {
			// A stream sends its header at once and its message only when
			// told: this one never is.
			_, err := conn.NewStream(fullCtx(t.Context()), &grpc.StreamDesc{ClientStreams: true}, controllerv1.Registry_Report_FullMethodName)
			require.NoError(t, err)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			gate := NewFullReports(1)
			gate.holdFor = tc.holdFor
			reg, conn, h := gatedRegistry(t, gate)
			tc.take(t, reg, conn, h)
			deadline := time.Now().Add(5 * time.Second)
			for {
				done := report(fullCtx(t.Context()), reg, "node-b")
				select {
				case got := <-h.entered:
					require.Equal(t, "node-b", got)
					h.release <- struct{}{}
					require.NoError(t, <-done)
					return
				case err := <-done:
					require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
				}
				require.True(t, time.Now().Before(deadline), "the slot never came back")
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}

func counted(t *testing.T, gate *FullReports, result string) float64 {
	t.Helper()
	return testutil.ToFloat64(gate.counted.WithLabelValues(result))
}

// Room is kept for a node told to send its inventory: its report is read
// even when every other slot is taken, others are told to wait while it
// is kept, and room not used is given back after grantFor.
func TestFullReportsKeepsRoomForThoseItTold(t *testing.T) {
	gate := NewFullReports(2)
	now := time.Now()
	require.Zero(t, gate.Grant("node-a", now))
	require.Zero(t, gate.Grant("node-a", now), "asked again: still kept")
	require.True(t, gate.admit("", now), "one slot of two is free")
	require.Equal(t, fullReportRetry, gate.Grant("node-b", now), "the last slot is node-a's")
	require.False(t, gate.admit("node-b", now))
	require.False(t, gate.admit("", now))
	require.True(t, gate.admit("node-a", now))
	require.False(t, gate.admit("node-a", now), "room is kept once")
	require.Equal(t, 1.0, counted(t, gate, "told_to_wait"))

	gate = NewFullReports(1)
	require.Zero(t, gate.Grant("node-a", now))
	require.Equal(t, fullReportRetry, gate.Grant("node-b", now))
	later := now.Add(fullReportGrant + time.Second)
	require.Zero(t, gate.Grant("node-b", later), "node-a did not come: its room went to node-b")
	require.False(t, gate.admit("node-a", later))
	require.True(t, gate.admit("node-b", later))
}
