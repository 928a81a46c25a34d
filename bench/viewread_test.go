package bench

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

// viewReadRounds is how many times BenchmarkViewRead reads each tree,
// taking turns, after a first read of each that warms the page cache.
const viewReadRounds = 5

// BenchmarkViewRead reads every file of a 1 GiB / 50,000-file cached
// volume, page cache warm, through a writable view (an overlay over it),
// through a read-only view (a bind mount of its layer) and from its layer
// dir itself, the comparator (issue 38's target for the writable view: at
// most 1.15x).
func BenchmarkViewRead(b *testing.B) {
	testfs.Need(b)
	for range b.N {
		state := filepath.Join(testfs.Mount(b, testfs.XFS, 4<<30), "state")
		n := newNode(b, state, "overlay")
		n.capture("", "tree", func(dir string) { genMixedTree(b, dir, treeFiles, treeBytes) })
		n.settle()
		rw := n.volume(map[string]string{driver.AttrSource: "tree"}, false)
		ro := n.volume(map[string]string{driver.AttrSource: "tree"}, true)
		n.timed(n.p.Publish, rw)
		n.timed(n.p.Publish, ro)
		trees := []struct{ what, dir string }{
			{"the layer dir (plain directory)", layerDir(b, state, "tree")},
			{"a writable view (overlay)", rw.Target},
			{"a read-only view (bind mount)", ro.Target},
		}
		read := readEvery(b, 1)
		took := map[string][]time.Duration{}
		for _, t := range trees {
			read(t.dir) // warm
		}
		for round := range viewReadRounds {
			for i := range trees {
				t := trees[(i+round)%len(trees)]
				start := time.Now()
				read(t.dir)
				took[t.what] = append(took[t.what], time.Since(start))
			}
		}
		n.timed(n.p.Unpublish, rw)
		n.timed(n.p.Unpublish, ro)
		n.p.Stop()
		plain := p50(took[trees[0].what])
		fmt.Printf("\n%-52s %12s  %s\n", "reading every file of 1 GiB / 50,000 files, warm", "p50", "vs")
		for _, t := range trees {
			d := p50(took[t.what])
			fmt.Printf("%-52s %12s  %.2fx the plain directory\n", t.what, ms(d), float64(d)/float64(plain))
		}
		b.ReportMetric(float64(p50(took[trees[1].what]))/float64(plain), "rw-view-vs-dir")
		b.ReportMetric(float64(p50(took[trees[2].what]))/float64(plain), "ro-view-vs-dir")
	}
}
