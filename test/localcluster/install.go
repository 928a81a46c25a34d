package localcluster

import (
	"os"
	"os/exec"
	"path/filepath"

	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/ociimage"
	"github.com/stretchr/testify/require"
)

// RegistrarImage is the upstream sidecar's image, as the base names it.
const RegistrarImage = "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.17.0"

// ImportRegistrar imports the upstream node-driver-registrar, built from
// its source by make e2e, under registrarImage into the node's runtime,
// and says whether it could.
func (c *Cluster) ImportRegistrar() bool {
	c.T.Helper()
	return c.importRegistrarInto(c.Containerd)
}

// importRegistrarInto is importRegistrar into the runtime at socket.
func (c *Cluster) importRegistrarInto(socket string) bool {
	c.T.Helper()
	path := os.Getenv("COWVOL_E2E_REGISTRAR_BINARY")
	if path == "" {
		return false
	}
	bin, err := os.ReadFile(path)
	require.NoError(c.T, err)
	c.ImportImageInto(socket, ociimage.Image{Name: RegistrarImage, Files: []ociimage.File{{Path: "csi-node-driver-registrar", Mode: 0o755, Data: bin}},
		Entrypoint: []string{"/csi-node-driver-registrar"}})
	return true
}

// ImportImage builds img and imports it into the node's containerd.
func (c *Cluster) ImportImage(img ociimage.Image) {
	c.T.Helper()
	c.ImportImageInto(c.Containerd, img)
}

// ImportImageInto builds img and imports it into the containerd at socket.
func (c *Cluster) ImportImageInto(socket string, img ociimage.Image) {
	c.T.Helper()
	out := filepath.Join(c.Work, "images", "extra.tar")
	require.NoError(c.T, ociimage.Write(out, img))
	if b, err := exec.Command("ctr", "--address", socket, "-n", "k8s.io", "images", "import", out).CombinedOutput(); err != nil {
		c.T.Fatalf("importing %s: %v: %s", img.Name, err, b)
	}
}

// PeerCASecret is the kubectl command that makes the Secret of a peer CA:
// the CA of p and its key.
func PeerCASecret(name string, p netlab.PKI) []string {
	return []string{"create", "secret", "generic", name, "-n", "cowvol", "--from-file=tls.crt=" + p.CA, "--from-file=tls.key=" + p.CAKey}
}
