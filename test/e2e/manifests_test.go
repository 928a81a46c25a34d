//go:build e2e

package e2e

import (
	"encoding/json"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/concourse/cowvol/internal/tb"
	"github.com/concourse/cowvol/test/localcluster"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"
)

// renderKustomization renders the kustomization in dir with kubectl's own
// kustomize, as kubectl apply -k would, and returns its objects by
// "Kind/name".
func renderKustomization(t tb.TB, dir string) (map[string]map[string]any, error) {
	t.Helper()
	kubectl := filepath.Join(localcluster.KubeBin(t), "kubectl")
	out, err := exec.Command(kubectl, "kustomize", dir).CombinedOutput()
	if err != nil {
		return nil, &renderError{string(out)}
	}
	objects := map[string]map[string]any{}
	for _, doc := range strings.Split(string(out), "\n---\n") {
		var obj map[string]any
		require.NoError(t, yaml.Unmarshal([]byte(doc), &obj))
		meta := obj["metadata"].(map[string]any)
		objects[obj["kind"].(string)+"/"+meta["name"].(string)] = obj
	}
	return objects, nil
}

// renderSnapshotterComponent renders the base with the image registry's
// and the image snapshotter's components.
func renderSnapshotterComponent(t tb.TB) map[string]map[string]any {
	t.Helper()
	dir := t.TempDir()
	writeOverlay(t, dir, func(s string) string { return s }, func(rel func(string) string) string {
		return "resources: [" + rel("deploy/csi") + "]\ncomponents: [" + rel("deploy/csi/components/image-registry") + ", " +
			rel("deploy/csi/components/image-snapshotter") + "]\n"
	})
	got, err := renderKustomization(t, dir)
	require.NoError(t, err)
	return got
}

// renderChart renders deploy/helm/cowvol into namespace cowvol with
// helm template, its values changed by args; it skips where make e2e did
// not build helm.
func renderChart(t tb.TB, args ...string) map[string]map[string]any {
	t.Helper()
	out, err := exec.Command(helmBinary(t), append([]string{"template", "cowvol", "../../deploy/helm/cowvol", "--namespace", "cowvol"}, args...)...).CombinedOutput()
	require.NoError(t, err, "%s", out)
	objects := map[string]map[string]any{}
	for _, doc := range strings.Split(string(out), "\n---\n") {
		var obj map[string]any
		require.NoError(t, yaml.Unmarshal([]byte(doc), &obj))
		if obj == nil {
			continue // only comments
		}
		meta := obj["metadata"].(map[string]any)
		objects[obj["kind"].(string)+"/"+meta["name"].(string)] = obj
	}
	return objects
}

// stateDirMount is the node plugin's mount of its state dir in objects.
func stateDirMount(t tb.TB, objects map[string]map[string]any) map[string]any {
	t.Helper()
	ds := objects["DaemonSet/cowvol-node"]
	require.NotNil(t, ds)
	containers := ds["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any)
	for _, c := range containers {
		c := c.(map[string]any)
		if c["name"] != "cowvol" {
			continue
		}
		for _, m := range c["volumeMounts"].([]any) {
			if m := m.(map[string]any); m["name"] == "state-dir" {
				return m
			}
		}
	}
	t.Fatal("the node plugin does not mount its state dir")
	return nil
}

// helmBinary is the helm make e2e builds; a test without it skips.
func helmBinary(t tb.TB) string {
	t.Helper()
	helm := os.Getenv("COWVOL_E2E_HELM_BINARY")
	if helm == "" {
		t.Skip("COWVOL_E2E_HELM_BINARY is not set: make e2e builds helm (test/e2e/tools/helm)")
	}
	return helm
}

// chartRefusal is what helm template says when the chart refuses values.
func chartRefusal(t tb.TB, args ...string) string {
	t.Helper()
	out, err := exec.Command(helmBinary(t), append([]string{"template", "cowvol", "../../deploy/helm/cowvol"}, args...)...).CombinedOutput()
	require.Error(t, err, "the chart renders with %v", args)
	return string(out)
}

type renderError struct{ out string }

func (e *renderError) Error() string { return e.out }

// withSetting sets key in a settings.yaml, which must have it once.
func withSetting(t tb.TB, settings, key, value string) string {
	t.Helper()
	line := regexp.MustCompile(`(?m)^  ` + regexp.QuoteMeta(key) + `: .*$`)
	require.Len(t, line.FindAllString(settings, -1), 1, "settings.yaml's %s", key)
	return line.ReplaceAllLiteralString(settings, "  "+key+": "+value)
}

// writeOverlay writes an overlay in dir as a user would: the example's
// settings.yaml edited by edit, and the kustomization.yaml kustomization
// makes, given how to name a dir of the repo from dir.
func writeOverlay(t tb.TB, dir string, edit func(settings string) string, kustomization func(rel func(repoDir string) string) string) {
	t.Helper()
	repo, err := filepath.Abs("../..")
	require.NoError(t, err)
	example, err := os.ReadFile(filepath.Join(repo, "deploy/csi/overlays/example/settings.yaml"))
	require.NoError(t, err)
	localcluster.WriteFile(t, filepath.Join(dir, "settings.yaml"), edit(string(example)))
	localcluster.WriteFile(t, filepath.Join(dir, "kustomization.yaml"), kustomization(func(p string) string {
		r, err := filepath.Rel(dir, filepath.Join(repo, p))
		require.NoError(t, err)
		return r
	}))
}

// settingsOverlay writes an overlay of deploy/csi/base with the settings
// component and the example's settings.yaml, edited by edit, and returns
// its dir.
func settingsOverlay(t tb.TB, edit func(settings string) string) string {
	t.Helper()
	dir := t.TempDir()
	writeOverlay(t, dir, edit, func(rel func(string) string) string {
		return "resources: [" + rel("deploy/csi/base") + ", settings.yaml]\n" +
			"components: [" + rel("deploy/csi/components/settings") + "]\n"
	})
	return dir
}

// TestManifests checks what users render, before any cluster: the
// example overlay's settings.yaml holds the base's own values (so a user
// changes only what differs), every setting reaches every place the base
// uses it, and a settings file missing a key is refused rather than
// rendering half-set manifests.
func TestManifests(t *testing.T) {
	base, err := renderKustomization(t, "../../deploy/csi")
	require.NoError(t, err)

	t.Run("the example's settings are the base's", func(t *testing.T) {
		got, err := renderKustomization(t, settingsOverlay(t, func(s string) string { return s }))
		require.NoError(t, err)
		require.Equal(t, base, got)
	})

	t.Run("every setting reaches every place", func(t *testing.T) {
		changed := map[string][2]string{
			"kubelet-dir":           {"/var/lib/kubelet", "/srv/k8s/kubelet"},
			"state-dir":             {"/var/lib/cowvol", "/mnt/cowvol"},
			"cow-backend":           {"auto", "reflink"},
			"default-size-limit":    {`"0"`, "20Gi"},
			"max-size-limit":        {`"0"`, "200Gi"},
			"high-watermark":        {`"90"`, `"85"`},
			"low-watermark":         {`"80"`, `"70"`},
			"stream-size-limit":     {"100Gi", "50Gi"},
			"controller-tls-secret": {"cowvol-controller-tls", "my-controller-tls"},
			"peer-ca-secret":        {"cowvol-peer-ca", "my-peer-ca"},
		}
		got, err := renderKustomization(t, settingsOverlay(t, func(s string) string {
			for key, v := range changed {
				require.Contains(t, s, "\n  "+key+": "+v[0]+"\n", "the example's default")
				s = withSetting(t, s, key, v[1])
			}
			return s
		}))
		require.NoError(t, err)
		node, _ := yaml.Marshal(got["DaemonSet/cowvol-node"])
		controller, _ := yaml.Marshal(got["Deployment/cowvol-controller"])
		for _, old := range []string{"/var/lib/kubelet", "cowvol-controller-tls", "cowvol-peer-ca"} {
			require.NotContains(t, string(node), old, "the node DaemonSet still names the default")
			require.NotContains(t, string(controller), old, "the controller Deployment still names the default")
		}
		spec := got["DaemonSet/cowvol-node"]["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
		hostPaths := map[string]string{}
		for _, v := range spec["volumes"].([]any) {
			v := v.(map[string]any)
			if hp, ok := v["hostPath"].(map[string]any); ok {
				hostPaths[v["name"].(string)] = hp["path"].(string)
			}
		}
		require.Equal(t, map[string]string{
			"plugin-dir":       "/srv/k8s/kubelet/plugins/cowvol.concourse-ci.org",
			"registration-dir": "/srv/k8s/kubelet/plugins_registry",
			"pods-dir":         "/srv/k8s/kubelet/pods",
			"state-dir":        "/mnt/cowvol",
		}, hostPaths)
		for _, c := range spec["containers"].([]any) {
			c := c.(map[string]any)
			env := map[string]string{}
			for _, e := range c["env"].([]any) {
				e := e.(map[string]any)
				if v, ok := e["value"].(string); ok {
					env[e["name"].(string)] = v
				}
			}
			require.Equal(t, "/srv/k8s/kubelet", env["KUBELET_DIR"], "container %s", c["name"])
			if c["name"] != "cowvol" {
				continue
			}
			require.Equal(t, map[string]string{
				"KUBELET_DIR": "/srv/k8s/kubelet", "COW_BACKEND": "reflink", "DEFAULT_SIZE_LIMIT": "20Gi",
				"MAX_SIZE_LIMIT": "200Gi", "HIGH_WATERMARK": "85", "LOW_WATERMARK": "70", "STREAM_SIZE_LIMIT": "50Gi",
			}, env)
			// The kubelet names targets by host path: the pods dir is
			// mounted at the same path inside.
			require.Contains(t, c["volumeMounts"], map[string]any{
				"name": "pods-dir", "mountPath": "/srv/k8s/kubelet/pods", "mountPropagation": "Bidirectional"})
			// Every setting is passed by its variable, none by a literal
			// (but the state dir, always /var/lib/cowvol inside).
			for _, arg := range c["args"].([]any) {
				for key := range changed {
					if key != "state-dir" && strings.HasPrefix(arg.(string), "--"+key+"=") {
						require.Contains(t, arg, "$(", "%s is set in args, beyond the settings' reach", arg)
					}
				}
			}
		}
		_, settingsApplied := got["ConfigMap/cowvol-settings"]
		require.False(t, settingsApplied, "the settings are local-config: read, never applied")
	})

	t.Run("the admission policy adds itself, cluster-scoped, and changes nothing else", func(t *testing.T) {
		dir := t.TempDir()
		writeOverlay(t, dir, func(s string) string { return s }, func(rel func(string) string) string {
			return "resources: [" + rel("deploy/csi") + "]\ncomponents: [" + rel("deploy/csi/components/admission-policy") + "]\n"
		})
		got, err := renderKustomization(t, dir)
		require.NoError(t, err)
		for _, kind := range []string{"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} {
			obj := got[kind+"/cowvol-volumes"]
			require.NotNil(t, obj, kind)
			require.NotContains(t, obj["metadata"], "namespace", "%s is cluster-scoped", kind)
			delete(got, kind+"/cowvol-volumes")
		}
		require.Equal(t, base, got)
	})

	t.Run("the image registry puts the node on the host's network, with a policy on the same port", func(t *testing.T) {
		dir := t.TempDir()
		writeOverlay(t, dir, func(s string) string { return s }, func(rel func(string) string) string {
			return "resources: [" + rel("deploy/csi") + "]\ncomponents: [" + rel("deploy/csi/components/image-registry") + "]\n"
		})
		got, err := renderKustomization(t, dir)
		require.NoError(t, err)
		spec := got["DaemonSet/cowvol-node"]["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
		require.Equal(t, true, spec["hostNetwork"], "the registry must be on the host's loopback")
		require.Equal(t, "ClusterFirstWithHostNet", spec["dnsPolicy"], "the controller's Service must still resolve")
		var address string
		for _, arg := range spec["containers"].([]any)[0].(map[string]any)["args"].([]any) {
			if a, ok := strings.CutPrefix(arg.(string), "--image-registry-address="); ok {
				address = a
			}
		}
		require.Equal(t, "127.0.0.1:7444", address)
		node, _ := yaml.Marshal(spec)
		require.Contains(t, string(node), "- --containerd-address=/run/containerd/containerd.sock")
		require.Contains(t, string(node), "mountPath: /run/containerd/containerd.sock", "the images of volumes gone are deleted from containerd")
		variables := map[string]string{}
		for _, v := range got["ValidatingAdmissionPolicy/cowvol-images"]["spec"].(map[string]any)["variables"].([]any) {
			variables[v.(map[string]any)["name"].(string)] = v.(map[string]any)["expression"].(string)
		}
		require.Contains(t, variables["own"], "'"+address+"/' + namespaceObject.metadata.name", "the policy admits another address than the registry's")
		require.Contains(t, variables["foreign"], ":"+strings.Split(address, ":")[1]+"/')", "the policy guards another port than the registry's")
		for _, name := range []string{"ValidatingAdmissionPolicy/cowvol-images", "ValidatingAdmissionPolicyBinding/cowvol-images",
			"ClusterRole/cowvol-node-image-registry", "ClusterRoleBinding/cowvol-node-image-registry",
			"ClusterRole/cowvol-image-registry-audience", "ClusterRoleBinding/cowvol-image-registry-audience"} {
			obj := got[name]
			require.NotNil(t, obj, name)
			require.NotContains(t, obj["metadata"], "namespace", "%s is cluster-scoped", name)
			delete(got, name)
		}
		// The kubelet's credential provider, from the plugin's image, into
		// the kubelet's bin dir.
		init := spec["initContainers"].([]any)[0].(map[string]any)
		require.Equal(t, []any{"/cowvol-credential-provider", "install", "/credential-provider-bin"}, init["command"])
		require.Equal(t, "cowvol-plugin:latest", init["image"], "the image an overlay's images: sets")
		require.Contains(t, string(node), "path: /usr/libexec/kubernetes/kubelet-plugins/credential-provider/exec")
		delete(got, "DaemonSet/cowvol-node")
		want := maps.Clone(base)
		delete(want, "DaemonSet/cowvol-node")
		require.Equal(t, want, got, "only the node DaemonSet changes")
	})

	t.Run("the image snapshotter adds its runtime class and socket to the image registry's node", func(t *testing.T) {
		got := renderSnapshotterComponent(t)
		rc := got["RuntimeClass/cowvol"]
		require.NotNil(t, rc)
		require.Equal(t, "cowvol", rc["handler"], "the handler containerd's config names")
		spec := got["DaemonSet/cowvol-node"]["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
		node, _ := yaml.Marshal(spec)
		require.Contains(t, string(node), "- --image-registry-address=127.0.0.1:7444")
		require.Contains(t, string(node), "- --image-snapshotter-endpoint=unix:///run/cowvol/snapshotter.sock")
		require.Contains(t, string(node), "mountPath: /run/cowvol")
		require.Contains(t, string(node), "path: /run/cowvol", "the socket where containerd's proxy_plugins.cowvol looks")
		require.Contains(t, string(node), "- --containerd-address=/run/containerd/containerd.sock")
		require.Contains(t, string(node), "mountPath: /run/containerd/containerd.sock")
		require.Contains(t, string(node), "mountPath: /var/lib/cowvol", "the state dir at its host path: the snapshotter names its dirs to containerd")
		require.Contains(t, string(node), "path: /var/lib/cowvol")
	})

	t.Run("the kustomize base is the chart's, as make manifests writes it", func(t *testing.T) {
		out := t.TempDir()
		cmd := exec.Command("go", "run", "./hack/update-kustomize", "-helm", helmBinary(t), "-out", out)
		cmd.Dir = "../.."
		msg, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", msg)
		want, err := os.ReadDir(out)
		require.NoError(t, err)
		have, err := os.ReadDir("../../deploy/csi/base")
		require.NoError(t, err)
		require.Len(t, have, len(want), "deploy/csi/base holds what make manifests writes, and nothing else")
		for _, f := range want {
			w, err := os.ReadFile(filepath.Join(out, f.Name()))
			require.NoError(t, err)
			h, err := os.ReadFile(filepath.Join("../../deploy/csi/base", f.Name()))
			require.NoError(t, err, "run make manifests")
			require.Equal(t, string(w), string(h), "deploy/csi/base/%s is stale: run make manifests", f.Name())
		}
	})

	t.Run("the Helm chart with its defaults renders the base", func(t *testing.T) {
		got := renderChart(t)
		want := maps.Clone(base)
		delete(want, "Namespace/cowvol") // helm install --create-namespace makes it
		require.Equal(t, want, got)
	})

	t.Run("the Helm chart's values reach every place", func(t *testing.T) {
		got := renderChart(t, "--set", "kubeletDir=/srv/k8s/kubelet", "--set", "stateDir=/mnt/cowvol",
			"--set", "peerCASecret=my-peer-ca", "--set", "controllerTLSSecret=my-controller-tls",
			"--set", "registrar.enabled=false", "--set", "image.repository=registry.example/cowvol-plugin", "--set", "image.tag=v1",
			"--set", "controller.replicas=1", "--set", "node.tolerations[0].operator=Exists",
			"--set", "node.hostNetwork=true", "--set", "node.extraArgs={--image-registry-address=127.0.0.1:7444}")
		node, _ := yaml.Marshal(got["DaemonSet/cowvol-node"])
		controller, _ := yaml.Marshal(got["Deployment/cowvol-controller"])
		for _, old := range []string{"/var/lib/kubelet", "cowvol-controller-tls", "cowvol-peer-ca", "node-driver-registrar", "cowvol-plugin:latest"} {
			require.NotContains(t, string(node), old, "the node DaemonSet still names the default")
			require.NotContains(t, string(controller), old, "the controller Deployment still names the default")
		}
		require.Contains(t, string(node), "--kubelet-registration-socket=/registration/cowvol.concourse-ci.org-reg.sock", "registering itself")
		require.Contains(t, string(node), "operator: Exists")
		require.Contains(t, string(node), "hostNetwork: true")
		require.Contains(t, string(node), "dnsPolicy: ClusterFirstWithHostNet", "on the host's network, the controller's Service must still resolve")
		require.Contains(t, string(node), "- --image-registry-address=127.0.0.1:7444")
		require.Contains(t, string(controller), "replicas: 1")
		require.Contains(t, string(controller), "image: registry.example/cowvol-plugin:v1")
	})

	t.Run("the Helm chart's image registry is the component's", func(t *testing.T) {
		got := renderChart(t, "--set", "images.registry.enabled=true", "--set", "images.registry.address=127.0.0.1:7555",
			"--set", "images.registry.auth=grace", "--set", "images.registry.credentialProviderBinDir=/opt/kubelet/providers",
			"--set", "images.registry.containerdSocket=/run/k3s/containerd/containerd.sock")
		node, _ := yaml.Marshal(got["DaemonSet/cowvol-node"])
		for _, want := range []string{"hostNetwork: true", "dnsPolicy: ClusterFirstWithHostNet", "- --image-registry-address=127.0.0.1:7555",
			"- --image-registry-auth=grace", "- --containerd-address=/run/containerd/containerd.sock", "mountPath: /run/containerd/containerd.sock",
			"path: /run/k3s/containerd/containerd.sock", "name: install-credential-provider", "path: /opt/kubelet/providers"} {
			require.Contains(t, string(node), want)
		}
		variables := map[string]string{}
		for _, v := range got["ValidatingAdmissionPolicy/cowvol-images"]["spec"].(map[string]any)["variables"].([]any) {
			variables[v.(map[string]any)["name"].(string)] = v.(map[string]any)["expression"].(string)
		}
		require.Contains(t, variables["own"], "'127.0.0.1:7555/' + namespaceObject.metadata.name")
		require.Contains(t, variables["foreign"], "):7555/')")
		binding := got["ClusterRoleBinding/cowvol-node-image-registry"]["subjects"].([]any)[0].(map[string]any)
		require.Equal(t, "cowvol", binding["namespace"])
		dir := t.TempDir()
		writeOverlay(t, dir, func(s string) string { return s }, func(rel func(string) string) string {
			return "resources: [" + rel("deploy/csi") + "]\ncomponents: [" + rel("deploy/csi/components/image-registry") + "]\n"
		})
		component, err := renderKustomization(t, dir)
		require.NoError(t, err)
		for _, name := range []string{"ClusterRole/cowvol-node-image-registry", "ClusterRole/cowvol-image-registry-audience",
			"ClusterRoleBinding/cowvol-image-registry-audience"} {
			require.Equal(t, component[name], got[name], name)
		}
		require.Equal(t, component["ValidatingAdmissionPolicyBinding/cowvol-images"], got["ValidatingAdmissionPolicyBinding/cowvol-images"])
	})

	t.Run("the Helm chart's snapshotter is the component's", func(t *testing.T) {
		got := renderChart(t, "--set", "images.registry.enabled=true", "--set", "images.snapshotter.enabled=true")
		component := renderSnapshotterComponent(t)
		require.Equal(t, component["RuntimeClass/cowvol"], got["RuntimeClass/cowvol"])
		// containerd mounts the layer dirs the snapshotter names: the
		// plugin's mounts in its state dir (a volume pulled as an index)
		// must reach the host.
		for what, objects := range map[string]map[string]map[string]any{"chart": got, "component": component} {
			require.Equal(t, "Bidirectional", stateDirMount(t, objects)["mountPropagation"], what)
		}
		require.Nil(t, stateDirMount(t, renderChart(t))["mountPropagation"], "without the snapshotter, the state dir is the plugin's own")
		node, _ := yaml.Marshal(got["DaemonSet/cowvol-node"])
		for _, want := range []string{"- --image-snapshotter-endpoint=unix:///run/cowvol/snapshotter.sock", "mountPath: /run/cowvol",
			"path: /run/cowvol", "- --state-dir=/var/lib/cowvol", "mountPath: /var/lib/cowvol"} {
			require.Contains(t, string(node), want)
		}

		// Elsewhere on the host: the plugin sees the socket and its state
		// dir where containerd does.
		got = renderChart(t, "--set", "images.registry.enabled=true", "--set", "images.snapshotter.enabled=true",
			"--set", "images.snapshotter.socketDir=/run/k3s/cowvol", "--set", "stateDir=/mnt/cowvol")
		node, _ = yaml.Marshal(got["DaemonSet/cowvol-node"])
		for _, want := range []string{"- --image-snapshotter-endpoint=unix:///run/k3s/cowvol/snapshotter.sock", "mountPath: /run/k3s/cowvol",
			"path: /run/k3s/cowvol", "- --state-dir=/mnt/cowvol", "mountPath: /mnt/cowvol", "path: /mnt/cowvol"} {
			require.Contains(t, string(node), want)
		}
		require.NotContains(t, string(node), "/var/lib/cowvol")

		// Without the snapshotter, the plugin's own path, whatever the
		// host's.
		got = renderChart(t, "--set", "stateDir=/mnt/cowvol")
		node, _ = yaml.Marshal(got["DaemonSet/cowvol-node"])
		require.Contains(t, string(node), "mountPath: /var/lib/cowvol")
		require.NotContains(t, string(node), "snapshotter")
		require.Nil(t, got["RuntimeClass/cowvol"])
	})

	t.Run("the Helm chart's snapshotter needs its registry", func(t *testing.T) {
		require.Contains(t, chartRefusal(t, "--set", "images.snapshotter.enabled=true"), "images.snapshotter.enabled needs images.registry.enabled")
	})

	t.Run("cert-manager makes the two Secrets the workloads mount, for the names they are reached by", func(t *testing.T) {
		require.Contains(t, chartRefusal(t, "--set", "certManager.enabled=true"), "certManager.enabled needs certManager.issuerRef.name")
		got := renderChart(t, "--set", "certManager.enabled=true", "--set", "certManager.issuerRef.name=cowvol-ca",
			"--set", "controllerTLSSecret=ctl-tls", "--set", "peerCASecret=peer-ca")
		ctl := got["Certificate/cowvol-controller"]["spec"].(map[string]any)
		peer := got["Certificate/cowvol-peer-ca"]["spec"].(map[string]any)
		require.Equal(t, "ctl-tls", ctl["secretName"])
		require.Equal(t, "peer-ca", peer["secretName"])
		issuer := map[string]any{"name": "cowvol-ca", "kind": "Issuer", "group": "cert-manager.io"}
		require.Equal(t, issuer, ctl["issuerRef"])
		require.Equal(t, issuer, peer["issuerRef"])
		// The nodes dial the controller by its Service's name; the peer CA
		// signs the nodes' certificates, and only the controller mounts it.
		node := toYAML(t, got["DaemonSet/cowvol-node"])
		for _, name := range ctl["dnsNames"].([]any) {
			require.Contains(t, node, "--controller-address="+name.(string)+":")
		}
		require.Equal(t, true, peer["isCA"])
		require.Contains(t, peer["usages"], "cert sign")
		require.NotContains(t, node, "peer-ca", "a node never mounts the peer CA")
		require.Contains(t, node, "--peer-certificates-from-controller")
		controller := toYAML(t, got["Deployment/cowvol-controller"])
		require.Contains(t, controller, "secretName: ctl-tls")
		require.Contains(t, controller, "secretName: peer-ca")
	})

	t.Run("monitoring scrapes every workload, alerts and draws only metrics cowvol serves", func(t *testing.T) {
		got := renderChart(t, "--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.prometheusRule.enabled=true",
			"--set", "monitoring.grafanaDashboard.enabled=true", "--set", "monitoring.serviceMonitor.labels.release=prom")
		sm := got["ServiceMonitor/cowvol"]
		require.Equal(t, map[string]any{"release": "prom"}, sm["metadata"].(map[string]any)["labels"])
		smSelector := sm["spec"].(map[string]any)["selector"].(map[string]any)["matchLabels"].(map[string]any)
		for svc, workload := range map[string]string{"cowvol-node-metrics": "DaemonSet/cowvol-node", "cowvol-controller-metrics": "Deployment/cowvol-controller"} {
			s := got["Service/"+svc]
			require.NotNil(t, s, svc)
			for k, v := range smSelector {
				require.Equal(t, v, s["metadata"].(map[string]any)["labels"].(map[string]any)[k], "the ServiceMonitor selects %s", svc)
			}
			spec := s["spec"].(map[string]any)
			podLabels := got[workload]["spec"].(map[string]any)["template"].(map[string]any)["metadata"].(map[string]any)["labels"].(map[string]any)
			for k, v := range spec["selector"].(map[string]any) {
				require.Equal(t, v, podLabels[k], "%s selects %s's pods", svc, workload)
			}
			require.Regexp(t, `containerPort: \d+\s+name: metrics`, toYAML(t, got[workload]), "%s's pods serve a port named metrics", workload)
		}
		served := servedMetrics(t)
		rules := toYAML(t, got["PrometheusRule/cowvol"])
		for _, alert := range []string{"CowvolNodeStalled", "CowvolCacheOverHighWatermark", "CowvolPullsFailing", "CowvolCapturesFailing"} {
			require.Contains(t, rules, "alert: "+alert)
		}
		dashboard := got["ConfigMap/cowvol-grafana-dashboard"]["data"].(map[string]any)["cowvol.json"].(string)
		var d struct{ Panels []any }
		require.NoError(t, json.Unmarshal([]byte(dashboard), &d))
		require.NotEmpty(t, d.Panels)
		for what, text := range map[string]string{"the alerts": rules, "the dashboard": dashboard} {
			names := regexp.MustCompile(`cowvol_[a-z_]+`).FindAllString(text, -1)
			require.NotEmpty(t, names)
			for _, n := range names {
				base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_sum"), "_count")
				require.True(t, served[base], "%s name %s, which no cowvol process serves (docs/metrics.md)", what, n)
			}
		}
	})

	t.Run("a settings file missing a key is refused", func(t *testing.T) {
		_, err := renderKustomization(t, settingsOverlay(t, func(s string) string {
			return strings.Replace(s, "  state-dir: /var/lib/cowvol\n", "", 1)
		}))
		require.Error(t, err)
		require.Contains(t, err.Error(), "state-dir")
	})
}

// toYAML is an object as YAML text, to look for what it says.
func toYAML(t tb.TB, obj map[string]any) string {
	t.Helper()
	require.NotNil(t, obj)
	b, err := yaml.Marshal(obj)
	require.NoError(t, err)
	return string(b)
}

// servedMetrics are the metrics docs/metrics.md lists, which hack/gendocs
// generates from their definitions (and TestMetrics holds to what a plugin
// serves).
func servedMetrics(t tb.TB) map[string]bool {
	t.Helper()
	b, err := os.ReadFile("../../docs/metrics.md")
	require.NoError(t, err)
	served := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(cowvol_[a-z_]+)`").FindAllStringSubmatch(string(b), -1) {
		served[m[1]] = true
	}
	require.NotEmpty(t, served)
	return served
}
