package streamer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	peerv1 "github.com/concourse/cowvol/api/peer/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// A swarm chains its members in the order they join, the first pulling
// from the holder; the last member asking again starts another; a swarm whose
// first stream ended a while ago, or failed, takes no more, and a new one
// starts.
func TestSwarmJoins(t *testing.T) {
	layer := swarmKey{ref: volume.Ref{Namespace: "ci", Handle: "out"}, enc: S2}
	type join struct {
		key       swarmKey
		addr      string
		after     time.Duration // on the clock, before the join
		endFirst  *error        // end the first stream before the join
		wantUp    string        // "": from the holder
		sameSwarm int           // the index of an earlier join in the same swarm (-1: a new one)
	}
	ok, failed := error(nil), errors.New("the link broke")
	tests := []struct {
		name  string
		joins []join
	}{
		{"a chain in join order", []join{
			{key: layer, addr: "b", sameSwarm: -1},
			{key: layer, addr: "c", wantUp: "b", sameSwarm: 0},
			{key: layer, addr: "d", wantUp: "c", sameSwarm: 0},
		}},
		{"the last member asking again starts a new swarm", []join{
			{key: layer, addr: "b", sameSwarm: -1},
			{key: layer, addr: "c", wantUp: "b", sameSwarm: 0},
			{key: layer, addr: "c", sameSwarm: -1},
			{key: layer, addr: "d", wantUp: "c", sameSwarm: 2},
		}},
		{"another member asking again joins at the end", []join{
			{key: layer, addr: "b", sameSwarm: -1},
			{key: layer, addr: "c", wantUp: "b", sameSwarm: 0},
			{key: layer, addr: "b", wantUp: "c", sameSwarm: 0},
		}},
		{"another encoding is another swarm", []join{
			{key: layer, addr: "b", sameSwarm: -1},
			{key: swarmKey{ref: layer.ref, enc: Zstd}, addr: "c", sameSwarm: -1},
		}},
		{"a swarm whose first stream ended takes no more", []join{
			{key: layer, addr: "b", sameSwarm: -1},
			{key: layer, addr: "c", endFirst: &ok, sameSwarm: -1},
		}},
		{"a swarm whose first stream failed takes no more", []join{
			{key: layer, addr: "b", sameSwarm: -1},
			{key: layer, addr: "c", endFirst: &failed, sameSwarm: -1},
		}},
		{"members join while the first stream runs", []join{
			{key: layer, addr: "b", sameSwarm: -1},
			{key: layer, addr: "c", after: swarmJoinWindow / 2, wantUp: "b", sameSwarm: 0},
			{key: layer, addr: "d", after: swarmJoinWindow / 2, wantUp: "c", sameSwarm: 0},
		}},
		{"a swarm no one joined for a while takes no more", []join{
			{key: layer, addr: "b", sameSwarm: -1},
			{key: layer, addr: "c", after: swarmJoinWindow, sameSwarm: -1},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			now := time.Unix(1_000_000, 0)
			ss := newSwarms()
			ss.clock = func() time.Time { return now }
			var got []joined
			for i, j := range tc.joins {
				if j.endFirst != nil {
					w, first := ss.first(got[0].swarm, tc.joins[0].key)
					require.True(t, first)
					ss.ended(w, Summary{Bytes: 1}, *j.endFirst)
				}
				now = now.Add(j.after)
				g := ss.join(j.key, member{addr: j.addr, token: j.addr + "-token"})
				got = append(got, g)
				require.NotEmpty(t, g.swarm, "join %d", i)
				assert.Equal(t, j.wantUp, g.up.addr, "join %d's upstream", i)
				if j.wantUp != "" {
					assert.Equal(t, j.wantUp+"-token", g.up.token)
				}
				if j.sameSwarm >= 0 {
					assert.Equal(t, got[j.sameSwarm].swarm, g.swarm, "join %d's swarm", i)
					continue
				}
				for k := range i {
					assert.NotEqual(t, got[k].swarm, g.swarm, "join %d starts a swarm", i)
				}
			}
		})
	}
}

// A holder forgets the swarms no one can join or ask about any more.
func TestSwarmsAreForgotten(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	ss := newSwarms()
	ss.clock = func() time.Time { return now }
	for i := range 100 {
		ss.join(swarmKey{ref: volume.Ref{Namespace: "ci", Handle: fmt.Sprintf("out-%d", i)}, enc: S2}, member{addr: "b", token: "t"})
	}
	now = now.Add(swarmJoinWindow)
	ss.join(swarmKey{ref: volume.Ref{Namespace: "ci", Handle: "new"}, enc: S2}, member{addr: "b", token: "t"})
	require.Len(t, ss.open, 1, "swarms that take no members are closed")
	require.Len(t, ss.byID, 101, "their digests are still answered")
	now = now.Add(swarmKeep + time.Second)
	ss.join(swarmKey{ref: volume.Ref{Namespace: "ci", Handle: "newer"}, enc: S2}, member{addr: "b", token: "t"})
	require.Len(t, ss.byID, 1)
	require.Len(t, ss.open, 1)
}

// A swarm's digest is its first stream's, waited for; one stream only is
// the first; a failed first stream, another layer's ask, or an unknown
// swarm get no digest.
func TestSwarmDigest(t *testing.T) {
	ref := volume.Ref{Namespace: "ci", Handle: "out"}
	ss := newSwarms()
	j := ss.join(swarmKey{ref: ref, enc: S2}, member{addr: "b", token: "t"})
	_, first := ss.first(j.swarm, swarmKey{ref: ref, enc: Zstd})
	require.False(t, first, "another encoding's stream is not the first")
	w, first := ss.first(j.swarm, swarmKey{ref: ref, enc: S2})
	require.True(t, first)
	_, again := ss.first(j.swarm, swarmKey{ref: ref, enc: S2})
	require.False(t, again, "a swarm has one first stream")

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := ss.digest(ctx, j.swarm, ref)
	require.ErrorIs(t, err, context.DeadlineExceeded, "not before the first stream ends")
	go ss.ended(w, Summary{Bytes: 10, Entries: 2, Digest: "xxh64:0011"}, nil)
	sum, err := ss.digest(context.Background(), j.swarm, ref)
	require.NoError(t, err)
	require.Equal(t, Summary{Bytes: 10, Entries: 2, Digest: "xxh64:0011"}, sum)

	_, err = ss.digest(context.Background(), j.swarm, volume.Ref{Namespace: "ci", Handle: "other"})
	require.ErrorIs(t, err, ErrNotHeld)
	_, err = ss.digest(context.Background(), "no-such-swarm", ref)
	require.ErrorIs(t, err, ErrNotHeld)

	j2 := ss.join(swarmKey{ref: ref, enc: Zstd}, member{addr: "b", token: "t"})
	w2, _ := ss.first(j2.swarm, swarmKey{ref: ref, enc: Zstd})
	ss.ended(w2, Summary{}, errors.New("the link broke"))
	_, err = ss.digest(context.Background(), j2.swarm, ref)
	require.ErrorIs(t, err, ErrSwarmFailed)
}

// A spool's reader gets what was appended, waiting for more, then the end
// or the failure; a spool has one reader; what it read is punched out;
// the file closes once both its pull and its reader let go, or after the
// grace if no reader comes.
func TestSpool(t *testing.T) {
	t.Run("read as it grows, to the end", func(t *testing.T) {
		sp, err := NewSpool(t.TempDir(), S2, nil)
		require.NoError(t, err)
		r, err := sp.Take()
		require.NoError(t, err)
		defer r.Close()
		_, err = sp.Take()
		require.ErrorIs(t, err, ErrSpoolTaken)
		sp.Append([]byte("abc"))
		buf := make([]byte, 2)
		n, _, err := r.Next(context.Background(), buf)
		require.NoError(t, err)
		require.Equal(t, "ab", string(buf[:n]))
		n, _, err = r.Next(context.Background(), buf)
		require.NoError(t, err)
		require.Equal(t, "c", string(buf[:n]))
		go func() {
			time.Sleep(20 * time.Millisecond)
			sp.Append([]byte("d"))
			sp.End(Summary{Bytes: 4})
		}()
		n, _, err = r.Next(context.Background(), buf)
		require.NoError(t, err, "waits for more")
		require.Equal(t, "d", string(buf[:n]))
		_, sum, err := r.Next(context.Background(), buf)
		require.ErrorIs(t, err, io.EOF)
		require.Equal(t, int64(4), sum.Bytes)
		sp.Fail(errors.New("too late"))
		_, _, err = r.Next(context.Background(), buf)
		require.ErrorIs(t, err, io.EOF, "an ended spool stays ended")
	})
	t.Run("a failure reaches the reader after what was appended", func(t *testing.T) {
		sp, err := NewSpool(t.TempDir(), S2, nil)
		require.NoError(t, err)
		r, err := sp.Take()
		require.NoError(t, err)
		defer r.Close()
		sp.Append([]byte("ab"))
		sp.Fail(errors.New("the link broke"))
		buf := make([]byte, 8)
		n, _, err := r.Next(context.Background(), buf)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		_, _, err = r.Next(context.Background(), buf)
		require.ErrorContains(t, err, "the link broke")
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		sp2, err := NewSpool(t.TempDir(), S2, nil)
		require.NoError(t, err)
		r2, err := sp2.Take()
		require.NoError(t, err)
		_, _, err = r2.Next(ctx, buf)
		require.ErrorIs(t, err, context.Canceled, "a reader waiting for more leaves with its context")
	})
	t.Run("a reader too far behind fails, after what it was sent", func(t *testing.T) {
		defer func(was int64) { maxSpoolBacklog = was }(maxSpoolBacklog)
		maxSpoolBacklog = 4 << 10
		sp, err := NewSpool(t.TempDir(), S2, nil)
		require.NoError(t, err)
		r, err := sp.Take()
		require.NoError(t, err)
		defer r.Close()
		buf := make([]byte, 8<<10)
		sp.Append(make([]byte, 3<<10))
		n, _, err := r.Next(context.Background(), buf)
		require.NoError(t, err)
		require.Equal(t, 3<<10, n)
		sp.Append(make([]byte, 3<<10)) // 3 KiB behind: kept
		sp.Append(make([]byte, 2<<10)) // 5 KiB behind: too far
		n, _, err = r.Next(context.Background(), buf)
		require.NoError(t, err)
		require.Equal(t, 3<<10, n, "what was kept is read")
		_, _, err = r.Next(context.Background(), buf)
		require.ErrorIs(t, err, ErrSpoolBacklog)

		lonely, err := NewSpool(t.TempDir(), S2, nil)
		require.NoError(t, err)
		lonely.Append(make([]byte, 5<<10))
		late, err := lonely.Take()
		require.NoError(t, err)
		_, _, err = late.Next(context.Background(), buf)
		require.ErrorIs(t, err, ErrSpoolBacklog, "a spool no reader came for holds no more than the backlog")
	})
	t.Run("what was read is punched out", func(t *testing.T) {
		sp, err := NewSpool(t.TempDir(), S2, nil)
		require.NoError(t, err)
		r, err := sp.Take()
		require.NoError(t, err)
		defer r.Close()
		chunk := make([]byte, 1<<20)
		for range 2 * punchEvery / len(chunk) {
			sp.Append(chunk)
		}
		allocated := func() int64 {
			var st unix.Stat_t
			require.NoError(t, unix.Fstat(int(sp.f.Fd()), &st))
			return st.Blocks * 512
		}
		require.GreaterOrEqual(t, allocated(), int64(2*punchEvery))
		for read := 0; read < punchEvery+len(chunk); {
			n, _, err := r.Next(context.Background(), chunk)
			require.NoError(t, err)
			read += n
		}
		require.LessOrEqual(t, allocated(), int64(punchEvery), "what the reader read is gone")
	})
	t.Run("closed once its pull and its reader let go", func(t *testing.T) {
		var closed atomic.Int32
		sp, err := NewSpool(t.TempDir(), S2, func() { closed.Add(1) })
		require.NoError(t, err)
		r, err := sp.Take()
		require.NoError(t, err)
		sp.Retire(0)
		require.Zero(t, closed.Load(), "its reader still reads")
		r.Close()
		require.Equal(t, int32(1), closed.Load())
		r.Close()
		require.Equal(t, int32(1), closed.Load(), "once")
	})
	t.Run("closed after the grace when no reader came", func(t *testing.T) {
		closed := make(chan struct{})
		dir := t.TempDir()
		sp, err := NewSpool(dir, S2, func() { close(closed) })
		require.NoError(t, err)
		sp.Append([]byte("abc"))
		sp.End(Summary{Bytes: 3})
		sp.Retire(20 * time.Millisecond)
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			t.Fatal("the spool was not closed")
		}
		_, err = sp.Take()
		require.ErrorIs(t, err, ErrSpoolTaken, "a closed spool has no reader")
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		require.Empty(t, entries, "a spool leaves no file")
	})
}

// tenantHolder holds one layer, for namespace ci only, and relays nothing.
type tenantHolder struct{ Holder }

func (tenantHolder) OpenLayer(namespace string, r, _ volume.Ref) (LayerFiles, func(), error) {
	if namespace != "ci" || r.Handle != "out" {
		return LayerFiles{}, nil, ErrNotHeld
	}
	return LayerFiles{Dir: "/nonexistent"}, func() {}, nil
}

func (tenantHolder) Relay(string, volume.Ref, volume.Ref, string) (*Spool, error) {
	return nil, ErrNotHeld
}

// The swarm's calls check what they are asked as PullLayer does, and
// answer another namespace as a holder that lacks the layer.
func TestSwarmRequests(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	NewServer(tenantHolder{}, nil, DefaultLimits).Register(srv)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	api := peerv1.NewPeerClient(conn)
	ctx := context.Background()
	out := &peerv1.VolumeRef{Namespace: "ci", Handle: "out"}
	token := NewRelayToken()
	join := func(mod func(*peerv1.JoinSwarmRequest)) func() error {
		return func() error {
			req := &peerv1.JoinSwarmRequest{Stream: &peerv1.PullLayerRequest{Namespace: "ci", Volume: out, Encoding: "s2"},
				RelayAddress: "10.0.0.2:7443", RelayToken: token}
			mod(req)
			_, err := api.JoinSwarm(ctx, req)
			return err
		}
	}
	pull := func(req *peerv1.PullLayerRequest) func() error {
		return func() error {
			stream, err := api.PullLayer(ctx, req)
			if err != nil {
				return err
			}
			_, err = stream.Recv()
			return err
		}
	}
	tests := []struct {
		name     string
		call     func() error
		wantCode codes.Code
	}{
		{"a join", join(func(*peerv1.JoinSwarmRequest) {}), codes.OK},
		{"a join for a malformed namespace", join(func(r *peerv1.JoinSwarmRequest) { r.Stream.Namespace = "Not_A_Namespace" }), codes.InvalidArgument},
		{"a join in an unknown encoding", join(func(r *peerv1.JoinSwarmRequest) { r.Stream.Encoding = "lz9" }), codes.InvalidArgument},
		{"a join that offers no relay", join(func(r *peerv1.JoinSwarmRequest) { r.RelayAddress = "" }), codes.InvalidArgument},
		{"a join of a stream of named files", join(func(r *peerv1.JoinSwarmRequest) { r.Stream.Files = []string{"a"} }), codes.InvalidArgument},
		{"a join of no stream", join(func(r *peerv1.JoinSwarmRequest) { r.Stream = nil }), codes.InvalidArgument},
		{"a join of a stub tree", join(func(r *peerv1.JoinSwarmRequest) { r.Stream.Stubs, r.Stream.InlineMax = true, 8192 }), codes.OK},
		{"a join with a malformed token", join(func(r *peerv1.JoinSwarmRequest) { r.RelayToken = "../../x" }), codes.InvalidArgument},
		{"a join for another namespace", join(func(r *peerv1.JoinSwarmRequest) { r.Stream.Namespace = "other" }), codes.NotFound},
		{"a digest of no swarm", func() error {
			_, err := api.GetSwarmDigest(ctx, &peerv1.GetSwarmDigestRequest{Namespace: "ci", Volume: out, Swarm: "nope"})
			return err
		}, codes.NotFound},
		{"a digest for another namespace", func() error {
			_, err := api.GetSwarmDigest(ctx, &peerv1.GetSwarmDigestRequest{Namespace: "other", Volume: out, Swarm: "nope"})
			return err
		}, codes.NotFound},
		{"a relay's stream of named files", pull(&peerv1.PullLayerRequest{Namespace: "ci", Volume: out, Encoding: "s2", RelayToken: token,
			Files: []string{"a"}, DataOnly: true}), codes.InvalidArgument},
		{"a relay's stream naming a swarm", pull(&peerv1.PullLayerRequest{Namespace: "ci", Volume: out, Encoding: "s2", RelayToken: token, Swarm: "x"}),
			codes.InvalidArgument},
		{"a relay's stream it does not have", pull(&peerv1.PullLayerRequest{Namespace: "ci", Volume: out, Encoding: "s2", RelayToken: token}),
			codes.NotFound},
		{"a swarm's first stream of named files", pull(&peerv1.PullLayerRequest{Namespace: "ci", Volume: out, Encoding: "s2", Swarm: "x",
			Files: []string{"a"}, DataOnly: true}), codes.InvalidArgument},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.wantCode, status.Code(tc.call()))
		})
	}
}
