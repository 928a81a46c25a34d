//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestLocalCluster is make cluster: TestFleet's cluster of real nodes
// with cowvol installed from its chart, kept up for a user to try until
// make cluster-down asks it to go (the file down in its dir), when it is
// taken down as every e2e cluster is, leaving nothing. It runs only under
// make cluster, which sets COWVOL_CLUSTER_DIR (and NODES, default 3).
func TestLocalCluster(t *testing.T) {
	dir := os.Getenv("COWVOL_CLUSTER_DIR")
	if dir == "" {
		t.Skip("COWVOL_CLUSTER_DIR is not set: make cluster runs this test, and keeps its cluster up until make cluster-down")
	}
	nodes := 3
	if s := os.Getenv("NODES"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(t, err, "NODES")
		nodes = n
	}
	// The controller's two replicas are on the nodes' own networks: one
	// node has room for one.
	require.GreaterOrEqual(t, nodes, 2, "NODES: the controller's two replicas need two nodes")
	f := startFleet(t, nodes)
	f.installCowvol()
	with := ""
	for _, extra := range strings.Fields(strings.ReplaceAll(os.Getenv("WITH"), ",", " ")) {
		switch extra {
		case "argo":
			require.NotEmpty(t, argoBin(), "WITH=argo: Argo Workflows was not built (make cluster builds it)")
			f.installArgo()
			with += "; Argo Workflows " + argoVersion + " in namespace argo (its steps run in ci as ServiceAccount argo-steps, on the pod network)"
		default:
			t.Fatalf("WITH=%s: make cluster can add argo", extra)
		}
	}
	raw, err := os.ReadFile(f.kubeconfig)
	require.NoError(t, err)
	writeFile(t, filepath.Join(dir, "kubeconfig"), string(raw))
	writeFile(t, filepath.Join(dir, "ready"), fmt.Sprintf("%d nodes%s; logs in %s\n", nodes, with, filepath.Join(f.work, "logs")))
	for {
		if _, err := os.Stat(filepath.Join(dir, "down")); err == nil {
			return
		}
		time.Sleep(time.Second)
	}
}
