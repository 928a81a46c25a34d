//go:build e2e

// Package e2e runs cowvol under real kubelets: the clusters of
// test/localcluster (one node on loopback, or a fleet of nodes in
// namespaces of their own), cowvol installed as a user installs it, and
// real step pods whose volumes the kubelets publish through it, in the
// scenarios a CI's build plays. The clusters are localcluster's; this
// package holds the scenarios and the steps' helpers. Everything a
// cluster starts it stops, leaving nothing behind.
package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/test/localcluster"
)

// scenario runs one step of the build, logging where it starts and ends.
// Scenarios build on each other, so a failure ends the whole run.
func (c *cluster) scenario(name string, fn func()) {
	c.T.Helper()
	start := time.Now()
	c.T.Logf("=== scenario: %s", name)
	c.Current = name
	fn()
	c.T.Logf("--- scenario done in %s: %s", time.Since(start).Round(time.Millisecond), name)
}

// ---- pods ----

// volume is one inline cowvol volume (or an emptyDir) of a step pod.
type volume struct {
	name, mountPath string
	attrs           map[string]string // nil: an emptyDir
	readOnly        bool
	// recursiveReadOnly asks for recursiveReadOnly: Enabled.
	recursiveReadOnly bool
}

// podOpt changes a step pod's spec and its step container's before the
// pod is created.
type podOpt func(spec, container map[string]any)

// podJSON is a step pod as Pod Security's baseline admits it (the step
// namespaces enforce it): on the pod network, with no host paths.
func podJSON(ns, name, script string, vols []volume, opts ...podOpt) string {
	var mounts, volumes []map[string]any
	for _, v := range vols {
		mount := map[string]any{"name": v.name, "mountPath": v.mountPath, "readOnly": v.readOnly}
		if v.recursiveReadOnly {
			mount["recursiveReadOnly"] = "Enabled"
		}
		mounts = append(mounts, mount)
		if v.attrs == nil {
			volumes = append(volumes, map[string]any{"name": v.name, "emptyDir": map[string]any{}})
			continue
		}
		volumes = append(volumes, map[string]any{"name": v.name, "csi": map[string]any{
			"driver": localcluster.DriverName, "volumeAttributes": v.attrs, "readOnly": v.readOnly}})
	}
	container := map[string]any{
		"name": "step", "image": localcluster.BusyboxImage, "imagePullPolicy": "Never",
		"command": []string{"/bin/sh", "-c", script}, "volumeMounts": mounts,
	}
	spec := map[string]any{
		"nodeName": localcluster.NodeName, "restartPolicy": "Never", "dnsPolicy": "Default",
		"automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
		"containers": []any{container},
		"volumes":    volumes,
	}
	for _, o := range opts {
		o(spec, container)
	}
	pod := map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": name, "namespace": ns},
		"spec":     spec,
	}
	b, _ := json.Marshal(pod)
	return string(b)
}

// createPodFed creates a step pod whose script runs once the test has
// copied dir's files into its container at path, as a user brings files
// into a pod (kubectl cp): a step namespace admits no hostPath.
func (c *cluster) createPodFed(ns, name, dir, path, script string, vols ...volume) {
	c.T.Helper()
	c.createPodWith(ns, name, `while [ ! -e /tmp/fed ]; do sleep 0.2; done; `+script, nil, vols...)
	c.Until(name+" to run", time.Minute, func() bool { return c.phase(ns, name) == "Running" })
	c.MustKubectl("", "cp", dir, ns+"/"+name+":"+path)
	c.MustKubectl("", "exec", "-n", ns, name, "--", "touch", "/tmp/fed")
}

func (c *cluster) createPod(ns, name, script string, vols ...volume) {
	c.T.Helper()
	c.MustKubectl(podJSON(ns, name, script, vols), "create", "-f", "-")
}

// createPodWith creates a step pod changed by opts.
func (c *cluster) createPodWith(ns, name, script string, opts []podOpt, vols ...volume) {
	c.T.Helper()
	c.MustKubectl(podJSON(ns, name, script, vols, opts...), "create", "-f", "-")
}

// deleteSteps deletes the pods of namespaces and waits until no step
// volume is mounted.
func (c *cluster) deleteSteps(namespaces ...string) {
	c.T.Helper()
	for _, ns := range namespaces {
		c.MustKubectl("", "delete", "pods", "--all", "-n", ns, "--grace-period=1", "--timeout=120s")
	}
	c.Until("every step volume to be torn down", 2*time.Minute, c.noStepVolumes)
}

// noStepVolumes says no pod's cowvol volume is mounted.
func (c *cluster) noStepVolumes() bool {
	mounts, err := overlay.MountsUnder(c.KubeletDir)
	if err != nil {
		return false
	}
	for _, mp := range mounts {
		if strings.Contains(mp, "kubernetes.io~csi") {
			return false
		}
	}
	return true
}

func (c *cluster) phase(ns, name string) string {
	out, _ := c.Kubectl("", "get", "pod", "-n", ns, name, "-o", "jsonpath={.status.phase}")
	return out
}

// waitDone waits for a pod to finish and returns its phase and log.
func (c *cluster) waitDone(ns, name string) (phase, log string) {
	c.T.Helper()
	c.Until("pod "+ns+"/"+name+" to finish", 3*time.Minute, func() bool {
		p := c.phase(ns, name)
		return p == "Succeeded" || p == "Failed"
	})
	log, _ = c.Kubectl("", "logs", "-n", ns, name)
	return c.phase(ns, name), log
}

// mustSucceed waits for a pod to succeed and returns its log.
func (c *cluster) mustSucceed(ns, name string) string {
	c.T.Helper()
	phase, log := c.waitDone(ns, name)
	if phase != "Succeeded" {
		c.T.Fatalf("pod %s/%s %s; log:\n%s\nevents:\n%s", ns, name, phase, log, c.events(ns, name))
	}
	return log
}

func (c *cluster) events(ns, name string) string {
	out, _ := c.Kubectl("", "get", "events", "-n", ns, "--field-selector", "involvedObject.name="+name,
		"-o", "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}")
	return out
}

func (c *cluster) deletePod(ns, name string) {
	c.T.Helper()
	c.MustKubectl("", "delete", "pod", "-n", ns, name, "--grace-period=1", "--timeout=120s")
}

// pluginLine is the first line the plugin logged containing all of parts.
func (c *cluster) pluginLine(parts ...string) (string, bool) {
	for _, line := range strings.Split(c.Plugin.Log(), "\n") {
		match := true
		for _, p := range parts {
			match = match && strings.Contains(line, p)
		}
		if match && len(line) > 21 {
			return line, true
		}
	}
	return "", false
}

// pluginLogTime is when the plugin logged the line (klog stamps lines with
// month, day and microseconds, in UTC here).
func (c *cluster) pluginLogTime(parts ...string) (time.Time, bool) {
	line, ok := c.pluginLine(parts...)
	if !ok {
		return time.Time{}, false
	}
	at, err := time.Parse("0102 15:04:05.000000", line[1:21])
	if err != nil {
		return time.Time{}, false
	}
	return time.Date(time.Now().UTC().Year(), at.Month(), at.Day(), at.Hour(), at.Minute(), at.Second(), at.Nanosecond(), time.UTC), true
}

// pluginDuration is the duration="..." the plugin logged on that line.
func (c *cluster) pluginDuration(parts ...string) string {
	line, _ := c.pluginLine(parts...)
	i := strings.Index(line, `duration="`)
	if i < 0 {
		return "not logged"
	}
	rest := line[i+len(`duration="`):]
	return rest[:strings.IndexByte(rest, '"')]
}

// waitCaptured waits until the plugin has captured handle: the kubelet
// unpublishes a finished pod's volumes on its own schedule.
func (c *cluster) waitCaptured(handle string) { c.T.Helper(); c.waitCapturedIn("ci", handle) }

// waitCapturedIn waits until the plugin has captured handle of namespace ns.
func (c *cluster) waitCapturedIn(ns, handle string) {
	c.T.Helper()
	c.Until("capture of "+ns+"/"+handle, 3*time.Minute, func() bool {
		_, ok := c.pluginLine(`"Captured step volume"`, `volume="`+ns+"/"+handle+`"`)
		return ok
	})
}

// kubectlCowvol runs the operator CLI through kubectl, as an operator
// would: kubectl finds kubectl-cowvol on its PATH.
func (c *cluster) kubectlCowvol(args ...string) string {
	c.T.Helper()
	return c.kubectlCowvolAt(c.ControllerAddr, args...)
}

// kubectlCowvolAt runs it against the controller at addr.
func (c *cluster) kubectlCowvolAt(addr string, args ...string) string {
	c.T.Helper()
	out, err := c.runKubectlCowvol(append([]string{"--controller-address=" + addr}, args...)...)
	if err != nil {
		c.T.Fatalf("kubectl cowvol %v: %v: %s", args, err, out)
	}
	return out
}

// runKubectlCowvol runs kubectl cowvol with the cluster's kubeconfig.
func (c *cluster) runKubectlCowvol(args ...string) (string, error) {
	bin := os.Getenv("COWVOL_KUBECTL_BINARY")
	if bin == "" {
		c.T.Fatal("COWVOL_KUBECTL_BINARY is not set: run make e2e")
	}
	// kubectl takes no flags before a plugin's name: they go to the plugin.
	cmd := exec.Command(filepath.Join(c.Bin, "kubectl"), append([]string{"cowvol", "--kubeconfig=" + c.Kubeconfig}, args...)...)
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(bin)+":"+os.Getenv("PATH"))
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// cluster is a local cluster (test/localcluster) with the e2e's steps and
// scenarios as its methods.
type cluster struct{ *localcluster.Cluster }
