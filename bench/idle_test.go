package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
)

// idleVolumes is how many volumes the idle node holds; idleFor how long its
// CPU is measured once the controller has its whole inventory.
const (
	idleVolumes = 10_000
	idleFor     = time.Minute
)

// BenchmarkIdleNode measures a node plugin's CPU over a minute in which
// nothing happens, reporting to a controller: with 10,000 cached volumes,
// against the same node with none (the comparator, in the same run).
// Target: at most 1% of a core.
func BenchmarkIdleNode(b *testing.B) {
	testfs.Need(b)
	addr := plugintest.FreeAddr(b)
	plugintest.Start(b, plugintest.Config{Mode: "controller", Args: []string{"--api-address=" + addr}})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	cache := controllerv1.NewCacheClient(conn)
	for range b.N {
		empty := idleCPU(b, cache, addr, "node-empty", 0)
		full := idleCPU(b, cache, addr, "node-full", idleVolumes)
		b.ReportMetric(full*100, "idle-10k-core-%")
		b.ReportMetric(empty*100, "idle-empty-core-%")
		fmt.Printf("\n%-52s %12s  %s\n", "cowvol idle node bench", "CPU", "vs")
		fmt.Printf("%-52s %12s  %s\n", fmt.Sprintf("idle node, %d volumes, over %s", idleVolumes, idleFor),
			fmt.Sprintf("%.2f%% core", full*100), fmt.Sprintf("empty node %.2f%% core; target ≤ 1%%", empty*100))
	}
}

// idleCPU starts a node plugin holding volumes cached volumes, waits until
// the controller lists them all, and returns the share of one core the
// plugin used over idleFor after that.
func idleCPU(b *testing.B, cache controllerv1.CacheClient, ctlAddr, nodeID string, volumes int) float64 {
	state := filepath.Join(testfs.Mount(b, testfs.XFS, 1<<30), "state")
	if volumes > 0 {
		seed(b, state, volumes)
	}
	p := plugintest.Start(b, plugintest.Config{StateDir: state, Backend: "overlay", NodeID: nodeID,
		Args: []string{"--controller-address=" + ctlAddr}})
	defer p.Stop()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		resp, err := cache.ListNodes(context.Background(), &controllerv1.ListNodesRequest{})
		if err != nil {
			b.Fatal(err)
		}
		known := false
		for _, n := range resp.Nodes {
			known = known || (n.NodeId == nodeID && int(n.Volumes) == volumes)
		}
		if known {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("the controller did not list %s's %d volumes in 2 minutes", nodeID, volumes)
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(5 * time.Second) // start-up's own work (recovery, the first sweeps) ends
	before, start := cpuTime(b, p.PID()), time.Now()
	time.Sleep(idleFor)
	return (cpuTime(b, p.PID()) - before).Seconds() / time.Since(start).Seconds()
}

// cpuTime is the user and system CPU time a process has used.
func cpuTime(b *testing.B, pid int) time.Duration {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// The command (field 2) is in parentheses and may hold spaces: fields
	// are counted after its closing one; utime and stime are fields 14
	// and 15, in clock ticks (USER_HZ, 100 on Linux).
	rest := string(raw)[strings.LastIndexByte(string(raw), ')')+2:]
	f := strings.Fields(rest)
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		b.Fatalf("/proc/%d/stat: %q", pid, raw)
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond
}
