package testfs

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A socket bound but not yet listening is not taken for one that listens.
func TestListening(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Bind(fd, &unix.SockaddrUnix{Name: path}))
	require.False(t, Listening(path), "bound, not listening")
	require.NoError(t, unix.Listen(fd, 1))
	require.True(t, Listening(path))
	require.False(t, Listening(path+"x"))
}
