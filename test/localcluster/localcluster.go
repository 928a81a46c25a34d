// Package localcluster is a Kubernetes cluster of real nodes on one
// machine, made for cowvol's e2e, its soak, its benches and make cluster:
// etcd, an API server that authorizes with Node and RBAC, a controller
// manager and a scheduler, and for each node a containerd, a kubelet
// (system:node:<name>) and a kube-proxy, with cowvol installed from its
// manifests or its Helm chart, and Argo Workflows when asked. A cluster
// is either one node on loopback (StartWith, StartNode) or a fleet of
// nodes in network and mount namespaces of their own (StartFleet).
// Everything it starts it stops when its TB ends, leaving no process,
// mount, cgroup, interface or changed sysctl behind.
//
// It runs under a testing.TB or under the command in cmd/ (a tb.TB of its
// own). It does not hold any test scenario: those are test/e2e's. It
// needs root, the binaries make e2e builds (named by the COWVOL_E2E_*
// variables) and the tools testfs.Need lists.
package localcluster

import (
	"os"
	"path/filepath"
	"strings"

	"github.com/concourse/cowvol/internal/tb"
)

// module is the go.mod line of cowvol's repository.
const module = "module github.com/concourse/cowvol\n"

// Repo is path in cowvol's repository, found from the working directory
// up (the e2e runs in test/e2e, make cluster's command at the top).
func Repo(t tb.TB, path string) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.HasPrefix(string(b), module) {
			return filepath.Join(dir, path)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatalf("%s: not in cowvol's repository (no go.mod of %s above it)", path, strings.TrimSpace(module))
		}
		dir = parent
	}
}
