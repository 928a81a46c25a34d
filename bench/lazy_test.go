package bench

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

// BenchmarkLazyPull: node B lacks a volume node A holds (50,000 files of
// 100 MiB, then 1 GiB; hosts of their own joined by veths, mutual TLS). It
// reports how long B's publish takes lazily and eagerly (at 4 GiB too, to
// show the lazy one flat in the size), and how long a
// step takes to be done that reads 5% of the files or all of them, lazily,
// eagerly (publish + read) and on A itself; and a step that runs a program
// from the volume. Lazily three times: as a first pull, with B having
// recorded the step's read order before, and on a B that never ran the
// step, with the order another B recorded and shared through the
// controller (TLS, on the lab's network). Each case runs on a fresh B (a
// new state dir on one filesystem, allocated and warmed as BenchmarkPull's
// is), its page cache dropped. The figures the targets name (reading all
// of 1 GiB lazily, with and without a recorded order, against eagerly and
// against a raw TCP copy of the tree into a plain dir on B, tar | tar over
// the same veths, followed by the same read; and lazily with B's
// fanotify group kept by a fill keeper, as deployed) are then taken lazyRounds
// more times, with A's copy in the page cache (B's dropped), taking
// turns, and reported as the
// median of the rounds' ratios, each round's shown: one sample of each
// drifts by a fifth, and a round's share the load of its seconds.
func BenchmarkLazyPull(b *testing.B) {
	lab := netlab.New(b)
	hostA, hostB := lab.Host("a"), lab.Host("b")
	tlsArgs := peerTLS(b)
	peerA := net.JoinHostPort(hostA.IP, "7443")
	// The nodes of the fleet's case find holders and share read orders
	// through the controller.
	ctl := startController(b, lab)
	fleetArgs := ctl.nodeArgs
	prog, err := exec.LookPath("true")
	if err != nil {
		b.Fatal(err)
	}
	for range b.N {
		stateA, diskB := testfs.Mount(b, testfs.XFS, 8<<30), testfs.MountAllocated(b, testfs.XFS, 6<<30)
		warmed := false
		bns := 0 // B nodes started
		a := &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: "a", StateDir: stateA,
			Wrap: hostA.Command, Args: append(append([]string{"--peer-address=" + peerA}, tlsArgs...), fleetArgs...)})}
		var sb strings.Builder
		fmt.Fprintf(&sb, "\n%-46s %12s %12s %12s %12s\n", "a step on a node without its input", "publish", "read 5%", "read all", "run a program")
		// COWVOL_LAZY_ROUNDS_ONLY: only the targets' rounds, at 1 GiB in
		// treeFiles, or in the shape COWVOL_LAZY_ROUNDS_SHAPE says
		// (MiB/files: issue 51 states its target against an eager pull
		// at 1536/30000).
		roundsOnly := os.Getenv("COWVOL_LAZY_ROUNDS_ONLY") != ""
		roundsSize, files := int64(1<<30), treeFiles
		sizes := []int64{100 << 20, roundsSize, 4 << 30}
		if roundsOnly {
			if shape := os.Getenv("COWVOL_LAZY_ROUNDS_SHAPE"); shape != "" {
				roundsSize, files = roundsShape(b, shape)
			}
			sizes = []int64{roundsSize}
		}
		for _, size := range sizes {
			// At 4 GiB only the publishes: the reads would say what 1 GiB's do.
			publishOnly := size > roundsSize
			handle := fmt.Sprintf("tree-%d", size>>20)
			a.capture("", handle, func(dir string) {
				genMixedTree(b, dir, files, size)
				copyFile(b, prog, filepath.Join(dir, "bin", "true"))
			})
			a.settle()
			if !warmed {
				warmDisk(b, layerDir(b, stateA, handle), diskB)
				warmed = true
			}
			// warm: a timed pull finds A's copy in the page cache, as a
			// holder finds an output it just captured and as
			// BenchmarkPull's raw TCP copy reads it (the rounds); else
			// cold (the table).
			warm := false
			warmA := func() {
				if warm {
					readEvery(b, 1)(layerDir(b, stateA, handle))
				}
			}
			// step times a step that publishes and then reads (nil: only
			// publishes), on a node it leaves as it found it.
			step := func(publish publishFunc, read func(dir string)) time.Duration {
				dropCaches(b)
				v, n, took := publish(read)
				if read != nil {
					start := time.Now()
					read(v.Target)
					took += time.Since(start)
				}
				n.timed(n.p.Unpublish, v)
				if n != a {
					n.discard()
				}
				return took
			}
			row := func(what string, publish publishFunc) {
				reads := []func(dir string){nil, readEvery(b, 20), readEvery(b, 1), runTrue(b)}
				if publishOnly {
					reads = reads[:1]
				}
				cols := []string{"-", "-", "-", "-"}
				key := strings.Join(strings.Fields(strings.Split(what, " (")[0]), "-")
				metrics := []string{"publish", "read-5pct", "read-all", "run"}
				for i, read := range reads {
					took := step(publish, read)
					cols[i] = ms(took)
					b.ReportMetric(float64(took.Milliseconds()), fmt.Sprintf("%s-%dMiB-%s-ms", strings.ReplaceAll(key, ",", ""), size>>20, metrics[i]))
				}
				fmt.Fprintf(&sb, "%-46s %12s %12s %12s %12s\n", fmt.Sprintf("%s, %d MiB", what, size>>20), cols[0], cols[1], cols[2], cols[3])
			}
			// pullOn pulls on a fresh B; profiled, B has recorded the
			// step's read order under its read profile first (a pull as
			// lazy as the timed one, read as it is, then destroyed);
			// kept, B's fanotify group is kept by a fill keeper of its
			// own, as the chart deploys every node (its readers' events
			// reach the plugin through the keeper, and its answers go
			// back the same way).
			pullOn := func(mode string, profiled, kept bool) publishFunc {
				return func(read func(dir string)) (kubeletsim.InlineVolume, *node, time.Duration) {
					bns++
					args := append([]string{"--peers=a=" + peerA, "--pull-mode=" + mode, "--pull-wait=30m"}, tlsArgs...)
					if kept {
						args = append(args, "--fill-keeper-socket="+startFillKeeper(b, filepath.Join(diskB, fmt.Sprintf("keeper%d", bns))))
					}
					bn := &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: "b",
						StateDir: filepath.Join(diskB, fmt.Sprintf("b%d", bns)), Wrap: hostB.Command, Args: args})}
					attrs := map[string]string{driver.AttrSource: handle}
					if profiled {
						attrs[driver.AttrReadProfile] = "bench/" + handle
						if read != nil {
							bn.recordReadOrder(attrs, read)
						}
					}
					warmA()
					v := bn.volume(attrs, true)
					return v, bn, bn.timed(bn.p.Publish, v)
				}
			}
			// fleetOn pulls lazily on a fresh B that never ran the step:
			// another B recorded its read order and shared it through the
			// controller, then went.
			fleetOn := func(read func(dir string)) (kubeletsim.InlineVolume, *node, time.Duration) {
				start := func() *node {
					bns++
					return &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: fmt.Sprintf("b%d", bns),
						StateDir: filepath.Join(diskB, fmt.Sprintf("b%d", bns)), Wrap: hostB.Command,
						Args: append(append([]string{"--pull-mode=lazy", "--pull-wait=30m"}, tlsArgs...), fleetArgs...)})}
				}
				attrs := map[string]string{driver.AttrSource: handle, driver.AttrReadProfile: "fleet/" + handle}
				if read != nil {
					recorder := start()
					shared := strings.Count(ctl.p.Log(), "A node shared a read order")
					recorder.recordReadOrder(attrs, read)
					for deadline := time.Now().Add(time.Minute); strings.Count(ctl.p.Log(), "A node shared a read order") == shared; {
						if time.Now().After(deadline) {
							b.Fatal("the recording node did not share its read order in a minute")
						}
						time.Sleep(50 * time.Millisecond)
					}
					recorder.discard()
				}
				bn := start()
				v := bn.volume(attrs, true)
				return v, bn, bn.timed(bn.p.Publish, v)
			}
			if !roundsOnly {
				row("lazy pull", pullOn("lazy", false, false))
				if !publishOnly {
					row("lazy pull, read order recorded", pullOn("lazy", true, false))
					row("lazy pull, order recorded on another node", fleetOn)
				}
				row("eager pull", pullOn("eager", false, false))
				if !publishOnly {
					row("local (on A)", func(func(string)) (kubeletsim.InlineVolume, *node, time.Duration) {
						v := a.volume(map[string]string{driver.AttrSource: handle}, true)
						return v, a, a.timed(a.p.Publish, v)
					})
				}
			}
			if size != roundsSize {
				continue
			}
			// The targets: reading all of 1 GiB (or the rounds' shape)
			// lazily at most 1.2x an eager pull, 1.1x with a recorded
			// order (issue 51: 1.1x without one, at 1.5 GiB in 30,000
			// files); from the publish to
			// the last byte read, lazily at most 0.75x a raw TCP copy of
			// the tree into a plain dir on B followed by the same read.
			// Each round runs the four in turn, starting with another,
			// each finding A's copy warm.
			warm = true
			readAll := readEvery(b, 1)
			rawCopies := 0
			kinds := []struct {
				key string
				run func() time.Duration
			}{
				{"lazy", func() time.Duration { return step(pullOn("lazy", false, false), readAll) }},
				{"lazy-kept", func() time.Duration { return step(pullOn("lazy", false, true), readAll) }},
				{"lazy-recorded", func() time.Duration { return step(pullOn("lazy", true, false), readAll) }},
				{"eager", func() time.Duration { return step(pullOn("eager", false, false), readAll) }},
				{"raw-tcp", func() time.Duration {
					rawCopies++
					dir := filepath.Join(diskB, fmt.Sprintf("raw%d", rawCopies))
					if err := os.Mkdir(dir, 0o755); err != nil {
						b.Fatal(err)
					}
					// Warm as the pulls' A is: tar reads a file at a
					// time, and from a cold cache each waits on the disk
					// (a 16.7 s copy against an eager pull's 9.2 s,
					// which reads ahead).
					dropCaches(b)
					warmA()
					took := vethStream(b, hostB, "tar -C "+layerDir(b, stateA, handle)+" -cf - .", "tar -C "+dir+" -xf -")
					start := time.Now()
					readAll(dir)
					took += time.Since(start)
					dropTree(b, dir)
					return took
				}},
			}
			took := map[string][]time.Duration{}
			for round := range lazyRounds {
				for i := range kinds {
					k := kinds[(i+round)%len(kinds)]
					took[k.key] = append(took[k.key], k.run())
				}
			}
			fmt.Fprintf(&sb, "reading all of %d MiB in %d files, %d rounds taking turns: p50 lazy %s, with a fill keeper %s, recorded %s, eager %s, raw TCP copy then read %s\n",
				size>>20, files, lazyRounds, ms(p50(took["lazy"])), ms(p50(took["lazy-kept"])), ms(p50(took["lazy-recorded"])), ms(p50(took["eager"])), ms(p50(took["raw-tcp"])))
			// A round's five run within seconds of each other, under the
			// same load: its ratio is the figure, and the median of the
			// rounds' ratios the target's. The ratio of the medians, which
			// may pair a round's slow lazy pull with another's fast eager
			// one, is shown beside it.
			for _, c := range []struct{ k, vs string }{{"lazy", "eager"}, {"lazy-kept", "eager"}, {"lazy-kept", "lazy"}, {"lazy-recorded", "eager"}, {"lazy", "raw-tcp"}, {"eager", "raw-tcp"}} {
				var rounds []string
				ratios := make([]float64, lazyRounds)
				for i := range lazyRounds {
					ratios[i] = float64(took[c.k][i]) / float64(took[c.vs][i])
					rounds = append(rounds, fmt.Sprintf("%.2fx", ratios[i]))
				}
				r := p50(ratios)
				fmt.Fprintf(&sb, "  %s: %.2fx %s, the rounds' median (rounds %s; ratio of the medians %.2fx)\n", c.k, r, c.vs,
					strings.Join(rounds, " / "), float64(p50(took[c.k]))/float64(p50(took[c.vs])))
				b.ReportMetric(r, c.k+"-vs-"+c.vs+"-read-all-p50")
			}
			for _, k := range []string{"lazy", "lazy-kept", "lazy-recorded", "raw-tcp"} {
				b.ReportMetric(float64(p50(took[k]).Milliseconds()), fmt.Sprintf("%s-%dMiB-read-all-p50-ms", k, size>>20))
			}
			b.ReportMetric(float64(p50(took["eager"]).Milliseconds()), fmt.Sprintf("eager-%dMiB-read-all-p50-ms", size>>20))
		}
		fmt.Print(sb.String())
		if roundsOnly {
			a.p.Stop()
			continue
		}
		// A copy goes to a node that serves peers (so that it outlives
		// its first holder): B serves them on its own address.
		fmt.Println(benchCopy(b, a, ctl, func() *node {
			bns++
			return &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: fmt.Sprintf("b%d", bns),
				StateDir: filepath.Join(diskB, fmt.Sprintf("b%d", bns)), Wrap: hostB.Command,
				Args: append(append([]string{"--pull-wait=30m", "--peer-address=" + net.JoinHostPort(hostB.IP, "7443")}, tlsArgs...), fleetArgs...)})}
		}))
		a.p.Stop()
	}
}

// benchCopy captures a 1 GiB / 50,000-file output with copies: 2 on a,
// beside a node that start makes (the only other one), and says how long
// after the capture the controller listed that node as a second holder,
// against an eager pull of the same tree onto a node of its own.
func benchCopy(b *testing.B, a *node, ctl benchController, start func() *node) string {
	api := ctl.api(b)
	holders := func(handle string) int {
		resp, err := api.LookupVolumes(context.Background(), &controllerv1.LookupVolumesRequest{
			Refs: []*controllerv1.VolumeRef{{Namespace: "ci", Handle: handle}}})
		if err != nil {
			b.Fatal(err)
		}
		return len(resp.Volumes[0].Nodes)
	}
	other := start()
	// The nodes earlier cases stopped are live to the controller until
	// they stall: a copy asked of one would wait for that.
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
		nodes, err := api.ListNodes(context.Background(), &controllerv1.ListNodesRequest{})
		if err != nil {
			b.Fatal(err)
		}
		running := 0
		for _, n := range nodes.Nodes {
			if n.State == "running" {
				running++
			}
		}
		if running == 2 {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("%d nodes still running after 2 minutes, want a and the new one", running)
		}
	}
	tree := b.TempDir()
	genMixedTree(b, tree, treeFiles, treeBytes)
	v := a.volume(map[string]string{driver.AttrCapture: "copied", driver.AttrCopies: "2"}, false)
	if err := a.p.Publish(v); err != nil {
		b.Fatal(err)
	}
	if out, err := exec.Command("sh", "-c", "tar -C "+tree+" -cf - . | tar -C "+v.Target+" -xf -").CombinedOutput(); err != nil {
		b.Fatal(err, string(out))
	}
	dropCaches(b)
	a.timed(a.p.Unpublish, v)
	captured := time.Now()
	for holders("copied") < 2 {
		if time.Since(captured) > 10*time.Minute {
			b.Fatal("no second copy in 10 minutes")
		}
		time.Sleep(50 * time.Millisecond)
	}
	copied := time.Since(captured)
	other.p.Stop() // its peer address is the next node's
	// The comparator: an eager pull of the same tree onto a fresh node.
	eager := start()
	defer eager.p.Stop()
	dropCaches(b)
	pv := eager.volume(map[string]string{driver.AttrSource: "copied"}, true)
	pulled := eager.timed(eager.p.Publish, pv)
	eager.timed(eager.p.Unpublish, pv)
	b.ReportMetric(float64(copied.Milliseconds()), "copy-1024MiB-ms")
	return fmt.Sprintf("copies: 2 of 1 GiB, capture to a second holder listed %s; an eager pull of it %s (%.2fx)",
		ms(copied), ms(pulled), float64(copied)/float64(pulled))
}

// roundsShape is the size and file count that COWVOL_LAZY_ROUNDS_SHAPE's
// shape (MiB/files) gives BenchmarkLazyPull's rounds.
func roundsShape(b *testing.B, shape string) (int64, int) {
	var mib int64
	var files int
	if n, err := fmt.Sscanf(shape, "%d/%d", &mib, &files); err != nil || n != 2 || mib <= 0 || files <= 0 || mib > 4<<10 {
		b.Fatalf("COWVOL_LAZY_ROUNDS_SHAPE=%q: want MiB/files, at most 4096 MiB (e.g. 1536/30000)", shape)
	}
	return mib << 20, files
}

// lazyRounds is how many times BenchmarkLazyPull takes the figures its
// targets name: a round's ratio drifts by up to a tenth here (one run's
// three rounds of the recorded order: 1.18, 1.06 and 1.09 eager), and a
// median of five stands two such rounds.
const lazyRounds = 5

// publishFunc publishes a step's volume of the input (having recorded
// read's order first, where it records one) on a node, and says how long
// the publish took.
type publishFunc func(read func(dir string)) (kubeletsim.InlineVolume, *node, time.Duration)

// recordReadOrder has a step read the source attrs name, lazily pulled,
// as read does, so that the node records its read order; then the volume
// is destroyed, to be pulled again.
func (n *node) recordReadOrder(attrs map[string]string, read func(dir string)) {
	v := n.volume(attrs, true)
	if err := n.p.Publish(v); err != nil {
		n.b.Fatal(err)
	}
	read(v.Target)
	if err := n.p.Unpublish(v); err != nil {
		n.b.Fatal(err)
	}
	ref := &nodev1.VolumeRef{Namespace: "ci", Handle: attrs[driver.AttrSource]}
	ctx := context.Background()
	for state := ""; state != "gone"; time.Sleep(100 * time.Millisecond) {
		list, err := n.p.NodeAPI.ListVolumes(ctx, &nodev1.ListVolumesRequest{Namespace: "ci", IncludeDestroyed: true})
		if err != nil {
			n.b.Fatal(err)
		}
		state = "gone" // its record too, not only its data: a pull makes it anew
		for _, v := range list.Volumes {
			if v.GetRef().GetHandle() == ref.Handle {
				state = v.State
			}
		}
		if state == "ready" {
			if _, err := n.p.NodeAPI.DestroyVolumes(ctx, &nodev1.DestroyVolumesRequest{Refs: []*nodev1.VolumeRef{ref}}); err != nil {
				n.b.Fatal(err)
			}
		}
	}
	dropCaches(n.b)
}

// readEvery reads every nth file of a tree whole.
func readEvery(b *testing.B, nth int) func(dir string) {
	return func(dir string) {
		i := 0
		err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err != nil || !d.Type().IsRegular() {
				return err
			}
			if i++; i%nth != 0 {
				return nil
			}
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = io.Copy(io.Discard, f)
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}

// runTrue runs the program the tree holds at bin/true.
func runTrue(b *testing.B) func(dir string) {
	return func(dir string) {
		if out, err := exec.Command(filepath.Join(dir, "bin", "true")).CombinedOutput(); err != nil {
			b.Fatal(err, string(out))
		}
	}
}

func writeFile(b *testing.B, path, data string) {
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		b.Fatal(err)
	}
}

func copyFile(b *testing.B, from, to string) {
	data, err := os.ReadFile(from)
	if err == nil {
		err = os.MkdirAll(filepath.Dir(to), 0o755)
	}
	if err == nil {
		err = os.WriteFile(to, data, 0o755)
	}
	if err != nil {
		b.Fatal(err)
	}
}

// dropCaches empties the page cache, so that a read measures the disk (a
// loop device on tmpfs) and the wire, not memory; then it waits for the
// machine to be idle: XFS inactivates the inodes of files deleted just
// before (the last step's 50,000, or a recording step's) in background
// workers, whose CPU the next step would otherwise share.
func dropCaches(b *testing.B) {
	_ = exec.Command("sync").Run()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
		b.Fatal(err)
	}
	waitIdle(b)
}

// waitIdle waits until the CPUs were at least 95% idle over 200 ms (for
// at most 20 s: a machine never idle is measured as it is).
func waitIdle(b *testing.B) {
	const window, idle = 200 * time.Millisecond, 0.95
	busy, total := cpuTicks(b)
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); {
		time.Sleep(window)
		busy2, total2 := cpuTicks(b)
		if total2 > total && float64(busy2-busy) <= (1-idle)*float64(total2-total) {
			return
		}
		busy, total = busy2, total2
	}
}

// cpuTicks is the ticks the machine's CPUs spent busy (not idle nor
// waiting for I/O) and in all, from /proc/stat.
func cpuTicks(b *testing.B) (busy, total int64) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Fatal(err)
	}
	fields := strings.Fields(strings.SplitN(string(data), "\n", 2)[0]) // cpu user nice system idle iowait ...
	for i, f := range fields[1:] {
		v, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			b.Fatal(err)
		}
		total += v
		if i != 3 && i != 4 {
			busy += v
		}
	}
	return busy, total
}
