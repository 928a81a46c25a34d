// Package bench measures cowvol's publish, unpublish and capture through the
// real plugin binary over gRPC, on filesystems it makes on loop devices
// (images on a private tmpfs: the root disk here is throttled and noisy),
// against cp -a of the same tree in the same run. Figures are reported as
// benchmark metrics and as a table; nothing here asserts a time.
package bench

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/overlay"
)

// The cached volume of the issue: 50,000 files, 1 GiB.
const (
	treeFiles = 50_000
	treeBytes = 1 << 30
	dirFiles  = 100
	samples   = 50 // publishes per O(1) figure
)

// genTree writes files totalling about bytes into root, in dirs of dirFiles,
// with sizes spread around the mean and contents that are not all zeros.
func genTree(b *testing.B, root string, files int, bytes int64) {
	b.Helper()
	buf := make([]byte, 2*(bytes/int64(files)))
	for i := range buf {
		buf[i] = byte(i*31 + i>>8)
	}
	writeTree(b, root, files, bytes, func(_ int, size int64) []byte { return buf[:size] })
}

// writeTree writes files totalling about bytes into root, in dirs of
// dirFiles, with sizes spread around the mean (at most twice it) and each
// file's contents from contents.
func writeTree(b *testing.B, root string, files int, bytes int64, contents func(i int, size int64) []byte) {
	b.Helper()
	mean := bytes / int64(files)
	for i := range files {
		dir := filepath.Join(root, fmt.Sprintf("d%03d", i/dirFiles))
		if i%dirFiles == 0 {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				b.Fatal(err)
			}
		}
		size := 2 * mean * int64((i*7919)%1000) / 1000
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%05d", i)), contents(i, size), 0o644); err != nil {
			b.Fatal(err)
		}
	}
}

// discard stops the node's plugin and removes its state dir, as a node
// gone for good leaves it: what its plugin left mounted there (an index
// whose janitor had not run yet, taken down by the next start's
// recovery) is unmounted first, as a reboot would.
func (n *node) discard() {
	n.p.Stop()
	if err := n.p.Wait(time.Minute); err != nil {
		n.b.Fatal(err)
	}
	mounts, err := overlay.MountsUnder(n.p.StateDir)
	if err != nil {
		n.b.Fatal(err)
	}
	for _, mp := range mounts { // (most recent first: each before the one it sits on)
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
			n.b.Fatal(err)
		}
	}
	if err := os.RemoveAll(n.p.StateDir); err != nil {
		n.b.Fatal(err)
	}
}

// node is a plugin with a counter for pod names.
type node struct {
	b *testing.B
	p *plugintest.Plugin
	n int
}

// newNode starts a plugin on stateDir, with the pods' dirs (the kubelet's)
// beside it on the same filesystem, as a node's disk holds both: not on the
// root disk, which is throttled here, and whose ext4 has no journal, which
// makes each mkdir scan for recently deleted inodes.
func newNode(b *testing.B, stateDir, backend string) *node {
	return &node{b: b, p: plugintest.Start(b, plugintest.Config{StateDir: stateDir, Backend: backend,
		KubeletDir: stateDir + "-kubelet"})}
}

func (n *node) volume(attrs map[string]string, readOnly bool) kubeletsim.InlineVolume {
	n.n++
	v := n.p.Volume("ci", fmt.Sprintf("pod-%d", n.n), "vol", attrs)
	v.ReadOnly = readOnly
	return v
}

func (n *node) timed(call func(kubeletsim.InlineVolume) error, v kubeletsim.InlineVolume) time.Duration {
	start := time.Now()
	if err := call(v); err != nil {
		n.b.Fatal(err)
	}
	return time.Since(start)
}

// capture runs fill as a step on an output captured as handle (over source,
// if any) and returns how long the capture (the unpublish) took.
func (n *node) capture(source, handle string, fill func(dir string)) time.Duration {
	attrs := map[string]string{driver.AttrCapture: handle}
	if source != "" {
		attrs[driver.AttrSource] = source
	}
	v := n.volume(attrs, false)
	n.timed(n.p.Publish, v)
	fill(v.Target)
	return n.timed(n.p.Unpublish, v)
}

// settle waits for the plugin's background work to finish (the janitor
// deleting trashed views, writeback of what was just captured), so that a
// sample measures the call and not the cleanup of the one before it.
func (n *node) settle() {
	trash := filepath.Join(n.p.StateDir, "trash")
	deadline := time.Now().Add(2 * time.Minute)
	for {
		entries, err := os.ReadDir(trash)
		if err != nil || len(entries) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := exec.Command("sync").Run(); err != nil {
		n.b.Fatal(err)
	}
}

// publishTimes publishes source k times (writable, unmodified), each from a
// settled state, and returns the publish and unpublish times.
func (n *node) publishTimes(source string, k int) (pub, unpub []time.Duration) {
	for range k {
		n.settle()
		v := n.volume(map[string]string{driver.AttrSource: source}, false)
		pub = append(pub, n.timed(n.p.Publish, v))
		unpub = append(unpub, n.timed(n.p.Unpublish, v))
	}
	return pub, unpub
}

// noopTimes makes k CSI calls that do nothing (NodeGetCapabilities), each
// from a settled state as publishTimes' are: the floor under any call.
func (n *node) noopTimes(k int) []time.Duration {
	var out []time.Duration
	for range k {
		n.settle()
		start := time.Now()
		if _, err := n.p.Node.NodeGetCapabilities(context.Background(), &csi.NodeGetCapabilitiesRequest{}); err != nil {
			n.b.Fatal(err)
		}
		out = append(out, time.Since(start))
	}
	return out
}

func p50[T cmp.Ordered](ds []T) T {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func cpA(b *testing.B, src, dst string) time.Duration {
	b.Helper()
	start := time.Now()
	if out, err := exec.Command("cp", "-a", src, dst).CombinedOutput(); err != nil {
		b.Fatalf("cp -a: %v: %s", err, out)
	}
	d := time.Since(start)
	if err := os.RemoveAll(dst); err != nil {
		b.Fatal(err)
	}
	return d
}

// layerDir finds a cached volume's data dir on disk (for the cp baseline):
// the one dir beside its layer's file sums, once they are made.
func layerDir(b *testing.B, stateDir, handle string) string {
	matches, err := filepath.Glob(filepath.Join(stateDir, "volumes", "ci", handle, "*"))
	var dirs []string
	for _, m := range matches {
		if fi, err := os.Stat(m); err == nil && fi.IsDir() {
			dirs = append(dirs, m)
		}
	}
	if err != nil || len(dirs) != 1 {
		b.Fatalf("layer of %s: %v %v", handle, matches, err)
	}
	return dirs[0]
}

// startLogged starts cmd, its output into the file log, and kills it
// when the bench ends.
func startLogged(b *testing.B, cmd *exec.Cmd, log string) {
	b.Helper()
	f, err := os.Create(log)
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		f.Close()
	})
}

// startFillKeeper runs `cowvol-plugin fill-keeper` in dir, as the node
// plugin pod's sidecar does, until the bench ends, and returns its socket
// once it listens.
func startFillKeeper(b *testing.B, dir string) string {
	b.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	sock := filepath.Join(dir, "keeper.sock")
	startLogged(b, exec.Command(plugintest.Binary(b), "fill-keeper", "--socket="+sock, "--grace=60s"), filepath.Join(dir, "log"))
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		if st, err := os.Stat(sock); err == nil && st.Mode().Type() == os.ModeSocket {
			return sock
		}
		if time.Now().After(deadline) {
			b.Fatal("the fill keeper did not listen in a minute")
		}
	}
}

type row struct{ what, value, vs string }

func ms(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d.Microseconds())/1000) }

// ratio is base ÷ d, with two decimals where it is small.
func ratio(base, d time.Duration) string {
	r := float64(base) / float64(d)
	if r < 10 {
		return fmt.Sprintf("%.2fx", r)
	}
	return fmt.Sprintf("%.0fx", r)
}

// BenchmarkCowvol is the speed table. Run it with -benchtime 1x
// (make bench): each figure is itself a median over many calls.
func BenchmarkCowvol(b *testing.B) {
	testfs.Need(b, "cp")
	var rows []row
	report := func(name string, d time.Duration) { b.ReportMetric(float64(d.Microseconds())/1000, name+"-ms") }

	for range b.N {
		// Overlay on XFS with reflink: the recommended state dir.
		xfs := testfs.Mount(b, testfs.XFS, 8<<30)
		ov := newNode(b, filepath.Join(xfs, "overlay-state"), "overlay")
		ov.capture("", "src", func(dir string) { genTree(b, dir, treeFiles, treeBytes) })
		srcDir := layerDir(b, ov.p.StateDir, "src")
		var cps []time.Duration
		for i := range 3 {
			cps = append(cps, cpA(b, srcDir, filepath.Join(xfs, fmt.Sprintf("cp-%d", i))))
		}
		cp := p50(cps)
		pub1, unpub1 := ov.publishTimes("src", samples)
		noop := p50(ov.noopTimes(samples))
		prev := "src"
		for i := 2; i <= 10; i++ {
			h := fmt.Sprintf("link-%d", i)
			ov.capture(prev, h, func(dir string) {
				if err := os.WriteFile(filepath.Join(dir, h), []byte(h), 0o644); err != nil {
					b.Fatal(err)
				}
			})
			prev = h
		}
		pub10, _ := ov.publishTimes(prev, samples)
		var fillDir string
		ov.settle()
		capture := ov.capture("src", "task-out", func(dir string) {
			fillDir = filepath.Join(dir, "new")
			genTree(b, fillDir, treeFiles, treeBytes)
		})
		ov.settle() // the copy must not pay for writeback the capture skipped
		copyOut := cpA(b, filepath.Join(layerDir(b, ov.p.StateDir, "task-out"), "new"), filepath.Join(xfs, "cp-out"))

		report("cp-a", cp)
		report("overlay-publish-p50", p50(pub1))
		report("overlay-unpublish-p50", p50(unpub1))
		report("noop-call-p50", noop)
		report("overlay-depth10-publish-p50", p50(pub10))
		report("capture-1GiB", capture)
		rows = append(rows,
			row{"cp -a of the cached volume (XFS)", ms(cp), "1x"},
			row{"overlay publish p50, depth 1", ms(p50(pub1)), "cp -a / this = " + ratio(cp, p50(pub1))},
			row{"a CSI call that does nothing, p50", ms(noop), "publish / this = " + ratio(p50(pub1), noop)},
			row{"overlay unpublish p50, unmodified", ms(p50(unpub1)), ""},
			row{"overlay publish p50, depth 10", ms(p50(pub10)), "this / depth 1 = " + ratio(p50(pub10), p50(pub1))},
			row{"capture of 1 GiB / 50,000 new files", ms(capture), ""},
			row{"cp -a of that new data", ms(copyOut), "this / capture = " + ratio(copyOut, capture)},
		)

		// Reflink clones on the same XFS.
		rf := newNode(b, filepath.Join(xfs, "reflink-state"), "reflink")
		rf.capture("", "src", func(dir string) { genTree(b, dir, treeFiles, treeBytes) })
		pubR, unpubR := rf.publishTimes("src", 3)
		report("reflink-publish-p50", p50(pubR))
		rows = append(rows,
			row{"reflink publish p50 (FICLONE walk)", ms(p50(pubR)), "cp -a / this = " + ratio(cp, p50(pubR))},
			row{"reflink unpublish p50", ms(p50(unpubR)), ""})
		rf.p.Stop()
		ov.p.Stop()

		// btrfs snapshots.
		bt := testfs.Mount(b, testfs.Btrfs, 4<<30)
		bn := newNode(b, filepath.Join(bt, "state"), "btrfs")
		bn.capture("", "src", func(dir string) { genTree(b, dir, treeFiles, treeBytes) })
		cpB := cpA(b, layerDir(b, bn.p.StateDir, "src"), filepath.Join(bt, "cp"))
		pubB, unpubB := bn.publishTimes("src", samples)
		report("btrfs-publish-p50", p50(pubB))
		rows = append(rows,
			row{"cp -a of the cached volume (btrfs)", ms(cpB), "1x"},
			row{"btrfs snapshot publish p50", ms(p50(pubB)), "cp -a / this = " + ratio(cpB, p50(pubB))},
			row{"btrfs unpublish p50", ms(p50(unpubB)), ""})
		bn.p.Stop()

		// Why XFS: overlay copy-up of a 50 MiB file on XFS and on ext4.
		for _, fs := range []testfs.Kind{testfs.XFS, testfs.Ext4} {
			d := copyUp(b, fs)
			report("copyup-50MiB-"+string(fs), d)
			rows = append(rows, row{"overlay copy-up of a 50 MiB file, " + string(fs), ms(d), ""})
		}
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%-42s %12s  %s\n", "cowvol bench (50,000 files, 1 GiB)", "time", "vs")
	for _, r := range rows {
		fmt.Fprintf(&sb, "%-42s %12s  %s\n", r.what, r.value, r.vs)
	}
	fmt.Print(sb.String())
}

// copyUp times the first write to a 50 MiB file that a view got from its
// source: overlay copies the file up, cloning it where the filesystem can.
func copyUp(b *testing.B, fs testfs.Kind) time.Duration {
	root := testfs.Mount(b, fs, 1<<30)
	n := newNode(b, filepath.Join(root, "state"), "overlay")
	defer n.p.Stop()
	n.capture("", "big", func(dir string) {
		if err := os.WriteFile(filepath.Join(dir, "big"), make([]byte, 50<<20), 0o644); err != nil {
			b.Fatal(err)
		}
	})
	var times []time.Duration
	for range 5 {
		v := n.volume(map[string]string{driver.AttrSource: "big"}, false)
		n.timed(n.p.Publish, v)
		start := time.Now()
		f, err := os.OpenFile(filepath.Join(v.Target, "big"), os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			b.Fatal(err)
		}
		_, err = f.Write([]byte{1})
		f.Close()
		if err != nil {
			b.Fatal(err)
		}
		times = append(times, time.Since(start))
		n.timed(n.p.Unpublish, v)
	}
	return p50(times)
}
