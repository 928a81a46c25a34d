package client

import (
	"context"
	"errors"
	"fmt"
	"io"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// Progress is told how much of a transfer is done, and of how much (-1:
// unknown).
type Progress func(done, total int64)

// Read streams a cached volume, or a path inside it, to w, through the
// controller from a node holding it: a tar (format "tar", encoded with
// enc) or one file's bytes (format "file"). It returns the node that
// served it.
func (c *Client) Read(ctx context.Context, r volume.Ref, path, format, enc string, w io.Writer, progress Progress) (string, error) {
	stream, err := c.Cache.ReadVolume(ctx, &controllerv1.ReadVolumeRequest{Ref: controllerv1.RefOf(r), Path: path, Format: format, Encoding: enc})
	if err != nil {
		return "", err
	}
	var node string
	var done, total int64 = 0, -1
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return node, nil
		}
		if err != nil {
			return node, err
		}
		if node == "" {
			node, total = msg.GetNodeId(), msg.GetTotalBytes()
		}
		if _, err := w.Write(msg.GetData()); err != nil {
			return node, err
		}
		done += int64(len(msg.GetData()))
		if progress != nil {
			progress(done, total)
		}
	}
}

// uploadChunk is what an upload sends a message at a time.
const uploadChunk = 1 << 20

// Write uploads a tar read from r (encoded as nv says) as a new cached
// volume, on the node nv names or the one the controller picks, and
// returns where it is.
func (c *Client) Write(ctx context.Context, nv *controllerv1.NewVolume, r io.Reader, progress Progress) (*controllerv1.VolumeLocation, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.Cache.WriteVolume(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&controllerv1.WriteVolumeRequest{Part: &controllerv1.WriteVolumeRequest_Volume{Volume: nv}}); err != nil {
		_, err = stream.CloseAndRecv()
		return nil, err
	}
	buf := make([]byte, uploadChunk)
	var done int64
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			if err := stream.Send(&controllerv1.WriteVolumeRequest{Part: &controllerv1.WriteVolumeRequest_Data{Data: buf[:n]}}); err != nil {
				_, err = stream.CloseAndRecv() // the controller's reason
				return nil, err
			}
			done += int64(n)
			if progress != nil {
				progress(done, -1)
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			return nil, fmt.Errorf("reading what to upload: %w", rerr)
		}
	}
	return stream.CloseAndRecv()
}
