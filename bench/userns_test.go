package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/cache"
	cownode "github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/volume"
)

// usernsPods says every pod whose name starts "userns-" runs in a user
// namespace of its own, as the API server would for hostUsers: false.
type usernsPods struct{}

func (usernsPods) UserNamespace(_ context.Context, p volume.Pod) (bool, error) {
	return strings.HasPrefix(p.Name, "userns-"), nil
}
func (usernsPods) StepResult(context.Context, volume.Pod) (volume.StepResult, bool) { return "", false }
func (usernsPods) Controller(context.Context, volume.Pod) (volume.Owner, bool, error) {
	return volume.Owner{}, false, nil
}

// engineNode is a node engine in process: the plugin binary learns which
// pods have user namespaces from an API server, which this bench has not.
type engineNode struct {
	b       *testing.B
	engine  *cownode.Engine
	kubelet string
	n       int
}

func newEngineNode(b *testing.B, stateDir, backend string) *engineNode {
	b.Helper()
	store, err := cache.Open(stateDir)
	if err != nil {
		b.Fatal(err)
	}
	kubelet := b.TempDir()
	e, err := cownode.New(cownode.Config{NodeID: "bench", StateDir: stateDir, Backend: backend, FlattenDepth: 64,
		KubeletDir: kubelet, Pods: usernsPods{}}, store, overlay.NewSysMounter(), nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { e.Close(); store.Close() })
	return &engineNode{b: b, engine: e, kubelet: kubelet}
}

// request is a writable volume of a new pod named prefix-N.
func (n *engineNode) request(prefix string, source, capture string) cownode.PublishRequest {
	n.b.Helper()
	n.n++
	uid := fmt.Sprintf("0b4a8c1e-3f2d-4c5b-9a6e-%012d", n.n)
	p := filepath.Join(n.kubelet, "pods", uid, "volumes", "kubernetes.io~csi", "vol", "mount")
	if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
		n.b.Fatal(err)
	}
	tp, err := n.engine.Layout().Parse(p)
	if err != nil {
		n.b.Fatal(err)
	}
	r := cownode.PublishRequest{VolumeID: fmt.Sprintf("csi-%d", n.n), Target: tp, Capture: capture, Scope: volume.ScopeNamespace,
		Pod: volume.Pod{Namespace: "ci", Name: fmt.Sprintf("%s-%d", prefix, n.n), UID: uid}}
	if source != "" {
		r.Source = volume.Ref{Namespace: "ci", Handle: source}
	}
	return r
}

// publishTimes publishes source k times to pods named prefix-N, writable
// and unmodified, and returns the publish times.
func (n *engineNode) publishTimes(prefix, source string, k int) []time.Duration {
	var pub []time.Duration
	for range k {
		r := n.request(prefix, source, "")
		start := time.Now()
		if err := n.engine.Publish(r); err != nil {
			n.b.Fatal(err)
		}
		pub = append(pub, time.Since(start))
		if err := n.engine.Unpublish(r.VolumeID, r.Target); err != nil {
			n.b.Fatal(err)
		}
	}
	return pub
}

// BenchmarkUserNamespacePublish compares, per backend and in one run, the
// publish of a 50,000-file input for a pod that shares the host's users
// with one for a pod with a user namespace of its own (hostUsers: false),
// whose runtime idmaps the mount, so that it gets no overlay.
func BenchmarkUserNamespacePublish(b *testing.B) {
	testfs.Need(b, "mkfs.xfs", "mkfs.btrfs")
	const bytes = 256 << 20 // clones and snapshots cost by files, not bytes
	var rows []row
	for range b.N {
		for _, c := range []struct {
			name    string
			fs      testfs.Kind
			backend string
		}{
			{"overlay on XFS (user namespaces: reflink clones)", testfs.XFS, "overlay"},
			{"reflink on XFS", testfs.XFS, "reflink"},
			{"btrfs snapshots", testfs.Btrfs, "btrfs"},
		} {
			n := newEngineNode(b, testfs.Mount(b, c.fs, 4<<30), c.backend)
			src := n.request("get", "", "src")
			if err := n.engine.Publish(src); err != nil {
				b.Fatal(err)
			}
			genTree(b, src.Target.Full, treeFiles, bytes)
			if err := n.engine.Unpublish(src.VolumeID, src.Target); err != nil {
				b.Fatal(err)
			}
			k := map[string]int{"overlay": 5, "reflink": 3, "btrfs": 5}[c.backend]
			host := p50(n.publishTimes("host", "src", k))
			userns := p50(n.publishTimes("userns", "src", k))
			b.ReportMetric(float64(host.Microseconds())/1000, c.backend+"-host-publish-ms")
			b.ReportMetric(float64(userns.Microseconds())/1000, c.backend+"-userns-publish-ms")
			rows = append(rows, row{c.name + ", host users", ms(host), ""},
				row{c.name + ", user namespace", ms(userns), "this / host users = " + ratio(userns, host)})
		}
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%-58s %12s  %s\n", "publish of 50,000 files (engine, p50)", "time", "vs")
	for _, r := range rows {
		fmt.Fprintf(&sb, "%-58s %12s  %s\n", r.what, r.value, r.vs)
	}
	fmt.Print(sb.String())
}
