package bench

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/indextest"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
)

// indexRounds is how many times each way is timed, taking turns.
const indexRounds = 3

// BenchmarkIndexedStubs: the puller's side of a lazy publish, from the
// holder's stub tree (a StubTar with the small files whole, as a lazy
// pull asks for it, packed once in memory) to a tree a step can open, for
// volumes of 1 GiB in 100,000, 300,000 and 1,000,000 files. Today's way
// extracts the stub tree (one stub file per file, on XFS; the pull's
// fanotify marks, one per stub, are not counted, so it is a lower bound);
// the index's way learns the tree from the same stream, writes its image,
// makes the blob a sparse file, writes the small files into it and mounts
// the image file-backed. Each way runs indexRounds times, taking turns,
// after the page cache is dropped; the figures are the medians, and the
// ratio is the index's over the stub tree's. It also reports the image's
// size and what the index's way allocates.
func BenchmarkIndexedStubs(b *testing.B) {
	testfs.Need(b)
	lim := streamer.DefaultLimits
	lim.Summed = true
	byFileCount(b, []int{100_000, 300_000, 1_000_000},
		fmt.Sprintf("%-10s %10s %12s %12s %8s %10s %12s", "files", "stubs MB", "stub tree", "index", "ratio", "image MB", "index alloc"),
		func(b *testing.B, files int, sb *strings.Builder) { indexedStubs(b, files, lim, sb) })
}

// byFileCount runs row for each count of files, as a sub-benchmark each
// (so that each one's filesystems go when it ends), and prints the table
// their rows make under header.
func byFileCount(b *testing.B, counts []int, header string, row func(b *testing.B, files int, sb *strings.Builder)) {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%s\n", header)
	for _, files := range counts {
		b.Run(fmt.Sprintf("files=%d", files), func(b *testing.B) {
			for range b.N {
				row(b, files, &sb)
			}
		})
	}
	fmt.Print(sb.String())
}

// indexedStubs is one row of BenchmarkIndexedStubs.
func indexedStubs(b *testing.B, files int, lim streamer.Limits, sb *strings.Builder) {
	holder := testfs.Mount(b, testfs.XFS, 8<<30) // sparse: a million inodes and 1 GiB
	layer := filepath.Join(holder, "layer")
	genTree(b, layer, files, 1<<30)
	sums, err := filesum.OfTree(context.Background(), layer)
	if err != nil {
		b.Fatal(err)
	}
	var wire bytes.Buffer
	if _, err := streamer.PackFirst(context.Background(), streamer.LayerFiles{Dir: layer, Sums: sums}, nil, &wire, streamer.Raw, streamer.StubTar, streamer.StubInline); err != nil {
		b.Fatal(err)
	}
	puller := testfs.MountAllocated(b, testfs.XFS, 4<<30)
	var stubs, indexes []time.Duration
	var imageBytes int64
	var alloc uint64
	for round := range indexRounds {
		dir := filepath.Join(puller, fmt.Sprintf("stubs-%d", round))
		if err := os.Mkdir(dir, 0o700); err != nil {
			b.Fatal(err)
		}
		dropCaches(b)
		start := time.Now()
		if _, err := streamer.UnpackStubs(context.Background(), bytes.NewReader(wire.Bytes()), streamer.Raw, dir, lim, streamer.StubInline,
			func(streamer.Stub) error { return nil }); err != nil {
			b.Fatal(err)
		}
		stubs = append(stubs, time.Since(start))
		if err := os.RemoveAll(dir); err != nil { // a million stubs are a GiB of inodes
			b.Fatal(err)
		}

		work := filepath.Join(puller, fmt.Sprintf("index-%d", round))
		if err := os.MkdirAll(filepath.Join(work, "mnt"), 0o700); err != nil {
			b.Fatal(err)
		}
		dropCaches(b)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		start = time.Now()
		imageBytes = mountIndexFromStubs(b, wire.Bytes(), lim, work)
		indexes = append(indexes, time.Since(start))
		runtime.ReadMemStats(&after)
		alloc = after.TotalAlloc - before.TotalAlloc
		if err := unix.Unmount(filepath.Join(work, "mnt"), 0); err != nil {
			b.Fatal(err)
		}
	}
	stub, idx := p50(stubs), p50(indexes)
	fmt.Fprintf(sb, "%-10d %10.1f %12s %12s %7.3fx %10.1f %9.1f MB\n", files, float64(wire.Len())/(1<<20),
		ms(stub), ms(idx), float64(idx)/float64(stub), float64(imageBytes)/(1<<20), float64(alloc)/(1<<20))
	b.ReportMetric(idx.Seconds(), fmt.Sprintf("index-%dk-s", files/1000))
	b.ReportMetric(stub.Seconds(), fmt.Sprintf("stubtree-%dk-s", files/1000))
	b.ReportMetric(float64(idx)/float64(stub), fmt.Sprintf("index/stubtree-%dk", files/1000))
}

// mountIndexFromStubs learns the index from a stub tree's stream, writes
// its image and a sparse blob holding the small files under work, and
// mounts it at work/mnt, as a pull would. It returns the image's size.
func mountIndexFromStubs(b *testing.B, wire []byte, lim streamer.Limits, work string) int64 {
	image, err := os.Create(filepath.Join(work, "index"))
	if err != nil {
		b.Fatal(err)
	}
	defer image.Close()
	layout, _, err := streamer.IndexStubs(context.Background(), bytes.NewReader(wire), streamer.Raw, lim, streamer.StubInline, image, nil)
	if err != nil {
		b.Fatal(err)
	}
	blob, err := os.Create(filepath.Join(work, "blob"))
	if err != nil {
		b.Fatal(err)
	}
	defer blob.Close()
	if err := blob.Truncate(layout.Size); err != nil {
		b.Fatal(err)
	}
	if err := layout.WriteInline(blob, func(int) {}); err != nil {
		b.Fatal(err)
	}
	if err := overlay.MountIndex(image.Name(), blob.Name(), filepath.Join(work, "mnt")); err != nil {
		b.Fatal(err)
	}
	st, err := image.Stat()
	if err != nil {
		b.Fatal(err)
	}
	return st.Size()
}

// BenchmarkIndexToLayer: what a volume pulled as an index costs to make a
// plain layer once its blob is whole (overlay.CopyIndex: the tree walked
// through the mount, each file's data cloned from the blob), against the
// same layer copied from a plain tree with clones (what a flatten of it
// costs, overlay.CopyLayers), on one XFS, for volumes of 1 GiB in 100,000
// and 300,000 files. Each way runs indexRounds times, taking turns, after
// the page cache is dropped; medians, and the ratio is the index's over
// the plain tree's.
func BenchmarkIndexToLayer(b *testing.B) {
	testfs.Need(b)
	byFileCount(b, []int{100_000, 300_000}, fmt.Sprintf("%-10s %12s %12s %8s %10s", "files", "plain tree", "index", "ratio", "cloned"), indexToLayer)
}

// indexToLayer is one row of BenchmarkIndexToLayer.
func indexToLayer(b *testing.B, files int, sb *strings.Builder) {
	fs := testfs.Mount(b, testfs.XFS, 8<<30)
	layer, work := filepath.Join(fs, "layer"), filepath.Join(fs, "work")
	genTree(b, layer, files, 1<<30)
	if err := os.MkdirAll(filepath.Join(work, "mnt"), 0o700); err != nil {
		b.Fatal(err)
	}
	image, blob, layout := indextest.Whole(b, layer, work)
	at := layout.Offset
	mnt := filepath.Join(work, "mnt")
	if err := overlay.MountIndex(image, blob, mnt); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
	var plains, indexes []time.Duration
	var cloned int64
	for round := range indexRounds {
		dst := filepath.Join(fs, fmt.Sprintf("plain-%d", round))
		dropCaches(b)
		start := time.Now()
		if _, err := overlay.CopyLayers(context.Background(), nil, []string{layer}, "", dst, true); err != nil {
			b.Fatal(err)
		}
		plains = append(plains, time.Since(start))
		if err := overlay.RemoveTree(dst); err != nil { // 300,000 inodes a copy
			b.Fatal(err)
		}

		dst = filepath.Join(fs, fmt.Sprintf("index-%d", round))
		dropCaches(b)
		start = time.Now()
		stats, err := overlay.CopyIndex(context.Background(), mnt, blob, at, dst)
		if err != nil {
			b.Fatal(err)
		}
		indexes = append(indexes, time.Since(start))
		cloned = stats.Cloned
		if err := overlay.RemoveTree(dst); err != nil {
			b.Fatal(err)
		}
	}
	plain, idx := p50(plains), p50(indexes)
	fmt.Fprintf(sb, "%-10d %12s %12s %7.3fx %10d\n", files, ms(plain), ms(idx), float64(idx)/float64(plain), cloned)
	b.ReportMetric(idx.Seconds(), fmt.Sprintf("index-%dk-s", files/1000))
	b.ReportMetric(plain.Seconds(), fmt.Sprintf("plain-%dk-s", files/1000))
	b.ReportMetric(float64(idx)/float64(plain), fmt.Sprintf("index/plain-%dk", files/1000))
}

// BenchmarkIndexPublish: node B lacks a volume node A holds (1 GiB in
// 100,000 and 300,000 files; two plugins on loopback). B's lazy publish,
// the moment its step may start, as a stub tree (today's way) and as an
// index (--pull-index), both served from the stub tree A kept after the
// capture, and as an index again with A's kept stream set aside (A walks
// its layer, as before it kept them), indexRounds times each, taking
// turns, each on a fresh B (a new state dir, page caches dropped); then
// how long until the volume is ready (every byte here; an index is ready
// as it is, made a plain layer later, once idle), and B's peak RSS by the publish's end and
// over the whole pull (until B has kept the filled layer's stub tree, the last work it makes), with
// B's CPU time over the pull and how long keeping that stub tree took it ("-": kept as an index
// pull received it, no walk). Medians; the ratios are the index's over the stub tree's, and the kept
// stream's over the walk's. Also what keeping the stub tree cost A: its
// time after the capture and its size a file.
//
// COWVOL_INDEX_PUBLISH_FILES (a comma-separated list; 1000000 takes a
// quarter of an hour a round), _FORMS (of stubs, index and walked) and
// _ROUNDS choose other runs.
func BenchmarkIndexPublish(b *testing.B) {
	testfs.Need(b)
	counts := []int{100_000, 300_000}
	if s := os.Getenv("COWVOL_INDEX_PUBLISH_FILES"); s != "" {
		counts = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(f)
			if err != nil {
				b.Fatalf("COWVOL_INDEX_PUBLISH_FILES: %v", err)
			}
			counts = append(counts, n)
		}
	}
	byFileCount(b, counts, fmt.Sprintf("%-10s %-7s %12s %12s %16s %12s %10s %12s", "files", "form", "publish", "ready", "RSS at publish", "peak RSS",
		"B's CPU", "B kept in"), indexPublish)
}

// keptLog is the plugin's line for a stub tree it kept, or found kept
// (the records an index pull received, kept as it was published): "-".
var keptLog = regexp.MustCompile(`"Kept a layer's stub tree" .* duration="([^"]+)"|"A layer's stub tree is kept already"`)

// summedLog is the plugin's line for a layer's table of sums it computed
// (after a capture, before it keeps the layer's stub tree).
var summedLog = regexp.MustCompile(`"Computed a layer's file sums" .* duration="([^"]+)"`)

// keptStubs waits up to within for n to keep a layer's stub tree (the
// last work a capture, or the fill of a pull, makes a node do), and says
// how long keeping it took.
func (n *node) keptStubs(within time.Duration) string {
	for deadline := time.Now().Add(within); ; time.Sleep(100 * time.Millisecond) {
		if m := keptLog.FindStringSubmatch(n.p.Log()); m != nil {
			return cmp.Or(m[1], "-")
		}
		if time.Now().After(deadline) {
			n.b.Fatalf("%s kept no stub tree: %s", n.p.NodeID, n.p.Log())
		}
	}
}

// indexPublish is one size of BenchmarkIndexPublish.
func indexPublish(b *testing.B, files int, sb *strings.Builder) {
	peerA := plugintest.FreeAddr(b)
	a := &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: "a", StateDir: testfs.Mount(b, testfs.XFS, 8<<30),
		Args: []string{"--peer-address=" + peerA}})}
	a.capture("", "tree", func(dir string) { genTree(b, dir, files, 1<<30) })
	keptFor := a.keptStubs(10 * time.Minute)
	summedFor := "-"
	if m := summedLog.FindStringSubmatch(a.p.Log()); m != nil {
		summedFor = m[1]
	}
	kept, err := filepath.Glob(filepath.Join(a.p.StateDir, "volumes", "ci", "tree", "*.stubs"))
	if err != nil || len(kept) != 1 {
		b.Fatalf("A's kept stub tree: %v %v", kept, err)
	}
	keptSt, err := os.Stat(kept[0])
	if err != nil {
		b.Fatal(err)
	}
	a.settle()
	// An index's blob lays each file at a block of its own, and the plain
	// layer copies each last block: a million small files take 8 GiB.
	diskB := testfs.Mount(b, testfs.XFS, max(8<<30, int64(files)*(16<<10)))
	forms := []struct {
		name   string
		index  bool
		walked bool // A's kept stream set aside
	}{{"stubs", false, false}, {"index", true, false}, {"walked", true, true}}
	chosen := strings.Split(cmp.Or(os.Getenv("COWVOL_INDEX_PUBLISH_FORMS"), "stubs,index,walked"), ",")
	rounds := indexRounds
	if s := os.Getenv("COWVOL_INDEX_PUBLISH_ROUNDS"); s != "" {
		if rounds, err = strconv.Atoi(s); err != nil {
			b.Fatalf("COWVOL_INDEX_PUBLISH_ROUNDS: %v", err)
		}
	}
	publish, ready, cpu := make([][]time.Duration, len(forms)), make([][]time.Duration, len(forms)), make([][]time.Duration, len(forms))
	peak, atPublish := make([]int64, len(forms)), make([]int64, len(forms))
	keptBy := make([]string, len(forms))
	for round := range rounds {
		for i, form := range forms {
			if !slices.Contains(chosen, form.name) {
				continue
			}
			if form.walked {
				if err := os.Rename(kept[0], kept[0]+".aside"); err != nil {
					b.Fatal(err)
				}
			}
			state := filepath.Join(diskB, fmt.Sprintf("%s-%d", form.name, round))
			bn := &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: "b", StateDir: state,
				KubeletDir: state + "-kubelet", Args: []string{"--peers=a=" + peerA, "--pull-mode=lazy", "--pull-wait=30m",
					fmt.Sprintf("--pull-index=%v", form.index)}})}
			if form.index != strings.Contains(bn.p.Log(), "as indexes") {
				b.Fatalf("B does not pull as %s: %s", form.name, bn.p.Log())
			}
			dropCaches(b)
			resetPeak(b, bn.p.PID())
			startCPU := cpuTime(b, bn.p.PID())
			v := bn.volume(map[string]string{driver.AttrSource: "tree"}, true)
			start := time.Now()
			publish[i] = append(publish[i], bn.timed(bn.p.Publish, v))
			atPublish[i] = max(atPublish[i], vmKiB(b, bn.p.PID(), "VmHWM"))
			for {
				got, err := bn.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: &nodev1.VolumeRef{Namespace: "ci", Handle: "tree"}})
				if err != nil {
					b.Fatal(err)
				}
				if got.State == "ready" {
					break
				}
				if got.State != "filling" {
					b.Fatalf("the pulled volume is %s", got.State)
				}
				time.Sleep(20 * time.Millisecond)
			}
			ready[i] = append(ready[i], time.Since(start))
			// The pull's last work on B: the filled layer's table of
			// sums read, and its stub tree kept for B's own peers (an
			// index pull's kept as it was received).
			keptBy[i] = bn.keptStubs(2 * time.Minute)
			peak[i] = max(peak[i], vmKiB(b, bn.p.PID(), "VmHWM"))
			cpu[i] = append(cpu[i], cpuTime(b, bn.p.PID())-startCPU)
			bn.timed(bn.p.Unpublish, v)
			bn.p.Stop()
			for _, dir := range []string{state, state + "-kubelet"} {
				if err := overlay.RemoveTree(dir); err != nil {
					b.Fatal(err)
				}
			}
			if form.walked {
				if err := os.Rename(kept[0]+".aside", kept[0]); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	for i, form := range forms {
		if len(publish[i]) > 0 {
			fmt.Fprintf(sb, "%-10d %-7s %12s %12s %12.1f MiB %8.1f MiB %8.2f s %12s\n", files, form.name, ms(p50(publish[i])), ms(p50(ready[i])),
				float64(atPublish[i])/1024, float64(peak[i])/1024, p50(cpu[i]).Seconds(), keptBy[i])
		}
	}
	ratio := func(x, y []time.Duration) float64 { return float64(p50(x)) / float64(p50(y)) }
	const stubs, index, walked = 0, 1, 2
	for _, r := range []struct {
		of, to int
		name   string
	}{{index, stubs, "index/stubs"}, {index, walked, "kept/walked"}} {
		if len(publish[r.of]) == 0 || len(publish[r.to]) == 0 {
			continue
		}
		pub, rdy := ratio(publish[r.of], publish[r.to]), ratio(ready[r.of], ready[r.to])
		fmt.Fprintf(sb, "%-10d %-7s %11.3fx %11.3fx   %s\n", files, "ratio", pub, rdy, r.name)
		b.ReportMetric(pub, fmt.Sprintf("%s-publish-%dk", r.name, files/1000))
		b.ReportMetric(rdy, fmt.Sprintf("%s-ready-%dk", r.name, files/1000))
	}
	fmt.Fprintf(sb, "%-10d summed by A in %s, kept by A in %s, %.1f bytes a file\n", files, summedFor, keptFor, float64(keptSt.Size())/float64(files))
	for i, form := range forms {
		if len(publish[i]) > 0 {
			b.ReportMetric(p50(publish[i]).Seconds(), fmt.Sprintf("%s-publish-%dk-s", form.name, files/1000))
		}
	}
}
