//go:build e2e

package e2e

import (
	"encoding/json"
	"strings"

	"github.com/stretchr/testify/require"
)

// pluginImageRuns runs the plugin's image, as make image builds it without
// Docker, in a pod: containerd takes the OCI layout and the binary starts.
func (c *cluster) pluginImageRuns() {
	pod := map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": "plugin-image", "namespace": "ci"},
		"spec": map[string]any{
			"nodeName": nodeName, "restartPolicy": "Never", "hostNetwork": true,
			"automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
			"containers": []any{map[string]any{
				"name": "cowvol", "image": pluginImage, "imagePullPolicy": "Never", "args": []string{"--version"},
			}},
		},
	}
	b, err := json.Marshal(pod)
	require.NoError(c.t, err)
	c.mustKubectl(string(b), "create", "-f", "-")
	out := c.mustSucceed("ci", "plugin-image")
	require.True(c.t, strings.HasPrefix(out, "cowvol-plugin "), "the image's entrypoint is the plugin: %q", out)
	report(c.t, "the plugin image built without Docker (make image) ran in containerd: "+strings.TrimSpace(out)+"\n")
}
