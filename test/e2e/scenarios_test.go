//go:build e2e

package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/tb"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/client"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
	"github.com/concourse/cowvol/test/localcluster"
)

// listFn prints every file under a dir with its checksum and every entry,
// sorted, so that two pods' views of a volume compare byte for byte.
const listFn = `list() { (cd "$1" && find . -type f | sort | xargs -r sha256sum && find . | sort); }; `

func listScript(dir string) string { return listFn + "list " + dir }

func attrs(kv ...string) map[string]string {
	m := map[string]string{}
	for i := 0; i < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

// TestE2E brings up one node and plays a CI build's steps on it.
func TestE2E(t *testing.T) {
	c := &cluster{localcluster.StartWith(t, testfs.Btrfs, "--image-registry-address="+imageRegistry)}

	// get: a pod writes a repository into a captured output.
	c.createPod("ci", "get", `set -e; cd /out
		mkdir -p src docs; echo 'package main' > src/main.go; echo 'old' > src/old.go
		echo '# repo' > README.md; echo 'guide' > docs/guide.md; ln -s README.md link`,
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "res-v1", "property.version", "v1")})
	c.mustSucceed("ci", "get")
	c.waitCaptured("res-v1")
	// When does the kubelet unpublish a finished pod's volume? Compare
	// the container's end with the plugin's capture.
	finished, err := time.Parse(time.RFC3339, c.MustKubectl("", "get", "pod", "-n", "ci", "get",
		"-o", "jsonpath={.status.containerStatuses[0].state.terminated.finishedAt}"))
	require.NoError(t, err)
	captured, ok := c.pluginLogTime(`"Captured step volume"`, `volume="ci/res-v1"`)
	require.True(t, ok)
	c.Until("the capture's event on the pod", 30*time.Second, func() bool {
		return strings.Contains(c.events("ci", "get"), `VolumeCaptured: Captured into cached volume "res-v1"`)
	})
	report(t, fmt.Sprintf("the kubelet unpublished (and cowvol captured) a finished pod's volume %s after its container ended (finishedAt has 1 s resolution), without the pod being deleted\n",
		captured.Sub(finished).Round(time.Millisecond)))
	c.createPod("ci", "get-list", listScript("/in"), volume{name: "in", mountPath: "/in", attrs: attrs("source", "res-v1"), readOnly: true})
	resV1 := c.mustSucceed("ci", "get-list")
	require.Contains(t, resV1, "./src/old.go")

	c.scenario("task changes a COW input and leaves the source as it was", func() {
		c.createPod("ci", "task", listFn+`set -e; cd /repo
			echo 'package main // built' > src/main.go; rm src/old.go; rm -r docs; echo new > src/new.go
			list /repo`,
			volume{name: "repo", mountPath: "/repo", attrs: attrs("source", "res-v1", "capture", "task-v1")})
		taskView := c.mustSucceed("ci", "task")
		require.NotContains(t, taskView, "old.go")
		c.waitCaptured("task-v1")
		c.createPod("ci", "source-after", listScript("/in"), volume{name: "in", mountPath: "/in", attrs: attrs("source", "res-v1"), readOnly: true})
		require.Equal(t, resV1, c.mustSucceed("ci", "source-after"), "the cached source is byte-for-byte unchanged")

		// The next task sees exactly the previous task's changes.
		c.createPod("ci", "next-task", listScript("/in"), volume{name: "in", mountPath: "/in", attrs: attrs("source", "task-v1")})
		require.Equal(t, taskView, c.mustSucceed("ci", "next-task"))
	})

	c.scenario("a chain: input captured and reused, twice", func() {
		prev := "res-v1"
		for i := 1; i <= 3; i++ {
			name, handle := fmt.Sprintf("chain-%d", i), fmt.Sprintf("chain-v%d", i)
			c.createPod("ci", name, fmt.Sprintf(`set -e; cd /w; test "$(cat step 2>/dev/null || echo 0)" = %d; echo %d > step; echo %d > file-%d`, i-1, i, i, i),
				volume{name: "w", mountPath: "/w", attrs: attrs("source", prev, "capture", handle)})
			c.mustSucceed("ci", name)
			c.waitCaptured(handle)
			prev = handle
		}
		c.createPod("ci", "chain-read", `set -e; cd /in; test "$(cat step)" = 3; cat file-1 file-2 file-3`,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", prev), readOnly: true})
		require.Equal(t, "1\n2\n3\n", c.mustSucceed("ci", "chain-read"))
	})

	c.scenario("two pods on one source do not see each other's writes", func() {
		for _, who := range []string{"a", "b"} {
			other := map[string]string{"a": "b", "b": "a"}[who]
			c.createPod("ci", "twin-"+who, fmt.Sprintf(`set -e; echo %s > /w/mine-%s; sleep 3; test ! -e /w/mine-%s; echo isolated`, who, who, other),
				volume{name: "w", mountPath: "/w", attrs: attrs("source", "res-v1")})
		}
		require.Equal(t, "isolated\n", c.mustSucceed("ci", "twin-a"))
		require.Equal(t, "isolated\n", c.mustSucceed("ci", "twin-b"))
	})

	c.scenario("a cache is forked by each step and kept only when its step succeeds", func() {
		cached := volume{name: "c", mountPath: "/c", attrs: attrs("cache", "deps/busybox")}
		promotedOrDiscarded := func(pod, event string) {
			c.Until(pod+"'s "+event, 30*time.Second, func() bool {
				return strings.Contains(c.events("ci", pod), event+`: Cache "deps/busybox"`)
			})
		}
		c.createPod("ci", "cache-1", `set -e; test -z "$(ls -A /c)"; echo 1 > /c/gen; echo started-empty`, cached)
		require.Equal(t, "started-empty\n", c.mustSucceed("ci", "cache-1"))
		promotedOrDiscarded("cache-1", "CachePromoted")
		c.createPod("ci", "cache-fails", `test "$(cat /c/gen)" = 1 && echo broken > /c/gen; exit 3`, cached)
		phase, _ := c.waitDone("ci", "cache-fails")
		require.Equal(t, "Failed", phase)
		promotedOrDiscarded("cache-fails", "CacheDiscarded")
		c.createPod("ci", "cache-2", `set -e; test "$(cat /c/gen)" = 1; echo 2 > /c/gen; echo forked-the-good-one`, cached)
		require.Equal(t, "forked-the-good-one\n", c.mustSucceed("ci", "cache-2"))
		promotedOrDiscarded("cache-2", "CachePromoted")
		c.createPod("other", "cache-other", `test -z "$(ls -A /c)" && echo a-key-of-its-own`, cached)
		require.Equal(t, "a-key-of-its-own\n", c.mustSucceed("other", "cache-other"), "another namespace's key of the same name")
		c.createPod("ci", "cache-read", `cat /c/gen`, volume{name: "c", mountPath: "/c", attrs: attrs("cache", "deps/busybox"), readOnly: true})
		require.Equal(t, "2\n", c.mustSucceed("ci", "cache-read"))
	})

	c.scenario("a task cache is promoted only after success", func() {
		// Build 1 fills the cache and succeeds: the scheduler promotes it.
		c.createPod("ci", "build-1", `set -e; echo deps-1 > /cache/deps`,
			volume{name: "cache", mountPath: "/cache", attrs: attrs("capture", "cache-b1")})
		c.mustSucceed("ci", "build-1")
		c.waitCaptured("cache-b1")
		promoted := "cache-b1"
		// Build 2 uses it, adds to it, and fails: not promoted.
		c.createPod("ci", "build-2", `set -e; test "$(cat /cache/deps)" = deps-1; echo broken > /cache/deps; exit 1`,
			volume{name: "cache", mountPath: "/cache", attrs: attrs("source", promoted, "capture", "cache-b2")})
		phase, _ := c.waitDone("ci", "build-2")
		require.Equal(t, "Failed", phase)
		c.waitCaptured("cache-b2")
		// Build 3 gets the last promoted cache, untouched by build 2.
		c.createPod("ci", "build-3", `set -e; cat /cache/deps`,
			volume{name: "cache", mountPath: "/cache", attrs: attrs("source", promoted, "capture", "cache-b3")})
		require.Equal(t, "deps-1\n", c.mustSucceed("ci", "build-3"))
	})

	c.scenario("namespaces: another's private volume is answered as missing, a shared one is readable by name", func() {
		refused := func(pod string, a map[string]string, want string) {
			c.createPod("other", pod, `cat /in/README.md`, volume{name: "in", mountPath: "/in", attrs: a, readOnly: true})
			c.Until("the refusal to show in "+pod+"'s events", 90*time.Second, func() bool {
				return strings.Contains(c.events("other", pod), "NotFound")
			})
			require.Contains(t, c.events("other", pod), want)
			require.NotContains(t, c.events("other", pod), "ready", "no state of ci's volume leaks")
			require.Equal(t, "Pending", c.phase("other", pod), "the pod stays ContainerCreating")
			c.deletePod("other", pod)
		}
		// Unnamed, a source resolves in the pod's own namespace.
		refused("intruder", attrs("source", "res-v1"), `source volume "res-v1" is not cached on this node`)
		// Named, a private volume answers exactly like a missing one.
		refused("intruder-named", attrs("source", "res-v1", "sourceNamespace", "ci"),
			`source volume "res-v1" of namespace "ci" is not cached on this node, or is not shared`)
		// A pod author's forged pod info is overwritten by the kubelet's.
		refused("forger", attrs("source", "res-v1", "csi.storage.k8s.io/pod.namespace", "ci"),
			`source volume "res-v1" is not cached on this node`)

		c.createPod("ci", "shared-get", `echo shared > /out/data`,
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", "shared-v1", "scope", "cluster")})
		c.mustSucceed("ci", "shared-get")
		c.waitCaptured("shared-v1")
		c.createPod("other", "guest", `cat /in/data`,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "shared-v1", "sourceNamespace", "ci"), readOnly: true})
		require.Equal(t, "shared\n", c.mustSucceed("other", "guest"))
		// The same handle captured in another namespace is that namespace's own.
		c.createPod("other", "same-handle", `echo mine > /out/data`,
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", "shared-v1")})
		c.mustSucceed("other", "same-handle")
		c.waitCapturedIn("other", "shared-v1")
		c.createPod("other", "same-handle-read", `cat /in/data`,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "shared-v1"), readOnly: true})
		require.Equal(t, "mine\n", c.mustSucceed("other", "same-handle-read"))
	})

	c.scenario("a size-limited step that writes too much fails cleanly; what it wrote is captured", func() {
		c.createPod("ci", "greedy", `set -e; echo start > /out/first; dd if=/dev/zero of=/out/big bs=1M count=64`,
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", "greedy-v1", "sizeLimit", "16Mi")})
		phase, log := c.waitDone("ci", "greedy")
		require.Equal(t, "Failed", phase, "the step fails: %s", log)
		require.Contains(t, log, "Disk quota exceeded")
		c.waitCaptured("greedy-v1")
		c.createPod("ci", "greedy-read", `cat /in/first; ls -s /in/big | awk '{print ($1 <= 16384) ? "capped" : "over"}'`,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "greedy-v1"), readOnly: true})
		require.Equal(t, "start\ncapped\n", c.mustSucceed("ci", "greedy-read"))
	})

	c.scenario("the plugin is killed and restarted while pods run and while volumes are torn down", func() {
		c.createPod("ci", "survivor", `set -e; echo before > /w/before; sleep 6; echo after > /w/after`,
			volume{name: "w", mountPath: "/w", attrs: attrs("source", "res-v1", "capture", "survivor-v1")})
		c.Until("the survivor to run", 60*time.Second, func() bool { return c.phase("ci", "survivor") == "Running" })
		c.Plugin.Restart() // a SIGKILL, then a new process
		c.mustSucceed("ci", "survivor")
		c.waitCaptured("survivor-v1")

		// Killed mid-capture: the plugin dies between the rename and the
		// commit; the kubelet's retried unpublish completes the capture.
		c.createPod("ci", "torn", `echo done > /w/result`,
			volume{name: "w", mountPath: "/w", attrs: attrs("capture", "torn-v1")})
		c.Plugin.Restart("COWVOL_CRASH_AT=capture-renamed")
		c.Until("the plugin to crash mid-capture", 3*time.Minute, func() bool { return !c.Plugin.Running() })
		c.Plugin.Restart()
		c.waitCaptured("torn-v1")

		c.createPod("ci", "survivor-read", `cat /in/before /in/after /in/README.md; cat /r/result`,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "survivor-v1"), readOnly: true},
			volume{name: "r", mountPath: "/r", attrs: attrs("source", "torn-v1"), readOnly: true})
		require.Equal(t, "before\nafter\n# repo\ndone\n", c.mustSucceed("ci", "survivor-read"))
	})

	c.scenario("step time with a 1 GiB COW input beside an emptyDir", func() {
		c.createPod("ci", "big-get", `set -e; dd if=/dev/zero of=/out/blob bs=1M count=1024 2>/dev/null; for i in $(seq 1 1000); do echo $i > /out/f$i; done`,
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", "big-v1")})
		c.mustSucceed("ci", "big-get")
		c.waitCaptured("big-v1")
		timeStep := func(name string, v volume) time.Duration {
			start := time.Now()
			c.createPod("ci", name, `ls /in >/dev/null; echo ok`, v)
			c.mustSucceed("ci", name)
			return time.Since(start)
		}
		// Warm the image and the node once, then time each kind twice.
		timeStep("warm", volume{name: "in", mountPath: "/in"})
		var cow, empty []time.Duration
		for i := range 2 {
			cow = append(cow, timeStep(fmt.Sprintf("cow-%d", i), volume{name: "in", mountPath: "/in", attrs: attrs("source", "big-v1")}))
			empty = append(empty, timeStep(fmt.Sprintf("empty-%d", i), volume{name: "in", mountPath: "/in"}))
		}
		report(t, fmt.Sprintf("pod create to Succeeded: COW input of a 1 GiB cached volume %v; emptyDir %v\n", cow, empty))
		for i := range cow {
			report(t, fmt.Sprintf("cowvol's own NodePublishVolume for cow-%d: %s\n", i, c.pluginDuration(`"Published step volume"`, fmt.Sprintf(`pod="ci/cow-%d"`, i))))
		}
	})

	c.scenario("the plugin serves only while the CSIDriver object makes the kubelet vouch for pods", func() {
		// A driver without its CSIDriver object refuses to start.
		out, err := exec.Command(plugintest.Binary(t), "--endpoint=unix://"+filepath.Join(t.TempDir(), "csi.sock"),
			"--state-dir="+t.TempDir(), "--kubelet-dir="+t.TempDir(), "--kubeconfig="+c.Kubeconfig,
			"--driver-name=absent.cowvol.example.org").CombinedOutput()
		require.Error(t, err)
		require.Contains(t, string(out), "the CSIDriver object does not exist")
		// Switched to podInfoOnMount: false at run time (the kubelet would
		// then pass pod authors' attributes through), publishes are
		// refused until it is switched back.
		patch := func(v bool) {
			c.MustKubectl("", "patch", "csidriver", localcluster.DriverName, "--type=merge", "-p", fmt.Sprintf(`{"spec":{"podInfoOnMount":%v}}`, v))
		}
		patch(false)
		c.Until("the plugin to see the change", 60*time.Second, func() bool {
			return strings.Contains(c.Plugin.Log(), "Refusing publishes until the CSIDriver object is fixed")
		})
		c.createPod("ci", "unvouched", `cat /in/README.md`,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "res-v1"), readOnly: true})
		c.Until("the refusal to show in the pod's events", 90*time.Second, func() bool {
			return strings.Contains(c.events("ci", "unvouched"), "refusing to publish")
		})
		patch(true)
		require.Equal(t, "# repo\n", c.mustSucceed("ci", "unvouched"), "the kubelet's retry is served once it is fixed")
	})

	c.scenario("the controller knows what the node holds, places a step next to its input, and treats a cordoned Node as landing", func() {
		ctx := context.Background()
		res := cowvolume.Ref{Namespace: "ci", Handle: "res-v1"}
		c.Until("the controller to see res-v1 on the node", 30*time.Second, func() bool {
			locs, err := c.Cache.Lookup(ctx, res)
			return err == nil && len(locs[0].Nodes) == 1 && locs[0].Nodes[0] == localcluster.NodeName
		})
		placed, err := c.Cache.Place(ctx, res)
		require.NoError(t, err)
		require.Equal(t, localcluster.NodeName, placed[0].NodeId)
		require.Positive(t, placed[0].InputBytesHeld)
		report(t, "the scheduler's client places a step reading res-v1 on "+client.Describe(placed[0])+"\n")
		// The step itself, its input built by the client as a scheduler would.
		in := client.Input("in", res, "ci")
		c.createPod("ci", "placed", `cat /in/README.md`, volume{name: "in", mountPath: "/in", attrs: in.CSI.VolumeAttributes, readOnly: true})
		require.Equal(t, "# repo\n", c.mustSucceed("ci", "placed"))
		// The operator's view: kubectl cowvol, as a kubectl plugin on PATH.
		listing := c.kubectlCowvol("volumes", "-n", "ci", "-l", "version=v1")
		require.Regexp(t, `(?m)^ci\s+res-v1\s+ready\s+succeeded\s+\S+\s+namespace\s+<none>\s+<none>\s+`+localcluster.NodeName+`\s`, listing)
		report(t, "kubectl cowvol volumes -n ci -l version=v1:\n"+listing)
		require.Regexp(t, `(?m)^`+localcluster.NodeName+`\s+running\s`, c.kubectlCowvol("nodes"))

		c.MustKubectl("", "cordon", localcluster.NodeName)
		c.Until("the controller to treat the cordoned node as landing", 30*time.Second, func() bool {
			resp, err := c.Cache.Cache.ListNodes(ctx, &controllerv1.ListNodesRequest{})
			return err == nil && len(resp.Nodes) == 1 && (resp.Nodes[0].State == "landed" || resp.Nodes[0].State == "landing")
		})
		c.Until("the node to learn it at its next heartbeat", 30*time.Second, func() bool {
			n, err := c.Plugin.NodeAPI.GetNode(ctx, &nodev1.GetNodeRequest{})
			return err == nil && strings.Contains(n.CapturesRefused, "schedule steps that capture elsewhere")
		})
		c.createPod("ci", "on-cordoned", `echo late > /out/f`, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "cordoned-v1")})
		c.Until("the cordoned node to refuse the capture", 90*time.Second, func() bool {
			return strings.Contains(c.events("ci", "on-cordoned"), "schedule steps that capture elsewhere")
		})
		c.MustKubectl("", "uncordon", localcluster.NodeName)
		c.mustSucceed("ci", "on-cordoned")
		c.waitCaptured("cordoned-v1")
	})

	c.scenario("the plugin image, built without Docker, runs in the cluster", func() {
		c.pluginImageRuns()
	})

	c.scenario("a step uses an input that only another node holds: the node pulls it from that node's plugin", func() {
		c.pullFromAnotherNode("eager") // btrfs: views are snapshots, which would copy stubs
	})

	c.scenario("with --kube-auth, RBAC on cachedvolumes decides who sees and destroys what", func() {
		c.kubeAuth()
	})

	c.scenario("a scheduler with only a kubeconfig reaches the controller pod through a port-forward", func() {
		c.reachThroughKubeconfig()
	})

	c.scenario("two controller replicas elect a leader through a Lease; the leader killed, the other takes over", func() {
		c.controllerHA()
	})

	c.scenario("a node whose cache fills up says so on its Node object, and again when it recovers", func() {
		nodeEvents := func() string {
			out, _ := c.Kubectl("", "get", "events", "-A", "--field-selector", "involvedObject.kind=Node,involvedObject.name="+localcluster.NodeName,
				"-o", "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}")
			return out
		}
		unfill := c.fillStateDir()
		c.Until("the CacheFull event on the Node", 60*time.Second, func() bool {
			return strings.Contains(nodeEvents(), "CacheFull: cowvol refuses new captures")
		})
		unfill()
		c.Until("the CacheRecovered event on the Node", 60*time.Second, func() bool {
			return strings.Contains(nodeEvents(), "CacheRecovered")
		})
		report(t, "the Node's events: "+strings.ReplaceAll(strings.TrimSpace(nodeEvents()), "\n", " | ")+"\n")
	})

	c.scenario("a step runs on an image a step left in a volume, with no registry", func() {
		c.stepImages()
	})

	c.scenario("a step runs on an image volume's own layers through the cowvol snapshotter, which holds the volume", func() {
		c.stepImagesOnSnapshotter()
	})

	c.scenario("the admission policy refuses what a namespace may not do, naming the rule", func() {
		c.admissionPolicy()
	})

	// Every pod gone, nothing of cowvol's may stay mounted.
	c.deleteSteps("ci", "other")
}

// report logs a finding and leaves it where make e2e prints it.
func report(t tb.TB, line string) {
	t.Log(strings.TrimSpace(line))
	if path := os.Getenv("COWVOL_E2E_REPORT"); path != "" {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			t.Error(err)
			return
		}
		defer f.Close()
		_, _ = f.WriteString(line)
	}
}

// admissionPolicy installs components/admission-policy and has the API
// server judge step pods (server-side dry runs: admission runs, nothing is
// made) in namespaces labelled for each rule, then removes it.
func (c *cluster) admissionPolicy() {
	t := c.T
	dir := filepath.Join(c.Work, "admission")
	repo, err := filepath.Abs("../..")
	require.NoError(t, err)
	component, err := filepath.Rel(dir, filepath.Join(repo, "deploy/csi/components/admission-policy"))
	require.NoError(t, err)
	localcluster.WriteFile(t, filepath.Join(dir, "kustomization.yaml"), "components: ["+component+"]\n")
	c.MustKubectl("", "apply", "-k", dir)
	defer c.MustKubectl("", "delete", "-k", dir)
	for ns, labels := range map[string][]string{
		"adm-none":   nil,
		"adm-ci":     {"cowvol.concourse-ci.org/volumes=allowed", "cowvol.concourse-ci.org/max-size-limit=10Mi"},
		"adm-shared": {"cowvol.concourse-ci.org/volumes=allowed", "cowvol.concourse-ci.org/share=cluster"},
		"adm-bad":    {"cowvol.concourse-ci.org/volumes=allowed", "cowvol.concourse-ci.org/max-size-limit=lots"},
	} {
		c.MustKubectl("", "create", "namespace", ns)
		defer c.MustKubectl("", "delete", "namespace", ns, "--wait=false")
		if labels != nil {
			c.MustKubectl("", append([]string{"label", "namespace", ns}, labels...)...)
		}
	}
	judge := func(ns string, vols ...volume) error {
		_, err := c.Kubectl(podJSON(ns, "judged", "true", vols), "create", "--dry-run=server", "-f", "-")
		return err
	}
	out := func(a map[string]string) volume { return volume{name: "out", mountPath: "/out", attrs: a} }
	// The policy takes a moment to be in force.
	c.Until("the policy to be in force", 60*time.Second, func() bool {
		err := judge("adm-none", out(attrs("capture", "x")))
		return err != nil && strings.Contains(err.Error(), "cowvol rule")
	})
	for _, tc := range []struct {
		name, ns string
		vols     []volume
		rule     string // "": admitted
	}{
		{"cowvol volumes where they are not allowed", "adm-none", []volume{out(attrs("capture", "x"))}, `rule "volumes"`},
		{"other volumes there", "adm-none", []volume{{name: "scratch", mountPath: "/s"}}, ""},
		{"a capture within the limit", "adm-ci", []volume{out(attrs("capture", "x", "sizeLimit", "5Mi"))}, ""},
		{"a capture past the limit", "adm-ci", []volume{out(attrs("capture", "x", "sizeLimit", "20Mi"))}, `rule "max-size-limit"`},
		{"a writable volume naming no limit", "adm-ci", []volume{out(attrs("capture", "x"))}, `at most 10Mi`},
		{"a read-only input naming no limit", "adm-ci", []volume{{name: "in", mountPath: "/in", attrs: attrs("source", "res"), readOnly: true}}, ""},
		{"a shared capture where sharing is not allowed", "adm-ci", []volume{out(attrs("capture", "x", "scope", "cluster", "sizeLimit", "1Mi"))}, `rule "share"`},
		{"a shared capture where it is", "adm-shared", []volume{out(attrs("capture", "x", "scope", "cluster"))}, ""},
		{"a malformed limit label", "adm-bad", []volume{out(attrs("capture", "x", "sizeLimit", "1Mi"))}, "is not a quantity"},
	} {
		err := judge(tc.ns, tc.vols...)
		if tc.rule == "" {
			require.NoError(t, err, tc.name)
			continue
		}
		require.Error(t, err, tc.name)
		require.Contains(t, err.Error(), tc.rule, tc.name)
		require.Contains(t, err.Error(), "namespace "+tc.ns, "%s: the message names the namespace", tc.name)
	}
	report(t, "the admission policy refused cowvol volumes in an unlabelled namespace, a shared capture without the share label, "+
		"and sizeLimits past (or missing under) a namespace's max-size-limit, each naming its rule\n")
}

// fillStateDir fills the state dir's filesystem past the plugin's high
// watermark (50%) with a file of its own, and returns what removes it.
func (c *cluster) fillStateDir() (unfill func()) {
	t := c.T
	filler, err := os.Create(filepath.Join(c.StateDir, "filler"))
	require.NoError(t, err)
	for {
		n, err := c.Plugin.NodeAPI.GetNode(context.Background(), &nodev1.GetNodeRequest{})
		require.NoError(t, err)
		if n.UsedPercent > 55 {
			break
		}
		// Synced, so that the filesystem counts it (btrfs reports space
		// late); a full disk is past the mark too.
		if _, err = filler.Write(make([]byte, 64<<20)); err == nil {
			err = filler.Sync()
		}
		if errors.Is(err, syscall.ENOSPC) {
			break
		}
		require.NoError(t, err)
	}
	return func() {
		filler.Close()
		require.NoError(t, os.Remove(filler.Name()))
	}
}
