package bench

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

// The cache of issue 50: 6 GiB in 100,000 files (COWVOL_BENCH_CACHE_GIB
// changes its size).
const cacheFiles = 100_000

// BenchmarkCache is issue 50's table: a step's fork of a cache of 6 GiB in
// 100,000 files (the publish of a cache volume: the step runs on it once
// it returns) and the promotion of what the step changed (its teardown),
// against the way GitHub's and Argo's caches work, in the same run: tar of
// the same tree to a local S3 store (SeaweedFS on loopback, its data on a
// tmpfs) at the end of a job, and from it into the next job's dir. Run it
// with -benchtime 1x (make bench).
func BenchmarkCache(b *testing.B) {
	weed := os.Getenv("COWVOL_BENCH_WEED_BINARY")
	if weed == "" {
		b.Skip("COWVOL_BENCH_WEED_BINARY is not set: make bench builds SeaweedFS (test/e2e/tools/seaweedfs) for the S3 comparator")
	}
	testfs.Need(b, "tar", "fstrim", "curl", "bash")
	gib := int64(6)
	if s := os.Getenv("COWVOL_BENCH_CACHE_GIB"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 1 {
			b.Fatalf("COWVOL_BENCH_CACHE_GIB=%q: want a positive number of GiB", s)
		}
		gib = n
	}
	var rows []row
	for range b.N {
		// Room for the cache and, later, the comparator's restore of it.
		xfs := testfs.Mount(b, testfs.XFS, (gib+2)<<30)
		n := newNode(b, filepath.Join(xfs, "state"), "overlay")
		// No API server tells this plugin how a step ended: promote always.
		attrs := map[string]string{driver.AttrCache: "bench/deps", driver.AttrCachePromote: "always"}
		first := n.volume(attrs, false)
		n.timed(n.p.Publish, first)
		genTree(b, first.Target, cacheFiles, gib<<30)
		firstPromotion := n.timed(n.p.Unpublish, first)

		var forks, promotions []time.Duration
		for i := range samples {
			n.settle()
			v := n.volume(attrs, false)
			forks = append(forks, n.timed(n.p.Publish, v))
			// What a build adds to its cache: a few new entries.
			for j := range 3 {
				if err := os.WriteFile(filepath.Join(v.Target, fmt.Sprintf("new-%d-%d", i, j)), make([]byte, 64<<10), 0o644); err != nil {
					b.Fatal(err)
				}
			}
			promotions = append(promotions, n.timed(n.p.Unpublish, v))
		}
		noop := p50(n.noopTimes(samples))

		// The comparator: the same tree tarred to S3, and back.
		n.settle()
		tree := layerDir(b, n.p.StateDir, firstVersion(b, n.p.StateDir))
		s3 := startS3(b, weed)
		save := timedShell(b, fmt.Sprintf("tar -C %s -cf - . | curl -sf -T - http://%s/cache/deps.tar", tree, s3))
		// The tree is in S3 now: free its room for the restore.
		n.discard()
		if out, err := exec.Command("fstrim", xfs).CombinedOutput(); err != nil {
			b.Fatalf("fstrim: %v: %s", err, out)
		}
		restored := filepath.Join(xfs, "restored")
		if err := os.Mkdir(restored, 0o755); err != nil {
			b.Fatal(err)
		}
		restore := timedShell(b, fmt.Sprintf("curl -sf http://%s/cache/deps.tar | tar -C %s -xf -", s3, restored))

		b.ReportMetric(float64(p50(forks).Microseconds())/1000, "fork-p50-ms")
		b.ReportMetric(float64(p50(promotions).Microseconds())/1000, "promotion-p50-ms")
		b.ReportMetric(save.Seconds(), "tar-to-s3-s")
		b.ReportMetric(restore.Seconds(), "tar-from-s3-s")
		size := fmt.Sprintf("%d GiB / %d files", gib, cacheFiles)
		rows = append(rows,
			row{"fork: a step's publish of the cache (" + size + "), p50", ms(p50(forks)), "tar from S3 / this = " + ratio(restore, p50(forks))},
			row{"promotion: its teardown, 3 files added, p50", ms(p50(promotions)), "tar to S3 / this = " + ratio(save, p50(promotions))},
			row{"the first version's promotion (" + size + " written)", ms(firstPromotion), ""},
			row{"a CSI call that does nothing, p50", ms(noop), ""},
			row{"tar of the cache to S3 (a job's end)", ms(save), ""},
			row{"tar of the cache from S3 (a job's start)", ms(restore), ""},
		)
	}
	var t strings.Builder
	fmt.Fprintf(&t, "\n%-66s %14s  %s\n", "cache (overlay on XFS, a loop device on tmpfs)", "time", "vs")
	for _, r := range rows {
		fmt.Fprintf(&t, "%-66s %14s  %s\n", r.what, r.value, r.vs)
	}
	b.Log(t.String())
}

// firstVersion is the handle of the cache's first version, the one whose
// layer holds the whole tree (the later ones are diffs over it).
func firstVersion(b *testing.B, stateDir string) string {
	b.Helper()
	layers, err := filepath.Glob(filepath.Join(stateDir, "volumes", "ci", "*", "*", "d000"))
	if err != nil || len(layers) != 1 {
		b.Fatalf("the cache's first version: %v %v", layers, err)
	}
	return filepath.Base(filepath.Dir(filepath.Dir(layers[0])))
}

// startS3 runs SeaweedFS's S3 gateway on loopback with a bucket "cache",
// its data on a tmpfs of its own, and returns its address.
func startS3(b *testing.B, weed string) string {
	b.Helper()
	data := b.TempDir()
	if err := unix.Mount("tmpfs", data, "tmpfs", 0, "size=16g,mode=0700"); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = unix.Unmount(data, unix.MNT_DETACH) })
	cmd := exec.Command(weed, "mini", "-dir="+data, "-bucket=cache", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
		"-master.telemetry=false", "-webdav=false", "-admin.ui=false")
	log := filepath.Join(b.TempDir(), "weed.log")
	startLogged(b, cmd, log)
	addr := "127.0.0.1:8333"
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if resp, err := http.Get("http://" + addr + "/cache/"); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return addr
			}
		} else if _, ok := err.(net.Error); !ok && !strings.Contains(err.Error(), "refused") {
			b.Fatal(err)
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(log)
			b.Fatalf("SeaweedFS's S3 gateway did not answer in 2 minutes:\n%s", out)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// timedShell runs a shell pipeline and says how long it took.
func timedShell(b *testing.B, script string) time.Duration {
	b.Helper()
	start := time.Now()
	if out, err := exec.Command("bash", "-o", "pipefail", "-c", script).CombinedOutput(); err != nil {
		b.Fatalf("%s: %v: %s", script, err, out)
	}
	return time.Since(start)
}

// BenchmarkCacheElsewhere is issue 50's second table: the first use of a
// cache of 1 GiB in 50,000 files on a node that never held its key (hosts
// of their own joined by veths, mutual TLS, a controller), lazily and
// eagerly: the time to a running step (its publish: the fleet's newest
// version asked of the controller and pulled from the node that made it)
// and to the step's end (it reads every file and adds one; its teardown).
// Beside it, the same step on the node that made the version, and the way
// Concourse moves a volume between workers: a tar of the tree streamed to
// the node (tar | tar over the same veths), then the same read. Each case
// runs on a fresh node, page caches dropped. The steps' teardowns discard
// their views (no API server says how they ended): BenchmarkCache times a
// promotion.
func BenchmarkCacheElsewhere(b *testing.B) {
	testfs.Need(b, "tar")
	pair := startCachePair(b)
	readAll := readEvery(b, 1)
	for range b.N {
		stateA, diskB := testfs.Mount(b, testfs.XFS, 4<<30), testfs.MountAllocated(b, testfs.XFS, 4<<30)
		a := pair.nodeA(stateA)
		seed := a.volume(map[string]string{driver.AttrCache: "bench/deps", driver.AttrCachePromote: "always"}, false)
		a.timed(a.p.Publish, seed)
		genMixedTree(b, seed.Target, treeFiles, 1<<30)
		a.timed(a.p.Unpublish, seed)
		a.settle()
		version := waitCacheVersion(b, pair.api, "bench/deps")
		warmDisk(b, layerDir(b, stateA, version), diskB)

		// step times a step of the cache on n: its publish, and the
		// publish, the read, the new file and the teardown.
		step := func(n *node) (publish, end time.Duration) {
			dropCaches(b)
			v := n.volume(map[string]string{driver.AttrCache: "bench/deps"}, false)
			publish = n.timed(n.p.Publish, v)
			start := time.Now()
			readAll(v.Target)
			if err := os.WriteFile(filepath.Join(v.Target, "added"), []byte("a build's new entry"), 0o644); err != nil {
				b.Fatal(err)
			}
			end = publish + time.Since(start) + n.timed(n.p.Unpublish, v)
			return publish, end
		}
		type timed struct {
			what         string
			running, end time.Duration
		}
		own := timed{what: "on the node that made the version"}
		own.running, own.end = step(a)
		cases := []timed{own}
		metricsB := net.JoinHostPort(pair.hostB.IP, "9090")
		for _, mode := range []string{"lazy", "eager"} {
			bn := pair.nodeB("b-"+mode, filepath.Join(diskB, mode), mode, "--metrics-address="+metricsB)
			c := timed{what: "first use on another node, " + mode}
			c.running, c.end = step(bn)
			if got := metricOf(b, metricsB, `cowvol_cache_forks_total{found="pulled"}`); got != 1 {
				b.Fatalf("the %s node's step did not fork the pulled version (forks found=pulled: %v)", mode, got)
			}
			bn.p.Stop()
			dropTree(b, bn.p.StateDir)
			cases = append(cases, c)
			b.ReportMetric(float64(c.running.Milliseconds()), mode+"-to-running-ms")
			b.ReportMetric(float64(c.end.Milliseconds()), mode+"-to-end-ms")
		}
		dir := filepath.Join(diskB, "tar")
		if err := os.Mkdir(dir, 0o755); err != nil {
			b.Fatal(err)
		}
		dropCaches(b)
		tar := timed{what: "tar | tar over the veths (Concourse's streaming), then the read"}
		tar.running = vethStream(b, pair.hostB, "tar -C "+layerDir(b, stateA, version)+" -cf - .", "tar -C "+dir+" -xf -")
		start := time.Now()
		readAll(dir)
		tar.end = tar.running + time.Since(start)
		dropTree(b, dir)
		a.p.Stop()
		b.ReportMetric(float64(own.running.Microseconds())/1000, "own-to-running-ms")
		b.ReportMetric(float64(tar.end.Milliseconds()), "tar-to-end-ms")
		var t strings.Builder
		fmt.Fprintf(&t, "\n%-66s %14s  %-22s %14s  %s\n", "a cache of 1 GiB / 50,000 files, first used on a node without it",
			"to running", "vs", "to the end", "vs")
		for _, c := range append(cases, tar) {
			fmt.Fprintf(&t, "%-66s %14s  %-22s %14s  %s\n", c.what, ms(c.running), "tar / this = "+ratio(tar.running, c.running),
				ms(c.end), "tar / this = "+ratio(tar.end, c.end))
		}
		b.Log(t.String())
	}
}

// waitCacheVersion waits until the controller lists a version of key in
// namespace ci, and returns its handle.
func waitCacheVersion(b *testing.B, api controllerv1.CacheClient, key string) string {
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		resp, err := api.LookupCaches(context.Background(), &controllerv1.LookupCachesRequest{Namespace: "ci", Keys: []string{key}})
		if err == nil && resp.Caches[0].GetFound() {
			return resp.Caches[0].GetVersion().GetRef().GetHandle()
		}
	}
	b.Fatalf("the controller listed no version of cache %s in a minute", key)
	return ""
}

// BenchmarkGoBuildCache is the build of examples/scheduler/go-build.json
// with its two caches, GOCACHE and GOMODCACHE (cowvol's own plugin,
// go build -trimpath, its modules from this machine's module cache as a
// file:// proxy): cold (both caches empty: what a build without caches
// pays every time), warm on the node that ran it, and warm on another
// node that never did (its caches' versions pulled lazily and eagerly from
// the first: hosts of their own joined by veths, a controller). Each time
// is the step's: the publishes of its two cache volumes, the build, and
// their teardowns (promotions).
func BenchmarkGoBuildCache(b *testing.B) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		b.Skip("no go on PATH: the build needs it")
	}
	modCache, err := exec.Command(goBin, "env", "GOMODCACHE").Output()
	if err != nil {
		b.Fatal(err)
	}
	proxy := filepath.Join(strings.TrimSpace(string(modCache)), "cache", "download")
	repo, err := filepath.Abs("..")
	if err != nil {
		b.Fatal(err)
	}
	pair := startCachePair(b)
	caches := map[string]string{"GOCACHE": "go-build/linux-amd64", "GOMODCACHE": "go-mod"}
	for range b.N {
		stateA, diskB := testfs.Mount(b, testfs.XFS, 8<<30), testfs.Mount(b, testfs.XFS, 8<<30)
		a := pair.nodeA(stateA)
		// build runs the step on n: its caches' publishes, the build, and
		// their teardowns, which promote what it left.
		build := func(n *node) time.Duration {
			dropCaches(b)
			start := time.Now()
			env := append(os.Environ(), "GOPROXY=file://"+proxy, "GOSUMDB=off", "GOFLAGS=-mod=readonly", "GOTOOLCHAIN=local", "CGO_ENABLED=0")
			var vols []kubeletsim.InlineVolume
			for name, key := range caches {
				v := n.volume(map[string]string{driver.AttrCache: key, driver.AttrCachePromote: "always"}, false)
				if err := n.p.Publish(v); err != nil {
					b.Fatalf("publishing cache %s: %v", key, err)
				}
				vols = append(vols, v)
				env = append(env, name+"="+v.Target)
			}
			cmd := exec.Command(goBin, "build", "-trimpath", "-o", filepath.Join(b.TempDir(), "cowvol-plugin"), "./cmd/cowvol-plugin")
			cmd.Dir, cmd.Env = repo, env
			if out, err := cmd.CombinedOutput(); err != nil {
				b.Fatalf("go build: %v: %s", err, out)
			}
			for _, v := range vols {
				if err := n.p.Unpublish(v); err != nil {
					b.Fatal(err)
				}
			}
			return time.Since(start)
		}
		cold := build(a)
		a.settle()
		warm := build(a)
		a.settle()
		for _, key := range caches {
			waitCacheVersion(b, pair.api, key)
		}
		elsewhere := map[string]time.Duration{}
		for _, mode := range []string{"lazy", "eager"} {
			bn := pair.nodeB("b-"+mode, filepath.Join(diskB, mode), mode)
			elsewhere[mode] = build(bn)
			bn.p.Stop()
			dropTree(b, bn.p.StateDir)
		}
		a.p.Stop()
		b.ReportMetric(cold.Seconds(), "cold-s")
		b.ReportMetric(warm.Seconds(), "warm-same-node-s")
		b.ReportMetric(elsewhere["lazy"].Seconds(), "warm-other-node-lazy-s")
		b.ReportMetric(elsewhere["eager"].Seconds(), "warm-other-node-eager-s")
		var t strings.Builder
		fmt.Fprintf(&t, "\n%-60s %12s  %s\n", "go build -trimpath ./cmd/cowvol-plugin, GOCACHE and GOMODCACHE cowvol caches", "time", "vs cold")
		for _, r := range []struct {
			what string
			took time.Duration
		}{{"cold (both caches empty: no cache at all)", cold}, {"warm, on the node that ran it", warm},
			{"warm, on another node, pulled lazily", elsewhere["lazy"]}, {"warm, on another node, pulled eagerly", elsewhere["eager"]}} {
			fmt.Fprintf(&t, "%-60s %12s  cold / this = %s\n", r.what, ms(r.took), ratio(cold, r.took))
		}
		b.Log(t.String())
	}
}
