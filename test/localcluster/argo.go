package localcluster

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/concourse/cowvol/internal/ociimage"
	"github.com/stretchr/testify/require"
)

// Argo Workflows on the fleet: built from source by make (ARGO_BIN, with
// the release's manifests beside the binaries), its images made from
// those binaries under the names the manifests give them.
const (
	ArgoVersion = "v3.7.8"
	// argoUser is the uid Argo's images run as (their manifests ask for
	// a non-root user).
	argoUser = "8737"
)

// ArgoBin is where make put Argo's binaries and manifests ("": not built,
// and the Argo scenario is skipped).
func ArgoBin() string { return os.Getenv("COWVOL_E2E_ARGO_BIN") }

// InstallArgo installs Argo Workflows from its release's manifests, as a
// user does, into namespace argo (its manifests unchanged but for the
// images' tags), and a ServiceAccount its step pods in ci run as, with
// what Argo's executor needs. Every pod of Argo's, the steps' included,
// is on the pod network and reaches the API server through the kubernetes
// Service.
func (f *Cluster) InstallArgo() {
	t := f.T
	bin := ArgoBin()
	read := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join(bin, name))
		require.NoError(t, err)
		return b
	}
	certs := MustRead(t, "/etc/ssl/certs/ca-certificates.crt")
	image := func(repo, binary, user string) ociimage.Image {
		return ociimage.Image{Name: "quay.io/argoproj/" + repo + ":" + ArgoVersion, User: user,
			Files: []ociimage.File{{Path: "bin/" + binary, Mode: 0o755, Data: read(binary)},
				{Path: "etc/ssl/certs/ca-certificates.crt", Mode: 0o644, Data: certs}, {Path: "tmp", Dir: true, Mode: 0o1777}},
			Entrypoint: []string{"/bin/" + binary}, Env: []string{"PATH=/bin", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"}}
	}
	images := []ociimage.Image{image("workflow-controller", "workflow-controller", argoUser),
		image("argocli", "argo", argoUser), image("argoexec", "argoexec", "")}
	for _, n := range f.Nodes {
		for _, img := range images {
			f.ImportImageInto(n.Containerd, img)
		}
	}
	dir := filepath.Join(f.Work, "argo-install")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	// kustomize takes a base by a path relative to the kustomization.
	base, err := filepath.Rel(dir, filepath.Join(bin, "manifests", "cluster-install"))
	require.NoError(t, err)
	WriteFile(t, filepath.Join(dir, "kustomization.yaml"), fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %s
images:
  - {name: quay.io/argoproj/workflow-controller, newTag: %[2]s}
  - {name: quay.io/argoproj/argocli, newTag: %[2]s}
`, base, ArgoVersion))
	f.MustKubectl("", "create", "namespace", "argo")
	f.MustKubectl("", "apply", "--server-side", "-k", dir)
	f.MustKubectl(`apiVersion: v1
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
	f.Until("Argo's workflow controller to run", 2*time.Minute, func() bool {
		out, err := f.Kubectl("", "get", "deployment", "workflow-controller", "-n", "argo", "-o", "jsonpath={.status.readyReplicas}")
		return err == nil && out == "1"
	})
}
