//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/testfs"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
	"github.com/concourse/cowvol/test/localcluster"
)

// Pod options of hardened steps.
func userNamespace(spec, _ map[string]any) {
	spec["hostUsers"] = false
}

func runAs(uid int) podOpt {
	return func(_, container map[string]any) {
		container["securityContext"] = map[string]any{"runAsUser": uid, "runAsGroup": uid, "runAsNonRoot": uid != 0}
	}
}

// noNewPrivileges sets allowPrivilegeEscalation: false on the step
// container (after runAs).
func noNewPrivileges(_, container map[string]any) {
	container["securityContext"].(map[string]any)["allowPrivilegeEscalation"] = false
}

// plantSetuid adds an init container, root, that leaves a setuid-root euid
// in the pod's emptyDir "shared", and capuid, a euid with the file
// capability cap_setuid.
func plantSetuid(spec, _ map[string]any) {
	spec["initContainers"] = []any{map[string]any{"name": "plant", "image": localcluster.BusyboxImage, "imagePullPolicy": "Never",
		"command": []string{"/bin/sh", "-c", "set -e; cp /bin/euid /shared/euid; chmod 4755 /shared/euid; " +
			"cp /bin/euid /shared/capuid; /bin/euid -setcap /shared/capuid"},
		"volumeMounts": []any{map[string]any{"name": "shared", "mountPath": "/shared"}}}}
}

func fsGroup(gid int) podOpt {
	return func(spec, _ map[string]any) { spec["securityContext"] = map[string]any{"fsGroup": gid} }
}

// stepResults lists the step result kubectl cowvol shows for each of a
// namespace's volumes.
func (c *cluster) stepResults(ns string) map[string]string {
	c.T.Helper()
	var list struct {
		Items []struct{ Handle, StepResult string }
	}
	require.NoError(c.T, json.Unmarshal([]byte(c.kubectlCowvol("volumes", "-n", ns, "-o", "json")), &list))
	out := map[string]string{}
	for _, v := range list.Items {
		out[v.Handle] = v.StepResult
	}
	return out
}

// TestHardenedSteps runs hardened step pods through cowvol volumes on the
// overlay backend over XFS, as a multi-tenant CI runs them on current
// Kubernetes (containerd 2, runc 1.5): user namespaces, non-root users,
// recursive read-only mounts, fsGroup, and setuid binaries or device nodes
// planted in volumes.
func TestHardenedSteps(t *testing.T) {
	c := &cluster{localcluster.StartWith(t, testfs.XFS, "--cow-backend=overlay")}

	c.scenario("a user-namespace task works through a chain, seeing and keeping node-side owners", func() {
		c.createPod("ci", "userns-get", `set -e; cd /out
			echo root > root-file; echo user > user-file; chown 1000:1000 user-file
			mkdir shared; chown 1000:1000 shared`,
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", "userns-res")})
		c.mustSucceed("ci", "userns-get")
		c.waitCaptured("userns-res")

		// hostUsers: false; in it, root is another user to the node.
		c.createPodWith("ci", "userns-task", `set -e; cd /w
			awk 'NR==1 && $2 == 0 {exit 1}' /proc/self/uid_map
			test "$(id -u)" = 0
			test "$(stat -c %u:%g root-file)" = 0:0; test "$(stat -c %u:%g user-file)" = 1000:1000
			echo more >> user-file; echo new > new-file; rm root-file; echo made > shared/by-root`,
			[]podOpt{userNamespace},
			volume{name: "w", mountPath: "/w", attrs: attrs("source", "userns-res", "capture", "userns-task")})
		c.mustSucceed("ci", "userns-task")
		c.waitCaptured("userns-task")

		c.createPod("ci", "userns-after", `set -e; cd /in
			test ! -e root-file; test "$(cat user-file)" = "$(printf 'user\nmore')"
			stat -c '%n %u:%g' user-file new-file shared shared/by-root`,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "userns-task"), readOnly: true})
		require.Equal(t, "user-file 1000:1000\nnew-file 0:0\nshared 1000:1000\nshared/by-root 0:0\n",
			c.mustSucceed("ci", "userns-after"), "owners as a host-user step sees them, with no chown walk")

		// A chain (an overlay capture over userns-res) read by a
		// user-namespace pod: a read-only overlay could not be idmapped.
		c.createPod("ci", "chain-task", `set -e; echo chained > /w/chained`,
			volume{name: "w", mountPath: "/w", attrs: attrs("source", "userns-res", "capture", "userns-chain")})
		c.mustSucceed("ci", "chain-task")
		c.waitCaptured("userns-chain")
		c.createPodWith("ci", "userns-chain-read", `set -e; cat /in/chained /in/root-file`, []podOpt{userNamespace},
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "userns-chain"), readOnly: true})
		require.Equal(t, "chained\nroot\n", c.mustSucceed("ci", "userns-chain-read"))
		publish := c.pluginDuration(`"Published step volume"`, `pod="ci/userns-task"`)
		report(t, fmt.Sprintf("user-namespace task (overlay on XFS, a reflink clone of a 3-file input): publish %s\n", publish))
	})

	c.scenario("setuid binaries, file capabilities and device nodes from a volume give no one root", func() {
		// The threat is real: runc passes a volume's setuid bits and file
		// capabilities into the container (an emptyDir here), whatever
		// the mount's flags.
		c.createPodWith("ci", "setuid-control", `/shared/euid; /shared/capuid -setuid`, []podOpt{runAs(1000), plantSetuid},
			volume{name: "shared", mountPath: "/shared"})
		require.Equal(t, "0\n0\n", c.mustSucceed("ci", "setuid-control"),
			"a setuid-root binary in an emptyDir runs as root, and one with cap_setuid becomes root")
		// What the README tells pod authors to add stops both wherever
		// the binary comes from.
		c.createPodWith("ci", "setuid-no-new-privs", `/shared/euid; /shared/capuid -setuid`, []podOpt{runAs(1000), noNewPrivileges, plantSetuid},
			volume{name: "shared", mountPath: "/shared"})
		require.Equal(t, "1000\n1000\n", c.mustSucceed("ci", "setuid-no-new-privs"), "allowPrivilegeEscalation: false")

		c.createPod("ci", "plant", `set -e; cd /out
			cp /bin/euid euid; chmod 4755 euid; cp /bin/euid sgid; chmod 2755 sgid
			cp /bin/euid capuid; /bin/euid -setcap capuid
			mknod null c 1 3; mknod zero c 1 5; test -c null`,
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", "tools", "scope", "cluster")})
		c.mustSucceed("ci", "plant")
		c.waitCaptured("tools")
		c.createPodWith("other", "victim", `set -e; cd /in
			stat -c '%n %a' euid sgid; ./euid; ./capuid -setuid
			for d in null zero; do if echo x > $d; then echo "$d opened"; exit 1; fi; done 2>/dev/null; echo no devices`,
			[]podOpt{runAs(1000)},
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "tools", "sourceNamespace", "ci"), readOnly: true})
		require.Equal(t, "euid 755\nsgid 755\n1000\n1000\nno devices\n", c.mustSucceed("other", "victim"))
	})

	c.scenario("every capture says how its step ended", func() {
		c.createPod("ci", "fails", `echo partial > /out/f; exit 3`,
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", "failed-out")})
		phase, _ := c.waitDone("ci", "fails")
		require.Equal(t, "Failed", phase)
		c.waitCaptured("failed-out")

		// An image that is not there: the container never starts, and
		// deleting the pod captures an output that is no output.
		c.createPodWith("ci", "never", `true`, []podOpt{func(_, container map[string]any) {
			container["image"] = "cowvol.test/missing:none"
		}}, volume{name: "out", mountPath: "/out", attrs: attrs("source", "userns-res", "capture", "never-out")})
		c.Until("the image to be missing", time.Minute, func() bool {
			out, _ := c.Kubectl("", "get", "pod", "-n", "ci", "never", "-o", "jsonpath={.status.containerStatuses[0].state.waiting.reason}")
			return out == "ErrImageNeverPull"
		})
		c.deletePod("ci", "never")
		c.waitCaptured("never-out")
		c.Until("the controller to hear of the captures", 30*time.Second, func() bool {
			r := c.stepResults("ci")
			return r["failed-out"] != "" && r["never-out"] != ""
		})
		results := c.stepResults("ci")
		require.Equal(t, string(cowvolume.StepSucceeded), results["userns-res"])
		require.Equal(t, string(cowvolume.StepFailed), results["failed-out"])
		require.Equal(t, string(cowvolume.StepNotStarted), results["never-out"])
		require.Contains(t, c.events("ci", "never"), "the step never started, so it holds its source unchanged")
		table := c.kubectlCowvol("volumes", "-n", "ci", "-l", cowvolume.PropertyStepResult+"="+string(cowvolume.StepNotStarted))
		require.Contains(t, table, "never-out", "a scheduler selects on it")
		require.NotContains(t, table, "failed-out")
	})

	c.scenario("non-root, recursively read-only and fsGroup steps", func() {
		c.createPodWith("ci", "nonroot", `set -e; echo mine > /out/mine; stat -c %u /out/mine`, []podOpt{runAs(1000)},
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", "nonroot-out")})
		require.Equal(t, "1000\n", c.mustSucceed("ci", "nonroot"), "a non-root step writes its output")
		c.waitCaptured("nonroot-out")

		c.createPod("ci", "rro", `if touch /in/x 2>/dev/null; then echo writable; exit 1; fi
			grep ' /in ' /proc/self/mountinfo | grep -q ' ro[, ]' && echo read-only`,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "nonroot-out"), readOnly: true, recursiveReadOnly: true})
		require.Equal(t, "read-only\n", c.mustSucceed("ci", "rro"))

		// fsGroupPolicy: None: the kubelet chowns nothing, so the
		// publish costs what it costs without fsGroup.
		c.createPod("ci", "no-fsgroup", `stat -c %g /w/user-file`,
			volume{name: "w", mountPath: "/w", attrs: attrs("source", "userns-res")})
		c.createPodWith("ci", "with-fsgroup", `stat -c %g /w/user-file`, []podOpt{fsGroup(2000)},
			volume{name: "w", mountPath: "/w", attrs: attrs("source", "userns-res")})
		require.Equal(t, "1000\n", c.mustSucceed("ci", "no-fsgroup"))
		require.Equal(t, "1000\n", c.mustSucceed("ci", "with-fsgroup"), "fsGroup changes no owner")
		report(t, fmt.Sprintf("fsGroup (fsGroupPolicy: None): publish %s with fsGroup, %s without\n",
			c.pluginDuration(`"Published step volume"`, `pod="ci/with-fsgroup"`),
			c.pluginDuration(`"Published step volume"`, `pod="ci/no-fsgroup"`)))
	})

	// A user-namespace step first: overlay mounts cannot be idmapped, so its
	// writable view is a tree of its own, copied from the pulled index once
	// the index is whole (its publish is retried until then); a host-users
	// step reads the same input after it.
	c.scenario("steps on a node without their input, one in a user namespace of its own, start over a lazy pull, read its bytes and run its program", func() {
		c.pullFromAnotherNode("lazy", userNamespace) // overlay on XFS: lazy where the kernel has pre-content events
	})
}
