package streamer

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	peerv1 "github.com/concourse/cowvol/api/peer/v1"
)

// chunkCodec decodes every chunk as protobuf does, data chunks into lent
// slices, and refuses what protobuf refuses.
func TestChunkCodec(t *testing.T) {
	data := func(b []byte, total int64) []byte {
		out, err := proto.Marshal(&peerv1.PullLayerChunk{Part: &peerv1.PullLayerChunk_Data{Data: b}, TotalBytes: total})
		require.NoError(t, err)
		return out
	}
	big := make([]byte, 1<<20)
	for i := range big {
		big[i] = byte(i * 7)
	}
	trailer, err := proto.Marshal(&peerv1.PullLayerChunk{Part: &peerv1.PullLayerChunk_Trailer{Trailer: &peerv1.Trailer{Bytes: 3, Entries: 1, Digest: "sha256:x"}}})
	require.NoError(t, err)
	totalFirst := protowire.AppendVarint(protowire.AppendTag(nil, 3, protowire.VarintType), 42)
	totalFirst = protowire.AppendBytes(protowire.AppendTag(totalFirst, 1, protowire.BytesType), []byte("abc"))
	unknown := protowire.AppendVarint(protowire.AppendTag(data([]byte("abc"), 0), 9, protowire.VarintType), 1)
	twice := append(data([]byte("abc"), 0), data([]byte("de"), 0)...)
	tests := []struct {
		name     string
		wire     []byte
		wantLent bool // decoded into a lent slice
		wantErr  bool
	}{
		{"data", data([]byte("abc"), 0), true, false},
		{"data and a total", data([]byte("abc"), 7), true, false},
		{"a MiB of data", data(big, 0), true, false},
		{"empty data", data([]byte{}, 0), true, false},
		{"the total first", totalFirst, true, false},
		{"a trailer", trailer, false, false},
		{"a field it does not know", unknown, false, false},
		{"data twice (the last counts)", twice, false, false},
		{"nothing", nil, false, false},
		{"cut short", data([]byte("abcdef"), 0)[:4], false, true},
	}
	// gRPC hands a message over in the pieces its frames brought it in.
	split := func(b []byte, n int) mem.BufferSlice {
		var out mem.BufferSlice
		for len(b) > n {
			out, b = append(out, mem.SliceBuffer(b[:n])), b[n:]
		}
		return append(out, mem.SliceBuffer(b))
	}
	for _, tc := range tests {
		for _, pieces := range []struct {
			name string
			size int
		}{{"whole", len(tc.wire) + 1}, {"in 3-byte pieces", 3}, {"in 16 KiB pieces", 16 << 10}} {
			t.Run(tc.name+", "+pieces.name, func(t *testing.T) {
				var got peerv1.PullLayerChunk
				err := chunkCodec{}.Unmarshal(split(tc.wire, pieces.size), &got)
				var want peerv1.PullLayerChunk
				wantErr := proto.Unmarshal(tc.wire, &want)
				if tc.wantErr {
					require.Error(t, err)
					require.Error(t, wantErr)
					return
				}
				require.NoError(t, err)
				require.True(t, proto.Equal(&want, &got), "got %v, want %v", &got, &want)
				var m peerv1.PullLayerChunk
				require.Equal(t, tc.wantLent, decodeDataChunk(split(tc.wire, pieces.size), &m))
				releaseChunk(&got)
			})
		}
	}
}

// Requests and other messages pass through to protobuf.
func TestChunkCodecOtherMessages(t *testing.T) {
	req := &peerv1.PullLayerRequest{Namespace: "ci", Files: []string{"a", "b"}}
	wire, err := chunkCodec{}.Marshal(req)
	require.NoError(t, err)
	var got peerv1.PullLayerRequest
	require.NoError(t, chunkCodec{}.Unmarshal(wire, &got))
	require.True(t, proto.Equal(req, &got))
}
