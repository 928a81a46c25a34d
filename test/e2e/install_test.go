//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/mountid"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/ociimage"
	"github.com/concourse/cowvol/pkg/plugin"
	"github.com/concourse/cowvol/test/localcluster"
)

// pluginImageRuns runs the plugin's image, as make image builds it without
// Docker, in a pod: containerd takes the OCI layout and the binary starts.
func (c *cluster) pluginImageRuns() {
	pod := map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": "plugin-image", "namespace": "ci"},
		"spec": map[string]any{
			"nodeName": localcluster.NodeName, "restartPolicy": "Never",
			"automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
			"containers": []any{map[string]any{
				"name": "cowvol", "image": localcluster.PluginImage, "imagePullPolicy": "Never", "args": []string{"--version"},
			}},
		},
	}
	b, err := json.Marshal(pod)
	require.NoError(c.T, err)
	c.MustKubectl(string(b), "create", "-f", "-")
	out := c.mustSucceed("ci", "plugin-image")
	require.Equal(c.T, "cowvol-plugin e2e\n", out, "the image's entrypoint is make image's plugin")
	// One image for every architecture make image builds for: containerd
	// ran this machine's.
	images, err := exec.Command("ctr", "--address", c.Containerd, "-n", "k8s.io", "images", "ls", "name=="+localcluster.PluginImage).CombinedOutput()
	require.NoError(c.T, err, "%s", images)
	require.Contains(c.T, string(images), "linux/amd64,linux/arm64")
	report(c.T, "the plugin image built without Docker (make image, linux/amd64 and linux/arm64) ran in containerd: "+strings.TrimSpace(out)+"\n")
}

// installOverlay is the overlay the e2e installs cowvol with, as a user's
// would be: the base with the settings and registrar-less components, the
// example's settings.yaml with this node's kubelet root dir and state dir,
// the image built by make image, and patches for what only this harness
// lacks (no CNI: host networking; no kube-proxy: the API server and the
// controller on loopback).
func (c *cluster) installOverlay(tag string, reg registration) string {
	dir := filepath.Join(c.Work, "overlay")
	writeOverlay(c.T, dir, func(s string) string {
		for key, value := range installSettings(c) {
			s = withSetting(c.T, s, key, value)
		}
		return s
	}, func(rel func(string) string) string {
		return fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %[1]s
  - settings.yaml
components:
  - %[2]s%[3]s
images:
  - name: cowvol-plugin
    newName: cowvol.test/cowvol-plugin
    newTag: %[5]s
# One replica on the host's network: the old one must go before the new
# one can listen.
replicas:
  - name: cowvol-controller
    count: 1
patches:
  - target: {kind: DaemonSet, name: cowvol-node}
    patch: |-
      - {op: add, path: /spec/template/spec/hostNetwork, value: true}
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --controller-address=127.0.0.1:7070}
      - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: KUBERNETES_SERVICE_HOST, value: "127.0.0.1"}}
      - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: KUBERNETES_SERVICE_PORT, value: "%[4]d"}}%[7]s
  - target: {kind: Deployment, name: cowvol-controller}
    patch: |-
      - {op: add, path: /spec/template/spec/hostNetwork, value: true}
      - {op: add, path: /spec/strategy, value: {type: Recreate}}
      - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: KUBERNETES_SERVICE_HOST, value: "127.0.0.1"}}
      - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: KUBERNETES_SERVICE_PORT, value: "%[4]d"}}%[6]s
`, rel("deploy/csi/base"), rel("deploy/csi/components/settings"), reg.component(rel), c.APIPort, tag, previousControllerPatch(tag), previousNodePatch(tag))
	})
	return dir
}

// previousControllerPatch takes out of the controller's command line, for
// the previous image, the flags the base has gained since (that release's
// manifests never passed them). The test op fails the render if the base
// moves them.
func previousControllerPatch(tag string) string {
	if tag != "previous" {
		return ""
	}
	return `
      - {op: test, path: /spec/template/spec/containers/0/args/13, value: --namespace-copies=1000}
      - {op: remove, path: /spec/template/spec/containers/0/args/13}
      - {op: test, path: /spec/template/spec/containers/0/args/12, value: --max-copies=5}
      - {op: remove, path: /spec/template/spec/containers/0/args/12}
      - {op: test, path: /spec/template/spec/containers/0/args/11, value: --peer-certificate-lifetime=24h}
      - {op: remove, path: /spec/template/spec/containers/0/args/11}
      - {op: test, path: /spec/template/spec/containers/0/args/10, value: --peer-ca-key-file=/peer-ca/tls.key}
      - {op: remove, path: /spec/template/spec/containers/0/args/10}
      - {op: test, path: /spec/template/spec/containers/0/args/9, value: --peer-ca-cert-file=/peer-ca/tls.crt}
      - {op: remove, path: /spec/template/spec/containers/0/args/9}
      - {op: test, path: /spec/template/spec/containers/0/args/7, value: --leader-election-label-pod}
      - {op: remove, path: /spec/template/spec/containers/0/args/7}`
}

// previousNodePatch takes out of the node plugin's pod, for the previous
// image, what the base has gained since: the fill keeper (a subcommand
// that image lacks) and the flag that names it, and the certificate from
// the controller (that image's node serves no peers then: it knew only
// one certificate for all, which the base no longer has).
func previousNodePatch(tag string) string {
	if tag != "previous" {
		return ""
	}
	return `
      - {op: test, path: /spec/template/spec/containers/0/args/19, value: --fill-keeper-socket=/run/cowvol-fill/keeper.sock}
      - {op: remove, path: /spec/template/spec/containers/0/args/19}
      - {op: test, path: /spec/template/spec/containers/0/args/16, value: --peer-certificates-from-controller}
      - {op: remove, path: /spec/template/spec/containers/0/args/16}
      - {op: test, path: /spec/template/spec/containers/0/args/15, value: --peer-advertise-address=$(POD_IP):7443}
      - {op: remove, path: /spec/template/spec/containers/0/args/15}
      - {op: test, path: /spec/template/spec/containers/0/args/14, value: --peer-address=0.0.0.0:7443}
      - {op: remove, path: /spec/template/spec/containers/0/args/14}
      - {op: test, path: /spec/template/spec/initContainers/0/name, value: fill-keeper}
      - {op: remove, path: /spec/template/spec/initContainers}`
}

// registration is how an install registers the plugin with the kubelet.
type registration int

const (
	// bySidecar: the base as it comes, with the upstream
	// node-driver-registrar sidecar.
	bySidecar registration = iota
	// byPlugin: components/registrar-less, cowvol registering itself.
	byPlugin
)

func (r registration) String() string {
	return map[registration]string{bySidecar: "the node-driver-registrar sidecar", byPlugin: "the plugin itself (components/registrar-less)"}[r]
}

// component is the kustomization's components line the registration adds.
func (r registration) component(rel func(string) string) string {
	if r == byPlugin {
		return "\n  - " + rel("deploy/csi/components/registrar-less")
	}
	return ""
}

// installSettings are the settings the e2e changes, as a user would in
// settings.yaml: this node's dirs, a default size limit its steps feel,
// and Secrets of its own names.
func installSettings(c *cluster) map[string]string {
	return map[string]string{
		"kubelet-dir":           c.KubeletDir,
		"state-dir":             filepath.Join(c.StateDir, "cowvol"),
		"default-size-limit":    installDefaultSizeLimit,
		"controller-tls-secret": "e2e-controller-tls",
		"peer-ca-secret":        "e2e-peer-ca",
	}
}

// installDefaultSizeLimit caps the installed plugin's step volumes that
// name no sizeLimit.
const installDefaultSizeLimit = "4Mi"

// upgradeFrom is the commit whose plugin the upgrade starts from: the last
// one CI passed before cowvol was installed from deploy/ in the e2e.
const upgradeFrom = "2e62b3c8f26656dbe7999c79605b95d900a67111"

// previousPlugin builds the plugin of upgradeFrom, or skips the test when
// this clone lacks that commit (a shallow one); under CI (CI=true), whose
// clone must hold it, it fails instead, so that the upgrade is never
// quietly untested.
func (c *cluster) previousPlugin() []byte {
	c.T.Helper()
	repo, err := filepath.Abs("../..")
	require.NoError(c.T, err)
	if err := exec.Command("git", "-C", repo, "cat-file", "-e", upgradeFrom+"^{commit}").Run(); err != nil {
		if os.Getenv("CI") == "true" {
			c.T.Fatalf("the upgrade starts from commit %s, which this CI clone lacks: %v", upgradeFrom, err)
		}
		c.T.Skipf("the upgrade starts from commit %s, which this clone lacks (a shallow clone?): %v", upgradeFrom, err)
	}
	src := filepath.Join(c.Work, "previous")
	require.NoError(c.T, os.MkdirAll(src, 0o755))
	archive := exec.Command("sh", "-c", fmt.Sprintf("git -C %s archive %s | tar -x -C %s", repo, upgradeFrom, src))
	if out, err := archive.CombinedOutput(); err != nil {
		c.T.Fatalf("extracting %s: %v: %s", upgradeFrom, err, out)
	}
	bin := filepath.Join(src, "cowvol-plugin")
	build := exec.Command("go", "build", "-trimpath", "-ldflags", "-X main.version=previous", "-o", bin, "./cmd/cowvol-plugin")
	build.Dir, build.Env = src, append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		c.T.Fatalf("building the plugin of %s: %v: %s", upgradeFrom, err, out)
	}
	b, err := os.ReadFile(bin)
	require.NoError(c.T, err)
	return b
}

// TestInstall installs cowvol as a user does, kubectl apply -k of an
// overlay, on a node with a controller manager and a scheduler, starting
// from an earlier commit's image: the DaemonSet's pod registers the plugin
// with the kubelet and the controller's Deployment elects its leader. A
// volume is captured and another is in use when the overlay rolls to this
// commit's image: nothing is lost. Then a get → task → task pipeline, a
// volume shared across namespaces and size-limited steps (by the volume and
// by the settings' default) run through the
// new pods; the plugin killed, or hung until its liveness probe fails, the
// kubelet restarts it and the pipeline goes on.
func TestInstall(t *testing.T) {
	c := &cluster{localcluster.StartNode(t, true)}
	certsPEM, err := os.ReadFile("/etc/ssl/certs/ca-certificates.crt")
	require.NoError(t, err)
	c.ImportImage(ociimage.Plugin("cowvol.test/cowvol-plugin:previous", "previous", c.previousPlugin(), nil, certsPEM))
	// The earlier image registers itself; the roll moves to the base as it
	// comes, with the upstream sidecar (built by make e2e).
	rolled := bySidecar
	if !c.ImportRegistrar() {
		rolled = byPlugin
		t.Log("COWVOL_E2E_REGISTRAR_BINARY is not set (make e2e builds the upstream node-driver-registrar): the roll keeps the plugin registering itself")
	}
	// A real node's kubelet dir is a shared mount: the plugin's mounts
	// (Bidirectional) must reach the pods.
	require.NoError(t, unix.Mount(c.KubeletDir, c.KubeletDir, "", unix.MS_BIND, ""))
	require.NoError(t, unix.Mount("", c.KubeletDir, "", unix.MS_SHARED|unix.MS_REC, ""))
	c.MustKubectl("", "apply", "-f", "../../deploy/csi/base/namespace.yaml")
	certs := filepath.Join(c.Work, "certs")
	ctl := netlab.NewPKI(t, filepath.Join(certs, "controller"), "cowvol-controller.cowvol.svc", "127.0.0.1")
	peer := netlab.NewPKI(t, filepath.Join(certs, "peer"), plugin.DefaultPeerServerName)
	c.createInstallSecrets(ctl, peer)
	// This node has no CNI (its pods use the host's network), so it never
	// turns Ready and keeps the not-ready taint the kubelet registers it
	// with, which would keep the scheduler and the DaemonSet controller
	// away; a cluster with a network has no such taint to lift.
	c.MustKubectl("", "taint", "nodes", localcluster.NodeName, "node.kubernetes.io/not-ready:NoSchedule-")
	t.Cleanup(c.DeletePods) // before the plugin goes: it unpublishes them
	t.Cleanup(func() {
		if t.Failed() {
			for _, args := range [][]string{
				{"get", "pods", "-A", "-o", "wide"},
				{"get", "events", "-n", "cowvol"},
				{"describe", "pods", "-n", "cowvol"},
				{"logs", "-n", "cowvol", "-l", "app=cowvol-node", "--tail=40"},
				{"logs", "-n", "cowvol", "-l", "app=cowvol-controller", "--tail=40"},
			} {
				out, _ := c.Kubectl("", args...)
				t.Logf("kubectl %s:\n%s", strings.Join(args, " "), out)
			}
		}
	})
	start := time.Now()
	c.MustKubectl("", "apply", "-k", c.installOverlay("previous", byPlugin))
	c.waitInstalled("previous", byPlugin)
	report(t, fmt.Sprintf("kubectl apply -k of an overlay (commit %.7s's image): the plugin registered through %s and the controller led in %s\n",
		upgradeFrom, byPlugin, time.Since(start).Round(100*time.Millisecond)))
	c.CreateStepNamespaces(false)
	c.Until("the namespaces' ServiceAccounts", 30*time.Second, func() bool {
		_, err1 := c.Kubectl("", "get", "serviceaccount", "default", "-n", "ci")
		_, err2 := c.Kubectl("", "get", "serviceaccount", "default", "-n", "other")
		return err1 == nil && err2 == nil
	})

	// Before the upgrade: a volume captured, and a step running on it.
	c.createPod("ci", "get", `set -e; echo 'package main' > /out/main.go; echo v1 > /out/version`,
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "res-v1", "scope", "cluster")})
	c.mustSucceed("ci", "get")
	c.waitCapturedInstalled("ci", "res-v1")
	c.createPod("ci", "across-upgrade", `set -e; cd /w; test "$(cat version)" = v1; echo before > upgraded
		while [ ! -e /w/go ]; do sleep 0.2; done; echo after >> upgraded; rm go`,
		volume{name: "w", mountPath: "/w", attrs: attrs("source", "res-v1", "capture", "across-upgrade")})
	c.createPod("ci", "reads-across-upgrade", `sleep 20; cat /in/version`,
		volume{name: "in", mountPath: "/in", attrs: attrs("source", "res-v1"), readOnly: true})
	for _, pod := range []string{"across-upgrade", "reads-across-upgrade"} {
		c.Until(pod+" to start", 60*time.Second, func() bool { return c.phase("ci", pod) == "Running" })
	}
	readerUID := c.MustKubectl("", "get", "pod", "-n", "ci", "reads-across-upgrade", "-o", "jsonpath={.metadata.uid}")

	// The roll: this commit's image.
	start = time.Now()
	c.MustKubectl("", "apply", "-k", c.installOverlay("e2e", rolled))
	c.waitInstalled("e2e", rolled)
	report(t, fmt.Sprintf("rolled to this commit's image, registered through %s, in %s, a step running on a cowvol volume\n",
		rolled, time.Since(start).Round(100*time.Millisecond)))
	// The controller runs as the manifests say: nobody, no capabilities.
	ctlPIDs := localcluster.PidsWhere(func(cmdline string) bool {
		return strings.HasPrefix(cmdline, "/cowvol-plugin\x00") && strings.Contains(cmdline, "--mode=controller")
	})
	require.Len(t, ctlPIDs, 1)
	procStatus, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", ctlPIDs[0]))
	require.NoError(t, err)
	require.Regexp(t, `(?m)^Uid:\s+65534\s+65534\s+65534\s+65534$`, string(procStatus))
	require.Regexp(t, `(?m)^CapEff:\s+0+$`, string(procStatus))
	require.Regexp(t, `(?m)^NoNewPrivs:\s+1$`, string(procStatus))
	uid := c.MustKubectl("", "get", "pod", "-n", "ci", "across-upgrade", "-o", "jsonpath={.metadata.uid}")
	target := filepath.Join(c.KubeletDir, "pods", uid, "volumes", "kubernetes.io~csi", "w", "mount")
	require.NoError(t, os.WriteFile(filepath.Join(target, "go"), nil, 0o644), "the step's volume is still mounted after the roll")
	c.mustSucceed("ci", "across-upgrade")
	c.waitCapturedInstalled("ci", "across-upgrade")
	c.createPod("ci", "after-upgrade", `set -e; cat /in/upgraded /in/version`,
		volume{name: "in", mountPath: "/in", attrs: attrs("source", "across-upgrade"), readOnly: true})
	require.Equal(t, "before\nafter\nv1\n", c.mustSucceed("ci", "after-upgrade"), "captured by the new plugin, over the old one's volume")
	// The read-only step the old plugin published ends too: the new one
	// takes its volume down.
	require.Equal(t, "v1\n", c.mustSucceed("ci", "reads-across-upgrade"))
	readerTarget := filepath.Join(c.KubeletDir, "pods", readerUID, "volumes", "kubernetes.io~csi", "in", "mount")
	c.Until("the new plugin to unpublish the old one's read-only volume", 60*time.Second, func() bool {
		_, mounted, err := mountid.Of(readerTarget)
		return err == nil && !mounted
	})

	// get → task → task, through the new pods.
	c.createPod("ci", "task-1", `set -e; cd /w; test "$(cat version)" = v1; echo built > out.bin`,
		volume{name: "w", mountPath: "/w", attrs: attrs("source", "res-v1", "capture", "task-1")})
	c.mustSucceed("ci", "task-1")
	c.waitCapturedInstalled("ci", "task-1")
	c.createPod("ci", "task-2", `set -e; cat /in/out.bin /in/main.go`,
		volume{name: "in", mountPath: "/in", attrs: attrs("source", "task-1"), readOnly: true})
	require.Equal(t, "built\npackage main\n", c.mustSucceed("ci", "task-2"))
	// Shared across namespaces by name; a size-limited step fails cleanly.
	c.createPod("other", "reads-shared", `cat /in/version`,
		volume{name: "in", mountPath: "/in", attrs: attrs("source", "res-v1", "sourceNamespace", "ci"), readOnly: true})
	require.Equal(t, "v1\n", c.mustSucceed("other", "reads-shared"))
	c.createPod("ci", "too-big", `dd if=/dev/zero of=/w/big bs=1M count=8 && sync`,
		volume{name: "w", mountPath: "/w", attrs: attrs("sizeLimit", "2Mi")})
	phase, _ := c.waitDone("ci", "too-big")
	require.Equal(t, "Failed", phase, "a step over its size limit fails")
	// The settings' default size limit caps a step that names none.
	c.createPod("ci", "too-big-by-default", `dd if=/dev/zero of=/w/big bs=1M count=8 && sync`,
		volume{name: "w", mountPath: "/w", attrs: attrs()})
	phase, log := c.waitDone("ci", "too-big-by-default")
	require.Equal(t, "Failed", phase, "a step over the default size limit (%s) fails", installDefaultSizeLimit)
	require.Contains(t, log, "Disk quota exceeded")

	// The plugin killed, then hung: the kubelet restarts it each time (the
	// second through the liveness probe), and the next step goes on.
	for i, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGSTOP} {
		pids := c.pluginContainerPIDs()
		require.NotEmpty(t, pids)
		for _, pid := range pids {
			require.NoError(t, syscall.Kill(pid, sig))
		}
		c.Until(fmt.Sprintf("the kubelet to restart the plugin (%s)", sig), 120*time.Second, func() bool {
			out, err := c.Kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-node",
				"-o", "jsonpath={.items[0].status.containerStatuses[0].restartCount} {.items[0].status.containerStatuses[0].ready}")
			restarts, ready, _ := strings.Cut(out, " ")
			n, _ := strconv.Atoi(restarts)
			return err == nil && n >= i+1 && ready == "true"
		})
		name := fmt.Sprintf("after-restart-%d", i)
		c.createPod("ci", name, `set -e; cat /in/out.bin`,
			volume{name: "in", mountPath: "/in", attrs: attrs("source", "task-1"), readOnly: true})
		require.Equal(t, "built\n", c.mustSucceed("ci", name))
	}
	report(t, "the installed plugin SIGKILLed, then SIGSTOPped: the kubelet restarted it (the second time when its liveness probe failed) and the next steps used the cached volumes\n")

	c.helmLifecycle(rolled, ctl, peer)
}

// createInstallSecrets makes the TLS Secrets the install names, in the
// namespace cowvol: the controller's serving certificate, and the peer CA.
func (c *cluster) createInstallSecrets(ctl, peer netlab.PKI) {
	settings := installSettings(c)
	c.MustKubectl("", "create", "secret", "generic", settings["controller-tls-secret"], "-n", "cowvol",
		"--from-file=tls.crt="+ctl.Cert, "--from-file=tls.key="+ctl.Key, "--from-file=ca.crt="+ctl.CA)
	c.MustKubectl("", localcluster.PeerCASecret(settings["peer-ca-secret"], peer)...)
}

// helmLifecycle moves the install to Helm, as a user would: the steps
// done, the kustomize install is deleted (namespace and Secrets too); the
// chart is installed with the e2e's settings and a step reads a volume
// cached before (the state dir stays); an upgrade that changes a setting
// rolls the node's pod and a step runs again; the uninstall leaves no
// mount and no plugin.
func (c *cluster) helmLifecycle(reg registration, ctl, peer netlab.PKI) {
	t := c.T
	helm := os.Getenv("COWVOL_E2E_HELM_BINARY")
	if helm == "" {
		t.Log("COWVOL_E2E_HELM_BINARY is not set (make e2e builds helm): the chart is not installed")
		return
	}
	c.deleteSteps("ci", "other")
	c.MustKubectl("", "delete", "-k", c.installOverlay("e2e", reg), "--timeout=180s")
	c.Until("the kustomize install to be gone", 3*time.Minute, func() bool {
		_, err := c.Kubectl("", "get", "namespace", "cowvol")
		return err != nil && len(c.pluginContainerPIDs()) == 0
	})

	c.MustKubectl("", "create", "namespace", "cowvol")
	c.createInstallSecrets(ctl, peer)
	settings := installSettings(c)
	values := map[string]any{
		"kubeletDir": settings["kubelet-dir"], "stateDir": settings["state-dir"], "defaultSizeLimit": settings["default-size-limit"],
		"controllerTLSSecret": settings["controller-tls-secret"], "peerCASecret": settings["peer-ca-secret"],
		"image":     map[string]any{"repository": "cowvol.test/cowvol-plugin", "tag": "e2e"},
		"registrar": map[string]any{"enabled": reg == bySidecar},
		// As the kustomize overlay's patches: this node's pods are on the
		// host's network, with no Service routing.
		"controller": map[string]any{"replicas": 1, "hostNetwork": true, "strategy": map[string]any{"type": "Recreate"},
			"extraEnv": c.apiServerEnv()},
		"node": map[string]any{"hostNetwork": true, "extraArgs": []string{"--controller-address=127.0.0.1:7070"},
			"extraEnv": c.apiServerEnv()},
	}
	valuesFile := filepath.Join(c.Work, "helm-values.json")
	raw, err := json.Marshal(values)
	require.NoError(t, err)
	localcluster.WriteFile(t, valuesFile, string(raw))
	runHelm := func(args ...string) {
		out, err := exec.Command(helm, append(args, "--kubeconfig", c.Kubeconfig)...).CombinedOutput()
		require.NoError(t, err, "helm %s: %s", strings.Join(args, " "), out)
	}
	chart := "../../deploy/helm/cowvol"
	start := time.Now()
	runHelm("install", "cowvol", chart, "--namespace", "cowvol", "-f", valuesFile)
	c.waitInstalled("e2e", reg)
	installed := time.Since(start)
	c.createPod("ci", "helm-installed", `set -e; cat /in/out.bin`,
		volume{name: "in", mountPath: "/in", attrs: attrs("source", "task-1"), readOnly: true})
	require.Equal(t, "built\n", c.mustSucceed("ci", "helm-installed"), "a volume cached before the move to Helm")

	start = time.Now()
	runHelm("upgrade", "cowvol", chart, "--namespace", "cowvol", "-f", valuesFile, "--set", "highWatermark=85")
	c.Until("the node's pod to roll onto the upgrade", 2*time.Minute, func() bool {
		out, err := c.Kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-node", "-o",
			`jsonpath={range .items[*]}{.spec.containers[0].env[?(@.name=="HIGH_WATERMARK")].value} {.status.containerStatuses[0].ready}{"\n"}{end}`)
		return err == nil && strings.TrimSpace(out) == "85 true"
	})
	c.waitInstalled("e2e", reg)
	upgraded := time.Since(start)
	c.createPod("ci", "helm-upgraded", `set -e; cd /w; cat out.bin; echo again > again`,
		volume{name: "w", mountPath: "/w", attrs: attrs("source", "task-1", "capture", "helm-upgraded", "sizeLimit", "1Mi")})
	require.Equal(t, "built\n", c.mustSucceed("ci", "helm-upgraded"))
	c.waitCapturedInstalled("ci", "helm-upgraded")

	c.deleteSteps("ci")
	start = time.Now()
	runHelm("uninstall", "cowvol", "--namespace", "cowvol", "--wait", "--timeout", "3m")
	c.Until("the plugin to be gone", 2*time.Minute, func() bool { return len(c.pluginContainerPIDs()) == 0 })
	require.True(t, c.noStepVolumes(), "no step volume stays mounted")
	report(t, fmt.Sprintf("helm install (registered through %s) %s, upgrade rolling the node %s, uninstall %s: a volume cached before the move read, a step captured, no mount left\n",
		reg, installed.Round(100*time.Millisecond), upgraded.Round(100*time.Millisecond), time.Since(start).Round(100*time.Millisecond)))
}

// apiServerEnv is the environment that points in-cluster clients at this
// node's API server, where no Service routes to it.
func (c *cluster) apiServerEnv() []map[string]string {
	return []map[string]string{{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"}, {"name": "KUBERNETES_SERVICE_PORT", "value": strconv.Itoa(c.APIPort)}}
}

// waitInstalled waits until the DaemonSet's pod runs the image of tag and
// has registered the plugin with the kubelet, and the controller's
// Deployment is available on that image.
func (c *cluster) waitInstalled(tag string, reg registration) {
	c.T.Helper()
	image := "cowvol.test/cowvol-plugin:" + tag
	want := image + " true" // the plugin, ready
	if reg == bySidecar {
		want = image + " " + localcluster.RegistrarImage + " true true" // and the sidecar
	}
	c.Until("the DaemonSet's pod on "+tag+" to register the plugin with the kubelet through "+reg.String(), 120*time.Second, func() bool {
		pods, err := c.Kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-node",
			"-o", "jsonpath={range .items[*]}{.spec.containers[*].image} {.status.containerStatuses[*].ready}{\"\\n\"}{end}")
		if err != nil || strings.TrimSpace(pods) != want {
			return false
		}
		out, err := c.Kubectl("", "get", "csinode", localcluster.NodeName, "-o", "jsonpath={.spec.drivers[*].name}")
		if err != nil || !strings.Contains(out, localcluster.DriverName) {
			return false
		}
		if reg == byPlugin {
			return true
		}
		// The kubelet told the sidecar, not a plugin of the last pod,
		// how its registration went (the sidecar exits if it failed).
		logs, err := c.Kubectl("", "logs", "-n", "cowvol", "-l", "app=cowvol-node", "-c", "node-driver-registrar", "--tail=-1")
		return err == nil && strings.Contains(logs, "Received NotifyRegistrationStatus call")
	})
	c.Until("the controller's Deployment on "+tag+" to be available", 120*time.Second, func() bool {
		out, err := c.Kubectl("", "get", "deployment", "cowvol-controller", "-n", "cowvol",
			"-o", "jsonpath={.status.updatedReplicas} {.status.availableReplicas} {.spec.template.spec.containers[0].image}")
		return err == nil && out == "1 1 "+image
	})
}

// waitCapturedInstalled waits until the installed plugin's controller
// lists a volume ready: the API server's view of the pipeline's outputs.
func (c *cluster) waitCapturedInstalled(ns, handle string) {
	c.T.Helper()
	c.Until("the capture of "+ns+"/"+handle, 60*time.Second, func() bool {
		out, err := c.Kubectl("", "get", "events", "-n", ns, "-o", "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}")
		return err == nil && strings.Contains(out, fmt.Sprintf(`VolumeCaptured: Captured into cached volume %q`, handle))
	})
}

// pluginContainerPIDs are the processes of the DaemonSet's plugin.
func (c *cluster) pluginContainerPIDs() []int {
	return localcluster.PidsWhere(func(cmdline string) bool {
		return strings.HasPrefix(cmdline, "/cowvol-plugin\x00") && strings.Contains(cmdline, "--mode=node")
	})
}
