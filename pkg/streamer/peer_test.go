package streamer

import (
	"io"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	peerv1 "github.com/concourse/cowvol/api/peer/v1"
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
