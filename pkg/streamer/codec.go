package streamer

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	peerv1 "github.com/concourse/cowvol/api/peer/v1"
	"github.com/concourse/cowvol/internal/bufpool"
)

// chunkCodec decodes the chunks of a stream the client reads into slices
// lent by bufpool, which the reader gives back once it has used a chunk's
// data: the default codec makes a new slice for each chunk (a gigabyte
// pulled was a gigabyte for the garbage collector, and its zeroing). The
// bytes on the wire are protobuf's either way; what is not a data chunk
// (a trailer, a field it does not know) is decoded by protobuf.
type chunkCodec struct{}

// chunkCall is the call option that decodes a stream's chunks so.
var chunkCall = grpc.ForceCodecV2(chunkCodec{})

var protoCodec = encoding.GetCodecV2(grpcproto.Name)

func (chunkCodec) Name() string { return grpcproto.Name }

func (chunkCodec) Marshal(v any) (mem.BufferSlice, error) { return protoCodec.Marshal(v) }

func (chunkCodec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(*peerv1.PullLayerChunk)
	if !ok {
		return protoCodec.Unmarshal(data, v)
	}
	buf := bufpool.Get(data.Len())
	data.CopyTo(buf)
	if decodeDataChunk(buf, m) {
		return nil
	}
	defer bufpool.Put(buf)
	return proto.Unmarshal(buf, m)
}

// decodeDataChunk decodes b, a PullLayerChunk that holds data and perhaps
// a total and nothing else, into m, its data moved to the start of b (m's
// data is then b's, to give back with releaseChunk); anything else is
// left to protobuf (false).
func decodeDataChunk(b []byte, m *peerv1.PullLayerChunk) bool {
	var data []byte
	var total int64
	seenData, seenTotal := false, false
	for rest := b; len(rest) > 0; {
		num, typ, n := protowire.ConsumeTag(rest)
		if n < 0 {
			return false
		}
		rest = rest[n:]
		switch {
		case num == 1 && typ == protowire.BytesType && !seenData:
			v, n := protowire.ConsumeBytes(rest)
			if n < 0 {
				return false
			}
			data, seenData, rest = v, true, rest[n:]
		case num == 3 && typ == protowire.VarintType && !seenTotal:
			v, n := protowire.ConsumeVarint(rest)
			if n < 0 {
				return false
			}
			total, seenTotal, rest = int64(v), true, rest[n:]
		default:
			return false
		}
	}
	if !seenData {
		return false
	}
	moved := b[:copy(b, data)]
	m.Reset()
	m.Part, m.TotalBytes = &peerv1.PullLayerChunk_Data{Data: moved}, total
	return true
}

// releaseChunk gives back the data of a chunk chunkCodec decoded, which
// its reader no longer uses.
func releaseChunk(m *peerv1.PullLayerChunk) {
	if d := m.GetData(); d != nil {
		bufpool.Put(d)
	}
}
