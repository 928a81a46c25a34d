package bench

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	fleetview "github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/controller/owners"
	"github.com/concourse/cowvol/pkg/volume"
)

// Owner sweep bench: 1,000 nodes of 1,000 volumes each; a tenth of them
// owned, by 10,000 workflows (10 volumes each), one in ten of which is gone.
const ownerNodes, ownerPerNode, ownerWorkflows = 1000, 1000, 10000

// liveWorkflows answers as an API server listing Workflows would.
type liveWorkflows map[string]bool

func (l liveWorkflows) Live(context.Context, owners.Kind) (map[string]bool, error) { return l, nil }

// OwnerGone: the bench's Events go nowhere (the plugin queues them).
func (liveWorkflows) OwnerGone(string, volume.Owner, []volume.Ref) {}

// BenchmarkOwnerSweep is what the controller's owner sweep costs on a
// 1,000-node view (the API server's listing taken as free): one sweep
// that finds the gone workflows' volumes, against the comparator, a
// listing of every volume of the view in pages (what kubectl cowvol
// volumes -A reads), in the same run; and the longest a page holds the
// view's read lock.
func BenchmarkOwnerSweep(b *testing.B) {
	for range b.N {
		view := fleetview.NewView(time.Minute, time.Hour)
		now := time.Now()
		live := liveWorkflows{}
		uid := func(w int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012d", w) }
		for w := range ownerWorkflows {
			if w%10 != 0 {
				live[uid(w)] = true
			}
		}
		owned := 0
		for n := range ownerNodes {
			held := make([]fleetview.Held, 0, ownerPerNode)
			for i := range ownerPerNode {
				h := fleetview.Held{Ref: volume.Ref{Namespace: "ci", Handle: fmt.Sprintf("vol-%d-%d", n, i)}, State: volume.StateReady, SizeBytes: 1 << 30,
					Properties: []fleetview.Property{{Key: "job", Value: "unit"}}}
				if i%10 == 0 {
					w := owned % ownerWorkflows
					o := volume.Owner{Group: "argoproj.io", Kind: "Workflow", Name: fmt.Sprintf("build-%d", w), UID: uid(w)}
					for k, v := range o.Properties() {
						h.Properties = append(h.Properties, fleetview.Property{Key: k, Value: v})
					}
					owned++
				}
				held = append(held, h)
			}
			id := fmt.Sprintf("node-%04d", n)
			if _, err := view.Report(fleetview.Report{NodeID: id, StoreID: id, Revision: 1, Full: true, Upserts: held, BytesFree: 100 << 30}, now); err != nil {
				b.Fatal(err)
			}
		}
		var longest time.Duration
		timed := timedView{View: view, longest: &longest}
		runtime.GC() // the reports' garbage, before either is timed
		start := time.Now()
		destroyed, err := owners.New(timed, live, live, owners.NewMetrics()).Sweep(context.Background())
		sweep := time.Since(start)
		if err != nil || destroyed != owned/10 {
			b.Fatalf("sweep: %d destroyed, want %d: %v", destroyed, owned/10, err)
		}
		runtime.GC()
		start = time.Now()
		listed, pages, q := 0, 0, fleetview.ListQuery{Limit: 1000}
		for {
			page, more, err := view.List(q, time.Now())
			if err != nil {
				b.Fatal(err)
			}
			listed, pages = listed+len(page), pages+1
			if !more {
				break
			}
			q.After = page[len(page)-1].Ref.String()
		}
		listing := time.Since(start)
		fmt.Printf("\n%-70s %10s\n", fmt.Sprintf("owner sweep, %d nodes × %d volumes (%d owned by %d workflows)", ownerNodes, ownerPerNode, owned, ownerWorkflows), "took")
		fmt.Printf("%-70s %10s\n", fmt.Sprintf("listing every volume, %d pages of 1,000 (the comparator)", pages), ms(listing))
		fmt.Printf("%-70s %10s  %.2fx the listing\n", fmt.Sprintf("a sweep: %d workflows gone, %d volumes destroyed", ownerWorkflows/10, destroyed), ms(sweep),
			float64(sweep)/float64(listing))
		fmt.Printf("%-70s %10s\n", "the longest page of the sweep (the view's read lock held)", ms(longest))
		b.ReportMetric(float64(sweep)/float64(listing), "sweep-vs-listing")
		b.ReportMetric(float64(longest.Microseconds())/1000, "longest-page-ms")
	}
}

// timedView times each page the sweep reads.
type timedView struct {
	*fleetview.View
	longest *time.Duration
}

func (t timedView) Owned(after string, scan int, now time.Time) ([]fleetview.Owned, string) {
	start := time.Now()
	page, next := t.View.Owned(after, scan, now)
	*t.longest = max(*t.longest, time.Since(start))
	return page, next
}
