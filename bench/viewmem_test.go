package bench

import (
	"fmt"
	"runtime"
	"strconv"
	"testing"
	"time"

	model "github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// BenchmarkViewMemory: what the controller's view keeps in memory per
// volume and per copy (one node's record of a volume), built in process
// from the nodes' full reports, without gRPC. Two fleets of 100 nodes ×
// 10,000 volumes each, shaped as BenchmarkControllerFleet's (20
// namespaces, two properties): one where every volume is a node's own (a
// million volumes, a million copies), one where every node holds the same
// 10,000 (10,000 volumes, a million copies). The live heap of each, with
// the heap = volumes × per-volume + copies × per-copy, gives both costs
// (issue 39: a fleet of 1,000 nodes holds 10 million copies).
func BenchmarkViewMemory(b *testing.B) {
	const nodes, perNode = 100, 10_000
	for range b.N {
		own := viewHeap(b, nodes, perNode, false)
		shared := viewHeap(b, nodes, perNode, true)
		copies := float64(nodes * perNode)
		ownVolumes, sharedVolumes := copies, float64(perNode)
		perVolume := (own - shared) / (ownVolumes - sharedVolumes)
		perCopy := (shared - sharedVolumes*perVolume) / copies
		fmt.Printf("\nthe controller's view, live heap: %d nodes × %d volumes each: every volume its node's own %.0f MiB, every volume on every node %.0f MiB\n",
			nodes, perNode, own/(1<<20), shared/(1<<20))
		fmt.Printf("  %.0f bytes a volume, %.0f bytes a copy: 1,000 nodes × 10,000 copies would take %.1f GiB with the volumes of a 500,000 pool\n",
			perVolume, perCopy, (10e6*perCopy+500e3*perVolume)/(1<<30))
		b.ReportMetric(perVolume, "bytes/volume")
		b.ReportMetric(perCopy, "bytes/copy")
	}
}

// viewHeap builds a view from nodes' full reports and says how much live
// heap it holds.
func viewHeap(b *testing.B, nodes, perNode int, shared bool) float64 {
	before := liveHeap()
	v := model.NewView(time.Hour, time.Hour)
	now := time.Now()
	for n := range nodes {
		r := model.Report{NodeID: fmt.Sprintf("node-%04d", n), StoreID: fmt.Sprintf("store-%04d", n), Revision: 1, Full: true,
			PeerAddress: fmt.Sprintf("10.0.%d.%d:7443", n/250, n%250), Upserts: make([]model.Held, perNode)}
		for i := range r.Upserts {
			handle := fmt.Sprintf("n%04d-v%05d", n, i)
			if shared {
				handle = fmt.Sprintf("shared-v%05d", i)
			}
			r.Upserts[i] = model.Held{Ref: volume.Ref{Namespace: fmt.Sprintf("team-%d", i%20), Handle: handle},
				State: volume.StateReady, SizeBytes: int64(1<<20 + n*i), Scope: volume.ScopeNamespace,
				Properties: []model.Property{{Key: "resource", Value: "repo"}, {Key: "version", Value: strconv.Itoa(i)}}}
		}
		if _, err := v.Report(r, now); err != nil {
			b.Fatal(err)
		}
	}
	heap := liveHeap() - before
	runtime.KeepAlive(v)
	return heap
}

// liveHeap is the heap's live bytes after a collection.
func liveHeap() float64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return float64(m.HeapAlloc)
}
