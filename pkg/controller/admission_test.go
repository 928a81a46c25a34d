package controller

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/proto"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// With its one slot taken, the gate defers a second node, telling it when
// to come back; the slot is free again once the first is released, and
// after the longest hold if it never is.
func TestFullReportsAdmitsAFewAtOnce(t *testing.T) {
	gate := NewFullReports(1)
	now := time.Now()
	release, err := gate.Take("node-a", now)
	require.NoError(t, err)

	_, err = gate.Take("node-b", now)
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	after, ok := client.RetryAfter(err)
	require.True(t, ok, "a RetryInfo in %v", err)
	require.Equal(t, fullReportRetry, after)
	require.Equal(t, 1.0, counted(t, gate, "deferred"))

	release()
	release() // twice: given back once
	second, err := gate.Take("node-b", now)
	require.NoError(t, err)
	_, err = gate.Take("node-c", now)
	require.Error(t, err, "released twice, the slot came back once")
	second()
	require.Equal(t, 2.0, counted(t, gate, "admitted"))

	gate = NewFullReports(1)
	gate.holdFor = 100 * time.Millisecond
	_, err = gate.Take("node-a", now) // never released: a stalled report
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		release, err := gate.Take("node-b", time.Now())
		if err == nil {
			release()
		}
		return err == nil
	}, 5*time.Second, 20*time.Millisecond, "the slot came back after the hold")
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

// registryOnLoopback serves a view's Registry as the controller does, with
// gate, and returns a client of it.
func registryOnLoopback(t *testing.T, v *fleet.View, gate *FullReports) controllerv1.RegistryClient {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(append(ServerOptions(), grpc.MaxRecvMsgSize(controllerv1.MaxMessage))...)
	Register(srv, Services{View: v, Orders: fleet.NewReadOrders(1 << 20), FullReports: gate, Metrics: fleet.NewMetrics(v)})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return controllerv1.NewRegistryClient(conn)
}

// inventory is a whole inventory of n volumes.
func inventory(node string, n int) *controllerv1.ReportRequest {
	req := &controllerv1.ReportRequest{NodeId: node, StoreId: "s", Revision: 1, Full: true}
	for i := range n {
		req.Upserts = append(req.Upserts, &controllerv1.VolumeSummary{Ref: &controllerv1.VolumeRef{Namespace: "ci", Handle: fmt.Sprintf("volume-%06d-%s", i, node)},
			State: "ready", SizeBytes: 1 << 20})
	}
	return req
}

// sendParts sends req through SendReport in parts, node in the header.
func sendParts(ctx context.Context, reg controllerv1.RegistryClient, node string, req *controllerv1.ReportRequest) error {
	raw, err := proto.Marshal(req)
	if err != nil {
		return err
	}
	_, err = client.SendReportParts(ctx, reg, node, raw)
	return err
}

// A whole inventory is gated by what it is, whatever its headers say: in
// one message or in parts it waits for room, a heartbeat never does; an
// inventory bigger than a message arrives whole in parts, and parts that
// say they are another node's are refused.
func TestReportsAreGatedByWhatTheyAre(t *testing.T) {
	v := fleet.NewView(time.Minute, time.Hour)
	gate := NewFullReports(1)
	reg := registryOnLoopback(t, v, gate)
	ctx := t.Context()

	release, err := gate.Take("someone-else", time.Now())
	require.NoError(t, err)
	_, err = reg.Report(ctx, inventory("node-a", 3))
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "a whole inventory without a header: %v", err)
	err = sendParts(ctx, reg, "node-b", inventory("node-b", 3))
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "a report in parts: %v", err)
	_, err = reg.Report(ctx, &controllerv1.ReportRequest{NodeId: "node-c", StoreId: "s"})
	require.NoError(t, err, "a heartbeat needs no room")
	release()

	big := inventory("node-b", 120_000)
	require.Greater(t, proto.Size(big), controllerv1.MaxMessage, "bigger than a message")
	_, err = reg.Report(ctx, big)
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "in one message: %v", err)
	require.NoError(t, sendParts(ctx, reg, "node-b", big))
	last, err := refFromWire(big.Upserts[119_999].GetRef())
	require.NoError(t, err)
	require.True(t, v.Lookup([]volume.Ref{last}, 0, time.Now())[0].Found, "the last part's volume is held")

	err = sendParts(ctx, reg, "node-a", inventory("node-b", 3))
	require.Equal(t, codes.InvalidArgument, status.Code(err), "parts for node-a saying node-b: %v", err)
	err = sendParts(ctx, reg, "", inventory("node-b", 3))
	require.Equal(t, codes.InvalidArgument, status.Code(err), "parts naming no node: %v", err)
}

// The controller reads at most so many calls' messages at once: one more
// is turned away before its message is read, told when to retry; a unary
// call's slot comes back once its message is read, a stream's when it
// ends; and a call turned away for its token takes no slot.
func TestMessagesAtOnce(t *testing.T) {
	msgs := NewMessages(2)
	admit := Tap(nil, msgs)
	info := &tap.Info{FullMethodName: controllerv1.Cache_LookupVolumes_FullMethodName}
	unary, err := admit(context.Background(), info)
	require.NoError(t, err)
	streamCtx, endStream := context.WithCancel(context.Background())
	_, err = admit(streamCtx, info)
	require.NoError(t, err)
	_, err = admit(context.Background(), info)
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	_, retry := client.RetryAfter(err)
	require.True(t, retry, "told when to retry")
	require.Equal(t, 1.0, testutil.ToFloat64(msgs.turnedAway))

	messageRead(unary)
	messageRead(unary) // once only
	_, err = admit(context.Background(), info)
	require.NoError(t, err, "the unary call's message was read")
	_, err = admit(context.Background(), info)
	require.Error(t, err)
	endStream()
	require.Eventually(t, func() bool {
		_, err := admit(context.Background(), info)
		return err == nil
	}, 5*time.Second, 10*time.Millisecond, "the stream ended")

	path := filepath.Join(t.TempDir(), "tokens")
	require.NoError(t, os.WriteFile(path, []byte("ci-token-0123456789ab,ci-scheduler,ci\n"), 0o600))
	tokens, err := LoadTokens(path)
	require.NoError(t, err)
	full := NewMessages(1)
	_, err = Tap(tokens, full)(context.Background(), &tap.Info{FullMethodName: info.FullMethodName, Header: metadata.MD{}})
	require.Equal(t, codes.Unauthenticated, status.Code(err))
	require.Len(t, full.slots, 0, "no slot for a call without a token")
}
