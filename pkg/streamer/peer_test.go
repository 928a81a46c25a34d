package streamer

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	peerv1 "github.com/concourse/cowvol/api/peer/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// An upload's reader yields the data messages after the header as one
// stream, ends cleanly at the sender's end, and breaks at a second header
// or a failed stream, saying which.
func TestUploadReader(t *testing.T) {
	header := &peerv1.WriteVolumeChunk{Part: &peerv1.WriteVolumeChunk_Volume{Volume: &peerv1.LayerVolume{}}}
	data := func(s string) *peerv1.WriteVolumeChunk {
		return &peerv1.WriteVolumeChunk{Part: &peerv1.WriteVolumeChunk_Data{Data: []byte(s)}}
	}
	broken := status.Error(codes.Canceled, "the client went away")
	tests := []struct {
		name     string
		messages []*peerv1.WriteVolumeChunk
		end      error
		want     string
		wantCode codes.Code // of Failed; OK: none
	}{
		{"data to the end", []*peerv1.WriteVolumeChunk{data("ab"), data(""), data("cd")}, io.EOF, "abcd", codes.OK},
		{"nothing but the header", nil, io.EOF, "", codes.OK},
		{"a second header", []*peerv1.WriteVolumeChunk{data("ab"), header, data("cd")}, io.EOF, "ab", codes.InvalidArgument},
		{"a broken stream", []*peerv1.WriteVolumeChunk{data("ab")}, broken, "ab", codes.Canceled},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			i := 0
			r := NewUploadReader(func() (*peerv1.WriteVolumeChunk, error) {
				if i == len(tc.messages) {
					return nil, tc.end
				}
				i++
				return tc.messages[i-1], nil
			}, func(m *peerv1.WriteVolumeChunk) bool { return m.GetVolume() != nil })
			got, err := io.ReadAll(r)
			require.Equal(t, tc.want, string(got))
			require.Equal(t, int64(len(tc.want)), r.N)
			if tc.wantCode == codes.OK {
				require.NoError(t, err)
				require.NoError(t, r.Failed())
				return
			}
			require.Error(t, err)
			require.Equal(t, tc.wantCode, status.Code(r.Failed()))
		})
	}
}

// hangingPeer sends each stream a chunk of data every gap, then hangs
// (alive, its stream open) once it has sent chunks of them.
type hangingPeer struct {
	peerv1.UnimplementedPeerServer
	chunks int
	gap    time.Duration
}

func (p hangingPeer) send(ctx context.Context, send func(*peerv1.PullLayerChunk) error) error {
	for range p.chunks {
		if err := send(&peerv1.PullLayerChunk{Part: &peerv1.PullLayerChunk_Data{Data: make([]byte, 512)}}); err != nil {
			return err
		}
		time.Sleep(p.gap)
	}
	<-ctx.Done()
	return ctx.Err()
}

func (p hangingPeer) PullLayer(_ *peerv1.PullLayerRequest, s grpc.ServerStreamingServer[peerv1.PullLayerChunk]) error {
	return p.send(s.Context(), s.Send)
}

func (p hangingPeer) ReadLayerFile(_ *peerv1.ReadLayerFileRequest, s grpc.ServerStreamingServer[peerv1.PullLayerChunk]) error {
	return p.send(s.Context(), s.Send)
}

func (p hangingPeer) ReadVolume(_ *peerv1.ReadVolumeRequest, s grpc.ServerStreamingServer[peerv1.PullLayerChunk]) error {
	return p.send(s.Context(), s.Send)
}

// A peer that stops sending mid-stream, alive, breaks off each kind of
// stream with ErrStalled once nothing came for the client's stall; a slow
// peer that keeps sending does not.
func TestStalledPeer(t *testing.T) {
	const stall = 300 * time.Millisecond
	ref := volume.Ref{Namespace: "ci", Handle: "src"}
	reads := []struct {
		name string
		read func(c *Client) error
	}{
		{"a layer's stream", func(c *Client) error {
			_, err := c.PullLayerFiles(context.Background(), LayerStream{Namespace: "ci", Ref: ref, Via: ref, Encoding: Raw, Shape: DataTar}, Swarmed{},
				nil, DefaultLimits, func(string, int64, func(io.WriterAt) error) error { return nil })
			return err
		}},
		{"a layer file", func(c *Client) error {
			_, err := c.ReadLayerFile(context.Background(), "ci", ref, ref, "f", 0, 0, discardAt{})
			return err
		}},
		{"a volume read", func(c *Client) error {
			_, err := c.ReadVolume(context.Background(), "ci", ref, "f", FormatFile, Raw, func([]byte, int64) error { return nil })
			return err
		}},
	}
	peers := []struct {
		name string
		peer hangingPeer
	}{
		{"hangs after two chunks", hangingPeer{chunks: 2, gap: 10 * time.Millisecond}},
		{"sends a chunk every half stall, then hangs", hangingPeer{chunks: 6, gap: stall / 2}},
	}
	for _, p := range peers {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		srv := grpc.NewServer()
		peerv1.RegisterPeerServer(srv, p.peer)
		go func() { _ = srv.Serve(lis) }()
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		require.NoError(t, err)
		for _, r := range reads {
			t.Run(p.name+", "+r.name, func(t *testing.T) {
				start := time.Now()
				err := r.read(NewClient(conn, stall))
				require.ErrorIs(t, err, ErrStalled)
				took := time.Since(start)
				require.GreaterOrEqual(t, took, time.Duration(p.peer.chunks-1)*p.peer.gap+stall, "a peer that kept sending was cut off")
				require.Less(t, took, time.Duration(p.peer.chunks)*p.peer.gap+10*stall)
			})
		}
		conn.Close()
		srv.Stop()
	}
}

// discardAt takes any write at any offset.
type discardAt struct{}

func (discardAt) WriteAt(p []byte, _ int64) (int, error) { return len(p), nil }
