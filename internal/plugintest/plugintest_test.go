package plugintest

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// A port FreePort gives is free, below the kernel's ephemeral range, and
// claimed for the test's length against every other test's FreePort: a
// port held by another is never given, and one let go is again.
func TestFreePortClaims(t *testing.T) {
	if _, ok := claimPort(t); !ok {
		t.Skip("no ports below the kernel's ephemeral range to claim (ip_local_port_range starts under 21000)")
	}
	locked := func(port int) bool {
		f, err := os.OpenFile(filepath.Join(os.TempDir(), claimedPortsDir, strconv.Itoa(port)), os.O_RDWR, 0)
		require.NoError(t, err)
		defer f.Close()
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		return err != nil
	}
	var held int
	t.Run("claims", func(t *testing.T) {
		seen := map[int]bool{}
		for range 50 {
			port := FreePort(t)
			require.GreaterOrEqual(t, port, claimedPortsFrom)
			require.Less(t, port, claimedPortsTo)
			require.False(t, seen[port], "port %d given twice while claimed", port)
			seen[port] = true
			require.True(t, locked(port), "port %d claimed", port)
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
			require.NoError(t, err, "port %d free", port)
			l.Close()
			held = port
		}
	})
	require.False(t, locked(held), "a port is let go when its test ends")
}
