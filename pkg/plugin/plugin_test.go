package plugin

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/driver"
)

// elect turns leader election on, with the Lease's namespace and this
// replica's identity.
func elect(o *Options, namespace, identity string) {
	o.LeaderElection.Enabled, o.LeaderElection.Namespace, o.LeaderElection.Identity = true, namespace, identity
}

// Each default is written once, in Defaults: the flags show it, and a
// command line that sets nothing runs with it.
func TestFlagsDefaultToDefaults(t *testing.T) {
	o := Defaults()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	o.AddFlags(fs, ModeAll)
	require.NoError(t, fs.Parse(nil))
	require.Equal(t, Defaults(), o)
	require.Equal(t, "90", fs.Lookup("high-watermark").DefValue)
	require.Equal(t, "1Ti", fs.Lookup("stream-size-limit").DefValue)
	require.Equal(t, "20s", fs.Lookup("pull-wait").DefValue)
	require.Equal(t, "20s", fs.Lookup("capture-wait").DefValue)
	require.NoError(t, fs.Parse([]string{"--mode=all", "--high-watermark=70", "--stream-size-limit=2Gi", "--peers=a=h:1,b=h:2", "--peers=c=h:3"}))
	require.Equal(t, ModeAll, o.Mode)
	require.Equal(t, 70, o.Node.HighWatermark)
	require.Equal(t, int64(2<<30), o.Peers.SizeLimit)
	require.Equal(t, []string{"a=h:1", "b=h:2", "c=h:3"}, o.Peers.Static)
	// Options built in code with nothing set are refused, not defaulted
	// behind the caller's back.
	require.ErrorContains(t, (&Options{}).Validate(), "driver name is required")
}

// Each mode's command line has the flags of the components it runs, and
// no other: a flag of another mode is refused, saying whose it is.
func TestFlagsByMode(t *testing.T) {
	tests := []struct {
		mode       Mode
		has, lacks []string
	}{
		{ModeNode, []string{"state-dir", "peer-address", "image-registry-address", "controller-address", "peer-tls-cert-file",
			"peer-certificates-from-controller"},
			[]string{"api-address", "kube-auth", "leader-election", "peer-ca-key-file"}},
		{ModeController, []string{"api-address", "kube-auth", "leader-election", "peer-tls-cert-file", "metrics-address", "peer-ca-cert-file",
			"peer-ca-key-file", "peer-certificate-lifetime"},
			[]string{"state-dir", "peer-address", "image-registry-address", "controller-address", "kubelet-dir"}},
		{ModeAll, []string{"state-dir", "api-address", "peer-address"}, []string{"leader-election"}},
	}
	for _, tc := range tests {
		t.Run(string(tc.mode), func(t *testing.T) {
			o := Defaults()
			fs := flag.NewFlagSet("test", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			o.AddFlags(fs, tc.mode)
			others := FlagsOfOtherModes(tc.mode)
			for _, name := range tc.has {
				require.NotNil(t, fs.Lookup(name), "--%s in %s mode", name, tc.mode)
				require.Empty(t, others[name])
			}
			for _, name := range tc.lacks {
				require.Nil(t, fs.Lookup(name), "--%s in %s mode", name, tc.mode)
				require.ErrorContains(t, fs.Parse([]string{"--" + name + "=x"}), "not defined")
				require.NotEmpty(t, others[name], "--%s is said to be another mode's", name)
			}
		})
	}
	require.Equal(t, "controller", FlagsOfOtherModes(ModeAll)["leader-election"])
	require.Equal(t, "controller or all", FlagsOfOtherModes(ModeNode)["api-address"])
	require.Equal(t, "node or all", FlagsOfOtherModes(ModeController)["state-dir"])
}

func TestModeFromArgs(t *testing.T) {
	for args, want := range map[string]Mode{
		"":                           ModeNode,
		"--mode=controller":          ModeController,
		"-mode all --v=2":            ModeAll,
		"--mode controller --x=1":    ModeController,
		"--v=2 -- --mode=controller": ModeNode,
	} {
		require.Equal(t, want, ModeFromArgs(strings.Fields(args), ModeNode), args)
	}
}

func TestOptionsValidate(t *testing.T) {
	good := func() Options {
		o := Defaults()
		o.NodeID = "n"
		return o
	}
	tests := []struct {
		name    string
		mut     func(*Options)
		wantErr string
	}{
		{"ok", func(*Options) {}, ""},
		{"tcp endpoint", func(o *Options) { o.Endpoint = "tcp://127.0.0.1:10000" }, ""},
		{"controller needs no state", func(o *Options) { o.Mode = ModeController; o.Node.StateDir = "" }, ""},
		{"bad scheme", func(o *Options) { o.Endpoint = "http://x" }, "endpoint"},
		{"no socket path", func(o *Options) { o.Endpoint = "unix://" }, "socket path"},
		{"bad mode", func(o *Options) { o.Mode = "both" }, "mode"},
		{"no node ID", func(o *Options) { o.NodeID = "" }, "node ID"},
		{"relative state dir", func(o *Options) { o.Node.StateDir = "state" }, "absolute"},
		{"bad backend", func(o *Options) { o.Node.Backend = "zfs" }, "unknown COW backend"},
		{"flatten depth too deep", func(o *Options) { o.Node.FlattenDepth = 600 }, "flatten depth"},
		{"relative kubelet dir", func(o *Options) { o.Node.KubeletDir = "kubelet" }, "kubelet dir"},
		{"negative limit", func(o *Options) { o.Node.MaxSizeLimit = -1 }, "negative"},
		{"default over max", func(o *Options) { o.Node.DefaultSizeLimit, o.Node.MaxSizeLimit = 2, 1 }, "exceeds the maximum"},
		{"watermarks crossed", func(o *Options) { o.Node.HighWatermark, o.Node.LowWatermark = 70, 80 }, "watermarks"},
		{"controller on loopback", func(o *Options) { o.Node.ControllerAddress = "127.0.0.1:7000" }, ""},
		{"controller off loopback", func(o *Options) { o.Node.ControllerAddress = "10.0.0.5:7000" }, "not a loopback address"},
		{"API off loopback", func(o *Options) { o.Mode, o.Controller.APIAddress = ModeController, "0.0.0.0:7000" }, "not a loopback address"},
		{"API off loopback over TLS with tokens", func(o *Options) {
			o.Mode, o.Controller.APIAddress, o.Controller.TLSCertFile, o.Controller.TLSKeyFile, o.Controller.TokensFile = ModeController, "0.0.0.0:7000", "/c", "/k", "/t"
		}, ""},
		{"TLS without tokens", func(o *Options) {
			o.Mode, o.Controller.TLSCertFile, o.Controller.TLSKeyFile = ModeController, "/c", "/k"
		}, "needs --tokens-file"},
		{"cert without key", func(o *Options) { o.Mode, o.Controller.TLSCertFile = ModeController, "/c" }, "go together"},
		{"controller over TLS without a token", func(o *Options) { o.Node.ControllerAddress, o.Node.TLSCAFile = "10.0.0.5:7000", "/ca" }, "needs --token-file"},
		{"controller over TLS with a token", func(o *Options) {
			o.Node.ControllerAddress, o.Node.TLSCAFile, o.Node.TokenFile = "10.0.0.5:7000", "/ca", "/t"
		}, ""},
		{"forget before stalled", func(o *Options) {
			o.Mode, o.Controller.StalledAfter, o.Controller.ForgetStalledAfter = ModeController, time.Minute, time.Second
		}, "shorter"},
		{"high over 100", func(o *Options) { o.Node.HighWatermark, o.Node.LowWatermark = 101, 80 }, "watermarks"},
		{"negative eviction grace", func(o *Options) { o.Node.EvictionGrace = -time.Second }, "--eviction-grace"},
		{"no capture wait", func(o *Options) { o.Node.CaptureWait = 0 }, "--capture-wait"},
		{"no output copies", func(o *Options) { o.Node.OutputCopies = 0 }, "--output-copies"},
		{"more output copies than allowed", func(o *Options) { o.Node.OutputCopies = 6 }, "--output-copies"},
		{"no cache versions kept", func(o *Options) { o.Node.CacheVersions = 0 }, "--cache-versions"},
		{"negative read orders memory", func(o *Options) { o.Mode, o.Controller.ReadOrdersMemory = ModeController, -1 }, "--read-orders-memory"},
		{"negative await for reports", func(o *Options) { o.Mode, o.Controller.AwaitReportsFor = ModeAll, -time.Second }, "--await-reports-for"},
		{"a node's options are not a controller's business", func(o *Options) { o.Mode, o.Node.StateDir = ModeController, "relative" }, ""},
		{"peers on loopback", func(o *Options) { o.Peers.Address, o.Peers.Static = "127.0.0.1:7443", []string{"b=127.0.0.1:7444"} }, ""},
		{"peer address off loopback without TLS", func(o *Options) { o.Peers.Address = "10.0.0.5:7443" }, "not a loopback address"},
		{"static peer off loopback without TLS", func(o *Options) { o.Peers.Static = []string{"b=10.0.0.6:7443"} }, "not a loopback address"},
		{"peers over mutual TLS", func(o *Options) {
			o.Peers.Address, o.Peers.Static = "10.0.0.5:7443", []string{"b=10.0.0.6:7443"}
			o.Peers.CertFile, o.Peers.KeyFile, o.Peers.CAFile = "/c", "/k", "/ca"
		}, ""},
		{"peer TLS without a CA", func(o *Options) { o.Peers.CertFile, o.Peers.KeyFile = "/c", "/k" }, "go together"},
		{"a node's own peer certificate off loopback", func(o *Options) {
			o.Node.ControllerAddress, o.Node.TLSCAFile, o.Node.TokenFile = "10.0.0.5:7000", "/ca", "/t"
			o.Peers.Address, o.Peers.FromController = "10.0.0.5:7443", true
		}, ""},
		{"a node's own peer certificate without a controller", func(o *Options) { o.Peers.FromController = true }, "needs --controller-address"},
		{"a node's own peer certificate and one for all", func(o *Options) {
			o.Node.ControllerAddress, o.Peers.FromController = "127.0.0.1:7000", true
			o.Peers.CertFile, o.Peers.KeyFile, o.Peers.CAFile = "/c", "/k", "/ca"
		}, "give one or the other"},
		{"a peer CA", func(o *Options) { o.Mode, o.Peers.CACertFile, o.Peers.CAKeyFile = ModeController, "/ca.crt", "/ca.key" }, ""},
		{"a peer CA without its key", func(o *Options) { o.Mode, o.Peers.CACertFile = ModeController, "/ca.crt" }, "go together"},
		{"a peer CA and one certificate for all", func(o *Options) {
			o.Mode, o.Peers.CACertFile, o.Peers.CAKeyFile = ModeController, "/ca.crt", "/ca.key"
			o.Peers.CertFile, o.Peers.KeyFile, o.Peers.CAFile = "/c", "/k", "/ca"
		}, "drop --peer-tls-cert-file"},
		{"peer certificates that last minutes", func(o *Options) { o.Mode, o.Peers.CertLifetime = ModeController, time.Minute }, "at least 10m"},
		{"peer address with no host to advertise", func(o *Options) {
			o.Peers.Address, o.Peers.CertFile, o.Peers.KeyFile, o.Peers.CAFile = ":7443", "/c", "/k", "/ca"
		}, "--peer-advertise-address"},
		{"advertised without an address", func(o *Options) { o.Peers.AdvertiseAddress = "10.0.0.5:7443" }, "needs --peer-address"},
		{"static peer without a node", func(o *Options) { o.Peers.Static = []string{"127.0.0.1:7443"} }, "want node=host:port"},
		{"bad stream encoding", func(o *Options) { o.Peers.Encoding = "lz4" }, "--stream-encoding"},
		{"profiling with nowhere to serve it", func(o *Options) { o.Profiling, o.MetricsAddress = true, "" }, "--metrics-address"},
		{"profiling beside the metrics", func(o *Options) { o.Profiling, o.MetricsAddress = true, "127.0.0.1:9090" }, ""},
		{"negative stream limit", func(o *Options) { o.Peers.SizeLimit = -1 }, "--stream-size-limit"},
		{"image registry off loopback", func(o *Options) { o.Images.RegistryAddress = "0.0.0.0:7444" }, "not a loopback address"},
		{"image snapshotter beside the registry", func(o *Options) {
			o.Images.RegistryAddress, o.Images.SnapshotterEndpoint = "127.0.0.1:7444", "unix:///run/cowvol/snapshotter.sock"
		}, ""},
		{"containerd checked for the snapshotter", func(o *Options) {
			o.Images.RegistryAddress, o.Images.SnapshotterEndpoint = "127.0.0.1:7444", "unix:///run/cowvol/snapshotter.sock"
			o.Images.ContainerdAddress = "/run/containerd/containerd.sock"
		}, ""},
		{"containerd without the registry", func(o *Options) { o.Images.ContainerdAddress = "/run/containerd/containerd.sock" }, "needs --image-registry-address"},
		{"containerd beside the registry alone", func(o *Options) {
			o.Images.RegistryAddress, o.Images.ContainerdAddress = "127.0.0.1:7444", "/run/containerd/containerd.sock"
		}, ""},
		{"containerd at a relative path", func(o *Options) {
			o.Images.RegistryAddress, o.Images.SnapshotterEndpoint = "127.0.0.1:7444", "unix:///run/cowvol/snapshotter.sock"
			o.Images.ContainerdAddress = "containerd.sock"
		}, "absolute path"},
		{"image snapshotter without the registry", func(o *Options) { o.Images.SnapshotterEndpoint = "unix:///run/sn.sock" }, "needs --image-registry-address"},
		{"image snapshotter on TCP", func(o *Options) {
			o.Images.RegistryAddress, o.Images.SnapshotterEndpoint = "127.0.0.1:7444", "tcp://127.0.0.1:7445"
		}, "want unix:///path"},
		{"API off loopback over TLS with Kubernetes auth", func(o *Options) {
			o.Mode, o.Controller.APIAddress, o.Controller.TLSCertFile, o.Controller.TLSKeyFile, o.Controller.KubeAuth = ModeController, "0.0.0.0:7000", "/c", "/k", true
		}, ""},
		{"Kubernetes auth and a tokens file", func(o *Options) { o.Mode, o.Controller.KubeAuth, o.Controller.TokensFile = ModeController, true, "/t" }, "give one"},
		{"leader election", func(o *Options) { o.Mode = ModeController; elect(o, "cowvol", "ctl-0") }, ""},
		{"leader election in node mode", func(o *Options) { elect(o, "cowvol", "n") }, "the controller's"},
		{"leader election in all mode", func(o *Options) { o.Mode = ModeAll; elect(o, "cowvol", "n") }, "every node plugin must serve"},
		{"leader's pod labelled without an election", func(o *Options) { o.Mode = ModeController; o.LeaderElection.LabelPod = true }, "needs --leader-election"},
		{"leader election without a namespace", func(o *Options) { o.Mode = ModeController; elect(o, "", "ctl-0") }, "POD_NAMESPACE"},
		{"leader election timings crossed", func(o *Options) {
			o.Mode = ModeController
			elect(o, "cowvol", "ctl-0")
			o.LeaderElection.LeaseDuration, o.LeaderElection.RenewDeadline = time.Second, 2*time.Second
		}, "renew deadline"},
		{"no stop timeout", func(o *Options) { o.StopTimeout = 0 }, "--stop-timeout"},
		{"no pull wait", func(o *Options) { o.Peers.PullWait = 0 }, "--pull-wait"},
		{"a negative read order refresh", func(o *Options) { o.Peers.ReadOrderRefresh = -time.Second }, "--read-order-refresh"},
		{"a negative swarm size", func(o *Options) { o.Peers.SwarmMinSize = -1 }, "--swarm-min-size"},
		{"registration needs a unix endpoint", func(o *Options) {
			o.Endpoint = "tcp://127.0.0.1:1"
			o.Node.RegistrationSocket = "/r.sock"
		}, "unix endpoint"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := good()
			tc.mut(&o)
			err := o.Validate()
			if tc.wantErr == "" {
				require.NoError(t, err)
				require.Equal(t, driver.DefaultDriverName, o.DriverName)
				return
			}
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}
