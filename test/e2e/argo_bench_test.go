//go:build e2e

package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/ociimage"
	"github.com/concourse/cowvol/internal/tb"
	"github.com/concourse/cowvol/test/localcluster"
)

// BenchmarkArgoArtifacts is make bench-argo: one DAG run on the fleet
// twice, in one run, by Argo Workflows: once passing its outputs as
// Argo's own artifacts through an S3 artifact repository (SeaweedFS's S3
// gateway, as teams run MinIO, in a pod on node-3), once as cowvol
// volumes. The DAG: produce writes 1 GiB in 50,000 files on node-1; near
// (node-1) and far (node-2) each read all of it; gather reads both their
// results on node-1. It reports, per run, the time from the Workflow's
// create to its success, each step's input handoff (its pod seen to its
// step's first read of its input), the bytes the nodes sent over the
// lab's bridge, and the S3 server's disk; and the ratios, artifacts over
// cowvol. Everything the pods write is on memory (the fleet's dirs on a
// tmpfs, cowvol's state filesystems on loop devices over tmpfs), so that
// neither side pays for this machine's throttled root disk.
func BenchmarkArgoArtifacts(b *testing.B) {
	weed := os.Getenv("COWVOL_E2E_WEED_BINARY")
	if weed == "" {
		b.Skip("COWVOL_E2E_WEED_BINARY is not set: make bench-argo builds SeaweedFS")
	}
	if localcluster.ArgoBin() == "" {
		b.Skip("COWVOL_E2E_ARGO_BIN is not set: make bench-argo builds Argo Workflows")
	}
	// A short path, not b.TempDir's: the kubelets' sockets below it must
	// fit in a unix socket's 108 bytes.
	work, err := os.MkdirTemp("", "b")
	require.NoError(b, err)
	require.NoError(b, unix.Mount("tmpfs", work, "tmpfs", 0, "size=24g,mode=0755"))
	b.Cleanup(func() {
		_ = unix.Unmount(work, unix.MNT_DETACH)
		_ = os.Remove(work)
	})
	b.Setenv("TMPDIR", work)

	f := startFleet(b, 3)
	f.InstallCowvol()
	f.InstallArgo()
	endpoint := f.installS3(weed)

	var artifacts, volumes handoffRun
	for b.Loop() {
		artifacts = f.runHandoff("bench-artifacts", handoffWorkflow("bench-artifacts", artifactsIO), true)
		volumes = f.runHandoff("bench-cowvol", handoffWorkflow("bench-cowvol", cowvolIO), false)
	}
	require.Equal(b, artifacts.sum, volumes.sum, "both runs' steps read the same tree")

	var table strings.Builder
	fmt.Fprintf(&table, "Argo's S3 artifacts against cowvol volumes (1 GiB in 50,000 files; S3 at %s on node-3):\n", endpoint)
	row := func(what string, a, v time.Duration) {
		fmt.Fprintf(&table, "  %-46s %10s %10s %8.1fx\n", what, a.Round(100*time.Millisecond), v.Round(10*time.Millisecond), a.Seconds()/v.Seconds())
	}
	fmt.Fprintf(&table, "  %-46s %10s %10s %9s\n", "", "artifacts", "cowvol", "ratio")
	row("Workflow created to Succeeded", artifacts.took, volumes.took)
	for _, step := range handoffSteps {
		row("handoff: "+step+" (pod seen to first read)", artifacts.steps[step].handoff(), volumes.steps[step].handoff())
	}
	// The comparator: what a step with no input takes from its pod seen
	// to its first line (Argo's init container, the kubelet, the runtime).
	row("no input: produce (pod seen to first line)", artifacts.steps["produce"].handoff(), volumes.steps["produce"].handoff())
	// Where the rest of the DAG's time goes: between steps, and in them.
	for _, step := range handoffSteps {
		row("gap: "+strings.Join(handoffDeps[step], ", ")+"'s last line to "+step+"'s pod", artifacts.gap(step), volumes.gap(step))
	}
	for _, step := range append([]string{"produce"}, handoffSteps...) {
		row("ran: "+step+" (first read to last line)", artifacts.steps[step].done.Sub(artifacts.steps[step].firstRead),
			volumes.steps[step].done.Sub(volumes.steps[step].firstRead))
	}
	fmt.Fprintf(&table, "  %-46s %10.0f %10.0f %8.1fx\n", "MiB sent over the bridge by the nodes",
		float64(artifacts.sent)/(1<<20), float64(volumes.sent)/(1<<20), float64(artifacts.sent)/float64(max(volumes.sent, 1)))
	fmt.Fprintf(&table, "  %-46s %10.0f %10s\n", "MiB on the S3 server's disk", float64(artifacts.s3Disk)/(1<<20), "-")
	b.Log(table.String())
	report(b, table.String())
	b.ReportMetric(artifacts.took.Seconds()/volumes.took.Seconds(), "dag-x")
	b.ReportMetric(artifacts.steps["near"].handoff().Seconds()/volumes.steps["near"].handoff().Seconds(), "same-node-x")
	b.ReportMetric(artifacts.steps["far"].handoff().Seconds()/volumes.steps["far"].handoff().Seconds(), "cross-node-x")
}

// handoffSteps are the DAG's steps that read an input.
var handoffSteps = []string{"near", "far", "gather"}

// handoffRun is what one run of the DAG measured.
type handoffRun struct {
	took   time.Duration
	steps  map[string]stepTimes
	sent   int64  // bytes the nodes sent on their links
	s3Disk int64  // bytes under the S3 server's data dir after the run
	sum    string // gather's digest of what near and far read
}

// stepTimes are when a step's pod was seen, and when its step first read
// its input (produce: its first line) and wrote its last line.
type stepTimes struct{ seen, firstRead, done time.Time }

// handoff is the step's input handoff: its pod seen to its first read.
func (s stepTimes) handoff() time.Duration { return s.firstRead.Sub(s.seen) }

// handoffDeps are the DAG's dependencies, each step's on its inputs'.
var handoffDeps = map[string][]string{"near": {"produce"}, "far": {"produce"}, "gather": {"near", "far"}}

// gap is the time from the last of a step's dependencies' last line to
// its pod seen: Argo's bookkeeping between steps, and with artifacts the
// archive and upload of the outputs.
func (r handoffRun) gap(step string) time.Duration {
	var last time.Time
	for _, dep := range handoffDeps[step] {
		if d := r.steps[dep].done; d.After(last) {
			last = d
		}
	}
	return r.steps[step].seen.Sub(last)
}

// String is the run as the log shows it: durations and sizes in units.
func (r handoffRun) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "took %s, %.0f MiB sent between nodes, %.0f MiB on the S3 disk, digest %s; steps (handoff, gap before, ran):",
		r.took.Round(100*time.Millisecond), float64(r.sent)/(1<<20), float64(r.s3Disk)/(1<<20), r.sum)
	for _, step := range slices.Sorted(maps.Keys(r.steps)) {
		st, gap := r.steps[step], "-" // produce waits for nothing
		if len(handoffDeps[step]) > 0 {
			gap = r.gap(step).Round(100 * time.Millisecond).String()
		}
		fmt.Fprintf(&b, " %s %s %s %s;", step, st.handoff().Round(100*time.Millisecond), gap, st.done.Sub(st.firstRead).Round(100*time.Millisecond))
	}
	return b.String()
}

// The step scripts, the same in both runs. produce logs when it starts,
// and writes the tree and the digest of its contents; a reader logs when
// it first read its input, and near and far check all of it against
// produce's digest; each logs when it ends. Stamps are read with adjtimex,
// to the microsecond (busybox's date has no sub-second format).
const (
	firstRead   = `adjtimex | awk '/tv_sec/ {s = $2} /tv_usec/ {u = $2} END {printf "first-read %d.%06d\n", s, u}'`
	lastLine    = `adjtimex | awk '/tv_sec/ {s = $2} /tv_usec/ {u = $2} END {printf "done %d.%06d\n", s, u}'`
	treeDigest  = `find . -type f | sort | xargs cat | sha256sum | cut -d' ' -f1`
	produceStep = `set -e
` + firstRead + `
mktree /out/tree 50000 21475
cd /out/tree && ` + treeDigest + ` > /out/sum
` + lastLine
	consumeStep = `set -e
head -c 1 /in/sum > /dev/null
` + firstRead + `
cd /in/tree && test "$(` + treeDigest + `)" = "$(cat /in/sum)"
mkdir -p /out && cp /in/sum /out/sum
` + lastLine
	gatherStep = `set -e
head -c 1 /near/sum > /dev/null
` + firstRead + `
test "$(cat /near/sum)" = "$(cat /far/sum)"
echo "sum $(cat /near/sum)"
` + lastLine
)

// handoffIO is how a run's steps pass their outputs: what each template
// adds for its inputs and outputs.
type handoffIO struct {
	// artifacts: Argo downloads the inputs and mounts them itself, and
	// the DAG's tasks name the artifacts they pass.
	artifacts                bool
	produce, consume, gather string
}

// artifactsIO passes them as Argo's artifacts, through the namespace's
// default artifact repository (S3): tar+gzip, Argo's default.
var artifactsIO = handoffIO{
	artifacts: true,
	produce: `
      outputs: {artifacts: [{name: out, path: /out}]}`,
	consume: `
      inputs:
        parameters: [{name: node}, {name: who}]
        artifacts: [{name: in, path: /in}]
      outputs: {artifacts: [{name: out, path: /out}]}`,
	gather: `
      inputs: {artifacts: [{name: near, path: /near}, {name: far, path: /far}]}`,
}

// cowvolIO passes them as cowvol volumes, as examples/argo does.
var cowvolIO = handoffIO{
	produce: `
      volumes: [{name: out, csi: {driver: cowvol.concourse-ci.org, volumeAttributes: {capture: "wf-{{workflow.uid}}-produce", owner: controller}}}]`,
	consume: `
      inputs: {parameters: [{name: node}, {name: who}]}
      volumes:
        - {name: in, csi: {driver: cowvol.concourse-ci.org, readOnly: true, volumeAttributes: {source: "wf-{{workflow.uid}}-produce"}}}
        - {name: out, csi: {driver: cowvol.concourse-ci.org, volumeAttributes: {capture: "wf-{{workflow.uid}}-{{inputs.parameters.who}}", owner: controller}}}`,
	gather: `
      volumes:
        - {name: near, csi: {driver: cowvol.concourse-ci.org, readOnly: true, volumeAttributes: {source: "wf-{{workflow.uid}}-near"}}}
        - {name: far, csi: {driver: cowvol.concourse-ci.org, readOnly: true, volumeAttributes: {source: "wf-{{workflow.uid}}-far"}}}`,
}

// handoffWorkflow is the DAG, its steps pinned to their nodes, passing
// outputs as io says.
func handoffWorkflow(name string, io handoffIO) string {
	mounts := func(vols ...string) string {
		if io.artifacts {
			return "" // Argo mounts what it downloads
		}
		var m []string
		for _, v := range vols {
			m = append(m, fmt.Sprintf("{name: %s, mountPath: /%s}", v, v))
		}
		return "\n        volumeMounts: [" + strings.Join(m, ", ") + "]"
	}
	step := func(script string) string {
		return "\n        image: " + localcluster.BusyboxImage + "\n        imagePullPolicy: Never\n        command: [sh, -c]\n        args: [" + strconv.Quote(script) + "]"
	}
	return `apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata: {name: ` + name + `}
spec:
  entrypoint: main
  serviceAccountName: argo-steps
  templates:
    - name: main
      dag:
        tasks:
          - {name: produce, template: produce}
          - name: near
            template: consume
            dependencies: [produce]
            arguments:
              parameters: [{name: node, value: node-1}, {name: who, value: near}]` + artifactArg(io, "in", "produce") + `
          - name: far
            template: consume
            dependencies: [produce]
            arguments:
              parameters: [{name: node, value: node-2}, {name: who, value: far}]` + artifactArg(io, "in", "produce") + `
          - name: gather
            template: gather
            dependencies: [near, far]` + gatherArgs(io) + `
    - name: produce
      nodeSelector: {kubernetes.io/hostname: node-1}` + io.produce + `
      container:` + step(produceStep) + mounts("out") + `
    - name: consume
      nodeSelector: {kubernetes.io/hostname: "{{inputs.parameters.node}}"}` + io.consume + `
      container:` + step(consumeStep) + mounts("in", "out") + `
    - name: gather
      nodeSelector: {kubernetes.io/hostname: node-1}` + io.gather + `
      container:` + step(gatherStep) + mounts("near", "far") + `
`
}

// artifactArg is a consumer task's input artifact, where the DAG passes
// artifacts.
func artifactArg(io handoffIO, name, from string) string {
	if !io.artifacts {
		return ""
	}
	return fmt.Sprintf("\n              artifacts: [{name: %s, from: \"{{tasks.%s.outputs.artifacts.out}}\"}]", name, from)
}

// gatherArgs are the gather task's input artifacts, where the DAG passes
// artifacts.
func gatherArgs(io handoffIO) string {
	if !io.artifacts {
		return ""
	}
	return `
            arguments:
              artifacts:
                - {name: near, from: "{{tasks.near.outputs.artifacts.out}}"}
                - {name: far, from: "{{tasks.far.outputs.artifacts.out}}"}`
}

// runHandoff runs the workflow once and measures it. A watch of the
// workflow's pods tells when each was first seen (creation timestamps have
// whole seconds).
func (f *fleet) runHandoff(name, workflow string, s3 bool) handoffRun {
	t := f.T
	seen := f.watchPods("ci", "workflows.argoproj.io/workflow="+name)
	sentBefore := f.bridgeBytes()
	f.MustKubectl(workflow, "create", "-n", "ci", "-f", "-")
	start := time.Now()
	var phase string
	f.Until(name+" to end", 20*time.Minute, func() bool {
		out, err := f.Kubectl("", "get", "workflow", name, "-n", "ci", "-o", "jsonpath={.status.phase}")
		phase = out
		return err == nil && (phase == "Succeeded" || phase == "Failed" || phase == "Error")
	})
	run := handoffRun{took: time.Since(start), steps: map[string]stepTimes{}, sent: f.bridgeBytes() - sentBefore}
	if phase != "Succeeded" {
		logs, _ := f.Kubectl("", "logs", "-n", "ci", "-l", "workflows.argoproj.io/workflow="+name, "--all-containers", "--prefix", "--tail=20")
		t.Fatalf("%s: %s\n%s", name, f.MustKubectl("", "get", "workflow", name, "-n", "ci", "-o",
			`jsonpath={.status.message}{"\n"}{range .status.nodes.*}{.displayName}{"\t"}{.phase}{"\t"}{.message}{"\n"}{end}`), logs)
	}
	created := seen()
	for step, pod := range f.argoPods(name) {
		logs := f.MustKubectl("", "logs", "-n", "ci", pod.name, "-c", "main")
		if step == "gather" {
			_, sum, _ := strings.Cut(logs, "sum ")
			run.sum, _, _ = strings.Cut(sum, "\n")
		}
		require.Contains(t, created, pod.name, "the watch saw %s", pod.name)
		run.steps[step] = stepTimes{seen: created[pod.name], firstRead: logStamp(t, logs, step, "first-read"), done: logStamp(t, logs, step, "done")}
	}
	for _, step := range append(handoffSteps, "produce") {
		require.Contains(t, run.steps, step, "%s ran", step)
	}
	require.Len(t, run.sum, 64, "gather's digest")
	if s3 {
		out := f.MustKubectl("", "exec", "-n", "s3", "seaweedfs", "--", "du", "-sk", "/data")
		kib, err := strconv.ParseInt(strings.Fields(out)[0], 10, 64)
		require.NoError(t, err, "du: %q", out)
		run.s3Disk = kib << 10
	}
	t.Logf("%s: %s", name, run)
	f.MustKubectl("", "delete", "workflow", name, "-n", "ci")
	return run
}

// watchPods watches the pods of namespace that selector selects, and
// returns what stops the watch and says when each pod was first seen.
func (f *fleet) watchPods(namespace, selector string) func() map[string]time.Time {
	cmd := exec.Command(f.Bin+"/kubectl", "--kubeconfig", f.Kubeconfig, "get", "pods", "-n", namespace, "-l", selector,
		"--watch", "--no-headers", "-o", "custom-columns=NAME:.metadata.name")
	out, err := cmd.StdoutPipe()
	require.NoError(f.T, err)
	require.NoError(f.T, cmd.Start())
	var mu sync.Mutex
	seen := map[string]time.Time{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		lines := bufio.NewScanner(out)
		for lines.Scan() {
			name, now := strings.TrimSpace(lines.Text()), time.Now()
			mu.Lock()
			if _, ok := seen[name]; !ok && name != "" {
				seen[name] = now
			}
			mu.Unlock()
		}
	}()
	return func() map[string]time.Time {
		_ = cmd.Process.Kill()
		<-done
		_ = cmd.Wait()
		mu.Lock()
		defer mu.Unlock()
		return seen
	}
}

// bridgeBytes is what every node has sent on its link to the lab's bridge.
func (f *fleet) bridgeBytes() int64 {
	var sum int64
	for _, n := range f.Nodes {
		out, err := exec.Command("nsenter", "--net=/run/netns/"+n.Netns, "cat", "/proc/net/dev").Output()
		require.NoError(f.T, err)
		for _, line := range bytes.Split(out, []byte("\n")) {
			name, counters, ok := strings.Cut(strings.TrimSpace(string(line)), ":")
			if !ok || name != "eth0" {
				continue
			}
			fields := strings.Fields(counters)
			tx, err := strconv.ParseInt(fields[8], 10, 64)
			require.NoError(f.T, err)
			sum += tx
		}
	}
	return sum
}

// s3Credentials are the S3 server's one identity's, and Argo's.
const s3AccessKey, s3SecretKey = "cowvol-bench", "cowvol-bench-secret-key"

// installS3 runs SeaweedFS (weed mini: master, volume server, filer and
// S3 gateway in one process) in a pod on node-3, its data on an emptyDir,
// and makes its S3 gateway ci's default artifact repository, as a team
// points Argo at its MinIO. It returns the gateway's address: the
// Service's cluster IP (the fleet has no cluster DNS).
func (f *fleet) installS3(weed string) string {
	t := f.T
	img := ociimage.Image{Name: "cowvol.test/seaweedfs:bench", Cmd: []string{"/bin/weed"}, Env: []string{"PATH=/bin"},
		Files: append(localcluster.BusyboxFiles(t), ociimage.File{Path: "bin/weed", Mode: 0o755, Data: localcluster.MustRead(t, weed)})}
	f.ImportImageInto(f.Nodes[2].Containerd, img)
	config := fmt.Sprintf(`{"identities": [{"name": "argo", "credentials": [{"accessKey": %q, "secretKey": %q}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}`,
		s3AccessKey, s3SecretKey)
	f.MustKubectl("", "create", "namespace", "s3")
	f.MustKubectl("", "create", "secret", "generic", "s3-config", "-n", "s3", "--from-literal=config.json="+config)
	f.MustKubectl(`apiVersion: v1
kind: Pod
metadata: {name: seaweedfs, namespace: s3, labels: {app: seaweedfs}}
spec:
  nodeSelector: {kubernetes.io/hostname: `+f.Nodes[2].Name+`}
  containers:
    - name: weed
      image: cowvol.test/seaweedfs:bench
      imagePullPolicy: Never
      # No telemetry, no web UIs: nothing but the S3 gateway and what it
      # stands on, and nothing that dials out of the lab.
      command: [/bin/weed, mini, -dir=/data, -bucket=argo, -s3.config=/etc/s3/config.json, -master.telemetry=false,
                -webdav=false, -admin.ui=false]
      ports: [{containerPort: 8333}]
      readinessProbe: {tcpSocket: {port: 8333}, periodSeconds: 1}
      volumeMounts: [{name: data, mountPath: /data}, {name: config, mountPath: /etc/s3}]
  volumes:
    - {name: data, emptyDir: {}}
    - {name: config, secret: {secretName: s3-config}}
---
apiVersion: v1
kind: Service
metadata: {name: seaweedfs, namespace: s3}
spec:
  selector: {app: seaweedfs}
  ports: [{port: 8333}]
`, "apply", "-f", "-")
	f.Until("the S3 server to be ready", 3*time.Minute, func() bool {
		out, err := f.Kubectl("", "get", "pod", "seaweedfs", "-n", "s3", "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		return err == nil && out == "True"
	})
	endpoint := f.MustKubectl("", "get", "service", "seaweedfs", "-n", "s3", "-o", "jsonpath={.spec.clusterIP}") + ":8333"
	f.MustKubectl("", "create", "secret", "generic", "s3-credentials", "-n", "ci",
		"--from-literal=accessKey="+s3AccessKey, "--from-literal=secretKey="+s3SecretKey)
	f.MustKubectl(`apiVersion: v1
kind: ConfigMap
metadata:
  name: artifact-repositories
  namespace: ci
  annotations: {workflows.argoproj.io/default-artifact-repository: s3}
data:
  s3: |
    s3:
      bucket: argo
      endpoint: `+endpoint+`
      insecure: true
      accessKeySecret: {name: s3-credentials, key: accessKey}
      secretKeySecret: {name: s3-credentials, key: secretKey}
`, "apply", "-f", "-")
	return endpoint
}

// logStamp is the time a step's log line "label SECONDS.MICROS" says.
func logStamp(t tb.TB, logs, step, label string) time.Time {
	t.Helper()
	_, at, ok := strings.Cut(logs, label+" ")
	require.True(t, ok, "%s logged no %s: %q", step, label, logs)
	at, _, _ = strings.Cut(at, "\n")
	secs, err := strconv.ParseFloat(at, 64)
	require.NoError(t, err, "%s's %s: %q", step, label, at)
	return time.Unix(0, int64(secs*1e9))
}
