package bench

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/plugintest"
)

// The simulated fleet: nodes × volumes each, reporting to one controller
// over loopback as node plugins do.
const (
	fleetNodes   = 100
	fleetVolumes = 10_000
)

// inventory is one simulated node's whole report: volumes shared with
// other nodes (a resource cache everyone holds) and its own.
func inventory(node int) []*controllerv1.VolumeSummary {
	out := make([]*controllerv1.VolumeSummary, fleetVolumes)
	for i := range out {
		handle := fmt.Sprintf("n%03d-v%05d", node, i)
		if i < fleetVolumes/10 {
			handle = fmt.Sprintf("shared-v%05d", i) // on every node
		}
		out[i] = &controllerv1.VolumeSummary{
			Ref: &controllerv1.VolumeRef{Namespace: fmt.Sprintf("team-%d", i%20), Handle: handle}, State: "ready",
			SizeBytes: int64(1<<20 + node*i), Scope: "namespace",
			Properties: []*controllerv1.Property{{Key: "resource", Value: "repo"}, {Key: "version", Value: strconv.Itoa(i)}},
		}
	}
	return out
}

func rss(b *testing.B, pid int) int64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}

// queries times 2,000 lookups of 10 handles and placements of 5-input
// steps, over handles the fleet holds.
func queries(b *testing.B, cache controllerv1.CacheClient) (lookups, placements []time.Duration) {
	ctx := context.Background()
	for i := range 2000 {
		var refs, inputs []*controllerv1.VolumeRef
		for j := range 10 {
			k := (i*10 + j) % fleetVolumes
			refs = append(refs, &controllerv1.VolumeRef{Namespace: fmt.Sprintf("team-%d", k%20), Handle: fmt.Sprintf("n%03d-v%05d", (i+j)%fleetNodes, k)})
		}
		for j := range 5 {
			k := (i*5 + j) % (fleetVolumes / 10)
			inputs = append(inputs, &controllerv1.VolumeRef{Namespace: fmt.Sprintf("team-%d", k%20), Handle: fmt.Sprintf("shared-v%05d", k)})
		}
		t0 := time.Now()
		if _, err := cache.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: refs}); err != nil {
			b.Fatal(err)
		}
		lookups = append(lookups, time.Since(t0))
		t0 = time.Now()
		if _, err := cache.Place(ctx, &controllerv1.PlaceRequest{Inputs: inputs}); err != nil {
			b.Fatal(err)
		}
		placements = append(placements, time.Since(t0))
	}
	return lookups, placements
}

// listPages times paging through one namespace's volumes and through
// every namespace, 500 a page (kubectl cowvol volumes, a scheduler's
// sweep), pages pages of each; and, as the comparator, lookups of the same
// 500 volumes a page returns: the cost of answering with them at all.
func listPages(b *testing.B, cache controllerv1.CacheClient, pages int) (one, all, lookups []time.Duration) {
	ctx := context.Background()
	page := func(namespace string, out *[]time.Duration) {
		req := &controllerv1.ListVolumesRequest{Namespace: namespace, Limit: 500}
		for range pages {
			t0 := time.Now()
			resp, err := cache.ListVolumes(ctx, req)
			if err != nil {
				b.Fatal(err)
			}
			*out = append(*out, time.Since(t0))
			if len(resp.GetVolumes()) != 500 {
				b.Fatalf("a page of %d volumes, not 500", len(resp.GetVolumes()))
			}
			var refs []*controllerv1.VolumeRef
			for _, v := range resp.GetVolumes() {
				refs = append(refs, v.GetRef())
			}
			t0 = time.Now()
			if _, err := cache.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: refs}); err != nil {
				b.Fatal(err)
			}
			lookups = append(lookups, time.Since(t0))
			req.PageToken = resp.GetNextPageToken()
		}
	}
	page("team-7", &one)
	page("", &all)
	return one, all, lookups
}

// BenchmarkControllerFleet measures the controller against a simulated fleet
// of 100 nodes × 10,000 volumes: applying one node's full sync, lookups of
// 10 handles, placement of a 5-input step, rebuilding the whole view after a
// restart, and its memory.
func BenchmarkControllerFleet(b *testing.B) {
	addr := plugintest.FreeAddr(b)
	// GOMEMLIMIT as deploy/csi's controller Deployment sets it, under its
	// 512 MiB memory limit.
	ctl := plugintest.Start(b, plugintest.Config{Mode: "controller", Args: []string{"--api-address=" + addr, "-v=2"},
		Env: []string{"GOMEMLIMIT=460MiB"}})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	reg, cache := controllerv1.NewRegistryClient(conn), controllerv1.NewCacheClient(conn)
	ctx := context.Background()
	// Inventories are made when sent, not kept: a million summaries held
	// here would make this process's garbage collector the thing measured
	// (it shares the machine's two cores with the controller).
	report := func(n int, full bool) (time.Duration, bool) {
		req := &controllerv1.ReportRequest{NodeId: fmt.Sprintf("node-%03d", n), StoreId: "store",
			Revision: 1, Full: full, BaseRevision: 1, BytesFree: int64(n) << 30}
		if full {
			req.Upserts = inventory(n)
		}
		start := time.Now()
		resp, err := reg.Report(ctx, req)
		if err != nil {
			b.Fatal(err)
		}
		return time.Since(start), resp.GetResync()
	}
	// The comparator: the same queries against the same controller while
	// it knows nothing, which is what loopback gRPC costs on this machine.
	floorLookups, floorPlacements := queries(b, cache)

	// The whole fleet reports, four nodes at a time.
	start := time.Now()
	g := errgroup.Group{}
	g.SetLimit(4)
	for n := range fleetNodes {
		g.Go(func() error {
			report(n, true)
			return nil
		})
	}
	_ = g.Wait()
	fill := time.Since(start)
	// Then a full sync of one node at a time against the whole view, as
	// the periodic resync of a running fleet is.
	var syncs []time.Duration
	for i := range 30 {
		d, _ := report(i*7%fleetNodes, true)
		syncs = append(syncs, d)
	}
	runtime.GC()

	lookups, placements := queries(b, cache)
	listOne, listAll, listLookups := listPages(b, cache, 20)
	mem := rss(b, ctl.PID())

	// A restart: every node's next heartbeat is told to resync, and sends
	// everything again.
	ctl.Restart()
	start = time.Now()
	for n := range fleetNodes {
		g.Go(func() error {
			if _, resync := report(n, false); resync {
				report(n, true)
			}
			return nil
		})
	}
	_ = g.Wait()
	rebuild := time.Since(start)
	memAfter := rss(b, ctl.PID())

	b.ReportMetric(float64(p50(syncs).Microseconds())/1000, "full-sync-p50-ms")
	b.ReportMetric(float64(p99(lookups).Microseconds())/1000, "lookup10-p99-ms")
	b.ReportMetric(float64(p99(placements).Microseconds())/1000, "place5-p99-ms")
	b.ReportMetric(float64(p50(listAll).Microseconds())/1000, "list500-p50-ms")
	b.ReportMetric(float64(rebuild.Milliseconds()), "rebuild-ms")
	b.ReportMetric(float64(mem>>20), "rss-MiB")
	rows := []row{
		{fmt.Sprintf("the whole fleet's first reports (%d nodes, 4 at a time)", fleetNodes), ms(fill), ""},
		{fmt.Sprintf("full sync of one node's %d volumes on a full view, p50", fleetVolumes), ms(p50(syncs)), "p99 " + ms(p99(syncs)) + " (target ≤ 50 ms)"},
		{"lookup of 10 handles, p50 (p99)", ms(p50(lookups)) + " (" + ms(p99(lookups)) + ")",
			"empty controller " + ms(p50(floorLookups)) + " (" + ms(p99(floorLookups)) + "); target p99 ≤ 1 ms"},
		{"placement of a 5-input step, p50 (p99)", ms(p50(placements)) + " (" + ms(p99(placements)) + ")",
			"empty controller " + ms(p50(floorPlacements)) + " (" + ms(p99(floorPlacements)) + "); target p99 ≤ 2 ms"},
		{"a page of 500 of one namespace's volumes, p50 (p99)", ms(p50(listOne)) + " (" + ms(p99(listOne)) + ")",
			ratio(p50(listOne), p50(listLookups)) + " a lookup of the same 500, p50 " + ms(p50(listLookups))},
		{"a page of 500 of every namespace's volumes, p50 (p99)", ms(p50(listAll)) + " (" + ms(p99(listAll)) + ")",
			ratio(p50(listAll), p50(listLookups)) + " a lookup of the same 500"},
		{"restart to a complete view (every node resyncs)", ms(rebuild), "target ≤ 10 s"},
		{fmt.Sprintf("controller RSS with %d volumes", fleetNodes*fleetVolumes), fmt.Sprintf("%d MiB", mem>>20), fmt.Sprintf("after the restart %d MiB (target ≤ 512 MiB)", memAfter>>20)},
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%-58s %12s  %s\n", "cowvol controller bench (100 nodes × 10,000 volumes)", "time", "vs")
	for _, r := range rows {
		fmt.Fprintf(&sb, "%-58s %12s  %s\n", r.what, r.value, r.vs)
	}
	fmt.Print(sb.String())
}
