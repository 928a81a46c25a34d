//go:build e2e

package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/ociimage"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
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
// user does, into namespace argo (its manifests unchanged but for the
// images' tags), and a ServiceAccount its step pods in ci run as, with
// what Argo's executor needs. Every pod of Argo's, the steps' included,
// is on the pod network and reaches the API server through the kubernetes
// Service.
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

// argoExample is the example a team copies (examples/argo/build.yaml), as
// the fleet runs it: named, on the harness's busybox image (imported into
// every node's runtime) and the fleet's registry of images from volumes.
func argoExample(t testing.TB, name string) string {
	raw := string(mustRead(t, "../../examples/argo/build.yaml"))
	for old, new := range map[string]string{
		"generateName: build-":     "name: " + name,
		"image: busybox:1.37":      "image: " + busyboxImage,
		"image: \"127.0.0.1:7444/": "image: \"" + imageRegistry + "/",
	} {
		require.Contains(t, raw, old, "examples/argo/build.yaml")
		raw = strings.ReplaceAll(raw, old, new)
	}
	return raw
}

// argoSums is what a check step of the example writes: sha256sum of each
// file the build step's successful attempt made, sorted by name.
func argoSums() string {
	var names []string
	for i := 1; i <= 100; i++ {
		names = append(names, fmt.Sprintf("f%d.txt", i))
	}
	slices.Sort(names)
	var b strings.Builder
	for _, n := range names {
		i := strings.TrimSuffix(strings.TrimPrefix(n, "f"), ".txt")
		fmt.Fprintf(&b, "%x  ./%s\n", sha256.Sum256([]byte("source file "+i+"\n")), n)
	}
	return b.String()
}

// argoPod is one step pod of a workflow: its DAG node's name (Argo's
// annotation: <workflow>.<task>, and (<attempt>) for a retried one), where
// it ran, and how long from its creation its step's container took to
// start (its volumes and image made ready: the step's input handoff).
type argoPod struct {
	name, node, step string
	handoff          time.Duration
}

func (f *fleet) argoPods(workflow string) map[string]argoPod {
	var pods struct {
		Items []struct {
			Metadata struct {
				Name        string            `json:"name"`
				Annotations map[string]string `json:"annotations"`
				Created     time.Time         `json:"creationTimestamp"`
			} `json:"metadata"`
			Spec struct {
				NodeName string `json:"nodeName"`
			} `json:"spec"`
			Status struct {
				ContainerStatuses []struct {
					Name  string `json:"name"`
					State struct {
						Terminated *struct {
							StartedAt  time.Time `json:"startedAt"`
							FinishedAt time.Time `json:"finishedAt"`
						} `json:"terminated"`
					} `json:"state"`
				} `json:"containerStatuses"`
			} `json:"status"`
		} `json:"items"`
	}
	require.NoError(f.t, json.Unmarshal([]byte(f.mustKubectl("", "get", "pods", "-n", "ci", "-l", "workflows.argoproj.io/workflow="+workflow, "-o", "json")), &pods))
	out := map[string]argoPod{}
	for _, p := range pods.Items {
		step := strings.TrimPrefix(p.Metadata.Annotations["workflows.argoproj.io/node-name"], workflow+".")
		pod := argoPod{name: p.Metadata.Name, node: p.Spec.NodeName, step: step}
		// Where the rest of a step's time goes (logged): its step's end, and
		// the end of Argo's wait container, which reports its outputs.
		ended := map[string]string{}
		for _, c := range p.Status.ContainerStatuses {
			if c.State.Terminated == nil {
				continue
			}
			if c.Name == "main" {
				pod.handoff = c.State.Terminated.StartedAt.Sub(p.Metadata.Created)
			}
			ended[c.Name] = c.State.Terminated.FinishedAt.Sub(p.Metadata.Created).String()
		}
		f.t.Logf("Argo step %s: pod %s on %s, created %s; its step started %s later; containers ended after %v",
			step, pod.name, pod.node, p.Metadata.Created.Format(time.TimeOnly), pod.handoff, ended)
		out[step] = pod
	}
	return out
}

// fleetArgo: Argo Workflows, unmodified, runs the example build, whose
// steps pass their outputs as cowvol volumes: a step retried after a
// failure (the failed attempt's output captured, never read), a fan-out
// and a fan-in, a step whose image an earlier step made. The fan-in's
// output is checked against what the build made, byte for byte. In a
// namespace that opts in to the locality webhook, the checks run on the
// node that holds their input, though nothing in the workflow says where
// to run. Deleting the Workflow destroys its volumes.
func (f *fleet) fleetArgo() {
	t := f.t
	if argoBin() == "" {
		t.Log("Argo Workflows was not built (COWVOL_E2E_ARGO_BIN is unset: run make e2e): its scenario is skipped")
		return
	}
	ctx := context.Background()
	f.installArgo()
	defer f.optInToLocality("ci")()
	const name = "cowvol-build"
	f.mustKubectl(argoExample(t, name), "create", "-n", "ci", "-f", "-")
	start := time.Now()
	f.until("the workflow to end", 5*time.Minute, func() bool {
		phase, err := f.kubectl("", "get", "workflow", name, "-n", "ci", "-o", "jsonpath={.status.phase}")
		return err == nil && (phase == "Succeeded" || phase == "Failed" || phase == "Error")
	})
	took := time.Since(start)
	phase := f.mustKubectl("", "get", "workflow", name, "-n", "ci", "-o", "jsonpath={.status.phase} {.status.message}")
	require.Equal(t, "Succeeded", strings.TrimSpace(phase), "the workflow's phase")
	uid := f.mustKubectl("", "get", "workflow", name, "-n", "ci", "-o", "jsonpath={.metadata.uid}")

	// Each step's span, for a reader of the log: where a build's time went.
	t.Log(f.mustKubectl("", "get", "workflow", name, "-n", "ci", "-o",
		`jsonpath={range .status.nodes.*}{.displayName}{"\t"}{.type}{"\t"}{.phase}{"\t"}{.startedAt}{"\t"}{.finishedAt}{"\n"}{end}`))
	pods := f.argoPods(name)
	for _, step := range []string{"build(0)", "build(1)", "unit", "lint", "toolbox", "report"} {
		require.Contains(t, pods, step, "a pod for each step and attempt")
		f.figure("Argo build: step "+step+", its pod created to its step started (s resolution)", pods[step].handoff)
	}
	// The fan-in's output: what the toolbox image says, and both checks'
	// sums of what build's second attempt made. Its first lines are the
	// step's; Argo's executor logs after them.
	made := "made by toolbox\n" + argoSums() + argoSums()
	logs := f.mustKubectl("", "logs", "-n", "ci", pods["report"].name, "-c", "main")
	require.True(t, strings.HasPrefix(logs, made), "the report step read both checks' outputs, in the toolbox image:\n%s", logs)
	built := pods["build(1)"].node
	for _, check := range []string{"unit", "lint"} {
		require.Equal(t, built, f.preferredNodes("ci", pods[check].name), "the locality webhook preferred the node holding %s's input", check)
		require.Equal(t, built, pods[check].node, "%s ran where its input was written", check)
	}

	// Every output, the failed attempt's too, is the Workflow's, and says
	// how its step ended.
	owned := func() map[string]string {
		locs, err := f.cache.List(ctx, &controllerv1.ListVolumesRequest{Namespace: "ci", Selector: cowvolume.PropertyOwnerUID + "=" + uid})
		require.NoError(t, err)
		out := map[string]string{}
		for _, l := range locs {
			require.Equal(t, "Workflow.argoproj.io/"+name, l.GetProperties()[cowvolume.PropertyOwner])
			out[strings.TrimPrefix(l.GetRef().GetHandle(), "wf-"+uid+"-")] = l.GetProperties()[cowvolume.PropertyStepResult]
		}
		return out
	}
	// (The last captures may end a moment after the Workflow does.)
	want := map[string]string{"build-0": "failed", "build-1": "succeeded", "unit": "succeeded", "lint": "succeeded",
		"toolbox": "succeeded", "report": "succeeded"}
	var seen map[string]string
	f.until("the workflow's outputs to be captured", time.Minute, func() bool {
		got := owned()
		if !maps.Equal(got, seen) {
			t.Logf("the workflow's outputs, by step result: %v", got)
			seen = got
		}
		return maps.Equal(got, want)
	})

	f.mustKubectl("", "delete", "workflow", name, "-n", "ci")
	deleted := time.Now()
	f.until("the deleted workflow's volumes to be destroyed", 2*time.Minute, func() bool { return len(owned()) == 0 })
	collected := time.Since(deleted)
	f.until("an Event in ci to say so", 30*time.Second, func() bool {
		msgs, err := f.kubectl("", "get", "events", "-n", "ci", "--field-selector", "reason=CachedVolumesDestroyed,involvedObject.name="+name,
			"-o", "jsonpath={.items[*].message}")
		return err == nil && strings.Contains(msgs, "Workflow.argoproj.io/"+name+" (uid "+uid+") is gone: cowvol destroyed the")
	})
	report(t, fmt.Sprintf("fleet: Argo Workflows %s ran the example build (a retried step, a fan-out and a fan-in, a step image from a volume) "+
		"passing its outputs as cowvol volumes in %s; the checks ran on the build's node, %s, placed by the locality webhook; "+
		"its 6 volumes were destroyed %s after the Workflow was deleted\n",
		argoVersion, took.Round(100*time.Millisecond), built, collected.Round(100*time.Millisecond)))
}
