package streamer

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Encoders and decoders are reused from stream to stream: each stream
// lands with its own files and nothing of the one before, in every
// encoding, streams large and small in turn.
func TestStreamsInTurnStayApart(t *testing.T) {
	for _, enc := range []Encoding{Raw, Zstd, S2, Gzip} {
		t.Run(string(enc), func(t *testing.T) {
			for i, size := range []int{3 << 20, 10, 1 << 20, 0, 5} {
				src := t.TempDir()
				data := make([]byte, size)
				_, err := rand.Read(data)
				require.NoError(t, err)
				name := fmt.Sprintf("f%d", i)
				require.NoError(t, os.WriteFile(filepath.Join(src, name), data, 0o644))
				var wire bytes.Buffer
				sent, err := Pack(context.Background(), src, &wire, enc, SparseTar)
				require.NoError(t, err)
				dst := t.TempDir()
				got, err := Unpack(context.Background(), &wire, enc, dst, DefaultLimits)
				require.NoError(t, err)
				require.Equal(t, sent, got)
				entries, err := os.ReadDir(dst)
				require.NoError(t, err)
				require.Len(t, entries, 1)
				landed, err := os.ReadFile(filepath.Join(dst, name))
				require.NoError(t, err)
				require.True(t, bytes.Equal(data, landed), "stream %d", i)
			}
		})
	}
}

// failingWriter takes n bytes, then fails.
type failingWriter struct{ n int }

var errGone = errors.New("the peer went away")

func (w *failingWriter) Write(p []byte) (int, error) {
	if len(p) > w.n {
		return 0, errGone
	}
	w.n -= len(p)
	return len(p), nil
}

// A stream that fails part-way stops its encoder, in every encoding: an
// s2 writer left unclosed kept a goroutine for ever, one per failed pull.
func TestAFailedStreamLeavesNoGoroutine(t *testing.T) {
	src := t.TempDir()
	data := make([]byte, 2<<20)
	_, err := rand.Read(data)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(src, "f"), data, 0o644))
	for _, enc := range []Encoding{Raw, Zstd, S2, Gzip} {
		t.Run(string(enc), func(t *testing.T) {
			before := runtime.NumGoroutine()
			for range 10 {
				_, err := Pack(context.Background(), src, &failingWriter{n: 256 << 10}, enc, SparseTar)
				require.ErrorIs(t, err, errGone)
			}
			require.Eventually(t, func() bool { return runtime.NumGoroutine() < before+5 }, 5*time.Second, 10*time.Millisecond,
				"%d goroutines before, %d after 10 failed streams", before, runtime.NumGoroutine())
		})
	}
}
