package plugin

import (
	"context"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc/peer"
	"k8s.io/klog/v2"
)

// callerConns are the controller API's connections, by their two ends, so
// that a follower closes the one a call it refused came on. A caller
// reaches the leader through a Service, whose choice of pod holds for a
// connection's life; and a connection can land on a follower: the
// Service's endpoints lag the new leader's label by a moment, and a
// deleted leader's address may already be a new follower's, which the
// lagging rules still send to. Kept open, such a connection is refused
// every call until apiConnectionAge ends it (a soak's node reported into
// a follower for that minute, while the new leader, its inventory
// missing, answered that a destroyed volume was held nowhere). Closed,
// the caller's next call dials again, and the Service sends it on.
type callerConns struct {
	mu    sync.Mutex
	conns map[string]net.Conn
}

func newCallerConns() *callerConns { return &callerConns{conns: map[string]net.Conn{}} }

// callerCloseDelay is how long after refusing a call a follower closes its
// connection: time for the answer to go out first (were it lost, the
// caller would see the connection's end, Unavailable too, and retry the
// same).
const callerCloseDelay = 100 * time.Millisecond

func connKey(local, remote net.Addr) string { return local.String() + "|" + remote.String() }

// listen records the connections of the listeners listen makes.
func (c *callerConns) listen(listen func() (net.Listener, error)) func() (net.Listener, error) {
	return func() (net.Listener, error) {
		l, err := listen()
		if err != nil {
			return nil, err
		}
		return &recordingListener{Listener: l, callers: c}, nil
	}
}

// closeSoon closes, after callerCloseDelay, the connection the call of ctx
// came on, if it is one of these (a call over another server's socket is
// not).
func (c *callerConns) closeSoon(ctx context.Context) {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil || p.LocalAddr == nil {
		return
	}
	key := connKey(p.LocalAddr, p.Addr)
	c.mu.Lock()
	conn := c.conns[key]
	delete(c.conns, key) // closed once, however many calls it carried
	c.mu.Unlock()
	if conn == nil {
		return
	}
	klog.V(2).InfoS("Closing a caller's connection to this follower, for it to reach the leader", "caller", p.Addr.String())
	time.AfterFunc(callerCloseDelay, func() { _ = conn.Close() })
}

func (c *callerConns) forget(key string, conn net.Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conns[key] == conn {
		delete(c.conns, key)
	}
}

type recordingListener struct {
	net.Listener
	callers *callerConns
}

func (l *recordingListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	rc := &recordedConn{Conn: conn, key: connKey(conn.LocalAddr(), conn.RemoteAddr()), callers: l.callers}
	l.callers.mu.Lock()
	l.callers.conns[rc.key] = rc
	l.callers.mu.Unlock()
	return rc, nil
}

// recordedConn leaves callerConns when it is closed, by either side.
type recordedConn struct {
	net.Conn
	key     string
	callers *callerConns
	once    sync.Once
}

func (c *recordedConn) Close() error {
	c.once.Do(func() { c.callers.forget(c.key, c) })
	return c.Conn.Close()
}
