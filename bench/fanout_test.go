package bench

import (
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/plugin"
)

// fanOutRate is every host's link, each way. At 200 Mbit/s a 1 GiB pull
// takes most of a minute on the wire while the receiving end uses a
// fraction of a core (a pull runs at several times that locally): with up
// to 9 plugins on 2 cores the links, not the CPUs, are the limit, which is
// what fan-out is about.
const fanOutRate = "200mbit"

// BenchmarkFanOut pulls one 1 GiB / 50,000-file volume from its holder
// onto 1, 4 and 8 consumer nodes at once, eagerly, every host's link
// shaped to fanOutRate both ways, and reports how long until every
// consumer holds it, against one consumer alone in the same run (issue 38's
// target with 8: at most 2x).
func BenchmarkFanOut(b *testing.B) {
	lab := netlab.New(b)
	holder := lab.Host("h")
	consumers := make([]*netlab.Host, 8)
	for i := range consumers {
		consumers[i] = lab.Host(fmt.Sprintf("c%d", i+1))
	}
	for _, h := range append([]*netlab.Host{holder}, consumers...) {
		h.ShapeLink(fanOutRate)
	}
	pki := netlab.NewPKI(b, filepath.Join(b.TempDir(), "pki"), plugin.DefaultPeerServerName)
	tlsArgs := []string{"--peer-tls-cert-file=" + pki.Cert, "--peer-tls-key-file=" + pki.Key, "--peer-ca-file=" + pki.CA}
	peer := net.JoinHostPort(holder.IP, "7443")
	for range b.N {
		state, disk := testfs.Mount(b, testfs.XFS, 4<<30), testfs.MountAllocated(b, testfs.XFS, 12<<30)
		h := &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: "h", StateDir: state,
			Wrap: holder.Command, Args: append([]string{"--peer-address=" + peer}, tlsArgs...)})}
		h.capture("", "tree", func(dir string) { genMixedTree(b, dir, treeFiles, treeBytes) })
		h.settle()
		warmDisk(b, layerDir(b, state, "tree"), disk)
		took := map[int]time.Duration{}
		var rows []string
		for _, n := range []int{1, 4, 8} {
			dropCaches(b)
			nodes := make([]*node, n)
			for i := range nodes {
				nodes[i] = &node{b: b, p: plugintest.Start(b, plugintest.Config{Backend: "overlay", NodeID: fmt.Sprintf("c%d", i+1),
					StateDir: filepath.Join(disk, fmt.Sprintf("n%d-c%d", n, i+1)), Wrap: consumers[i].Command,
					Args: append([]string{"--peers=h=" + peer, "--pull-mode=eager", "--pull-wait=30m"}, tlsArgs...)})}
			}
			each := make([]time.Duration, n)
			start := time.Now()
			g := errgroup.Group{}
			for i, c := range nodes {
				g.Go(func() error { // b.Fatal belongs to the benchmark's goroutine
					v := c.volume(map[string]string{driver.AttrSource: "tree"}, true)
					began := time.Now()
					if err := c.p.Publish(v); err != nil {
						return err
					}
					each[i] = time.Since(began)
					return c.p.Unpublish(v)
				})
			}
			if err := g.Wait(); err != nil {
				b.Fatal(err)
			}
			took[n] = time.Since(start)
			for _, c := range nodes {
				c.p.Stop()
				dropTree(b, c.p.StateDir)
			}
			var per []string
			for _, d := range each {
				per = append(per, fmt.Sprintf("%.1fs", d.Seconds()))
			}
			b.ReportMetric(float64(took[n].Milliseconds()), fmt.Sprintf("fanout-%d-ms", n))
			rows = append(rows, fmt.Sprintf("%-52s %10.1fs  %5.2fx one alone (each: %s)", fmt.Sprintf("%d consumer(s) pulling at once, until all hold it", n),
				took[n].Seconds(), float64(took[n])/float64(took[1]), strings.Join(per, " ")))
		}
		b.ReportMetric(float64(took[8])/float64(took[1]), "fanout-8-vs-1")
		fmt.Printf("\n%-52s %11s  %s\n%s\n", fmt.Sprintf("fan-out of 1 GiB / 50,000 files, links %s each way", fanOutRate), "time", "vs", strings.Join(rows, "\n"))
		h.p.Stop()
	}
}
