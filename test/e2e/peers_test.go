//go:build e2e

package e2e

import (
	"context"
	"crypto/md5"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/pull"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
)

// pullFromAnotherNode runs a second node plugin outside the kubelet (a
// node of its own as far as the controller knows), captures a volume
// there, and has a step pod on the kubelet's node use it as its input, and
// run a program from it: the node's plugin pulls it from the other one (in
// mode, lazy or eager) while the kubelet retries. With firstOpts, a step
// with those pod options (a user namespace of its own) is the first to
// use it, through a writable view, and the read-only step comes after.
func (c *cluster) pullFromAnotherNode(mode string, firstOpts ...podOpt) {
	t := c.T
	kubeletDir := t.TempDir()
	other := plugintest.Start(t, plugintest.Config{
		NodeID: "other-node", StateDir: filepath.Join(c.StateDir, "other-node"), KubeletDir: kubeletDir,
		Args: []string{"--controller-address=" + c.ControllerAddr, "--peer-address=" + plugintest.FreeAddr(t)},
	})
	defer other.Stop()
	// A step on the other node: its output is captured there.
	v := other.Volume("ci", "remote-get", "out", map[string]string{driver.AttrCapture: "remote-v1"})
	require.NoError(t, other.Publish(v))
	require.NoError(t, os.MkdirAll(filepath.Join(v.Target, "src"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(v.Target, "src", "main.go"), []byte("package remote\n"), 0o644))
	big := make([]byte, 64<<20)
	for i := range big {
		big[i] = byte(i * 7 / 3)
	}
	require.NoError(t, os.WriteFile(filepath.Join(v.Target, "blob"), big, 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(v.Target, "bin"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(v.Target, "bin", "euid"), c.BuildStatic("euid", t.TempDir()), 0o755))
	require.NoError(t, other.Unpublish(v))
	ctx := context.Background()
	c.Until("the controller to see remote-v1 on the other node only", 30*time.Second, func() bool {
		locs, err := c.Cache.Lookup(ctx, cowvolume.Ref{Namespace: "ci", Handle: "remote-v1"})
		return err == nil && len(locs[0].Nodes) == 1 && locs[0].Nodes[0] == "other-node"
	})
	start := time.Now()
	script := `set -e; cat /in/src/main.go; wc -c < /in/blob; /in/bin/euid; md5sum < /in/blob`
	want := fmt.Sprintf("package remote\n%d\n0\n%x  -\n", 64<<20, md5.Sum(big))
	puller, took := "uses-remote", time.Duration(0) // the step that pulled it, and when it succeeded
	if len(firstOpts) > 0 {
		puller = "uses-remote-first"
		c.createPodWith("ci", puller, script+`; echo mine > /in/src/main.go; cat /in/src/main.go`, firstOpts,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "remote-v1")})
		require.Equal(t, want+"mine\n", c.mustSucceed("ci", puller),
			"the first pod reads the other node's bytes, runs its program and writes over its input")
		took = time.Since(start)
	}
	c.createPod("ci", "uses-remote", script,
		volume{name: "in", mountPath: "/in", attrs: attrs("source", "remote-v1"), readOnly: true})
	require.Equal(t, want, c.mustSucceed("ci", "uses-remote"), "the pod reads the other node's bytes and runs its program")
	if took == 0 {
		took = time.Since(start)
	}
	c.Until("the controller to see remote-v1 on both nodes", 30*time.Second, func() bool {
		locs, err := c.Cache.Lookup(ctx, cowvolume.Ref{Namespace: "ci", Handle: "remote-v1"})
		return err == nil && len(locs[0].Nodes) == 2
	})
	c.Until("the pull's event on the pod", 30*time.Second, func() bool {
		return strings.Contains(c.events("ci", puller), `VolumePulled: Pulled source volume "remote-v1" from node other-node`)
	})
	pulled, ok := c.pluginLine(`"Pulled a source volume from a peer"`, `volume="ci/remote-v1"`)
	require.True(t, ok, "the kubelet's node pulled it")
	modeLine, ok := c.pluginLine(`"Pulls of sources this node lacks"`)
	require.True(t, ok, "the plugin says how it pulls")
	require.Contains(t, modeLine, `mode="`+mode+`"`)
	if mode == "lazy" && pull.IndexSupported(c.StateDir) == nil {
		require.Contains(t, modeLine, "as indexes mounted file-backed", "a lazy pull mounts an index by default where the kernel can")
	}
	if len(firstOpts) > 0 {
		report(t, fmt.Sprintf("a step pod with a user namespace of its own wrote over a 64 MiB input held only by another node: "+
			"its view (a tree of its own, copied from the index once whole) published in %s\n",
			c.pluginDuration(`"Published step volume"`, `pod="ci/`+puller+`"`)))
	}
	report(t, fmt.Sprintf("a step pod used a 64 MiB volume held only by another node: the pod succeeded %s after it was created (%s; %s)\n",
		took.Round(100*time.Millisecond), strings.TrimSpace(pulled[strings.Index(pulled, "Pulled"):]),
		strings.TrimSpace(modeLine[strings.Index(modeLine, "mode="):])))
}
