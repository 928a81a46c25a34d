//go:build e2e

package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/stretchr/testify/require"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/tb"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
	"github.com/concourse/cowvol/test/localcluster"
)

// argoExample is the example a team copies (examples/argo/build.yaml), as
// the fleet runs it: named, on the harness's busybox image (imported into
// every node's runtime) and the fleet's registry of images from volumes.
func argoExample(t tb.TB, name string) string {
	raw := string(localcluster.MustRead(t, "../../examples/argo/build.yaml"))
	for old, new := range map[string]string{
		"generateName: build-":     "name: " + name,
		"image: busybox:1.37":      "image: " + localcluster.BusyboxImage,
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
	require.NoError(f.T, json.Unmarshal([]byte(f.MustKubectl("", "get", "pods", "-n", "ci", "-l", "workflows.argoproj.io/workflow="+workflow, "-o", "json")), &pods))
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
		f.T.Logf("Argo step %s: pod %s on %s, created %s; its step started %s later; containers ended after %v",
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
	t := f.T
	if localcluster.ArgoBin() == "" {
		t.Log("Argo Workflows was not built (COWVOL_E2E_ARGO_BIN is unset: run make e2e): its scenario is skipped")
		return
	}
	ctx := context.Background()
	f.InstallArgo()
	defer f.optInToLocality("ci")()
	const name = "cowvol-build"
	f.MustKubectl(argoExample(t, name), "create", "-n", "ci", "-f", "-")
	start := time.Now()
	f.Until("the workflow to end", 5*time.Minute, func() bool {
		phase, err := f.Kubectl("", "get", "workflow", name, "-n", "ci", "-o", "jsonpath={.status.phase}")
		return err == nil && (phase == "Succeeded" || phase == "Failed" || phase == "Error")
	})
	took := time.Since(start)
	phase := f.MustKubectl("", "get", "workflow", name, "-n", "ci", "-o", "jsonpath={.status.phase} {.status.message}")
	require.Equal(t, "Succeeded", strings.TrimSpace(phase), "the workflow's phase")
	uid := f.MustKubectl("", "get", "workflow", name, "-n", "ci", "-o", "jsonpath={.metadata.uid}")

	// Each step's span, for a reader of the log: where a build's time went.
	t.Log(f.MustKubectl("", "get", "workflow", name, "-n", "ci", "-o",
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
	logs := f.MustKubectl("", "logs", "-n", "ci", pods["report"].name, "-c", "main")
	require.True(t, strings.HasPrefix(logs, made), "the report step read both checks' outputs, in the toolbox image:\n%s", logs)
	built := pods["build(1)"].node
	for _, check := range []string{"unit", "lint"} {
		require.Equal(t, built, f.preferredNodes("ci", pods[check].name), "the locality webhook preferred the node holding %s's input", check)
		require.Equal(t, built, pods[check].node, "%s ran where its input was written", check)
	}

	// Every output, the failed attempt's too, is the Workflow's, and says
	// how its step ended.
	owned := func() map[string]string {
		locs, err := f.Cache.List(ctx, &controllerv1.ListVolumesRequest{Namespace: "ci", Selector: cowvolume.PropertyOwnerUID + "=" + uid})
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
	f.Until("the workflow's outputs to be captured", time.Minute, func() bool {
		got := owned()
		if !maps.Equal(got, seen) {
			t.Logf("the workflow's outputs, by step result: %v", got)
			seen = got
		}
		return maps.Equal(got, want)
	})

	f.MustKubectl("", "delete", "workflow", name, "-n", "ci")
	deleted := time.Now()
	f.Until("the deleted workflow's volumes to be destroyed", 2*time.Minute, func() bool { return len(owned()) == 0 })
	collected := time.Since(deleted)
	f.Until("an Event in ci to say so", 30*time.Second, func() bool {
		msgs, err := f.Kubectl("", "get", "events", "-n", "ci", "--field-selector", "reason=CachedVolumesDestroyed,involvedObject.name="+name,
			"-o", "jsonpath={.items[*].message}")
		return err == nil && strings.Contains(msgs, "Workflow.argoproj.io/"+name+" (uid "+uid+") is gone: cowvol destroyed the")
	})
	report(t, fmt.Sprintf("fleet: Argo Workflows %s ran the example build (a retried step, a fan-out and a fan-in, a step image from a volume) "+
		"passing its outputs as cowvol volumes in %s; the checks ran on the build's node, %s, placed by the locality webhook; "+
		"its 6 volumes were destroyed %s after the Workflow was deleted\n",
		localcluster.ArgoVersion, took.Round(100*time.Millisecond), built, collected.Round(100*time.Millisecond)))
}
