//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/ociimage"
	"github.com/concourse/cowvol/internal/tb"
	imagepkg "github.com/concourse/cowvol/pkg/image"
	"github.com/concourse/cowvol/pkg/registry"
	"github.com/concourse/cowvol/pkg/registry/credential"
	"github.com/concourse/cowvol/pkg/snapshotter"
	"github.com/concourse/cowvol/test/localcluster"
)

// imageRegistry is where the node plugin serves its volumes' images: the
// address components/image-registry gives it and its policy guards.
const imageRegistry = "127.0.0.1:7444"

// withImage runs the step container on image, pulled if the node lacks it,
// as the pod's ServiceAccount.
func withImage(image string) podOpt {
	return withImagePolicy(image, "IfNotPresent")
}

func withImagePolicy(image, policy string) podOpt {
	return func(spec, container map[string]any) {
		container["image"], container["imagePullPolicy"] = image, policy
		spec["serviceAccountName"] = localcluster.StepsServiceAccount
	}
}

// withRegistryToken mounts, at /var/run/cowvol/token, a token of the pod's
// ServiceAccount for the registry's audience: what a pod that wants to
// read the registry itself can have.
func withRegistryToken() podOpt {
	return func(spec, container map[string]any) {
		spec["serviceAccountName"] = localcluster.StepsServiceAccount
		spec["volumes"] = append(spec["volumes"].([]map[string]any), map[string]any{"name": "registry-token", "projected": map[string]any{
			"sources": []any{map[string]any{"serviceAccountToken": map[string]any{"audience": credential.Audience, "expirationSeconds": 600, "path": "token"}}}}})
		container["volumeMounts"] = append(container["volumeMounts"].([]map[string]any),
			map[string]any{"name": "registry-token", "mountPath": "/var/run/cowvol", "readOnly": true})
	}
}

// runtimeManifest reads from the node's containerd the manifest of the
// image it keeps as name, and its digest.
func (c *cluster) runtimeManifest(name string) (string, ocispec.Manifest) {
	c.T.Helper()
	// Standard output alone: ctr warns on standard error.
	ctr := func(args ...string) string {
		out, err := exec.Command("ctr", append([]string{"--address", c.Containerd, "-n", "k8s.io"}, args...)...).Output()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			err = fmt.Errorf("%w: %s", err, exit.Stderr)
		}
		require.NoError(c.T, err)
		return string(out)
	}
	lines := strings.Split(strings.TrimSpace(ctr("images", "ls", "name=="+name)), "\n")
	require.Len(c.T, lines, 2, "the runtime keeps %s", name)
	target := strings.Fields(lines[1])[2]
	var m ocispec.Manifest
	require.NoError(c.T, json.Unmarshal([]byte(ctr("content", "get", target)), &m))
	return target, m
}

// registryGet asks the node's registry for path as a process on the node,
// with token (empty: none), and answers the status and body.
func registryGet(t tb.TB, path, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://"+imageRegistry+path, nil)
	require.NoError(t, err)
	if token != "" {
		req.SetBasicAuth(credential.User, token)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// registryToken is a token of ns's steps ServiceAccount for the registry,
// bound to the pod ns/pod on this node: what the kubelet hands the
// credential provider for that pod.
func (c *cluster) registryToken(ns, pod string) string {
	c.T.Helper()
	return strings.TrimSpace(c.MustKubectl("", "create", "token", localcluster.StepsServiceAccount, "-n", ns, "--audience="+credential.Audience,
		"--bound-object-kind=Pod", "--bound-object-name="+pod, "--duration=10m"))
}

// hostNetworkTenant is a namespace whose pods may use their node's
// network: an attacker's, in imagesTenancy.
const hostNetworkTenant = "hostnet"

// onHostNetwork puts the pod on its node's network: what only a namespace
// that Pod Security does not hold to baseline admits.
func onHostNetwork(spec, _ map[string]any) { spec["hostNetwork"] = true }

// rootfsImageScript is a get step that leaves a rootfs-format image
// (busybox's) in /out; a task on it prints rootfsImageSays.
const (
	rootfsImageScript = `set -e; cd /out; mkdir -p rootfs/bin rootfs/etc rootfs/tmp
		cp /bin/busybox rootfs/bin/; for a in sh cat echo; do ln -s busybox rootfs/bin/$a; done
		echo rootfs > rootfs/etc/made-by
		echo '{"env":["PATH=/bin","GREETING=hello from a volume"],"user":"0","cmd":["/bin/sh"]}' > metadata.json`
	rootfsImageTask = `echo "$GREETING"; cat /etc/made-by`
	rootfsImageSays = "hello from a volume\nrootfs\n"
)

// stepImages: a get step leaves a rootfs-format image (busybox's) in a
// capture and a task runs on it; an oci-build-like step leaves an OCI
// image.tar and another task runs on that; the kubelet pulls both from
// the node's own loopback registry. A pod of another namespace naming them
// is refused at admission, and by the registry when the policy lets it by.
func (c *cluster) stepImages() {
	t := c.T
	c.createPod("ci", "get-image", rootfsImageScript, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "img-rootfs")})
	c.mustSucceed("ci", "get-image")
	c.waitCaptured("img-rootfs")
	started := time.Now()
	c.createPodWith("ci", "on-rootfs", rootfsImageTask, []podOpt{withImage(imageRegistry + "/ci/img-rootfs:latest")})
	require.Equal(t, rootfsImageSays, c.mustSucceed("ci", "on-rootfs"))
	report(t, fmt.Sprintf("a task ran on the rootfs-format image a get step left in a volume, pulled from the node's loopback registry: done %s after it was created\n",
		time.Since(started).Round(100*time.Millisecond)))

	// The image.tar an image-building step leaves: an OCI layout.
	src := filepath.Join(c.Work, "oci-build")
	require.NoError(t, os.MkdirAll(src, 0o755))
	require.NoError(t, ociimage.Write(filepath.Join(src, "image.tar"), ociimage.Image{Name: "example.com/built:latest",
		Files: append(localcluster.BusyboxFiles(t), ociimage.File{Path: "etc/made-by", Mode: 0o644, Data: []byte("oci-build\n")}),
		Cmd:   []string{"/bin/sh"}, Env: []string{"PATH=/bin"}}))
	c.createPodFed("ci", "oci-build", src, "/src", `set -e; cp /src/image.tar /out/`,
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "img-oci")})
	c.mustSucceed("ci", "oci-build")
	c.waitCaptured("img-oci")
	c.createPodWith("ci", "on-oci", `cat /etc/made-by`, []podOpt{withImage(imageRegistry + "/ci/img-oci:latest")})
	require.Equal(t, "oci-build\n", c.mustSucceed("ci", "on-oci"))

	c.imagesTenancy()

	// Another namespace: the policy refuses ci's images however they are
	// named; the registry refuses what the policy lets by.
	c.MustKubectl("", "apply", "-f", "../../deploy/csi/components/image-registry/policy.yaml")
	defer c.MustKubectl("", "delete", "-f", "../../deploy/csi/components/image-registry/policy.yaml")
	judge := func(ns, image string) error {
		_, err := c.Kubectl(podJSON(ns, "judged", "true", nil, withImage(image)), "create", "--dry-run=server", "-f", "-")
		return err
	}
	c.Until("the images policy to be in force", 60*time.Second, func() bool {
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
	require.NoError(t, judge("other", localcluster.BusyboxImage), "other images are not the policy's")
	// Naming ci as the owner: admitted (the pod's namespace comes first),
	// refused by the registry (img-rootfs is not shared).
	c.createPodWith("other", "steal", "true", []podOpt{withImage(imageRegistry + "/other/ci/img-rootfs:latest")})
	c.Until("the pull of another namespace's image to fail", 60*time.Second, func() bool {
		reason, _ := c.Kubectl("", "get", "pod", "-n", "other", "steal", "-o", "jsonpath={.status.containerStatuses[0].state.waiting.reason}")
		return reason == "ErrImagePull" || reason == "ImagePullBackOff"
	})
	require.Contains(t, c.events("other", "steal"), "not found")
	c.deletePod("other", "steal")
	report(t, "a pod of another namespace naming ci's image volume was refused by the images policy (under five spellings of the loopback address), "+
		"and its pull by the registry where it named ci as the owner of a volume ci never shared\n")
}

// imagesTenancy: with no admission policy in the way, another namespace
// reads none of ci's images from the node: not from a hostNetwork pod
// under any loopback spelling, with no credential or its own; not as a
// process on the node; not by naming the image the kubelet already
// pulled for ci, by digest or by image ID. A volume shared with scope
// cluster is still run by the namespace it was shared with.
func (c *cluster) imagesTenancy() {
	t := c.T
	_, latest := c.runtimeManifest(imageRegistry + "/ci/img-rootfs:latest")
	layer := latest.Layers[0].Digest.String()

	// A hostNetwork pod of another namespace, as an attacker would ask:
	// every answer for ci's image is the one for an image that is not
	// there. The step namespaces admit no hostNetwork pod (Pod Security
	// baseline), so the attacker's is one whose operator let it have one.
	_, err := c.Kubectl(podJSON("other", "attacker", "true", nil, onHostNetwork), "create", "-f", "-")
	require.ErrorContains(t, err, `violates PodSecurity "baseline:latest": host namespaces (hostNetwork=true)`)
	c.MustKubectl("", "create", "namespace", hostNetworkTenant)
	c.MustKubectl("", "label", "namespace", hostNetworkTenant, "pod-security.kubernetes.io/enforce=privileged")
	c.MustKubectl("", "create", "serviceaccount", localcluster.StepsServiceAccount, "-n", hostNetworkTenant)
	script := `T=$(cat /var/run/cowvol/token)
		AUTH="Authorization: Basic $(printf 'serviceaccount-token:%s' "$T" | base64 | tr -d '\n')"
		ask() {
			if [ -n "$4" ]; then printf 'GET %s HTTP/1.0\r\nHost: %s\r\n%s\r\n\r\n' "$3" "$1" "$4"
			else printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$3" "$1"; fi | nc -w 5 "$1" "$2" 2>&1 | tr -d '\r' | grep -v '^Date: '
		}
		for host in 127.0.0.1 localhost 127.0.0.2 ::1; do for cred in none own; do
			h=""; [ $cred = own ] && h="$AUTH"
			for what in img-rootfs img-absent; do
				echo "== $host $cred manifest $what"; ask $host 7444 /v2/ci/$what/manifests/latest "$h"
				echo "== $host $cred blob $what"; ask $host 7444 /v2/ci/$what/blobs/` + layer + ` "$h"
			done
		done; done`
	c.createPodWith(hostNetworkTenant, "attacker", script, []podOpt{onHostNetwork, withRegistryToken()})
	answers := map[string]string{}
	var key string
	asked := c.mustSucceed(hostNetworkTenant, "attacker")
	c.deletePod(hostNetworkTenant, "attacker")
	for _, line := range strings.Split(strings.TrimSpace(asked), "\n") {
		if k, ok := strings.CutPrefix(line, "== "); ok {
			key = k
			continue
		}
		answers[key] += line + "\n"
	}
	for _, host := range []string{"127.0.0.1", "localhost", "127.0.0.2", "::1"} {
		for _, cred := range []string{"none", "own"} {
			for _, kind := range []string{"manifest", "blob"} {
				img, nothing := answers[host+" "+cred+" "+kind+" img-rootfs"], answers[host+" "+cred+" "+kind+" img-absent"]
				require.NotContains(t, img, "200 OK", "%s %s %s", host, cred, kind)
				require.NotContains(t, img, "sha256:", "%s %s %s", host, cred, kind)
				// Names of one length: the answers' lengths are compared too.
				require.Equal(t, strings.ReplaceAll(nothing, "ci/img-absent", "ci/img-rootfs"), img, "%s %s %s: ci's image is told from nothing", host, cred, kind)
			}
		}
	}
	require.Contains(t, answers["127.0.0.1 none manifest img-rootfs"], "401 Unauthorized")
	require.Contains(t, answers["localhost none blob img-rootfs"], "401 Unauthorized")
	require.Contains(t, answers["127.0.0.1 own manifest img-rootfs"], "404 Not Found")
	require.Contains(t, answers["127.0.0.1 own blob img-rootfs"], "404 Not Found")

	// What proving the namespace adds to a pull: the kubelet runs the
	// provider once per pod token, and the registry reviews the token once
	// (then keeps the answer).
	token := c.registryToken("ci", "on-rootfs")
	started := time.Now()
	code, _ := registryGet(t, "/v2/ci/img-rootfs/manifests/latest", token)
	reviewed := time.Since(started)
	require.Equal(t, http.StatusOK, code)
	started = time.Now()
	code, _ = registryGet(t, "/v2/ci/img-rootfs/manifests/latest", token)
	kept := time.Since(started)
	require.Equal(t, http.StatusOK, code)
	var provider []time.Duration
	for range 5 {
		cmd := exec.Command(localcluster.CredentialProviderBinary(t))
		cmd.Stdin = strings.NewReader(`{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderRequest",` +
			`"image":"` + imageRegistry + `/ci/img-rootfs:latest","serviceAccountToken":"` + token + `"}`)
		started = time.Now()
		out, err := cmd.Output()
		provider = append(provider, time.Since(started))
		require.NoError(t, err)
		require.Contains(t, string(out), token)
	}
	slices.Sort(provider)
	report(t, fmt.Sprintf("proving a pull's namespace: the credential provider ran in %s (median of 5 runs), the registry's first answer to a new "+
		"token (a TokenReview) took %s and the next, kept, %s\n", provider[2].Round(100*time.Microsecond),
		reviewed.Round(100*time.Microsecond), kept.Round(100*time.Microsecond)))

	// A process on the node with no credential: the same.
	for _, path := range []string{"/v2/ci/%s/manifests/latest", "/v2/ci/%s/blobs/" + layer} {
		code, body := registryGet(t, fmt.Sprintf(path, "img-rootfs"), "")
		code2, body2 := registryGet(t, fmt.Sprintf(path, "img-absent"), "")
		require.Equal(t, http.StatusUnauthorized, code)
		require.Equal(t, code2, code)
		require.Equal(t, strings.ReplaceAll(body2, "ci/img-absent", "ci/img-rootfs"), body)
	}

	// The image the kubelet pulled for ci, named by another namespace's
	// pods by digest and by image ID: the kubelet makes each pull again
	// with the pod's own credential (KubeletEnsureSecretPulledImages),
	// which the registry refuses, or, told never to pull, runs nothing.
	repoDigest := c.MustKubectl("", "get", "pod", "-n", "ci", "on-rootfs", "-o", "jsonpath={.status.containerStatuses[0].imageID}")
	require.Contains(t, repoDigest, imageRegistry+"/ci/img-rootfs@sha256:")
	imageID := latest.Config.Digest.String()
	named := map[string]string{"by-digest-never": repoDigest, "by-digest-present": repoDigest, "by-id-never": imageID, "by-id-present": imageID}
	for pod, image := range named {
		policy := "IfNotPresent"
		if strings.HasSuffix(pod, "-never") {
			policy = "Never"
		}
		c.createPodWith("other", pod, "cat /etc/made-by", []podOpt{withImagePolicy(image, policy)})
	}
	for pod := range named {
		c.Until("the kubelet to refuse "+pod, 2*time.Minute, func() bool {
			reason, _ := c.Kubectl("", "get", "pod", "-n", "other", pod, "-o", "jsonpath={.status.containerStatuses[0].state.waiting.reason}")
			return reason == "ErrImageNeverPull" || reason == "ErrImagePull" || reason == "ImagePullBackOff"
		})
		require.Equal(t, "Pending", c.phase("other", pod), pod)
		c.deletePod("other", pod)
	}
	// The namespace that pulled it runs it by digest without a pull.
	c.createPodWith("ci", "by-digest", "cat /etc/made-by", []podOpt{withImagePolicy(repoDigest, "Never")})
	require.Equal(t, "rootfs\n", c.mustSucceed("ci", "by-digest"))

	// Shared with scope cluster: ci runs other's image, as
	// <reader>/<owner>/<handle>.
	c.createPod("other", "get-shared-image", `set -e; cd /out; mkdir -p rootfs/bin rootfs/etc
		cp /bin/busybox rootfs/bin/; ln -s busybox rootfs/bin/sh; ln -s busybox rootfs/bin/cat; echo shared > rootfs/etc/made-by
		echo '{"env":["PATH=/bin"],"cmd":["/bin/sh"]}' > metadata.json`,
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "img-shared", "scope", "cluster")})
	c.mustSucceed("other", "get-shared-image")
	c.waitCapturedIn("other", "img-shared")
	c.createPodWith("ci", "on-shared", "cat /etc/made-by", []podOpt{withImage(imageRegistry + "/ci/other/img-shared:latest")})
	require.Equal(t, "shared\n", c.mustSucceed("ci", "on-shared"))
	report(t, "another namespace's hostNetwork pod asked the node's registry for ci's image and blob under 4 loopback spellings, with no credential "+
		"and with its own token: every answer was the one for an image that is not there (401 without, 404 with); its pods naming the image "+
		"the kubelet pulled for ci, by digest and by image ID, with Never and IfNotPresent, never ran; ci ran it by digest, and another "+
		"namespace's image shared with scope cluster\n")
}

// replayRemoteLayer: another namespace writes, into a volume of its own,
// OCI layouts whose layer carries the remote layer ci's pull was handed
// (its annotation and its digest as diff ID), and whose layer is only
// named by that digest; pulled as any tag and as :cowvol under the
// runtime class, the registry serves neither, and nothing runs.
func (c *cluster) replayRemoteLayer(taken ocispec.Manifest) {
	t := c.T
	remote := taken.Layers[0]
	for _, tt := range []struct {
		handle string
		layer  ocispec.Descriptor
	}{
		{"replay-annotated", remote},
		{"replay-digest", ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer, Digest: remote.Digest, Size: 0}},
	} {
		src := filepath.Join(c.Work, tt.handle)
		// The layer's blob an empty file, its digest the config's diff ID.
		require.NoError(t, ociimage.WriteLayout(src, tt.layer, nil, tt.layer.Digest))
		c.createPodFed("other", "write-"+tt.handle, src, "/src", `set -e; cp -r /src/. /out/`,
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", tt.handle)})
		c.mustSucceed("other", "write-"+tt.handle)
		c.waitCapturedIn("other", tt.handle)
		for _, tag := range []string{"latest", registry.RemoteTag} {
			pod := tt.handle + "-" + tag
			opts := []podOpt{withImage(imageRegistry + "/other/" + tt.handle + ":" + tag)}
			if tag == registry.RemoteTag {
				opts = append(opts, func(spec, _ map[string]any) { spec["runtimeClassName"] = "cowvol" })
			}
			c.createPodWith("other", pod, "cat /etc/made-by", opts)
			c.Until("the pull of "+pod+" to fail", 2*time.Minute, func() bool {
				reason, _ := c.Kubectl("", "get", "pod", "-n", "other", pod, "-o", "jsonpath={.status.containerStatuses[0].state.waiting.reason}")
				return reason == "ErrImagePull" || reason == "ImagePullBackOff"
			})
			require.Equal(t, "Pending", c.phase("other", pod))
			c.deletePod("other", pod)
		}
	}
	require.Contains(t, c.Plugin.Log(), "Refused an image that names a remote layer")
	report(t, "another namespace's images carrying the remote layer ci's pull was handed (its annotation, or its digest as diff ID) were refused by the registry, as any tag and as :cowvol under the runtime class\n")
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
	t := c.T
	// The node's containerd is configured as docs/step-images.md says, and the
	// check the plugin runs at start says so; it would say what is wrong.
	missing, err := snapshotter.Check(context.Background(), c.Containerd, c.Snapshotter)
	require.NoError(t, err)
	require.Empty(t, missing)
	missing, err = snapshotter.Check(context.Background(), c.Containerd, "/run/elsewhere.sock")
	require.NoError(t, err)
	require.Len(t, missing, 1)
	require.Contains(t, missing[0], `not at "/run/elsewhere.sock"`)
	c.MustKubectl("", "apply", "-f", "../../deploy/csi/components/image-snapshotter/runtimeclass.yaml")
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

	// What the runtime pulled: a manifest minted for its pull, whose one
	// layer it never fetched.
	_, m := c.runtimeManifest(image)
	require.Len(t, m.Layers, 1)
	require.Contains(t, m.Layers[0].Annotations, imagepkg.RemoteLayerAnnotation)
	content, err := exec.Command("ctr", "--address", c.Containerd, "-n", "k8s.io", "content", "ls", "-q").CombinedOutput()
	require.NoError(t, err, "%s", content)
	require.NotContains(t, string(content), m.Layers[0].Digest.String(), "the remote layer was fetched")
	c.replayRemoteLayer(m)

	// Held while a container runs on it.
	c.createPodWith("ci", "runs-on-image", "sleep 3600", opts)
	c.Until("the pod on the image volume to run", 2*time.Minute, func() bool { return c.phase("ci", "runs-on-image") == "Running" })
	c.createPod("ci", "bystander", "echo x > /out/f", volume{name: "out", mountPath: "/out", attrs: attrs("capture", "img-bystander")})
	c.mustSucceed("ci", "bystander")
	c.waitCaptured("img-bystander")
	volumes := filepath.Join(c.StateDir, "cowvol", "volumes", "ci")
	// Eviction: the disk filled past the high watermark, the reaper takes
	// what nothing holds (the bystander), not the volume a container
	// runs on.
	unfill := c.fillStateDir()
	c.Until("the reaper to evict the volume beside it", 2*time.Minute, func() bool {
		_, err := os.Stat(filepath.Join(volumes, "img-bystander"))
		return os.IsNotExist(err)
	})
	unfill()
	v, err := c.Plugin.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: &nodev1.VolumeRef{Namespace: "ci", Handle: "img-rootfs"}})
	require.NoError(t, err, "the image volume a container runs on was evicted")
	require.Equal(t, "ready", v.State)
	require.NotEmpty(t, v.HoldingImages)

	// Destroyed, it is hidden at once, and kept while the container runs
	// (the reaper frees a volume destroyed with it).
	c.createPod("ci", "bystander-2", "echo x > /out/f", volume{name: "out", mountPath: "/out", attrs: attrs("capture", "img-bystander-2")})
	c.mustSucceed("ci", "bystander-2")
	c.waitCaptured("img-bystander-2")
	_, err = c.Plugin.NodeAPI.DestroyVolumes(context.Background(), &nodev1.DestroyVolumesRequest{Refs: []*nodev1.VolumeRef{
		{Namespace: "ci", Handle: "img-rootfs"}, {Namespace: "ci", Handle: "img-bystander-2"}}})
	require.NoError(t, err)
	c.Until("the volume destroyed with it to be freed", time.Minute, func() bool {
		_, err := os.Stat(filepath.Join(volumes, "img-bystander-2"))
		return os.IsNotExist(err)
	})
	require.DirExists(t, filepath.Join(volumes, "img-rootfs"), "the image volume a container runs on was freed")
	madeBy := c.MustKubectl("", "exec", "-n", "ci", "runs-on-image", "--", "cat", "/etc/made-by")
	require.Equal(t, "rootfs\n", madeBy)

	// Destroyed, the volume's images leave the runtime (the pulled copy
	// of stepImages too), even while a container runs on one.
	ctr := func(args ...string) string {
		out, err := exec.Command("ctr", append([]string{"--address", c.Containerd, "-n", "k8s.io"}, args...)...).CombinedOutput()
		require.NoError(t, err, "%s", out)
		return string(out)
	}
	c.Until("the runtime to forget the destroyed volume's images", 2*time.Minute, func() bool {
		images := ctr("images", "ls", "-q")
		// The CRI's record by image ID too, or containerd keeps it all.
		return !strings.Contains(images, imageRegistry+"/ci/img-rootfs") && !strings.Contains(images, m.Config.Digest.String())
	})
	require.Equal(t, "rootfs\n", c.MustKubectl("", "exec", "-n", "ci", "runs-on-image", "--", "cat", "/etc/made-by"))

	c.deletePod("ci", "runs-on-image")
	c.deletePod("ci", "on-snapshotter")
	freed := time.Now()
	c.Until("the image volume to be freed once no container runs on it", 3*time.Minute, func() bool {
		_, err := os.Stat(filepath.Join(volumes, "img-rootfs"))
		return os.IsNotExist(err)
	})
	// Nothing references what is left of the image: containerd's next
	// collection (asked for here, as a synchronous lease delete does)
	// takes its layer and every snapshot on it from the snapshotter (the
	// pause image the class's sandboxes run on stays, pinned).
	c.Until("containerd to collect the image's snapshots on the cowvol snapshotter", time.Minute, func() bool {
		ctr("leases", "create", "--id", "cowvol-e2e-collect")
		ctr("leases", "delete", "--sync", "cowvol-e2e-collect")
		return !strings.Contains(ctr("snapshots", "--snapshotter", "cowvol", "ls"), m.Layers[0].Digest.String())
	})
	report(t, fmt.Sprintf("a task ran on the rootfs-format image volume's own layers through the cowvol snapshotter (its layer never fetched): "+
		"done %s after it was created; a running container kept the volume through eviction and a destroy, freed %s after its pod was deleted\n",
		took.Round(100*time.Millisecond), time.Since(freed).Round(time.Second)))
}
