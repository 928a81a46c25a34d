package test

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

func TestVersionFlag(t *testing.T) {
	out, err := exec.Command(plugintest.Binary(t), "--version").CombinedOutput()
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(out), "cowvol-plugin "), "got %q", out)
}

// Bad options are refused at start-up with a message naming the option.
func TestBadOptionsExit(t *testing.T) {
	sock := "unix://" + filepath.Join(t.TempDir(), "csi.sock")
	tests := []struct {
		name, want string
		args       []string
	}{
		{"mode", "mode", []string{"--mode=both"}},
		{"relative state dir", "absolute", []string{"--state-dir=state"}},
		{"backend", "unknown COW backend", []string{"--cow-backend=zfs"}},
		{"endpoint", "endpoint", []string{"--endpoint=http://x"}},
		{"flatten depth", "flatten depth", []string{"--flatten-depth=0"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--endpoint=" + sock, "--state-dir=" + t.TempDir()}, tc.args...)
			out, err := exec.Command(plugintest.Binary(t), args...).CombinedOutput()
			require.Error(t, err)
			require.Contains(t, string(out), tc.want)
		})
	}
}

// NodeGetInfo names the node, and reports as its topology only what
// never changes (the kubelet never relabels a Node); the node API names
// the store, whose ID stays with the state dir across restarts, and a
// wiped state dir has a new one.
func TestNodeGetInfoReportsTheStore(t *testing.T) {
	testfs.Need(t)
	p := plugintest.Start(t, plugintest.Config{StateDir: t.TempDir(), Backend: "overlay"})
	store := func() string {
		resp, err := p.Node.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
		require.NoError(t, err)
		require.Equal(t, "test-node", resp.NodeId)
		require.Equal(t, map[string]string{driver.TopologyKey: "test-node"}, resp.AccessibleTopology.Segments)
		n, err := p.NodeAPI.GetNode(context.Background(), &nodev1.GetNodeRequest{})
		require.NoError(t, err)
		return n.StoreId
	}
	first := store()
	require.Len(t, first, 32)
	p.Restart()
	require.Equal(t, first, store(), "a restart keeps the store")
	p.Kill()
	require.NoError(t, os.RemoveAll(p.StateDir))
	require.NoError(t, os.Mkdir(p.StateDir, 0o700))
	p.Restart()
	require.NotEqual(t, first, store(), "a wiped state dir is a new store")
	caps, err := p.Node.NodeGetCapabilities(context.Background(), &csi.NodeGetCapabilitiesRequest{})
	require.NoError(t, err)
	require.Len(t, caps.Capabilities, 1)
	require.Equal(t, csi.NodeServiceCapability_RPC_GET_VOLUME_STATS, caps.Capabilities[0].GetRpc().GetType())
}

// Any server that cannot start stops the plugin, with a non-zero exit
// naming it, before anything serves; nothing is left listening and the
// state dir is released (before, a failure after the node API had started
// could leave the plugin hanging, healthy to its probe).
func TestAServerFailingStopsThePlugin(t *testing.T) {
	testfs.Need(t)
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	garbage := filepath.Join(t.TempDir(), "garbage.pem")
	require.NoError(t, os.WriteFile(garbage, []byte("not a certificate"), 0o600))
	dir := t.TempDir()
	state := t.TempDir()
	free := func() string { return plugintest.FreeAddr(t) }
	tests := []struct {
		name, want string
		args       []string
	}{
		{"metrics port busy", "serving metrics", []string{"--metrics-address=" + busy.Addr().String()}},
		{"peer port busy", "serving peers", []string{"--metrics-address=" + free(), "--peer-address=" + busy.Addr().String()}},
		// Loaded before anything is served: pulls need it as much as the
		// peer server does.
		{"bad peer certificate", "loading the peer certificate", []string{"--peer-address=" + free(),
			"--peer-tls-cert-file=" + garbage, "--peer-tls-key-file=" + garbage, "--peer-ca-file=" + garbage}},
		{"registration socket in no dir", "serving kubelet registration",
			[]string{"--metrics-address=" + free(), "--kubelet-registration-socket=" + filepath.Join(dir, "missing", "reg.sock")}},
		{"controller port busy", "serving the controller's APIs", []string{"--mode=all", "--api-address=" + busy.Addr().String()}},
		{"bad tokens file", "tokens", []string{"--mode=all", "--api-address=" + free(),
			"--tokens-file=" + filepath.Join(dir, "no-such-tokens")}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sock := filepath.Join(dir, "csi.sock")
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			args := append([]string{"--endpoint=unix://" + sock, "--state-dir=" + state, "--kubelet-dir=" + dir, "--cow-backend=overlay"}, tc.args...)
			out, err := exec.CommandContext(ctx, plugintest.Binary(t), args...).CombinedOutput()
			require.NoError(t, ctx.Err(), "the plugin hung instead of exiting:\n%s", out)
			var exit *exec.ExitError
			require.ErrorAs(t, err, &exit)
			require.Equal(t, 1, exit.ExitCode())
			require.Contains(t, string(out), tc.want)
			_, err = os.Stat(sock)
			require.ErrorIs(t, err, os.ErrNotExist, "the CSI socket went with the process")
		})
	}
	p := plugintest.Start(t, plugintest.Config{StateDir: state, Backend: "overlay", KubeletDir: dir})
	_, err = p.Identity.Probe(context.Background(), &csi.ProbeRequest{})
	require.NoError(t, err, "the state dir was released")
}

// A socket left by a dead plugin is removed; one a live plugin serves on
// is not taken over.
func TestSocketHandling(t *testing.T) {
	testfs.Need(t)
	p := plugintest.Start(t, plugintest.Config{StateDir: t.TempDir(), Backend: "overlay"})
	out, err := exec.Command(plugintest.Binary(t), "--endpoint=unix://"+p.Sock, "--state-dir="+t.TempDir()).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "another process is serving")

	p.Kill() // leaves the socket file behind
	_, err = os.Stat(p.Sock)
	require.NoError(t, err)
	// Listening on a path a socket file holds fails (EADDRINUSE): a plugin
	// that serves again removed the stale one.
	p.Restart()
	_, err = p.Identity.Probe(context.Background(), &csi.ProbeRequest{})
	require.NoError(t, err)
}

func TestControllerMode(t *testing.T) {
	p := plugintest.Start(t, plugintest.Config{Mode: "controller"})
	caps, err := p.Identity.GetPluginCapabilities(context.Background(), &csi.GetPluginCapabilitiesRequest{})
	require.NoError(t, err)
	var services []csi.PluginCapability_Service_Type
	for _, c := range caps.Capabilities {
		services = append(services, c.GetService().GetType())
	}
	require.Contains(t, services, csi.PluginCapability_Service_CONTROLLER_SERVICE)
	cc, err := csi.NewControllerClient(p.Conn).ControllerGetCapabilities(context.Background(), &csi.ControllerGetCapabilitiesRequest{})
	require.NoError(t, err)
	var rpcs []csi.ControllerServiceCapability_RPC_Type
	for _, c := range cc.Capabilities {
		rpcs = append(rpcs, c.GetRpc().GetType())
	}
	require.ElementsMatch(t, []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES, csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY, csi.ControllerServiceCapability_RPC_GET_VOLUME,
	}, rpcs, "what the controller's view can answer, and nothing it cannot (inline volumes are never created or attached)")
	_, err = p.Node.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
	require.Equal(t, codes.Unimplemented, code(err), "controller mode serves no node")
	info, err := p.Identity.GetPluginInfo(context.Background(), &csi.GetPluginInfoRequest{})
	require.NoError(t, err)
	require.Equal(t, driver.DefaultDriverName, info.Name)
}

func TestMetrics(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	e.step("", "m1", func(dir string) { write(t, dir, "f", "x") })
	require.Error(t, e.publish(e.volume(map[string]string{driver.AttrSource: "absent"}, false)))
	body := scrape(t, e)
	for _, want := range []string{
		`cowvol_rpc_duration_seconds_count{code="OK",method="/csi.v1.Node/NodePublishVolume"} 1`,
		`cowvol_rpc_duration_seconds_count{code="NotFound",method="/csi.v1.Node/NodePublishVolume"} 1`,
		`cowvol_cached_volumes{state="ready"} 1`,
		`cowvol_captures_total{result="ok"} 1`,
		`cowvol_step_volumes{state="published"} 0`,
		`cowvol_quarantined_step_volumes 0`,
		`cowvol_node_info{backend="overlay",size_limits="off"} 1`,
	} {
		require.Contains(t, body, want)
	}
	// Every metric a plugin serves is in the generated reference.
	docs, err := os.ReadFile("../docs/metrics.md")
	require.NoError(t, err)
	for _, line := range strings.Split(body, "\n") {
		if name, ok := strings.CutPrefix(line, "# TYPE cowvol_"); ok {
			name = "cowvol_" + strings.Fields(name)[0]
			require.Contains(t, string(docs), "| `"+name+"` |", "docs/metrics.md lists %s", name)
		}
	}
}

// Profiles are served beside the metrics only when asked for
// (--profiling): they show what the plugin is doing to whoever reaches
// the port.
func TestProfilingIsOptIn(t *testing.T) {
	testfs.Need(t)
	get := func(e *env, path string) (int, []byte) {
		resp, err := http.Get("http://" + e.metrics + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, body
	}
	off := newEnv(t, plugintest.Config{Backend: "overlay"})
	code, _ := get(off, "/debug/pprof/")
	require.Equal(t, http.StatusNotFound, code, "no profiles unless asked for")

	on := newEnv(t, plugintest.Config{Backend: "overlay", Args: []string{"--profiling"}})
	code, body := get(on, "/debug/pprof/goroutine?debug=1")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, string(body), "goroutine profile:")
	code, body = get(on, "/debug/pprof/profile?seconds=1")
	require.Equal(t, http.StatusOK, code)
	require.NotEmpty(t, body, "a CPU profile")
}

// SIGTERM lets an RPC in flight finish, then the plugin exits cleanly; the
// restarted plugin adopts what it published.
func TestGracefulStop(t *testing.T) {
	state := testfs.Mount(t, testfs.XFS, 1<<30)
	e := newEnv(t, plugintest.Config{StateDir: state, Backend: "copy"})
	e.step("", "many", func(dir string) {
		for i := range 10000 {
			write(t, dir, filepath.Join("d", string(rune('a'+i%20)), strings.Repeat("f", 1+i%9)+string(rune('A'+i/400))+string(rune('a'+i%23))), "x")
		}
	})
	v := e.volume(map[string]string{driver.AttrSource: "many"}, false)
	published := make(chan error, 1)
	go func() { published <- e.publish(v) }()
	eventually(t, "the publish to start copying", func() bool {
		entries, _ := os.ReadDir(filepath.Join(state, "views"))
		return len(entries) > 0
	})
	e.p.Stop()
	require.NoError(t, <-published, "the in-flight publish finished")
	require.NoError(t, e.p.ExitErr(), "a clean exit")
	before := mountID(t, v.Target)
	require.NotZero(t, before, "the finished publish left its mount")
	e.p.Restart()
	require.Equal(t, before, mountID(t, v.Target), "the restarted plugin adopted the mount as it was")
	e.umount(v)
	e.noLeaks(t)
}

// The plugin can register itself with the kubelet (no sidecar): the
// kubelet's plugin watcher calls GetInfo and NotifyRegistrationStatus on
// the registration socket; the plugin is ready (its readiness probe, which
// a DaemonSet's rolling update waits for) once the kubelet took it, and a
// stopped plugin's socket is gone.
func TestKubeletRegistration(t *testing.T) {
	testfs.Need(t)
	reg := filepath.Join(t.TempDir(), "cowvol.concourse-ci.org-reg.sock")
	metrics := plugintest.FreeAddr(t)
	p := plugintest.Start(t, plugintest.Config{StateDir: t.TempDir(), Backend: "overlay",
		Args: []string{"--kubelet-registration-socket=" + reg, "--metrics-address=" + metrics}})
	readyz := func() (int, string) {
		resp, err := http.Get("http://" + metrics + "/readyz")
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, strings.TrimSpace(string(body))
	}
	code, why := readyz()
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "not registered with the kubelet yet", why)
	conn, err := grpc.NewClient("unix://"+reg, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	client := registerapi.NewRegistrationClient(conn)
	info, err := client.GetInfo(context.Background(), &registerapi.InfoRequest{})
	require.NoError(t, err)
	require.Equal(t, registerapi.CSIPlugin, info.Type)
	require.Equal(t, driver.DefaultDriverName, info.Name)
	require.Equal(t, p.Sock, info.Endpoint)
	require.Equal(t, []string{"1.0.0"}, info.SupportedVersions)
	_, err = client.NotifyRegistrationStatus(context.Background(), &registerapi.RegistrationStatus{
		PluginRegistered: false, Error: "plugin cowvol.concourse-ci.org: version 0.9 not supported"})
	require.NoError(t, err)
	code, why = readyz()
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "the kubelet refused the registration: plugin cowvol.concourse-ci.org: version 0.9 not supported", why)
	_, err = client.NotifyRegistrationStatus(context.Background(), &registerapi.RegistrationStatus{PluginRegistered: true})
	require.NoError(t, err)
	code, why = readyz()
	require.Equal(t, http.StatusOK, code, why)
	p.Stop()
	_, err = os.Stat(reg)
	require.ErrorIs(t, err, os.ErrNotExist, "the kubelet sees a stopped plugin's registration go")
}

// The README's first command works the first time, also on a loaded
// machine: the demo's client waits for the plugin it starts to listen
// (before, its first call could beat the socket: "dial unix .../csi.sock:
// connect: no such file or directory").
func TestDemoUnderLoad(t *testing.T) {
	testfs.Need(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Two busy loops per core keep the plugin's start-up slow.
	for i := 0; i < 4; i++ {
		spin := exec.CommandContext(ctx, "sh", "-c", "while :; do :; done")
		require.NoError(t, spin.Start())
		t.Cleanup(func() { _ = spin.Wait() })
	}
	for run := 0; run < 3; run++ {
		out, err := exec.Command(plugintest.Binary(t), "demo").CombinedOutput()
		require.NoError(t, err, "run %d:\n%s", run, out)
		require.Contains(t, string(out), "OK: every step saw what it should")
	}
}
