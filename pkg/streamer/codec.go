package streamer

import (
	"encoding/binary"
	"io"

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
	if decodeDataChunk(data, m) {
		return nil
	}
	buf := bufpool.Get(data.Len())
	defer bufpool.Put(buf)
	data.CopyTo(buf)
	return proto.Unmarshal(buf, m)
}

// decodeDataChunk decodes data, a PullLayerChunk that holds data and
// perhaps a total and nothing else, into m, its data copied once, from
// gRPC's buffers into a lent slice (m's data is then that slice, to give
// back with releaseChunk); anything else is left to protobuf (false, m
// untouched).
func decodeDataChunk(data mem.BufferSlice, m *peerv1.PullLayerChunk) (ok bool) {
	r := data.Reader()
	defer r.Close()
	var lent []byte
	defer func() {
		if !ok && lent != nil {
			bufpool.Put(lent)
		}
	}()
	var total uint64
	seenTotal := false
	for r.Remaining() > 0 {
		tag, err := binary.ReadUvarint(r)
		if err != nil {
			return false
		}
		num, typ := protowire.DecodeTag(tag)
		switch {
		case num == 1 && typ == protowire.BytesType && lent == nil:
			n, err := binary.ReadUvarint(r)
			if err != nil || n > uint64(r.Remaining()) {
				return false
			}
			lent = bufpool.Get(int(n))
			if _, err := io.ReadFull(r, lent); err != nil {
				return false
			}
		case num == 3 && typ == protowire.VarintType && !seenTotal:
			if total, err = binary.ReadUvarint(r); err != nil {
				return false
			}
			seenTotal = true
		default:
			return false
		}
	}
	if lent == nil {
		return false
	}
	m.Reset()
	m.Part, m.TotalBytes = &peerv1.PullLayerChunk_Data{Data: lent}, int64(total)
	return true
}

// releaseChunk gives back the data of a chunk chunkCodec decoded, which
// its reader no longer uses.
func releaseChunk(m *peerv1.PullLayerChunk) {
	if d := m.GetData(); d != nil {
		bufpool.Put(d)
	}
}
