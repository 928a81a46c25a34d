package test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/volume"
)

var (
	kubectlCowvolOnce sync.Once
	kubectlCowvolPath string
	kubectlCowvolErr  error
)

// kubectlCowvol builds the operator CLI once for the package (COWVOL_KUBECTL_BINARY
// names a built one).
func kubectlCowvol(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("COWVOL_KUBECTL_BINARY"); p != "" {
		return p
	}
	kubectlCowvolOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kubectl-cowvol-")
		if err == nil {
			err = os.Chmod(dir, 0o755) // tests run it as other users too
		}
		if err != nil {
			kubectlCowvolErr = err
			return
		}
		kubectlCowvolPath = filepath.Join(dir, "kubectl-cowvol")
		out, err := exec.Command("go", "build", "-o", kubectlCowvolPath, "github.com/concourse/cowvol/cmd/kubectl-cowvol").CombinedOutput()
		if err != nil {
			kubectlCowvolErr = err
			kubectlCowvolPath = string(out)
		}
	})
	require.NoError(t, kubectlCowvolErr, kubectlCowvolPath)
	return kubectlCowvolPath
}

// The operator CLI against a controller and two node plugins: nodes and
// volumes as tables and as JSON and YAML, filters by namespace, node and
// property, a volume's chain, pin, destroy, and taking a node out of
// service and back; errors name what went wrong and exit non-zero.
func TestKubectlCowvol(t *testing.T) {
	f := startFleet(t, nil, "node-a", "node-b")
	bin := kubectlCowvol(t)
	empty := filepath.Join(t.TempDir(), "kubeconfig") // no cluster: the namespace comes from -n
	run := func(args ...string) (string, error) {
		cmd := exec.Command(bin, append([]string{"--controller-address=" + f.addr, "--kubeconfig=" + empty}, args...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	must := func(args ...string) string {
		t.Helper()
		out, err := run(args...)
		require.NoError(t, err, out)
		return out
	}
	require.NoError(t, os.WriteFile(empty, []byte("apiVersion: v1\nkind: Config\n"), 0o600))

	a, b := f.nodes["node-a"], f.nodes["node-b"]
	a.step("", "repo-v1", func(dir string) { write(t, dir, "f", "1") })
	v := a.mount(map[string]string{driver.AttrSource: "repo-v1", driver.AttrCapture: "built",
		volume.AttrPropertyPrefix + "kind": "build"}, false)
	write(t, v.Target, "out", "x")
	a.umount(v)
	b.step("", "repo-v1", func(dir string) { write(t, dir, "f", "1") })
	held := b.mount(map[string]string{driver.AttrSource: "repo-v1"}, true) // in use on b

	eventually(t, "the CLI to list every volume", func() bool {
		out, err := run("volumes", "-n", "ci", "-o", "json")
		return err == nil && strings.Contains(out, `"built"`) && strings.Contains(out, `"node-b"`) && strings.Contains(out, `"inUseOn"`)
	})

	nodes := must("nodes")
	require.Regexp(t, `(?m)^NAME\s+STATE\s+STORE\s+VOLUMES\s+BYTES\s+FREE\s+PULLS\s+LAST HEARTBEAT$`, nodes)
	require.Regexp(t, `(?m)^node-a\s+running\s+\S+\s+2\s+`, nodes)
	require.Regexp(t, `(?m)^node-b\s+running\s+\S+\s+1\s+`, nodes)
	require.Regexp(t, `(?m)^node-a\s.*\s(eager|lazy \(stubs\)|lazy \(index\))\s+\S+ ago$`, nodes, "how each node pulls, as it reported")

	var listed struct {
		Items []struct {
			Handle     string            `json:"handle"`
			State      string            `json:"state"`
			Parent     string            `json:"parent"`
			Nodes      []string          `json:"nodes"`
			InUseOn    []string          `json:"inUseOn"`
			Properties map[string]string `json:"properties"`
		} `json:"items"`
	}
	require.NoError(t, json.Unmarshal([]byte(must("volumes", "-n", "ci", "-o", "json")), &listed))
	require.Len(t, listed.Items, 2)
	require.Equal(t, "built", listed.Items[0].Handle)
	require.Equal(t, "ci/repo-v1", listed.Items[0].Parent)
	require.Equal(t, map[string]string{"kind": "build"}, listed.Items[0].Properties)
	require.Equal(t, []string{"node-a", "node-b"}, listed.Items[1].Nodes)
	require.Equal(t, []string{"node-b"}, listed.Items[1].InUseOn)

	require.NoError(t, yaml.Unmarshal([]byte(must("volumes", "-A", "--node=node-b", "-o", "yaml")), &listed))
	require.Len(t, listed.Items, 1, "node-b holds only repo-v1")
	require.Equal(t, "repo-v1", listed.Items[0].Handle)

	table := must("volumes", "-n", "ci", "-l", "kind=build")
	require.Regexp(t, `(?m)^NAMESPACE\s+HANDLE\s+STATE\s+STEP\s+SIZE\s+SCOPE\s+PARENT\s+OWNER\s+NODES\s+IN USE ON\s+PROPERTIES$`, table)
	require.Regexp(t, `(?m)^ci\s+built\s+ready\s+<unknown>\s+\S+\s+namespace\s+ci/repo-v1\s+<none>\s+node-a\s+<none>\s+kind=build$`, table)
	require.NotRegexp(t, `(?m)^ci\s+repo-v1\s`, table, "the selector leaves repo-v1 out")
	require.Contains(t, must("volumes", "-n", "other"), "NAMESPACE", "an empty namespace lists nothing, with a header")

	chain := must("chain", "-n", "ci", "built", "-o", "json")
	require.NoError(t, json.Unmarshal([]byte(chain), &listed))
	require.Equal(t, []string{"built", "repo-v1"}, []string{listed.Items[0].Handle, listed.Items[1].Handle})

	require.Regexp(t, `(?m)^ci\s+built\s+node-a$`, must("pin", "-n", "ci", "built", "--for=1h"))
	eventually(t, "the pin to reach the node", func() bool {
		return strings.Contains(must("volumes", "-n", "ci", "-l", "kind=build"), "ready,pinned")
	})
	must("unpin", "-n", "ci", "built")

	require.Regexp(t, `(?m)^ci\s+repo-v1\s+node-a,node-b$`, must("destroy", "-n", "ci", "repo-v1", "missing"))
	out, _ := run("volumes", "-n", "ci")
	require.NotRegexp(t, `(?m)^ci\s+repo-v1\s`, out, "gone from listings at once")
	b.umount(held)

	require.Regexp(t, `(?m)^node-b\s+land(ing|ed)\s+`, must("land", "node-b"))
	eventually(t, "node-b to be landed once its step is gone", func() bool {
		return regexp.MustCompile(`(?m)^node-b\s+landed\s+`).MatchString(must("nodes"))
	})
	require.Regexp(t, `(?m)^node-b\s+running\s+`, must("resume", "node-b"))

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"an unknown node", []string{"land", "node-z"}, "NotFound"},
		{"a bad selector", []string{"volumes", "-l", "kind in ("}, "InvalidArgument"},
		{"a bad output format", []string{"nodes", "-o", "xml"}, `output "xml"`},
		{"a bad handle", []string{"destroy", "-n", "ci", "../x"}, "handle"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := run(tc.args...)
			require.Error(t, err)
			require.Contains(t, out, "error: ")
			require.Contains(t, out, tc.want)
		})
	}
	raw, err := exec.Command(bin, "nodes").CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(raw), "--controller-address")
}
