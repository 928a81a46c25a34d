//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/ociimage"
)

// Argo Workflows on the fleet: built from source by make (ARGO_BIN, with
// the release's manifests beside the binaries), its images made from
// those binaries under the names the manifests give them.
const (
	argoVersion = "v3.7.8"
	// argoUser is the uid Argo's images run as (their manifests ask for
	// a non-root user).
	argoUser = "8737"
)

// argoBin is where make put Argo's binaries and manifests ("": not built,
// and the Argo scenario is skipped).
func argoBin() string { return os.Getenv("COWVOL_E2E_ARGO_BIN") }

// installArgo installs Argo Workflows from its release's manifests, as a
// user does, into namespace argo: the workflow controller and argo
// server on their nodes' network (the harness has no pod network), and a
// ServiceAccount its step pods in ci run as, with what Argo's executor
// needs.
func (f *fleet) installArgo() {
	t := f.t
	bin := argoBin()
	read := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join(bin, name))
		require.NoError(t, err)
		return b
	}
	certs := mustRead(t, "/etc/ssl/certs/ca-certificates.crt")
	image := func(repo, binary, user string) ociimage.Image {
		return ociimage.Image{Name: "quay.io/argoproj/" + repo + ":" + argoVersion, User: user,
			Files: []ociimage.File{{Path: "bin/" + binary, Mode: 0o755, Data: read(binary)},
				{Path: "etc/ssl/certs/ca-certificates.crt", Mode: 0o644, Data: certs}, {Path: "tmp", Dir: true, Mode: 0o1777}},
			Entrypoint: []string{"/bin/" + binary}, Env: []string{"PATH=/bin", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"}}
	}
	images := []ociimage.Image{image("workflow-controller", "workflow-controller", argoUser),
		image("argocli", "argo", argoUser), image("argoexec", "argoexec", "")}
	for _, n := range f.nodes {
		for _, img := range images {
			f.importImageInto(n.containerd, img)
		}
	}
	dir := filepath.Join(f.work, "argo-install")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	// kustomize takes a base by a path relative to the kustomization.
	base, err := filepath.Rel(dir, filepath.Join(bin, "manifests", "cluster-install"))
	require.NoError(t, err)
	writeFile(t, filepath.Join(dir, "kustomization.yaml"), fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %s
images:
  - {name: quay.io/argoproj/workflow-controller, newTag: %[2]s}
  - {name: quay.io/argoproj/argocli, newTag: %[2]s}
patches:
  - target: {kind: Deployment}
    patch: |-
      - {op: add, path: /spec/template/spec/hostNetwork, value: true}
`, base, argoVersion))
	f.mustKubectl("", "create", "namespace", "argo")
	f.mustKubectl("", "apply", "--server-side", "-k", dir)
	f.mustKubectl(`apiVersion: v1
kind: ServiceAccount
metadata: {name: argo-steps, namespace: ci}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: argo-executor, namespace: ci}
rules:
  - apiGroups: [argoproj.io]
    resources: [workflowtaskresults]
    verbs: [create, patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: argo-steps, namespace: ci}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: argo-executor}
subjects: [{kind: ServiceAccount, name: argo-steps, namespace: ci}]
`, "apply", "-f", "-")
	f.until("Argo's workflow controller to run", 2*time.Minute, func() bool {
		out, err := f.kubectl("", "get", "deployment", "workflow-controller", "-n", "argo", "-o", "jsonpath={.status.readyReplicas}")
		return err == nil && out == "1"
	})
}

// argoExample is the example a team copies (examples/argo), as the
// fleet runs it: named, on the harness's step image.
func argoExample(t *testing.T, name string) string {
	raw := string(mustRead(t, "../../examples/argo/pass-outputs.yaml"))
	for old, new := range map[string]string{
		"generateName: pass-outputs-":   "name: " + name,
		"image: busybox:1.37":           "image: " + busyboxImage,
		"imagePullPolicy: IfNotPresent": "imagePullPolicy: Never",
	} {
		require.Contains(t, raw, old, "examples/argo/pass-outputs.yaml")
		raw = strings.ReplaceAll(raw, old, new)
	}
	return raw
}

// fleetArgo: Argo Workflows, unmodified, runs the example DAG whose steps
// pass an output to the next as a cowvol volume; in a namespace that opts in to
// the locality webhook, the step that reads it runs on the node that
// wrote it, though nothing in the workflow says where to run.
func (f *fleet) fleetArgo() {
	t := f.t
	if argoBin() == "" {
		t.Log("Argo Workflows was not built (COWVOL_E2E_ARGO_BIN is unset: run make e2e): its scenario is skipped")
		return
	}
	f.installArgo()
	defer f.optInToLocality("ci")()
	const name = "cowvol-dag"
	f.mustKubectl(argoExample(t, name), "create", "-n", "ci", "-f", "-")
	start := time.Now()
	f.until("the workflow to end", 4*time.Minute, func() bool {
		phase, err := f.kubectl("", "get", "workflow", name, "-n", "ci", "-o", "jsonpath={.status.phase}")
		return err == nil && (phase == "Succeeded" || phase == "Failed" || phase == "Error")
	})
	took := time.Since(start)
	phase := f.mustKubectl("", "get", "workflow", name, "-n", "ci", "-o", "jsonpath={.status.phase} {.status.message}")
	require.Equal(t, "Succeeded", strings.TrimSpace(phase), "the workflow's phase")
	var pods struct {
		Items []struct {
			Metadata struct {
				Name string `json:"name"`
			} `json:"metadata"`
			Spec struct {
				NodeName string `json:"nodeName"`
			} `json:"spec"`
		} `json:"items"`
	}
	require.NoError(t, json.Unmarshal([]byte(f.mustKubectl("", "get", "pods", "-n", "ci", "-l", "workflows.argoproj.io/workflow="+name, "-o", "json")), &pods))
	nodes, podNames := map[string]string{}, map[string]string{}
	for _, p := range pods.Items {
		// Argo names a step's pod <workflow>-<step>-<hash>.
		step, _, _ := strings.Cut(strings.TrimPrefix(p.Metadata.Name, name+"-"), "-")
		nodes[step], podNames[step] = p.Spec.NodeName, p.Metadata.Name
	}
	require.Contains(t, nodes, "produce")
	require.Contains(t, nodes, "consume")
	// The first line is the step's; Argo's executor logs after it.
	logs := f.mustKubectl("", "logs", "-n", "ci", podNames["consume"], "-c", "main")
	require.True(t, strings.HasPrefix(logs, "made-by-argo\n"), "the consume step read the produce step's output: %q", logs)
	require.Equal(t, nodes["produce"], f.preferredNodes("ci", podNames["consume"]), "the locality webhook preferred the node that wrote the input")
	require.Equal(t, nodes["produce"], nodes["consume"], "the step reading the output ran where it was written")
	report(t, fmt.Sprintf("fleet: Argo Workflows %s ran a 2-step DAG passing its output as a cowvol volume in %s; the reading step ran on the writer's node, %s, placed by the locality webhook\n",
		argoVersion, took.Round(100*time.Millisecond), nodes["produce"]))
}
