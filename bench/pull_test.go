package bench

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

// vmKiB reads a process's VmRSS or VmHWM (peak) in KiB.
func vmKiB(b *testing.B, pid int, field string) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			n, err := strconv.ParseInt(strings.Fields(rest)[0], 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return n
		}
	}
	b.Fatalf("no %s for process %d", field, pid)
	return 0
}

// resetPeak restarts a process's VmHWM from its current RSS.
func resetPeak(b *testing.B, pid int) {
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0); err != nil {
		b.Fatal(err)
	}
}

// vethStream runs a sender pipeline here and a receiver reading from a
// socket accepted in host's namespace: the bytes cross the lab's veths, as
// a stream between two nodes' processes would.
func vethStream(b *testing.B, host *netlab.Host, send, receive string) time.Duration {
	b.Helper()
	l, err := host.Listen(0)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	out, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	return pipeline(b, out, <-accepted, send, receive)
}

// BenchmarkPull pulls a 50,000-file / 1 GiB cached volume from one node
// plugin to another, each a host of its own joined by veth pairs, over
// mutual TLS, in each encoding; against, in the same run and over the same
// veths, Concourse's default pipeline (tar | gzip | tar over a socket), a
// tar | zstd | tar socket pipe, a copy of the tree over a plain socket
// (tar | tar: the raw TCP copy a pull is held to), the tar bytes alone
// over a socket (the wire's ceiling) and a local tar | tar pipe. It reports the
// extra memory each end needed, and what crosses the wire for a child whose
// parent the puller holds.
//
// The figures the targets name (the default pull, the local pipe, the
// raw TCP copy and the bytes dropped) are taken pullRounds times, the
// contenders taking turns within each round, and reported as medians:
// one sample of each drifted by a fifth from run to run, more than the
// differences measured. Every writer lands on a filesystem whose blocks
// exist (MountAllocated), after two copies of the tree made and removed
// first, untimed: on a new filesystem the first writers paid up to twice
// the time of the later ones, with the same CPU (waiting, not working).
func BenchmarkPull(b *testing.B) {
	testfs.Need(b, "tar", "gzip", "zstd")
	lab := netlab.New(b)
	hostA, hostB := lab.Host("a"), lab.Host("b")
	tlsArgs := peerTLS(b)
	peerA, metricsA := net.JoinHostPort(hostA.IP, "7443"), net.JoinHostPort(hostA.IP, "9090")
	for range b.N {
		stateA, stateB := testfs.Mount(b, testfs.XFS, 4<<30), testfs.MountAllocated(b, testfs.XFS, 6<<30)
		a := &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: "a", StateDir: stateA,
			Wrap: hostA.Command, Args: append([]string{"--peer-address=" + peerA, "--metrics-address=" + metricsA}, tlsArgs...)})}
		a.capture("", "tree", func(dir string) { genMixedTree(b, dir, treeFiles, treeBytes) })
		src := layerDir(b, stateA, "tree")
		a.settle()

		mbps := func(d time.Duration) float64 { return float64(treeBytes) / d.Seconds() / 1e6 }
		scratch := func(name string) string {
			d := filepath.Join(stateB, "cmp-"+name)
			if err := os.MkdirAll(d, 0o755); err != nil {
				b.Fatal(err)
			}
			return d
		}
		localPipe := func() time.Duration {
			local := scratch("local")
			defer dropTree(b, local)
			return tarCopy(b, src, local)
		}
		// pull pulls the tree onto a new node B with enc, and says how
		// long and the extra RSS (MiB) each end needed; keep leaves B
		// running with its copy.
		pull := func(enc string, keep bool) (took time.Duration, rssIn, rssOut int64, bn *node) {
			dir := scratch("state-" + enc)
			bn = &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: "b", StateDir: dir,
				Wrap: hostB.Command, Args: append([]string{"--peers=a=" + peerA, "--stream-encoding=" + enc,
					"--pull-wait=30m", "--pull-mode=eager"}, tlsArgs...)})}
			baseIn, baseOut := vmKiB(b, bn.p.PID(), "VmRSS"), vmKiB(b, a.p.PID(), "VmRSS")
			resetPeak(b, bn.p.PID())
			resetPeak(b, a.p.PID())
			v := bn.volume(map[string]string{driver.AttrSource: "tree"}, true)
			took = bn.timed(bn.p.Publish, v)
			rssIn = max(0, vmKiB(b, bn.p.PID(), "VmHWM")-baseIn) >> 10
			rssOut = max(0, vmKiB(b, a.p.PID(), "VmHWM")-baseOut) >> 10
			bn.timed(bn.p.Unpublish, v)
			if !keep {
				bn.p.Stop()
				dropTree(b, dir)
			}
			return took, rssIn, rssOut, bn
		}

		type result struct {
			what           string
			took           []time.Duration // one per sample
			rssIn, rssOut  int64           // MiB, receiver and sender, the most of any sample
			measuredMemory bool
		}
		results := map[string]*result{}
		var order []string
		add := func(what string, took time.Duration) *result {
			r := results[what]
			if r == nil {
				r = &result{what: what}
				results[what] = r
				order = append(order, what)
			}
			r.took = append(r.took, took)
			return r
		}
		const (
			gzipPipe   = "tar | gzip | tar over the veths (Concourse's default)"
			zstdPipe   = "tar | zstd | tar over the veths"
			dropped    = "tar -c over the veths, dropped (raw TCP)"
			toDisk     = "tar -c over the veths, into one file (raw TCP to disk)"
			tcpCopy    = "tar -c | tar -x over the veths (raw TCP copy)"
			local      = "tar -c | tar -x, local pipe"
			pullPrefix = "cowvol pull, "
			defaultEnc = "s2"
		)

		warmDisk(b, src, stateB)

		for round := range pullRounds {
			// The bytes alone: the wire's own ceiling.
			add(dropped, vethStream(b, hostB, "tar -C "+src+" -cf - .", "cat > /dev/null"))
			// A copy of the tree over raw TCP: the same tar bytes over
			// the veths, extracted into files on B by tar. What a pull
			// is held to (0.9× of it): the wire and the making of
			// 50,000 files, without TLS, framing or a digest.
			overTCP := scratch("tcp")
			add(tcpCopy, vethStream(b, hostB, "tar -C "+src+" -cf - .", "tar -C "+overTCP+" -xf -"))
			dropTree(b, overTCP)
			took, in, out, _ := pull(defaultEnc, false)
			r := add(pullPrefix+defaultEnc, took)
			r.measuredMemory, r.rssIn, r.rssOut = true, max(r.rssIn, in), max(r.rssOut, out)
			add(local, localPipe())
			if round > 0 {
				continue
			}
			// Once: the other encodings and pipelines, for the table.
			gz := scratch("gzip")
			add(gzipPipe, vethStream(b, hostB, "tar -C "+src+" -cf - . | gzip", "gzip -d | tar -C "+gz+" -xf -"))
			dropTree(b, gz)
			zs := scratch("zstd")
			add(zstdPipe, vethStream(b, hostB, "tar -C "+src+" -cf - . | zstd -q -T1", "zstd -q -d | tar -C "+zs+" -xf -"))
			dropTree(b, zs)
			// The same tar bytes written to one file on B's state dir:
			// the wire and the disk, without making 50,000 files.
			tarFile := filepath.Join(scratch("file"), "tree.tar")
			add(toDisk, vethStream(b, hostB, "tar -C "+src+" -cf - .", "cat > "+tarFile))
			dropTree(b, filepath.Dir(tarFile))
			for _, enc := range []string{"raw", "zstd"} {
				took, in, out, _ := pull(enc, false)
				r := add(pullPrefix+enc, took)
				r.measuredMemory, r.rssIn, r.rssOut = true, in, out
			}
		}
		// Last, gzip, whose B keeps its copy: the child pull below stacks
		// on it.
		took, in, out, last := pull("gzip", true)
		r := add(pullPrefix+"gzip", took)
		r.measuredMemory, r.rssIn, r.rssOut = true, in, out
		for _, what := range order {
			if strings.HasPrefix(what, pullPrefix) {
				b.ReportMetric(mbps(p50(results[what].took)), strings.TrimPrefix(what, pullPrefix)+"-MB/s")
			}
		}

		// A child of the tree: the puller holds its parent, so only the
		// child's layer crosses.
		a.capture("tree", "child", func(dir string) { genTree(b, filepath.Join(dir, "child"), 100, 1<<20) })
		sentBefore := peerSent(b, metricsA)
		v := last.volume(map[string]string{driver.AttrSource: "child"}, true)
		childTook := last.timed(last.p.Publish, v)
		last.timed(last.p.Unpublish, v)
		childWire := peerSent(b, metricsA) - sentBefore
		got, err := last.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: &nodev1.VolumeRef{Namespace: "ci", Handle: "child"}})
		if err != nil || got.GetBase().GetHandle() != "tree" {
			b.Fatalf("the child pulled does not stack on the local tree: %v %v", got, err)
		}

		median := func(what string) time.Duration { return p50(results[what].took) }
		var sb strings.Builder
		fmt.Fprintf(&sb, "\n%-55s %11s %8s %14s  %s\n", "pulling a 50,000-file / 1 GiB volume between two hosts", "time (p50)", "MB/s",
			"extra RSS in/out", "vs gzip / zstd pipe / local pipe / raw TCP copy / raw TCP dropped / raw TCP to disk; samples")
		for _, what := range order {
			r := results[what]
			mem := "-"
			if r.measuredMemory {
				mem = fmt.Sprintf("%d / %d MiB", r.rssIn, r.rssOut)
			}
			d := p50(r.took)
			fmt.Fprintf(&sb, "%-55s %11s %8.0f %14s  %s / %s / %s / %s / %s / %s; %s\n", r.what, ms(d), mbps(d), mem,
				ratio(median(gzipPipe), d), ratio(median(zstdPipe), d), ratio(median(local), d), ratio(median(tcpCopy), d),
				ratio(median(dropped), d), ratio(median(toDisk), d), samplesOf(r.took))
		}
		// The targets, round by round: each round's pull against the
		// comparators of the same round.
		def := results[pullPrefix+defaultEnc].took
		for i := range def {
			fmt.Fprintf(&sb, "round %d: the default pull at %s of the local pipe, %s of the raw TCP copy\n", i+1,
				ratio(results[local].took[i], def[i]), ratio(results[tcpCopy].took[i], def[i]))
		}
		fmt.Fprintf(&sb, "a child (100 files, 1 MiB) of a tree the puller holds: %s, %d KiB on the wire\n", ms(childTook), childWire>>10)
		fmt.Print(sb.String())
	}
}

// warmDisk copies the tree at src onto the filesystem at fs twice, untimed,
// and removes the copies: the filesystem makes its inodes once, and its
// disk writes enough for the kernel to let it hold its share of dirty pages
// (on a new device, writers are throttled early, waiting with idle CPU).
func warmDisk(b *testing.B, src, fs string) {
	b.Helper()
	for range 2 {
		dir := filepath.Join(fs, "warm")
		tarCopy(b, src, dir)
		dropTree(b, dir)
	}
}

// tarCopy copies the tree at src into dst (made if missing) with a local
// tar | tar pipe, and says how long the pipe took.
func tarCopy(b *testing.B, src, dst string) time.Duration {
	b.Helper()
	if err := os.MkdirAll(dst, 0o755); err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	if out, err := exec.Command("sh", "-c", "tar -C "+src+" -cf - . | tar -C "+dst+" -xf -").CombinedOutput(); err != nil {
		b.Fatal(err, string(out))
	}
	return time.Since(start)
}

// dropTree removes dir and syncs, so that the next writer does not pay for
// its write-back.
func dropTree(b *testing.B, dir string) {
	b.Helper()
	if err := os.RemoveAll(dir); err != nil {
		b.Fatal(err)
	}
	_ = exec.Command("sync").Run()
}

// pullRounds is how many times BenchmarkPull takes the figures its targets
// name.
const pullRounds = 3

// samplesOf lists a figure's samples, in seconds.
func samplesOf(ds []time.Duration) string {
	parts := make([]string, len(ds))
	for i, d := range ds {
		parts[i] = fmt.Sprintf("%.2f", d.Seconds())
	}
	return strings.Join(parts, " ") + " s"
}

// peerSent is what a node sent its peers on the wire so far (bytes, every
// encoding), from its metrics.
func peerSent(b *testing.B, metricsAddr string) int64 {
	return int64(metricOf(b, metricsAddr, "cowvol_peer_sent_bytes_total"))
}

// metricOf is a plugin's metric, its samples (every label) summed.
func metricOf(b *testing.B, metricsAddr, name string) float64 {
	b.Helper()
	resp, err := http.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), name)
		if !ok || rest == "" || (rest[0] != '{' && rest[0] != ' ') {
			continue
		}
		v, err := strconv.ParseFloat(rest[strings.LastIndexByte(rest, ' ')+1:], 64)
		if err != nil {
			b.Fatal(err)
		}
		sum += v
	}
	return sum
}
