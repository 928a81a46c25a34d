//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/stretchr/testify/require"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/ociimage"
	"github.com/concourse/cowvol/pkg/registry"
	"github.com/concourse/cowvol/pkg/snapshotter"
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
		"[::1]:7444/ci/img-rootfs", "LOCALHOST:7444/ci/img-oci", imageRegistry + "/ci/other/img-rootfs", imageRegistry + "/ci/img-rootfs:cowvol"} {
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

// stepImagesOnSnapshotter: the rootfs-format image the get step left
// (stepImages) runs under the cowvol runtime class as its :cowvol tag: the
// kubelet pulls it for the class's handler, containerd unpacks it into the
// cowvol snapshotter, and its layer (the volume's rootfs/) is never
// fetched. A container running on it keeps the volume through eviction
// (the reaper evicts a volume beside it) and a destroy, while the
// volume's images leave the runtime's list; once the pods are gone, the
// volume is freed and no snapshot is left.
func (c *cluster) stepImagesOnSnapshotter() {
	t := c.t
	// The node's containerd is configured as the README says, and the
	// check the plugin runs at start says so; it would say what is wrong.
	missing, err := snapshotter.Check(context.Background(), c.containerd, c.snapshotter)
	require.NoError(t, err)
	require.Empty(t, missing)
	missing, err = snapshotter.Check(context.Background(), c.containerd, "/run/elsewhere.sock")
	require.NoError(t, err)
	require.Len(t, missing, 1)
	require.Contains(t, missing[0], `not at "/run/elsewhere.sock"`)
	c.mustKubectl("", "apply", "-f", "../../deploy/csi/components/image-snapshotter/runtimeclass.yaml")
	image := imageRegistry + "/ci/img-rootfs:" + registry.RemoteTag
	opts := []podOpt{withImage(image), func(spec, _ map[string]any) { spec["runtimeClassName"] = "cowvol" }}
	started := time.Now()
	c.createPodWith("ci", "on-snapshotter", `echo "$GREETING"; cat /etc/made-by`, opts)
	require.Equal(t, "hello from a volume\nrootfs\n", c.mustSucceed("ci", "on-snapshotter"))
	took := time.Since(started)
	// An OCI layout has no remote layer: under the class, containerd
	// unpacks it into the snapshotter (once per node), and it runs there.
	c.createPodWith("ci", "oci-on-snapshotter", `cat /etc/made-by`,
		[]podOpt{withImage(imageRegistry + "/ci/img-oci:" + registry.RemoteTag), opts[1]})
	require.Equal(t, "oci-build\n", c.mustSucceed("ci", "oci-on-snapshotter"))

	resp, err := http.Get("http://" + imageRegistry + "/v2/ci/img-rootfs/manifests/" + registry.RemoteTag)
	require.NoError(t, err)
	var m struct {
		Config struct{ Digest string }
		Layers []struct{ Digest string }
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&m))
	resp.Body.Close()
	require.Len(t, m.Layers, 1)
	content, err := exec.Command("ctr", "--address", c.containerd, "-n", "k8s.io", "content", "ls", "-q").CombinedOutput()
	require.NoError(t, err, "%s", content)
	require.NotContains(t, string(content), m.Layers[0].Digest, "the remote layer was fetched")

	// Held while a container runs on it.
	c.createPodWith("ci", "runs-on-image", "sleep 3600", opts)
	c.until("the pod on the image volume to run", 2*time.Minute, func() bool { return c.phase("ci", "runs-on-image") == "Running" })
	c.createPod("ci", "bystander", "echo x > /out/f", volume{name: "out", mountPath: "/out", attrs: attrs("capture", "img-bystander")})
	c.mustSucceed("ci", "bystander")
	c.waitCaptured("img-bystander")
	volumes := filepath.Join(c.stateDir, "cowvol", "volumes", "ci")
	// Eviction: the disk filled past the high watermark, the reaper takes
	// what nothing holds (the bystander), not the volume a container
	// runs on.
	unfill := c.fillStateDir()
	c.until("the reaper to evict the volume beside it", 2*time.Minute, func() bool {
		_, err := os.Stat(filepath.Join(volumes, "img-bystander"))
		return os.IsNotExist(err)
	})
	unfill()
	v, err := c.plugin.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: &nodev1.VolumeRef{Namespace: "ci", Handle: "img-rootfs"}})
	require.NoError(t, err, "the image volume a container runs on was evicted")
	require.Equal(t, "ready", v.State)
	require.NotEmpty(t, v.HoldingImages)

	// Destroyed, it is hidden at once, and kept while the container runs
	// (the reaper frees a volume destroyed with it).
	c.createPod("ci", "bystander-2", "echo x > /out/f", volume{name: "out", mountPath: "/out", attrs: attrs("capture", "img-bystander-2")})
	c.mustSucceed("ci", "bystander-2")
	c.waitCaptured("img-bystander-2")
	_, err = c.plugin.NodeAPI.DestroyVolumes(context.Background(), &nodev1.DestroyVolumesRequest{Refs: []*nodev1.VolumeRef{
		{Namespace: "ci", Handle: "img-rootfs"}, {Namespace: "ci", Handle: "img-bystander-2"}}})
	require.NoError(t, err)
	c.until("the volume destroyed with it to be freed", time.Minute, func() bool {
		_, err := os.Stat(filepath.Join(volumes, "img-bystander-2"))
		return os.IsNotExist(err)
	})
	require.DirExists(t, filepath.Join(volumes, "img-rootfs"), "the image volume a container runs on was freed")
	madeBy := c.mustKubectl("", "exec", "-n", "ci", "runs-on-image", "--", "cat", "/etc/made-by")
	require.Equal(t, "rootfs\n", madeBy)

	// Destroyed, the volume's images leave the runtime (the pulled copy
	// of stepImages too), even while a container runs on one.
	ctr := func(args ...string) string {
		out, err := exec.Command("ctr", append([]string{"--address", c.containerd, "-n", "k8s.io"}, args...)...).CombinedOutput()
		require.NoError(t, err, "%s", out)
		return string(out)
	}
	c.until("the runtime to forget the destroyed volume's images", 2*time.Minute, func() bool {
		images := ctr("images", "ls", "-q")
		// The CRI's record by image ID too, or containerd keeps it all.
		return !strings.Contains(images, imageRegistry+"/ci/img-rootfs") && !strings.Contains(images, m.Config.Digest)
	})
	require.Equal(t, "rootfs\n", c.mustKubectl("", "exec", "-n", "ci", "runs-on-image", "--", "cat", "/etc/made-by"))

	c.deletePod("ci", "runs-on-image")
	c.deletePod("ci", "on-snapshotter")
	freed := time.Now()
	c.until("the image volume to be freed once no container runs on it", 3*time.Minute, func() bool {
		_, err := os.Stat(filepath.Join(volumes, "img-rootfs"))
		return os.IsNotExist(err)
	})
	// Nothing references what is left of the image: containerd's next
	// collection (asked for here, as a synchronous lease delete does)
	// takes its layer and every snapshot on it from the snapshotter (the
	// pause image the class's sandboxes run on stays, pinned).
	c.until("containerd to collect the image's snapshots on the cowvol snapshotter", time.Minute, func() bool {
		ctr("leases", "create", "--id", "cowvol-e2e-collect")
		ctr("leases", "delete", "--sync", "cowvol-e2e-collect")
		return !strings.Contains(ctr("snapshots", "--snapshotter", "cowvol", "ls"), m.Layers[0].Digest)
	})
	report(t, fmt.Sprintf("a task ran on the rootfs-format image volume's own layers through the cowvol snapshotter (its layer never fetched): "+
		"done %s after it was created; a running container kept the volume through eviction and a destroy, freed %s after its pod was deleted\n",
		took.Round(100*time.Millisecond), time.Since(freed).Round(time.Second)))
}
