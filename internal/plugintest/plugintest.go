// Package plugintest runs the real cowvol-plugin binary on a unix socket for
// tests, sanity runs and benchmarks, and gives them gRPC clients to it. It is
// test support only and never imported by the plugin.
package plugintest

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/internal/tb"
)

var (
	buildOnce sync.Once
	binary    string
	buildErr  error
)

// Binary returns the plugin binary: $COWVOL_PLUGIN_BINARY (make test builds
// it once), else one built now for this test process.
func Binary(tb tb.TB) string {
	tb.Helper()
	buildOnce.Do(func() {
		if b := os.Getenv("COWVOL_PLUGIN_BINARY"); b != "" {
			binary, buildErr = filepath.Abs(b)
			return
		}
		dir, err := os.MkdirTemp("", "cowvol-plugintest-")
		if err != nil {
			buildErr = err
			return
		}
		binary = filepath.Join(dir, "cowvol-plugin")
		out, err := exec.Command("go", "build", "-o", binary, "github.com/concourse/cowvol/cmd/cowvol-plugin").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("building the plugin: %v: %s", err, out)
		}
	})
	if buildErr != nil {
		tb.Fatal(buildErr)
	}
	return binary
}

// Config says how to run the plugin.
type Config struct {
	StateDir     string
	Backend      string // default auto
	Mode         string // default node
	FlattenDepth int    // default 64
	// KubeletDir is where pods' targets live (default: a temp dir).
	KubeletDir string
	// NodeID is the node's name (default test-node).
	NodeID string
	Env    []string
	Args   []string
	// Wrap, if set, says how to run the binary (say, in a network
	// namespace: netlab.Host.Command).
	Wrap func(name string, args ...string) (string, []string)
}

// Plugin is a running plugin process and clients to it.
type Plugin struct {
	Config
	Sock     string
	Conn     *grpc.ClientConn
	Node     csi.NodeClient
	Identity csi.IdentityClient
	// NodeAPI is a client of the node API served beside the CSI socket.
	NodeAPI nodev1.NodeAPIClient
	apiConn *grpc.ClientConn

	tb      tb.TB
	proc    *Process
	log     *lockedBuffer
	exitErr error
}

// lockedBuffer is the plugin's log: written by the process's output copier
// while a test reads it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Start runs the plugin and waits until it answers Probe. It is stopped
// (SIGTERM) when tb ends, and its log is shown if tb failed.
func Start(tb tb.TB, cfg Config) *Plugin {
	tb.Helper()
	if cfg.Backend == "" {
		cfg.Backend = "auto"
	}
	if cfg.Mode == "" {
		cfg.Mode = "node"
	}
	if cfg.FlattenDepth == 0 {
		cfg.FlattenDepth = 64
	}
	if cfg.KubeletDir == "" {
		cfg.KubeletDir = tb.TempDir()
	}
	if cfg.NodeID == "" {
		cfg.NodeID = "test-node"
	}
	sockDir, err := os.MkdirTemp("", "cowvol-sock-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(sockDir) })
	p := &Plugin{Config: cfg, Sock: filepath.Join(sockDir, "csi.sock"), tb: tb}
	p.start(nil)
	tb.Cleanup(func() {
		p.Stop()
		if tb.Failed() {
			tb.Logf("plugin log:\n%s", p.log.String())
		}
	})
	return p
}

func (p *Plugin) start(extraEnv []string) {
	p.tb.Helper()
	args := []string{"--endpoint=unix://" + p.Sock, "--mode=" + p.Mode, "-v=4"}
	if p.Mode != "controller" { // a controller's command line has no node flags
		args = append(args, "--node-id="+p.NodeID, "--state-dir="+p.StateDir, "--cow-backend="+p.Backend,
			"--flatten-depth="+strconv.Itoa(p.FlattenDepth), "--kubelet-dir="+p.KubeletDir)
	}
	args = append(args, p.Args...)
	name := Binary(p.tb)
	if p.Wrap != nil {
		name, args = p.Wrap(name, args...)
	}
	cmd := exec.Command(name, args...)
	cmd.Env = append(append(os.Environ(), p.Env...), extraEnv...)
	if p.log == nil {
		p.log = &lockedBuffer{}
	}
	fmt.Fprintf(p.log, "--- start %v\n", args)
	cmd.Stdout, cmd.Stderr = p.log, p.log
	proc, err := StartProcess(cmd, nil)
	if err != nil {
		p.tb.Fatal(err)
	}
	p.proc = proc
	if p.Conn == nil {
		conn, err := grpc.NewClient("unix://"+p.Sock, grpc.WithTransportCredentials(insecure.NewCredentials()),
			fastReconnect)
		if err != nil {
			p.tb.Fatal(err)
		}
		p.Conn = conn
		p.Node, p.Identity = csi.NewNodeClient(conn), csi.NewIdentityClient(conn)
		api, err := grpc.NewClient("unix://"+filepath.Join(filepath.Dir(p.Sock), "node-api.sock"),
			grpc.WithTransportCredentials(insecure.NewCredentials()), fastReconnect)
		if err != nil {
			p.tb.Fatal(err)
		}
		p.apiConn, p.NodeAPI = api, nodev1.NewNodeAPIClient(api)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := p.Identity.Probe(ctx, &csi.ProbeRequest{})
		cancel()
		if err == nil {
			return
		}
		if !p.proc.Running() {
			exit, _ := p.proc.Wait(0)
			p.tb.Fatalf("plugin exited at start-up: %v\n%s", exit, p.log.String())
		}
		if time.Now().After(deadline) {
			p.tb.Fatalf("plugin did not answer Probe within 30s: %v\n%s", err, p.log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Volume is the inline volume name of a new pod of namespace ns, laid out
// under the plugin's kubelet dir with the volume's dir made, as the kubelet
// does before it publishes.
func (p *Plugin) Volume(ns, pod, name string, attrs map[string]string) kubeletsim.InlineVolume {
	p.tb.Helper()
	v := kubeletsim.NewInlineVolume(p.KubeletDir, kubeletsim.NewPod(ns, pod), name, attrs)
	if err := os.MkdirAll(filepath.Dir(v.Target), 0o750); err != nil {
		p.tb.Fatal(err)
	}
	return v
}

// fastReconnect: restarts are routine here, so clients reconnect quickly
// instead of backing off for seconds.
var fastReconnect = grpc.WithConnectParams(grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.6, MaxDelay: 100 * time.Millisecond},
	MinConnectTimeout: time.Second,
})

// Publish makes the kubelet's NodePublishVolume call for v.
func (p *Plugin) Publish(v kubeletsim.InlineVolume) error {
	_, err := p.Node.NodePublishVolume(context.Background(), v.PublishRequest())
	return err
}

// Unpublish makes the kubelet's NodeUnpublishVolume call for v.
func (p *Plugin) Unpublish(v kubeletsim.InlineVolume) error {
	_, err := p.Node.NodeUnpublishVolume(context.Background(), v.UnpublishRequest())
	return err
}

// PID is the running process's ID.
func (p *Plugin) PID() int { return p.proc.PID() }

// Log is what the plugin printed so far.
func (p *Plugin) Log() string { return p.log.String() }

// Running says whether the process is still alive.
func (p *Plugin) Running() bool { return p.proc.Running() }

// Wait waits for the process to exit (on its own, at a crash point); it
// fails only if the process is still running after timeout.
func (p *Plugin) Wait(timeout time.Duration) error {
	exit, err := p.proc.Wait(timeout)
	if err == nil {
		p.exitErr = exit
	}
	return err
}

func (p *Plugin) signal(sig syscall.Signal) {
	if p.Running() {
		p.exitErr = p.proc.Stop(sig, 60*time.Second)
	}
}

// ExitErr is how the last process ended (nil for a clean exit).
func (p *Plugin) ExitErr() error { return p.exitErr }

// Kill stops the plugin with SIGKILL, as a crash would.
func (p *Plugin) Kill() { p.signal(syscall.SIGKILL) }

// Stop stops the plugin with SIGTERM, as the kubelet's pod deletion would.
func (p *Plugin) Stop() {
	p.signal(syscall.SIGTERM)
	if p.Conn != nil {
		p.Conn.Close()
		p.apiConn.Close()
		p.Conn = nil
	}
}

// Restart starts the plugin again on the same socket and state dir, with
// extra environment (say COWVOL_CRASH_AT) for this run only.
func (p *Plugin) Restart(extraEnv ...string) {
	p.tb.Helper()
	p.Kill()
	p.start(extraEnv)
}

// FreePort is a loopback TCP port nothing listens on now (for a plugin's
// API, metrics or peer address), held for tb by no other test on this
// machine. A port the kernel picks and frees is from its ephemeral range,
// which every outgoing connection takes ports from too: one was taken
// between the pick and the plugin's bind (CI, "address already in use").
// So it is picked below that range (ports [20000, 30000): under
// NodePorts' too), claimed until tb ends by a lock every test process
// takes the same way, and free when picked; the kernel picks where no
// such range is.
func FreePort(tb tb.TB) int {
	tb.Helper()
	if port, ok := claimPort(tb); ok {
		return port
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// The ports FreePort claims, and where their locks are.
const (
	claimedPortsFrom, claimedPortsTo = 20000, 30000
	claimedPortsDir                  = "cowvol-test-ports"
)

// claimPort claims a port of [claimedPortsFrom, claimedPortsTo) below the
// kernel's ephemeral range, free as it is claimed, for tb's length. Its
// lock file stays (empty): one removed while another process opened it
// would let two lock two files of one name.
func claimPort(tb tb.TB) (int, bool) {
	to := claimedPortsTo
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if lo, _, ok := strings.Cut(strings.TrimSpace(string(b)), "\t"); ok {
			if n, err := strconv.Atoi(strings.TrimSpace(lo)); err == nil {
				to = min(to, n)
			}
		}
	}
	dir := filepath.Join(os.TempDir(), claimedPortsDir)
	if to-claimedPortsFrom < 1000 || os.MkdirAll(dir, 0o700) != nil {
		return 0, false
	}
	n := to - claimedPortsFrom
	start := rand.IntN(n)
	for i := range n {
		port := claimedPortsFrom + (start+i)%n
		lock, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(port)), os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return 0, false
		}
		if syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
			lock.Close() // another test's
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			lock.Close() // something else's
			continue
		}
		l.Close()
		tb.Cleanup(func() { lock.Close() }) // (its lock with it)
		return port, true
	}
	return 0, false
}

// FreeAddr is FreePort as a host:port.
func FreeAddr(tb tb.TB) string { return fmt.Sprintf("127.0.0.1:%d", FreePort(tb)) }
