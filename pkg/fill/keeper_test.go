package fill

import (
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The keeper survives what a confused or replaced plugin sends: a message
// it does not know drops that plugin alone, extra descriptors are closed,
// a put from a plugin that is not the current one is refused, and the
// next plugin is answered as the first was.
func TestKeeperTakesNoNonsense(t *testing.T) {
	sock := serveKeeper(t, time.Second)
	var err error
	dial := func() *net.UnixConn {
		var c *net.UnixConn
		require.Eventually(t, func() bool {
			c, err = net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sock, Net: "unixpacket"})
			return err == nil
		}, 5*time.Second, 10*time.Millisecond)
		t.Cleanup(func() { c.Close() })
		return c
	}
	first := dial()
	st, err := os.Stat(sock)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), "only root reaches it")

	hello := func(c *net.UnixConn) byte {
		require.NoError(t, sendPacket(c, -1, opHello))
		op, _, fd, err := readPacket(c)
		require.NoError(t, err)
		require.Equal(t, -1, fd)
		return op
	}
	require.Equal(t, byte(opNone), hello(first), "nothing kept yet")

	// Garbage, with a descriptor beside it: that plugin is dropped.
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	require.NoError(t, sendPacket(first, int(r.Fd()), 'Z', 1, 2))
	_, _, _, err = readPacket(first)
	require.Error(t, err, "dropped")

	// A put from a plugin that never said hello is refused: nothing kept.
	stranger := dial()
	require.NoError(t, sendPacket(stranger, int(w.Fd()), opPut))
	second := dial()
	require.Equal(t, byte(opNone), hello(second), "a stranger's put is not kept")

	// An answer for an event it never handed out is ignored, and a sync
	// is answered after it.
	require.NoError(t, sendPacket(second, -1, opAnswer, 12345, uint64(unix.FAN_ALLOW)))
	require.NoError(t, sendPacket(second, -1, opSync, 7))
	op, fields, _, err := readPacket(second)
	require.NoError(t, err)
	require.Equal(t, byte(opSync), op)
	require.Equal(t, []uint64{7}, fields)
}
