//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/examples/scheduler"
	"github.com/concourse/cowvol/pkg/registry"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
	"github.com/concourse/cowvol/test/localcluster"
)

// fleetBuild: a get step on node-1 captures an input (files and a
// program); the Cache API places the next step on node-1, and
// kube-scheduler binds it there; a step pinned to node-3 gets the input
// from node-1 across the bridge, reads the same bytes and runs the
// program from it. Each step's time from bound to started is reported.
func (f *fleet) fleetBuild() {
	t := f.T
	const files = 2000 // of 100 KiB: 200 MiB
	f.createPodWith("ci", "get", fmt.Sprintf(`set -e; cd /out; mkdir -p bin data
		cp /bin/busybox bin/echo; yes cowvol | head -c 102400 > /tmp/block
		for i in $(seq %d); do { echo $i; cat /tmp/block; } > data/f$i; done`, files),
		[]podOpt{onNode("node-1")}, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "res-1")})
	f.mustSucceed("ci", "get")
	f.waitCapturedOn("node-1", "ci", "res-1")
	ctx := context.Background()
	ref := cowvolume.Ref{Namespace: "ci", Handle: "res-1"}
	var first string
	f.Until("the controller to place a step on res-1", 30*time.Second, func() bool {
		nodes, err := f.Cache.Place(ctx, ref)
		if err != nil || len(nodes) == 0 {
			return false
		}
		first = nodes[0].NodeId
		return first == "node-1"
	})
	read := `set -e; cd /in; find data -type f | sort | xargs md5sum | md5sum; ls data | wc -l; ./bin/echo ran-from-the-input`
	input := volume{name: "in", mountPath: "/in", attrs: attrs("source", "res-1"), readOnly: true}
	f.createPodWith("ci", "near", read, []podOpt{preferring(first)}, input)
	near := f.mustSucceed("ci", "near")
	require.Equal(t, "node-1", f.podOn("ci", "near"), "kube-scheduler bound the step where Place ranked first")
	f.createPodWith("ci", "far", read, []podOpt{onNode("node-3")}, input)
	far := f.mustSucceed("ci", "far")
	require.Equal(t, "node-3", f.podOn("ci", "far"))
	require.Equal(t, near, far, "the step on node-3 read node-1's bytes")
	require.Contains(t, far, fmt.Sprintf("\n%d\nran-from-the-input\n", files))
	f.Until("the controller to see res-1 on node-3 too", 30*time.Second, func() bool {
		locs, err := f.Cache.Lookup(ctx, ref)
		return err == nil && len(locs) == 1 && len(locs[0].Nodes) == 2
	})
	nearStart, farStart := f.startedAfterBound("ci", "near"), f.startedAfterBound("ci", "far")
	f.figure("200 MiB input: step placed next to it, bound to started", nearStart)
	f.figure("200 MiB input: step on another node (lazy), bound to started", farStart)
	report(t, fmt.Sprintf("fleet: a step placed by the Cache API next to its %d-file, 200 MiB input started %s after kube-scheduler bound it; "+
		"one pinned to another node got the input from node-1 across the bridge and started %s after it was bound (whole seconds)\n",
		files, nearStart, farStart))
}

// fleetLargeInput: a get on node-1 captures 1 GiB in 50,000 files and a
// program; a step next to it (placed by the Cache API) and a step pinned
// to node-2, which gets the input lazily from node-1, read every byte of
// it alike and run the program from it. Their times from bound to
// started are reported side by side.
func (f *fleet) fleetLargeInput() {
	t := f.T
	const files, size = 50000, 21475 // 1.0 GiB
	f.createPodWith("ci", "big-get", fmt.Sprintf("mktree /out %d %d", files, size),
		[]podOpt{onNode("node-1")}, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "big")})
	f.mustSucceed("ci", "big-get")
	f.waitCapturedOn("node-1", "ci", "big")
	ranked, err := f.Cache.Place(context.Background(), cowvolume.Ref{Namespace: "ci", Handle: "big"})
	require.NoError(t, err)
	require.NotEmpty(t, ranked)
	require.Equal(t, "node-1", ranked[0].NodeId, "Place ranks the holder first")
	read := `set -e; cd /in; ./bin/hello; find data -type f | sort | xargs md5sum | md5sum; find data -type f | wc -l`
	input := volume{name: "in", mountPath: "/in", attrs: attrs("source", "big"), readOnly: true}
	f.createPodWith("ci", "big-near", read, []podOpt{preferring(ranked[0].NodeId)}, input)
	near := f.mustSucceed("ci", "big-near")
	require.Equal(t, "node-1", f.podOn("ci", "big-near"))
	f.createPodWith("ci", "big-far", read, []podOpt{onNode("node-2")}, input)
	far := f.mustSucceed("ci", "big-far")
	require.Equal(t, near, far, "the step on node-2 read node-1's bytes")
	require.True(t, strings.HasPrefix(far, "hello\n") && strings.HasSuffix(far, fmt.Sprintf("\n%d\n", files)), "%q", far)
	// node-3's state dir is btrfs, whose views copy their layers: it
	// pulls eagerly (--pull-mode auto), all of the input before the step
	// starts.
	f.createPodWith("ci", "big-eager", read, []podOpt{onNode("node-3")}, input)
	require.Equal(t, near, f.mustSucceed("ci", "big-eager"), "the step on node-3 read node-1's bytes")
	nearStart, lazyStart, eagerStart := f.startedAfterBound("ci", "big-near"), f.startedAfterBound("ci", "big-far"), f.startedAfterBound("ci", "big-eager")
	report(t, fmt.Sprintf("fleet, 1 GiB in %d files: the step next to its input started %s after it was bound; one on another node "+
		"getting it lazily across the bridge %s, and one getting it eagerly %s (whole seconds); each read every byte alike and ran a program from it\n",
		files, nearStart, lazyStart, eagerStart))
	f.figure("1 GiB input: step on its node, bound to started", nearStart)
	f.figure("1 GiB input: step on another node, lazy pull (XFS), bound to started", lazyStart)
	f.figure("1 GiB input: step on another node, eager pull (btrfs), bound to started", eagerStart)
	for _, pod := range []string{"big-near", "big-far", "big-eager"} {
		f.deletePod("ci", pod)
	}
	// Room for the scenarios that follow.
	_, err = f.Cache.Destroy(context.Background(), cowvolume.Ref{Namespace: "ci", Handle: "big"})
	require.NoError(t, err)
}

// fleetStepImage: a get on node-1 leaves a rootfs-format image in a
// volume; a task on node-3 runs on it, the kubelet pulling it from
// node-3's loopback registry, which brings the volume from node-1. A task
// on node-2 runs on it through the snapshotter (the RuntimeClass cowvol,
// the image's :cowvol tag): node-2's plugin brings the volume from node-1,
// and the container's layer is the volume, its blob never fetched.
func (f *fleet) fleetStepImage() {
	t := f.T
	f.createPodWith("ci", "img-get", rootfsImageScript, []podOpt{onNode("node-1")},
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "fleet-img")})
	f.mustSucceed("ci", "img-get")
	f.waitCapturedOn("node-1", "ci", "fleet-img")
	start := time.Now()
	f.createPodWith("ci", "img-far", rootfsImageTask, []podOpt{onNode("node-3"), withImage(imageRegistry + "/ci/fleet-img:latest")})
	require.Equal(t, rootfsImageSays, f.mustSucceed("ci", "img-far"))
	took := time.Since(start)
	require.Equal(t, "node-3", f.podOn("ci", "img-far"))
	require.Contains(t, f.holders("ci", "fleet-img"), "node-3", "node-3's registry brought the image's volume")

	start = time.Now()
	f.createPodWith("ci", "img-snap", rootfsImageTask, []podOpt{onNode("node-2"),
		withImage(imageRegistry + "/ci/fleet-img:" + registry.RemoteTag), func(spec, _ map[string]any) { spec["runtimeClassName"] = "cowvol" }})
	require.Equal(t, rootfsImageSays, f.mustSucceed("ci", "img-snap"))
	snapTook := time.Since(start)
	require.Contains(t, f.holders("ci", "fleet-img"), "node-2", "node-2's plugin brought the image's volume")
	n2 := f.Node("node-2")
	out, err := exec.Command("ctr", "--address", n2.Containerd, "-n", "k8s.io", "snapshots", "--snapshotter", "cowvol", "ls").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Greater(t, strings.Count(strings.TrimSpace(string(out)), "\n"), 0, "the container runs on the cowvol snapshotter: %s", out)
	f.figure("step image from another node, loopback registry: created to done", took)
	f.figure("step image from another node, snapshotter: created to done", snapTook)
	report(t, fmt.Sprintf("fleet: tasks ran on a step image whose volume was on node-1: on node-3 through its loopback registry, done %s after it was created; "+
		"on node-2 through the snapshotter (the volume is the container's layer), done %s after it was created\n",
		took.Round(100*time.Millisecond), snapTook.Round(100*time.Millisecond)))
}

// schedulerBuild runs a build of seven steps over the fleet with the
// example scheduler (examples/scheduler), as a CI would: three gets pinned
// to the three nodes, a compile placed next to its input, a test whose
// three inputs live on three nodes, a step that fails on its first node
// and is run again on another, and a package; then a CI's GC pins the
// package and destroys the rest.
func (f *fleet) schedulerBuild() {
	t := f.T
	r := f.runner()
	steps := []scheduler.Step{
		{Name: "get-a", Output: "src-a", Node: "node-1", Script: "echo alpha > /out/a"},
		{Name: "get-b", Output: "src-b", Node: "node-2", Script: "echo beta > /out/b"},
		{Name: "get-c", Output: "src-c", Node: "node-3", Script: "echo gamma > /out/c"},
		{Name: "compile", Inputs: []string{"src-a"}, Output: "bin", Script: "tr a-z A-Z < /in/src-a/a > /out/a.bin"},
		{Name: "test", Inputs: []string{"bin", "src-b", "src-c"}, Output: "report",
			Script: "cat /in/bin/a.bin /in/src-b/b /in/src-c/c > /out/report"},
		// Fails on its first attempt (the pod's name ends in -1).
		{Name: "flaky", Inputs: []string{"report"}, Output: "checked",
			Script: `case $(hostname) in *-1) exit 1;; esac; wc -l < /in/report/report > /out/lines`},
		{Name: "package", Inputs: []string{"report", "checked"}, Output: "pkg",
			Script: "cat /in/report/report /in/checked/lines | tee /out/pkg"},
	}
	ctx := context.Background()
	started := time.Now()
	results, err := r.Run(ctx, "b1", steps)
	require.NoError(t, err)
	took := time.Since(started)
	byStep := map[string]scheduler.Result{}
	for _, res := range results {
		byStep[res.Step] = res
	}
	require.Equal(t, "ALPHA\nbeta\ngamma\n3\n", byStep["package"].Log)
	for _, s := range steps {
		res := byStep[s.Name]
		switch {
		case s.Node != "":
			require.Equal(t, s.Node, res.Node, "pinned step %s", s.Name)
		case s.Name != "flaky":
			require.NotEmpty(t, res.Ranked, s.Name)
			require.Equal(t, res.Ranked[0], res.Node, "kube-scheduler bound %s where Place ranked first", s.Name)
		}
	}
	require.Equal(t, "node-1", byStep["compile"].Node, "compile runs next to its input")
	require.Equal(t, 2, byStep["flaky"].Attempts, "the failed step ran again")
	require.NotEqual(t, "", byStep["flaky"].Handle)
	handles := func(names ...string) []string {
		var hs []string
		for _, n := range names {
			hs = append(hs, byStep[n].Handle)
		}
		return hs
	}
	require.NoError(t, r.Pin(ctx, time.Now().Add(time.Hour), handles("package")...))
	gone := handles("get-a", "get-b", "get-c", "compile", "test", "flaky")
	// The failed attempt's output was destroyed already.
	gone = append(gone, strings.TrimSuffix(byStep["flaky"].Handle, "-2")+"-1")
	require.NoError(t, r.Destroy(ctx, gone...))
	f.Until("the destroyed outputs to be gone from every node", time.Minute, func() bool {
		for _, h := range gone {
			locs, err := f.Cache.Lookup(ctx, cowvolume.Ref{Namespace: "ci", Handle: h})
			if err != nil || (len(locs) == 1 && len(locs[0].Nodes) != 0) {
				return false
			}
		}
		return true
	})
	locs, err := f.Cache.Lookup(ctx, cowvolume.Ref{Namespace: "ci", Handle: byStep["package"].Handle})
	require.NoError(t, err)
	require.NotEmpty(t, locs[0].Nodes, "the pinned package stays")
	report(t, fmt.Sprintf("fleet: the example scheduler ran a 7-step build over 3 nodes in %s: each unpinned step bound where Place ranked it first, "+
		"a test read three inputs held on three nodes, a step that failed ran again on another node, and the CI's GC pinned the package and destroyed the rest\n",
		took.Round(100*time.Millisecond)))
}

// runner is the example scheduler, running steps in ci through the
// fleet's API server and the scheduler's client of the Cache API.
func (f *fleet) runner() *scheduler.Runner {
	cfg, err := clientcmd.BuildConfigFromFlags("", f.Kubeconfig)
	require.NoError(f.T, err)
	kube, err := kubernetes.NewForConfig(cfg)
	require.NoError(f.T, err)
	return &scheduler.Runner{Kube: kube, Cache: f.Cache, Namespace: "ci", Image: localcluster.BusyboxImage, ServiceAccount: localcluster.StepsServiceAccount,
		Timeout: 3 * time.Minute, Logf: f.T.Logf}
}

// chainBuild is a build of a get pinned to node and steps each reading
// the last one's output and adding a line to it, slowly enough that
// something can happen to the cluster meanwhile; the last step prints
// what the chain made.
func chainBuild(node string, steps int) ([]scheduler.Step, string) {
	build := []scheduler.Step{{Name: "get", Output: "s0", Node: node, Script: "echo 0 > /out/lines"}}
	want := "0\n"
	for i := 1; i <= steps; i++ {
		build = append(build, scheduler.Step{Name: fmt.Sprintf("s%d", i), Inputs: []string{fmt.Sprintf("s%d", i-1)},
			Output: fmt.Sprintf("s%d", i), Script: fmt.Sprintf("sleep 3; cat /in/s%d/lines > /out/lines; echo %d >> /out/lines", i-1, i)})
		want += fmt.Sprintf("%d\n", i)
	}
	build = append(build, scheduler.Step{Name: "show", Inputs: []string{fmt.Sprintf("s%d", steps)}, Script: fmt.Sprintf("cat /in/s%d/lines", steps)})
	return build, want
}

// buildInBackground runs a build with the example scheduler while the
// caller does something to the cluster; wait returns how it ended.
func (f *fleet) buildInBackground(name string, steps []scheduler.Step) (wait func() ([]scheduler.Result, error)) {
	r := f.runner()
	type ended struct {
		results []scheduler.Result
		err     error
	}
	done := make(chan ended, 1)
	go func() {
		res, err := r.Run(context.Background(), name, steps)
		done <- ended{res, err}
	}()
	return func() ([]scheduler.Result, error) {
		select {
		case e := <-done:
			return e.results, e.err
		case <-time.After(10 * time.Minute):
			f.T.Fatalf("build %s did not end in 10 minutes", name)
			return nil, nil
		}
	}
}

// viewComplete says whether the controller the scheduler reaches knows
// every node running and each of want's volumes on the nodes given.
func (f *fleet) viewComplete(want map[cowvolume.Ref][]string) bool {
	nodes, err := f.Cache.Nodes(context.Background())
	if err != nil || len(nodes) != len(f.Nodes) {
		return false
	}
	for _, n := range nodes {
		if n.State != "running" {
			return false
		}
	}
	for ref, holders := range want {
		if !slices.Equal(f.holders(ref.Namespace, ref.Handle), holders) {
			return false
		}
	}
	return true
}

// heldNow is where the controller says each of refs is held now.
func (f *fleet) heldNow(refs ...cowvolume.Ref) map[cowvolume.Ref][]string {
	held := map[cowvolume.Ref][]string{}
	for _, ref := range refs {
		nodes := f.holders(ref.Namespace, ref.Handle)
		require.NotEmpty(f.T, nodes, "%s is held somewhere", ref)
		held[ref] = nodes
	}
	return held
}

// fleetFailover: the controller's leading replica's pod is deleted while
// a build runs. The other replica leads; its view (every node running,
// the volumes where they are) is complete within seconds; the
// scheduler's client, through DialKube, follows it; the build ends with
// the right outputs.
func (f *fleet) fleetFailover() {
	t := f.T
	steps, want := chainBuild("node-2", 4)
	wait := f.buildInBackground("fo", steps)
	f.waitCapturedOn("node-2", "ci", "fo-get-s0-1")
	known := f.heldNow(cowvolume.Ref{Namespace: "ci", Handle: "res-1"}, cowvolume.Ref{Namespace: "ci", Handle: "fo-get-s0-1"})
	old := f.Leader()
	require.NotEmpty(t, old)
	deleted := time.Now()
	f.MustKubectl("", "delete", "pod", "-n", "cowvol", old, "--wait=false")
	var led time.Duration
	f.Until("another replica to lead", time.Minute, func() bool {
		now := f.Leader()
		led = time.Since(deleted)
		return now != "" && now != old
	})
	f.Until("the new leader's view to be complete", time.Minute, func() bool { return f.viewComplete(known) })
	complete := time.Since(deleted)
	results, err := wait()
	require.NoError(t, err, "no step is lost to the leader's move")
	last := results[len(results)-1]
	require.Equal(t, want, last.Log)
	for _, r := range results {
		require.Equal(t, 1, r.Attempts, "step %s ran once", r.Step)
	}
	f.figure("controller failover: leader pod deleted to another replica leading", led)
	f.figure("controller failover: leader pod deleted to a complete view", complete)
	report(t, fmt.Sprintf("fleet: the controller's leader deleted mid-build: another replica led after %s and its view was complete (3 nodes running, the volumes where they were) %s after the delete; "+
		"the scheduler's client followed it and the %d-step build ended right, each step run once\n",
		led.Round(100*time.Millisecond), complete.Round(100*time.Millisecond), len(steps)))
}

// fleetUpgrade: helm upgrade to a new image while a build runs: the
// DaemonSet rolls node by node and the controller's replicas roll (its
// leader moves), and no step fails.
func (f *fleet) fleetUpgrade() {
	t := f.T
	// The new image: this one under another tag, in every node's runtime.
	for _, n := range f.Nodes {
		localcluster.Run(t, "ctr", "--address", n.Containerd, "-n", "k8s.io", "images", "tag", "--force", localcluster.PluginImage, "cowvol.test/cowvol-plugin:e2e-next")
	}
	steps, want := chainBuild("node-3", 6)
	wait := f.buildInBackground("up", steps)
	f.waitCapturedOn("node-3", "ci", "up-get-s0-1")
	helm := os.Getenv("COWVOL_E2E_HELM_BINARY")
	f.HelmValues["image"] = map[string]any{"repository": "cowvol.test/cowvol-plugin", "tag": "e2e-next"}
	start := time.Now()
	f.Helm(helm, "upgrade", "cowvol", "../../deploy/helm/cowvol", "--namespace", "cowvol")
	f.WaitFleetInstalled("e2e-next")
	rolled := time.Since(start)
	results, err := wait()
	require.NoError(t, err, "no step fails while cowvol rolls")
	require.Equal(t, want, results[len(results)-1].Log)
	for _, r := range results {
		require.Equal(t, 1, r.Attempts, "step %s ran once", r.Step)
	}
	f.figure("helm upgrade: 3 nodes' plugins and 2 controller replicas rolled", rolled)
	report(t, fmt.Sprintf("fleet: helm upgrade to a new image rolled 3 nodes' plugins and the controller's 2 replicas in %s during a %d-step build; no step failed or ran twice\n",
		rolled.Round(100*time.Millisecond), len(steps)))
}

// nodeState is the state the controller gives node ("" if it knows no
// such node, or cannot be asked).
func (f *fleet) nodeState(node string) string {
	st, _ := f.nodeStatus(node)
	return st
}

// nodeStatus is the state the controller gives node and the store it
// reports.
func (f *fleet) nodeStatus(node string) (state, store string) {
	nodes, err := f.Cache.Nodes(context.Background())
	if err != nil {
		return "", ""
	}
	for _, n := range nodes {
		if n.NodeId == node {
			return n.State, n.StoreId
		}
	}
	return "", ""
}

// holders lists the nodes the controller says hold ns/handle ready.
func (f *fleet) holders(ns, handle string) []string {
	locs, err := f.Cache.Lookup(context.Background(), cowvolume.Ref{Namespace: ns, Handle: handle})
	if err != nil || len(locs) != 1 {
		return nil
	}
	nodes := append([]string(nil), locs[0].Nodes...)
	slices.Sort(nodes)
	return nodes
}

// fleetNodeDeath: a node dies (every process of it at once, its link
// down) while a step on another node lazily reads an input only it
// holds. The read fails with EIO and the step fails, without hanging;
// the controller marks the node stalled; the scheduler's loop runs the
// step again on another node, which gets the input once the node is back
// with its store, and the build ends with the right output. Killed again
// and back with its store wiped, the node's old volumes are forgotten.
func (f *fleet) fleetNodeDeath() {
	t := f.T
	sum := "find data -type f | sort | xargs md5sum | md5sum"
	// 40 MiB the stream cannot compress, on node-1, which dies.
	f.createPodWith("ci", "nd-src", "set -e; mktree /out 2000 20480; cd /out; "+sum,
		[]podOpt{onNode("node-1")}, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "nd-src")})
	srcSum := f.mustSucceed("ci", "nd-src")
	// More input bytes on node-2 (XFS: its pulls are lazy) than anywhere:
	// Place ranks it first for a step reading both.
	f.createPodWith("ci", "nd-local", "head -c 67108864 /dev/urandom > /out/blob; md5sum < /out/blob",
		[]podOpt{onNode("node-2")}, volume{name: "out", mountPath: "/out", attrs: attrs("capture", "nd-local")})
	blobSum := f.mustSucceed("ci", "nd-local")
	f.waitCapturedOn("node-1", "ci", "nd-src")
	f.waitCapturedOn("node-2", "ci", "nd-local")
	victim, reader := f.Node("node-1"), f.Node("node-2")
	// node-2's link slow: the lazy pull of 40 MiB takes about 40 s there,
	// and node-1 dies mid-way.
	reader.Host.Throttle("8mbit")
	defer reader.Host.Unthrottle()
	_, store := f.nodeStatus(victim.Name)
	wait := f.buildInBackground("nd", []scheduler.Step{{Name: "read", Inputs: []string{"nd-src", "nd-local"},
		Script: "set -eo pipefail; cd /in/nd-src; " + sum + "; md5sum < /in/nd-local/blob"}})
	f.Until("the step to read its input lazily on "+reader.Name, 2*time.Minute, func() bool {
		return f.phase("ci", "nd-read-1") == "Running"
	})
	require.Equal(t, reader.Name, f.podOn("ci", "nd-read-1"), "Place ranked the node with the most input bytes first")
	time.Sleep(3 * time.Second) // a few files in
	killed := time.Now()
	f.Kill(victim)
	var endedAfter, stalledAfter time.Duration
	f.Until("the step reading from the dead node to end", 3*time.Minute, func() bool {
		endedAfter = time.Since(killed)
		return f.phase("ci", "nd-read-1") != "Running"
	})
	f.Until("the controller to mark "+victim.Name+" stalled", 2*time.Minute, func() bool {
		stalledAfter = time.Since(killed)
		return f.nodeState(victim.Name) == "stalled"
	})
	require.Empty(t, f.holders("ci", "nd-src"), "a stalled node's volumes are not offered")

	// Back with its store: it serves its volumes again, and the step's
	// second attempt, away from node-2, gets its input from it.
	f.Revive(victim, false)
	f.Until(victim.Name+" back, serving its volumes", 2*time.Minute, func() bool {
		st, s := f.nodeStatus(victim.Name)
		return st == "running" && s == store && slices.Contains(f.holders("ci", "nd-src"), victim.Name)
	})
	results, err := wait()
	require.NoError(t, err, "the build ends")
	res := results[0]
	require.Equal(t, 2, res.Attempts, "the step ran again")
	require.Len(t, res.Failures, 1)
	require.Equal(t, reader.Name, res.Failures[0].Node)
	require.Contains(t, res.Failures[0].Log, "Input/output error", "the read of what the dead node did not send fails with EIO")
	require.NotEqual(t, reader.Name, res.Node, "the step ran again on another node")
	require.Equal(t, srcSum+blobSum, res.Log, "the step read the right bytes")

	// Back with its store wiped: its old volumes are forgotten.
	f.Kill(victim)
	f.Revive(victim, true)
	f.Until(victim.Name+" back with a new store, its old volumes forgotten", 2*time.Minute, func() bool {
		st, s := f.nodeStatus(victim.Name)
		return st == "running" && s != store && !slices.Contains(f.holders("ci", "nd-src"), victim.Name)
	})
	if res.Node != victim.Name {
		require.Contains(t, f.holders("ci", "nd-src"), res.Node, "the copy the second attempt pulled stays")
	}
	rebooted := time.Now()
	f.Until(victim.Name+"'s plugin to be registered with its kubelet again", 5*time.Minute, func() bool {
		pods, err := f.Kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-node", "--field-selector", "spec.nodeName="+victim.Name,
			"-o", "jsonpath={.items[*].status.containerStatuses[*].ready}")
		if err != nil || pods != "true true" {
			return false
		}
		ready, err := f.Kubectl("", "get", "csinode", victim.Name, "-o", "jsonpath={.spec.drivers[*].name}")
		return err == nil && strings.Contains(ready, localcluster.DriverName)
	})
	t.Logf("%s's plugin was registered again %s after it came back with a wiped store", victim.Name, time.Since(rebooted).Round(time.Second))
	f.figure("node killed: to the step reading from it failing", endedAfter)
	f.figure("node killed: to the controller marking it stalled", stalledAfter)
	report(t, fmt.Sprintf("fleet: %s killed (every process, link down) while a step on %s lazily read a 40 MiB input only it held: "+
		"the step failed with EIO %s after the kill, the controller marked %s stalled after %s; back with its store it served again and the step's "+
		"second attempt (on %s) read the right bytes; back with a wiped store its old volumes were forgotten\n",
		victim.Name, reader.Name, endedAfter.Round(time.Second), victim.Name, stalledAfter.Round(time.Second), res.Node))
}

// fleetDrain: a node drained during a build takes no new step, and a
// volume only it holds stays pullable while it lands; uncordoned, it is
// back in service.
func (f *fleet) fleetDrain() {
	t := f.T
	ctx := context.Background()
	f.createPodWith("ci", "before-drain", "echo held-by-node-1 > /out/f", []podOpt{onNode("node-1")},
		volume{name: "out", mountPath: "/out", attrs: attrs("capture", "drain-src")})
	f.mustSucceed("ci", "before-drain")
	f.waitCapturedOn("node-1", "ci", "drain-src")
	f.MustKubectl("", "drain", "node-1", "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=90s")
	f.Until("the controller to take node-1 out of service", 30*time.Second, func() bool {
		s := f.nodeState("node-1")
		return s == "landing" || s == "landed"
	})
	ref := cowvolume.Ref{Namespace: "ci", Handle: "drain-src"}
	// The drain may have taken the controller's leader with it: a new
	// one answers once the nodes have reported to it.
	var placed []*controllerv1.NodePlacement
	f.Until("the controller to place a step", time.Minute, func() bool {
		var err error
		placed, err = f.Cache.Place(ctx, ref)
		return err == nil
	})
	for _, p := range placed {
		require.NotEqual(t, "node-1", p.NodeId, "a step placed on a drained node")
	}
	read := volume{name: "in", mountPath: "/in", attrs: attrs("source", "drain-src"), readOnly: true}
	f.createPodWith("ci", "during-drain", "cat /in/f", []podOpt{preferring("node-1")}, read)
	require.Equal(t, "held-by-node-1\n", f.mustSucceed("ci", "during-drain"), "the draining node's volume is pulled")
	require.NotEqual(t, "node-1", f.podOn("ci", "during-drain"))
	f.MustKubectl("", "uncordon", "node-1")
	f.Until("the controller to put node-1 back in service", 30*time.Second, func() bool { return f.nodeState("node-1") == "running" })
	f.createPodWith("ci", "after-drain", "cat /in/f", []podOpt{preferring("node-1")}, read)
	require.Equal(t, "held-by-node-1\n", f.mustSucceed("ci", "after-drain"))
	require.Equal(t, "node-1", f.podOn("ci", "after-drain"))
	report(t, "fleet: a node drained during a build took no step, its volume was pulled from it while it landed, and uncordoned it was placed on again\n")
}

// fleetTenancy: another namespace's pod on any node, naming ci's private
// volume (as its own, or as ci's with sourceNamespace), is answered as it
// is for a volume that does not exist, and never reads it.
func (f *fleet) fleetTenancy() {
	t := f.T
	for _, node := range []string{"node-1", "node-2", "node-3"} {
		for name, a := range map[string]map[string]string{
			"own":     attrs("source", "drain-src"),
			"as-ci":   attrs("source", "drain-src", "sourceNamespace", "ci"),
			"missing": attrs("source", "no-such-volume", "sourceNamespace", "ci"),
		} {
			pod := "steal-" + name + "-" + node
			f.createPodWith("other", pod, "cat /in/f", []podOpt{onNode(node)}, volume{name: "in", mountPath: "/in", attrs: a, readOnly: true})
		}
	}
	for _, node := range []string{"node-1", "node-2", "node-3"} {
		var said []string
		for _, name := range []string{"own", "as-ci", "missing"} {
			pod := "steal-" + name + "-" + node
			var msg string
			f.Until("the publish of "+pod+" to be refused", time.Minute, func() bool {
				for _, line := range strings.Split(f.events("other", pod), "\n") {
					if strings.HasPrefix(line, "FailedMount: ") {
						msg = line
						return true
					}
				}
				return false
			})
			require.Equal(t, "Pending", f.phase("other", pod), pod)
			said = append(said, strings.ReplaceAll(strings.ReplaceAll(msg, "no-such-volume", "drain-src"), pod, "POD"))
		}
		require.Contains(t, said[0], "not found", node)
		require.Equal(t, said[2], said[1], "on %s, ci's volume is told from a missing one", node)
	}
	report(t, "fleet: another namespace's pods on every node naming ci's private volume, as their own or as ci's, were answered as for a volume that does not exist\n")
}

// fleetLocality: in a namespace that opts in to the locality webhook, a
// step pod that names its input and nothing of where to run (as a CI
// engine that knows nothing of cowvol creates it) gets a preference for
// the node holding the input from the controller, and kube-scheduler binds
// it there, for an input on each of two nodes. With the webhook out of
// reach, a pod is still created, unplaced.
func (f *fleet) fleetLocality() {
	t := f.T
	defer f.optInToLocality("ci")()
	preferredNode := func(name string) string { return f.preferredNodes("ci", name) }
	read := `set -e; cat /in/where`
	for _, node := range []string{"node-2", "node-3"} {
		get, step, handle := "loc-get-"+node, "loc-step-"+node, "loc-"+node
		f.createPodWith("ci", get, "echo "+node+" > /out/where", []podOpt{onNode(node)},
			volume{name: "out", mountPath: "/out", attrs: attrs("capture", handle)})
		f.mustSucceed("ci", get)
		require.Empty(t, preferredNode(get), "a pod bound to its node is left as it is")
		f.waitCapturedOn(node, "ci", handle)
		f.createPodWith("ci", step, read, []podOpt{unbound()},
			volume{name: "in", mountPath: "/in", attrs: attrs("source", handle), readOnly: true})
		require.Equal(t, node+"\n", f.mustSucceed("ci", step))
		require.Equal(t, node, preferredNode(step), "the webhook preferred the input's holder")
		require.Equal(t, node, f.podOn("ci", step), "kube-scheduler bound the step next to its input")
	}

	// Out of reach (a port the Service does not have): the pod is created
	// all the same, with no preference.
	f.MustKubectl("", "patch", "mutatingwebhookconfiguration", "cowvol-locality", "--type=json",
		"-p", `[{"op":"replace","path":"/webhooks/0/clientConfig/service/port","value":444}]`)
	defer f.MustKubectl("", "patch", "mutatingwebhookconfiguration", "cowvol-locality", "--type=json",
		"-p", `[{"op":"replace","path":"/webhooks/0/clientConfig/service/port","value":443}]`)
	f.createPodWith("ci", "loc-unplaced", read, []podOpt{unbound()},
		volume{name: "in", mountPath: "/in", attrs: attrs("source", "loc-node-2"), readOnly: true})
	require.Equal(t, "node-2\n", f.mustSucceed("ci", "loc-unplaced"))
	require.Empty(t, preferredNode("loc-unplaced"))
}

// optInToLocality labels namespace ns for the locality webhook, and
// returns what takes the label off.
func (f *fleet) optInToLocality(ns string) func() {
	const label = "cowvol.concourse-ci.org/locality"
	f.MustKubectl("", "label", "namespace", ns, label+"=enabled")
	return func() { f.MustKubectl("", "label", "namespace", ns, label+"-") }
}

// preferredNodes are the nodes a pod prefers by name (the terms the
// locality webhook adds), space-separated.
func (f *fleet) preferredNodes(ns, pod string) string {
	return f.MustKubectl("", "get", "pod", "-n", ns, pod, "-o",
		"jsonpath={.spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[*].preference.matchFields[0].values[0]}")
}

// fleetCaches runs three builds of a job, each on another node, with a
// cache: the first starts empty, the second (warm, on a node that never
// held the key) fails and leaves the cache as it was, the third (warm on a
// third node) forks the first's version and succeeds. A fourth, which no
// scheduler of ours placed, lands where the newest version is. The
// controller lists the key, and clearing it reaches every node.
func (f *fleet) fleetCaches() {
	t := f.T
	const key = "job/deps"
	cached := volume{name: "c", mountPath: "/c", attrs: attrs("cache", key)}
	ended := func(pod, event string) {
		f.Until(pod+"'s "+event, time.Minute, func() bool {
			return strings.Contains(f.events("ci", pod), event+`: Cache "`+key+`"`)
		})
	}
	newest := func(pod string) *controllerv1.CacheLocation {
		var loc *controllerv1.CacheLocation
		f.Until("the controller to list "+pod+"'s version of "+key, time.Minute, func() bool {
			locs, err := f.Cache.Caches(context.Background(), "ci", key)
			if err != nil || len(locs) != 1 {
				return false
			}
			loc = locs[0]
			return loc.GetFound() && loc.GetPromotedBy() == pod
		})
		return loc
	}
	start := time.Now()
	f.createPodWith("ci", "cache-build-1", `set -e; test -z "$(ls -A /c)"; echo 1 > /c/gen; echo started-empty`, []podOpt{onNode("node-1")}, cached)
	require.Equal(t, "started-empty\n", f.mustSucceed("ci", "cache-build-1"))
	ended("cache-build-1", "CachePromoted")
	first := newest("cache-build-1")
	require.Equal(t, []string{"node-1"}, first.GetVersion().GetNodes())

	f.createPodWith("ci", "cache-build-2", `test "$(cat /c/gen)" = 1 && echo broken > /c/gen; exit 3`, []podOpt{onNode("node-2")}, cached)
	phase, _ := f.waitDone("ci", "cache-build-2")
	require.Equal(t, "Failed", phase)
	ended("cache-build-2", "CacheDiscarded")

	f.createPodWith("ci", "cache-build-3", `set -e; test "$(cat /c/gen)" = 1; echo 3 > /c/gen; echo forked-the-last-good-one`,
		[]podOpt{onNode("node-3")}, cached)
	require.Equal(t, "forked-the-last-good-one\n", f.mustSucceed("ci", "cache-build-3"))
	ended("cache-build-3", "CachePromoted")
	third := newest("cache-build-3")
	require.Contains(t, third.GetVersion().GetNodes(), "node-3")
	require.NotEqual(t, first.GetVersion().GetRef().GetHandle(), third.GetVersion().GetRef().GetHandle())
	builds := time.Since(start)

	restore := f.optInToLocality("ci")
	f.createPodWith("ci", "cache-build-4", `set -e; test "$(cat /c/gen)" = 3; echo warm`, []podOpt{unbound()},
		volume{name: "c", mountPath: "/c", attrs: attrs("cache", key), readOnly: true})
	require.Equal(t, "warm\n", f.mustSucceed("ci", "cache-build-4"))
	restore()
	require.Equal(t, "node-3", f.preferredNodes("ci", "cache-build-4"), "the webhook preferred the newest version's holder")
	require.Equal(t, "node-3", f.podOn("ci", "cache-build-4"))

	cleared, err := f.Cache.ClearCaches(context.Background(), "ci", key)
	require.NoError(t, err)
	require.Len(t, cleared, 1)
	f.createPodWith("ci", "cache-after-clear", `test -z "$(ls -A /c)" && echo empty`, []podOpt{onNode("node-1")}, cached)
	f.Until("node-1 to clear "+key, time.Minute, func() bool {
		// A step published before node-1's next heartbeat may still
		// fork its version: run it again until it starts empty.
		phase, out := f.waitDone("ci", "cache-after-clear")
		if phase == "Succeeded" && out == "empty\n" {
			return true
		}
		f.MustKubectl("", "delete", "pod", "-n", "ci", "cache-after-clear", "--wait")
		f.createPodWith("ci", "cache-after-clear", `test -z "$(ls -A /c)" && echo empty`, []podOpt{onNode("node-1")}, cached)
		return false
	})
	report(t, fmt.Sprintf("fleet: a cache's three builds on three nodes took %s: the second and third found the first's version "+
		"(pulled from the node that made it), the second failed and left it as it was, a pod no scheduler of ours placed "+
		"landed where the newest version is, and a clear reached every node\n", builds.Round(time.Second)))
}
