package test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/controller/locality"
	"github.com/concourse/cowvol/pkg/volume"
)

// The controller's locality webhook, as the API server calls it (HTTPS,
// the controller's certificate): a pod naming a volume a node reported
// gets a preference for that node, by name; one naming another
// namespace's private volume, or an image of no registry it was told of,
// gets none; and every pod is allowed.
func TestLocalityWebhook(t *testing.T) {
	testfs.Need(t)
	dir := t.TempDir()
	pki := netlab.NewPKI(t, filepath.Join(dir, "pki"), "cowvol-controller", "127.0.0.1")
	tokens := filepath.Join(dir, "tokens")
	require.NoError(t, os.WriteFile(tokens, []byte("node-token-0123456789,system:cowvol-node,*,node-a\nadmin-token-0123456789,admin,*\n"), 0o600))
	nodeToken := filepath.Join(dir, "node-token")
	require.NoError(t, os.WriteFile(nodeToken, []byte("node-token-0123456789\n"), 0o600))
	addr, webhook := plugintest.FreeAddr(t), plugintest.FreeAddr(t)
	const registry = "127.0.0.1:7444"
	plugintest.Start(t, plugintest.Config{Mode: "controller", Args: []string{"--api-address=" + addr,
		"--tls-cert-file=" + pki.Cert, "--tls-key-file=" + pki.Key, "--tokens-file=" + tokens,
		"--webhook-address=" + webhook, "--locality-image-registry=" + registry}})
	n := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", Args: []string{"--controller-address=" + addr,
		"--tls-ca-file=" + pki.CA, "--token-file=" + nodeToken}})
	n.captureIn("ci", "mine", nil)
	n.captureIn("other", "private", nil)
	n.captureIn("other", "shared", map[string]string{"scope": "cluster"})
	api := controllerv1.NewCacheClient(dialTLS(t, addr, pki.CA, "admin-token-0123456789"))
	eventually(t, "the controller to know the node's volumes", func() bool {
		resp, err := api.ListVolumes(context.Background(), &controllerv1.ListVolumesRequest{})
		return err == nil && len(resp.GetVolumes()) == 3
	})

	caPEM, err := os.ReadFile(pki.CA)
	require.NoError(t, err)
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(caPEM))
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}}
	review := func(pod *corev1.Pod) []string {
		t.Helper()
		raw, err := json.Marshal(pod)
		require.NoError(t, err)
		body, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
			Request: &admissionv1.AdmissionRequest{UID: "u", Kind: metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
				Operation: admissionv1.Create, Namespace: "ci", Object: runtime.RawExtension{Raw: raw}}})
		require.NoError(t, err)
		resp, err := client.Post("https://"+webhook+locality.Path, "application/json", bytes.NewReader(body))
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		var out admissionv1.AdmissionReview
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
		require.True(t, out.Response.Allowed)
		if out.Response.Patch == nil {
			return nil
		}
		patch, err := jsonpatch.DecodePatch(out.Response.Patch)
		require.NoError(t, err)
		placed, err := patch.Apply(raw)
		require.NoError(t, err)
		var got corev1.Pod
		require.NoError(t, json.Unmarshal(placed, &got))
		var nodes []string
		for _, term := range got.Spec.Affinity.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
			nodes = append(nodes, term.Preference.MatchFields[0].Values...)
		}
		return nodes
	}
	pod := func(image string, attrs map[string]string) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "step"}, Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: image}}}}
		if attrs != nil {
			p.Spec.Volumes = []corev1.Volume{{Name: "in", VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
				Driver: volume.DriverName, VolumeAttributes: attrs}}}}
		}
		return p
	}
	require.Equal(t, []string{"node-a"}, review(pod("busybox", map[string]string{"source": "mine"})))
	require.Equal(t, []string{"node-a"}, review(pod("busybox", map[string]string{"source": "shared", "sourceNamespace": "other"})))
	require.Nil(t, review(pod("busybox", map[string]string{"source": "private", "sourceNamespace": "other"})),
		"another namespace's private volume steers nothing")
	require.Equal(t, []string{"node-a"}, review(pod(registry+"/ci/mine:latest", nil)), "a step image from a volume")
	require.Nil(t, review(pod("registry.example/ci/mine:latest", nil)))
	require.Nil(t, review(pod("busybox", nil)))
}
