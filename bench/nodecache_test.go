package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/volume"
)

// The node cache's own figures: eviction under disk pressure, and listing
// through the node API.
const (
	evictVolumes = 1000
	evictFiles   = 50
	listVolumes  = 10_000
	listPage     = 500
)

func p99(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)*99/100]
}

// BenchmarkNodeCache evicts 1,000 cached volumes of 50 files each to get a
// disk under its low watermark, timing publishes of a pinned volume during
// it against the same publishes on the idle node; and lists 10,000 volumes
// through the node API, a page of 500 at a time.
func BenchmarkNodeCache(b *testing.B) {
	testfs.Need(b)
	var rows []row
	for range b.N {
		rows = append(rows, benchEviction(b)...)
		rows = append(rows, benchListing(b)...)
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%-52s %12s  %s\n", "cowvol node cache bench", "time", "vs")
	for _, r := range rows {
		fmt.Fprintf(&sb, "%-52s %12s  %s\n", r.what, r.value, r.vs)
	}
	fmt.Print(sb.String())
}

func benchEviction(b *testing.B) []row {
	fs := testfs.Mount(b, testfs.XFS, 1<<30)
	n := &node{b: b, p: plugintest.Start(b, plugintest.Config{StateDir: filepath.Join(fs, "state"), Backend: "overlay",
		Args: []string{"--high-watermark=60", "--low-watermark=5", "--eviction-grace=0s"}})}
	n.capture("", "hot", func(dir string) {
		if err := os.WriteFile(filepath.Join(dir, "f"), []byte("hot"), 0o644); err != nil {
			b.Fatal(err)
		}
	})
	if _, err := n.p.NodeAPI.PinVolume(context.Background(), &nodev1.PinVolumeRequest{Ref: &nodev1.VolumeRef{Namespace: "ci", Handle: "hot"}}); err != nil {
		b.Fatal(err)
	}
	data := make([]byte, 1024)
	for i := range evictVolumes {
		n.capture("", fmt.Sprintf("v%04d", i), func(dir string) {
			for j := range evictFiles {
				if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%02d", j)), data, 0o644); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	n.settle()
	publishHot := func() time.Duration {
		v := n.volume(map[string]string{driver.AttrSource: "hot"}, true)
		d := n.timed(n.p.Publish, v)
		n.timed(n.p.Unpublish, v)
		return d
	}
	var idle []time.Duration
	for range samples {
		idle = append(idle, publishHot())
	}
	// Push the disk over its high watermark from outside the cache; the
	// reaper's next round evicts everything evictable.
	filler, err := os.Create(filepath.Join(fs, "filler"))
	if err != nil {
		b.Fatal(err)
	}
	defer filler.Close()
	chunk := make([]byte, 4<<20)
	for {
		n.settle()
		info, err := n.p.NodeAPI.GetNode(context.Background(), &nodev1.GetNodeRequest{})
		if err != nil {
			b.Fatal(err)
		}
		if info.UsedPercent > 62 {
			break
		}
		if _, err := filler.Write(chunk); err != nil {
			b.Fatal(err)
		}
	}
	var during []time.Duration
	deadline := time.Now().Add(5 * time.Minute)
	for !evicted(n.p.Log(), evictVolumes) {
		if time.Now().After(deadline) {
			b.Fatal("eviction did not finish in 5 minutes")
		}
		if strings.Contains(n.p.Log(), `reason="watermark"`) {
			during = append(during, publishHot())
		} else {
			time.Sleep(5 * time.Millisecond)
		}
	}
	first, last := logSpan(b, n.p.Log(), `reason="watermark"`)
	took := last.Sub(first)
	b.ReportMetric(float64(took.Milliseconds()), "evict-1000-ms")
	n.p.Stop()
	rows := []row{
		{fmt.Sprintf("eviction of %d volumes (%d files each)", evictVolumes, evictFiles), ms(took),
			fmt.Sprintf("%s a volume", (took / evictVolumes).Round(time.Microsecond))},
		{"publish p50 of a pinned volume, idle node", ms(p50(idle)), "1x"},
	}
	if len(during) > 0 {
		rows = append(rows, row{fmt.Sprintf("publish p50 during the eviction (%d samples)", len(during)), ms(p50(during)),
			"this / idle = " + ratio(p50(during), p50(idle))})
	}
	return rows
}

// evicted says whether the plugin logged want watermark evictions.
func evicted(log string, want int) bool {
	return strings.Count(log, `"Destroying a cached volume"`) >= want
}

// logSpan is when the first and last log lines containing part were logged
// (klog stamps lines with month, day and microseconds).
func logSpan(b *testing.B, log, part string) (first, last time.Time) {
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, part) || len(line) < 21 {
			continue
		}
		at, err := time.Parse("0102 15:04:05.000000", line[1:21])
		if err != nil {
			continue
		}
		if first.IsZero() {
			first = at
		}
		last = at
	}
	if first.IsZero() {
		b.Fatalf("no log line with %s", part)
	}
	return first, last
}

func benchListing(b *testing.B) []row {
	fs := testfs.Mount(b, testfs.XFS, 1<<30)
	state := filepath.Join(fs, "state")
	seed(b, state, listVolumes)
	p := plugintest.Start(b, plugintest.Config{StateDir: state, Backend: "overlay"})
	defer p.Stop()
	var pages []time.Duration
	var whole time.Duration
	for round := range 6 { // the first warms the connection and the page cache
		if round == 1 {
			pages, whole = nil, 0
		}
		start, token, count := time.Now(), "", 0
		for {
			t0 := time.Now()
			resp, err := p.NodeAPI.ListVolumes(context.Background(), &nodev1.ListVolumesRequest{PageSize: listPage, PageToken: token})
			if err != nil {
				b.Fatal(err)
			}
			pages = append(pages, time.Since(t0))
			count += len(resp.Volumes)
			if token = resp.NextPageToken; token == "" {
				break
			}
		}
		if count != listVolumes {
			b.Fatalf("listed %d volumes, want %d", count, listVolumes)
		}
		if d := time.Since(start); whole == 0 || d < whole {
			whole = d
		}
	}
	b.ReportMetric(float64(p99(pages).Microseconds())/1000, "list-page-p99-ms")
	b.ReportMetric(float64(whole.Microseconds())/1000, "list-10k-ms")
	return []row{
		{fmt.Sprintf("node API: one page of %d of %d volumes, p99", listPage, listVolumes), ms(p99(pages)), ""},
		{fmt.Sprintf("node API: all %d volumes (best of 5)", listVolumes), ms(whole), ""},
	}
}

// seed makes a store of n ready volumes the way captures make them, without
// a plugin (making them through pods would take most of the bench's time).
func seed(b *testing.B, dir string, n int) {
	s, err := cache.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	for i := range n {
		id := fmt.Sprintf("seed-%d", i)
		v, err := s.Publish(cache.View{VolumeID: id, Capture: fmt.Sprintf("v%05d", i), Scope: volume.ScopeNamespace,
			Properties: map[string]string{"resource": "repo", "version": fmt.Sprint(i)},
			Pod:        volume.Pod{Namespace: "ci", Name: "seed", UID: "0b4a8c1e-3f2d-4c5b-9a6e-7d8f9a0b1c2d"}})
		if err == nil {
			err = s.SetMounted(id, 1, "")
		}
		if err == nil {
			err = s.SetViewState(id, cache.ViewPublished, cache.ViewCapturing)
		}
		var res cache.Volume
		if err == nil {
			res, err = s.CaptureTarget(v)
		}
		if err == nil {
			err = os.MkdirAll(s.DataPath(res), 0o755)
		}
		if err == nil {
			_, err = s.CommitCapture(id, cache.Captured{})
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}
