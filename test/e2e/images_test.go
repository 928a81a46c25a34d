//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/ociimage"
)

// imageRegistry is where the node plugin serves its volumes' images: the
// address components/image-registry gives it and its policy guards.
const imageRegistry = "127.0.0.1:7444"

// withImage runs the step container on image, pulled if the node lacks it.
func withImage(image string) podOpt {
	return func(_, container map[string]any) {
		container["image"], container["imagePullPolicy"] = image, "IfNotPresent"
	}
}

// withHostDir mounts a dir of the host read-only at path.
func withHostDir(dir, path string) podOpt {
	return func(spec, container map[string]any) {
		spec["volumes"] = append(spec["volumes"].([]map[string]any),
			map[string]any{"name": "host", "hostPath": map[string]any{"path": dir, "type": "Directory"}})
		container["volumeMounts"] = append(container["volumeMounts"].([]map[string]any),
			map[string]any{"name": "host", "mountPath": path, "readOnly": true})
	}
}

// stepImages: a get step leaves a rootfs-format image (busybox's) in a
// capture and a task runs on it; an oci-build-like step leaves an OCI
// image.tar and another task runs on that; the kubelet pulls both from
// the node's own loopback registry. A pod of another namespace naming them
// is refused at admission, and by the registry when the policy lets it by.
func (c *cluster) stepImages() {
	t := c.t
	c.createPod("ci", "get-image", `set -e; cd /out; mkdir -p rootfs/bin rootfs/etc rootfs/tmp
		cp /bin/busybox rootfs/bin/; for a in sh cat echo; do ln -s busybox rootfs/bin/$a; done
		echo rootfs > rootfs/etc/made-by
		echo '{"env":["PATH=/bin","GREETING=hello from a volume"],"user":"0","cmd":["/bin/sh"]}' > metadata.json`,
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "img-rootfs")})
	c.mustSucceed("ci", "get-image")
	c.waitCaptured("img-rootfs")
	started := time.Now()
	c.createPodWith("ci", "on-rootfs", `echo "$GREETING"; cat /etc/made-by`, []podOpt{withImage(imageRegistry + "/ci/img-rootfs:latest")})
	require.Equal(t, "hello from a volume\nrootfs\n", c.mustSucceed("ci", "on-rootfs"))
	report(t, fmt.Sprintf("a task ran on the rootfs-format image a get step left in a volume, pulled from the node's loopback registry: done %s after it was created\n",
		time.Since(started).Round(100*time.Millisecond)))

	// The image.tar an image-building step leaves: an OCI layout.
	src := filepath.Join(c.work, "oci-build")
	require.NoError(t, os.MkdirAll(src, 0o755))
	require.NoError(t, ociimage.Write(filepath.Join(src, "image.tar"), ociimage.Image{Name: "example.com/built:latest",
		Files: append(busyboxFiles(t), ociimage.File{Path: "etc/made-by", Mode: 0o644, Data: []byte("oci-build\n")}),
		Cmd:   []string{"/bin/sh"}, Env: []string{"PATH=/bin"}}))
	c.createPodWith("ci", "oci-build", `set -e; cp /src/image.tar /out/`, []podOpt{withHostDir(src, "/src")},
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "img-oci")})
	c.mustSucceed("ci", "oci-build")
	c.waitCaptured("img-oci")
	c.createPodWith("ci", "on-oci", `cat /etc/made-by`, []podOpt{withImage(imageRegistry + "/ci/img-oci:latest")})
	require.Equal(t, "oci-build\n", c.mustSucceed("ci", "on-oci"))

	// Another namespace: the policy refuses ci's images however they are
	// named; the registry refuses what the policy lets by.
	c.mustKubectl("", "apply", "-f", "../../deploy/csi/components/image-registry/policy.yaml")
	defer c.mustKubectl("", "delete", "-f", "../../deploy/csi/components/image-registry/policy.yaml")
	judge := func(ns, image string) error {
		_, err := c.kubectl(podJSON(ns, "judged", "true", nil, withImage(image)), "create", "--dry-run=server", "-f", "-")
		return err
	}
	c.until("the images policy to be in force", 60*time.Second, func() bool {
		err := judge("other", imageRegistry+"/ci/img-rootfs:latest")
		return err != nil && strings.Contains(err.Error(), `cowvol rule "images"`)
	})
	for _, image := range []string{imageRegistry + "/ci/img-rootfs:latest", "localhost:7444/ci/img-rootfs", "127.0.0.2:7444/ci/img-rootfs",
		"[::1]:7444/ci/img-rootfs", "LOCALHOST:7444/ci/img-oci", imageRegistry + "/ci/other/img-rootfs"} {
		err := judge("other", image)
		require.Error(t, err, image)
		require.Contains(t, err.Error(), "may only run images of the node registry under "+imageRegistry+"/other/", image)
	}
	require.NoError(t, judge("ci", imageRegistry+"/ci/img-rootfs:latest"), "ci runs its own image")
	require.NoError(t, judge("other", busyboxImage), "other images are not the policy's")
	// Naming ci as the owner: admitted (the pod's namespace comes first),
	// refused by the registry (img-rootfs is not shared).
	c.createPodWith("other", "steal", "true", []podOpt{withImage(imageRegistry + "/other/ci/img-rootfs:latest")})
	c.until("the pull of another namespace's image to fail", 60*time.Second, func() bool {
		reason, _ := c.kubectl("", "get", "pod", "-n", "other", "steal", "-o", "jsonpath={.status.containerStatuses[0].state.waiting.reason}")
		return reason == "ErrImagePull" || reason == "ImagePullBackOff"
	})
	require.Contains(t, c.events("other", "steal"), "not found")
	c.deletePod("other", "steal")
	report(t, "a pod of another namespace naming ci's image volume was refused by the images policy (under five spellings of the loopback address), "+
		"and its pull by the registry where it named ci as the owner of a volume ci never shared\n")
}
