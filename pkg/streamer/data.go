package streamer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"k8s.io/klog/v2"

	peerv1 "github.com/concourse/cowvol/api/peer/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// CheckPath checks a path a caller names inside a volume: it is resolved
// within the volume, so only its form is checked here.
func CheckPath(p string) error {
	if len(p) > unix.PathMax || strings.ContainsRune(p, 0) {
		return fmt.Errorf("path %s: want at most %d bytes without NUL", volume.Quote(p), unix.PathMax)
	}
	return nil
}

// ReadVolume streams a volume, or a path inside it, as a plain tar (holes
// travel as zeros: anyone's tar reader takes it) or a file's bytes, then a
// trailer with their size and digest.
func (s *Server) ReadVolume(req *peerv1.ReadVolumeRequest, stream grpc.ServerStreamingServer[peerv1.PullLayerChunk]) error {
	ref, err := parseRequest(req.GetNamespace(), req.GetVolume())
	if err != nil {
		return err
	}
	format, err := ParseFormat(req.GetFormat())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	enc, err := ParseDataEncoding(req.GetEncoding())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if err := CheckPath(req.GetPath()); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	rd, err := s.holder.OpenVolume(req.GetNamespace(), ref, req.GetPath(), format)
	if err != nil {
		return holderError(err)
	}
	defer rd.Close()
	w := &chunkWriter{stream: stream, total: rd.Size}
	var sum Summary
	if format == FormatFile {
		c := newCounter(false)
		if _, err = io.CopyBuffer(io.MultiWriter(w, c), rd.File, make([]byte, streamBuffer)); err == nil {
			sum = c.summary(1)
		}
	} else {
		sum, err = Pack(stream.Context(), rd.Dir, w, enc, PlainTar)
	}
	if err == nil && w.sent == 0 {
		err = w.send(nil) // an empty file still says its size
	}
	if err != nil {
		klog.ErrorS(err, "Serving a volume read", "volume", ref, "path", req.GetPath(), "format", format)
		return holderError(err)
	}
	return stream.Send(trailerChunk(sum))
}

// WriteVolume makes a new cached volume from an uploaded tar, extracted
// strictly: an upload is a whole tree from outside the cluster.
func (s *Server) WriteVolume(stream grpc.ClientStreamingServer[peerv1.WriteVolumeChunk, peerv1.LayerVolume]) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	head := first.GetVolume()
	if head == nil {
		return status.Error(codes.InvalidArgument, "the first message must say what volume to make")
	}
	l := layerOf(head)
	if err := l.Validate(); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if !l.Parent.IsZero() || !l.Base.IsZero() || l.Destroyed {
		return status.Error(codes.InvalidArgument, "an upload is a root volume: no parent, no base")
	}
	enc, err := ParseDataEncoding(first.GetEncoding())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	lim := s.limits
	lim.Strict = true
	r := NewUploadReader(stream.Recv, func(m *peerv1.WriteVolumeChunk) bool { return m.GetVolume() != nil })
	err = s.holder.Receive(l, func(dir string) (Summary, error) {
		sum, err := Unpack(stream.Context(), r, enc, dir, lim)
		if err == nil {
			_, err = io.Copy(io.Discard, r) // the sender must be done
		}
		return sum, err
	})
	if err != nil {
		if rerr := r.Failed(); rerr != nil {
			return rerr
		}
		return holderError(err)
	}
	return stream.SendAndClose(head)
}

func layerOf(l *peerv1.LayerVolume) Layer {
	return Layer{Ref: fromPeerRef(l.GetRef()), Parent: fromPeerRef(l.GetParent()), Base: fromPeerRef(l.GetBase()),
		Scope: volume.Scope(l.GetScope()), Properties: l.GetProperties(),
		TTL: l.GetTtl().AsDuration(), SizeBytes: l.GetSizeBytes(), Destroyed: l.GetDestroyed()}
}

// ReadVolume asks the peer for a volume read and hands each data chunk to
// chunk as it arrives (with the total the peer announced), then checks the
// trailer against what arrived.
func (c *Client) ReadVolume(ctx context.Context, namespace string, r volume.Ref, path string, format Format, enc Encoding,
	chunk func(data []byte, total int64) error) (Summary, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stream, err := c.api.ReadVolume(ctx, &peerv1.ReadVolumeRequest{Namespace: namespace, Volume: toPeerRef(r),
		Path: path, Format: string(format), Encoding: string(enc)})
	if err != nil {
		return Summary{}, err
	}
	var n int64
	for {
		msg, err := recvWithin(c, stream.Recv, cancel)
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = fmt.Errorf("%w: the peer sent no trailer", ErrCorrupt)
			}
			return Summary{}, stalled(ctx, err)
		}
		if t := msg.GetTrailer(); t != nil {
			if format == FormatFile && t.GetBytes() != n {
				return Summary{}, fmt.Errorf("%w: %d bytes sent, %d arrived", ErrCorrupt, t.GetBytes(), n)
			}
			return Summary{Bytes: t.GetBytes(), Entries: t.GetEntries(), Digest: t.GetDigest()}, nil
		}
		n += int64(len(msg.GetData()))
		if err := chunk(msg.GetData(), msg.GetTotalBytes()); err != nil {
			return Summary{}, err
		}
	}
}

// WriteVolume uploads a tar (encoded with enc) read from r as a new cached
// volume l on the peer.
func (c *Client) WriteVolume(ctx context.Context, l Layer, enc Encoding, r io.Reader) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // a failed send ends the call
	stream, err := c.api.WriteVolume(ctx)
	if err != nil {
		return err
	}
	head := &peerv1.LayerVolume{Ref: toPeerRef(l.Ref), Scope: string(l.Scope), Properties: l.Properties}
	if l.TTL > 0 {
		head.Ttl = durationpb.New(l.TTL)
	}
	if err := stream.Send(&peerv1.WriteVolumeChunk{Part: &peerv1.WriteVolumeChunk_Volume{Volume: head}, Encoding: string(enc)}); err != nil {
		_, err = stream.CloseAndRecv() // the peer's reason
		return err
	}
	buf := make([]byte, maxChunkData)
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			if err := stream.Send(&peerv1.WriteVolumeChunk{Part: &peerv1.WriteVolumeChunk_Data{Data: buf[:n]}}); err != nil {
				_, err = stream.CloseAndRecv()
				return err
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			return rerr
		}
	}
	_, err = stream.CloseAndRecv()
	return err
}
