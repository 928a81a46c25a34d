package test

import (
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/netlab"
	"github.com/concourse/cowvol/internal/peerid"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/driver"
)

func cref(ns, h string) *controllerv1.VolumeRef {
	return &controllerv1.VolumeRef{Namespace: ns, Handle: h}
}

// fleet is a controller, node plugins reporting to it on loopback, and a
// scheduler's client of its Cache API.
type fleet struct {
	ctl  *plugintest.Plugin
	addr string // the controller's API
	api  controllerv1.CacheClient
	// registry is the nodes' side of its API.
	registry controllerv1.RegistryClient
	nodes    map[string]*env
}

// startFleet starts a controller with ctlArgs and a node plugin for each
// of nodeIDs.
func startFleet(t *testing.T, ctlArgs []string, nodeIDs ...string) *fleet {
	t.Helper()
	testfs.Need(t)
	addr := plugintest.FreeAddr(t)
	f := &fleet{nodes: map[string]*env{}, addr: addr}
	f.ctl = plugintest.Start(t, plugintest.Config{Mode: "controller", Args: append([]string{"--api-address=" + addr}, ctlArgs...)})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	f.api, f.registry = controllerv1.NewCacheClient(conn), controllerv1.NewRegistryClient(conn)
	for _, id := range nodeIDs {
		f.nodes[id] = newEnv(t, plugintest.Config{Backend: "overlay", NodeID: id, Args: []string{"--controller-address=" + addr}})
	}
	return f
}

// A controller and three node plugins on loopback: the nodes report what
// they capture, lookups say which nodes hold what, placement ranks nodes by
// the bytes of a step's inputs they hold, a killed node goes stalled and
// out of the answers, a node back with a wiped state dir holds nothing it
// held before at once, and a restarted controller rebuilds the same view
// from the nodes.
func TestControllerViewOfTheNodes(t *testing.T) {
	f := startFleet(t, []string{"--stalled-after=3s", "--forget-stalled-after=1m"}, "node-a", "node-b", "node-c")
	ctl, api, nodes, ctx := f.ctl, f.api, f.nodes, context.Background()
	blob := func(size int) func(string) {
		return func(dir string) { write(t, dir, "blob", strings.Repeat("x", size)) }
	}
	nodes["node-a"].step("", "res", blob(1<<20))
	nodes["node-b"].step("", "res", blob(1<<20))
	nodes["node-b"].step("", "tools", blob(4<<20))

	lookup := func() []*controllerv1.VolumeLocation {
		resp, err := api.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{
			cref("ci", "res"), cref("ci", "tools"), cref("ci", "nope")}})
		require.NoError(t, err)
		return resp.Volumes
	}
	eventually(t, "the controller to see every capture", func() bool {
		l := lookup()
		return strings.Join(l[0].Nodes, ",") == "node-a,node-b" && strings.Join(l[1].Nodes, ",") == "node-b"
	})
	require.False(t, lookup()[2].Found)
	require.Equal(t, "ready", lookup()[0].State)

	placed := func() []string {
		resp, err := api.Place(ctx, &controllerv1.PlaceRequest{Inputs: []*controllerv1.VolumeRef{cref("ci", "res"), cref("ci", "tools")}})
		require.NoError(t, err)
		var order []string
		for _, n := range resp.Nodes {
			order = append(order, n.NodeId)
		}
		return order
	}
	eventually(t, "placement to rank by the bytes held", func() bool {
		return strings.Join(placed(), ",") == "node-b,node-a,node-c"
	})
	resp, err := api.Place(ctx, &controllerv1.PlaceRequest{Inputs: []*controllerv1.VolumeRef{cref("ci", "res"), cref("ci", "tools")}})
	require.NoError(t, err)
	require.Greater(t, resp.Nodes[0].InputBytesHeld, int64(5<<20))
	require.Len(t, resp.Nodes[1].Missing, 1, "node-a lacks tools")
	require.Len(t, resp.Nodes[2].Missing, 2)

	// Answers as short as the caller asks: the best placement, the first
	// holder by ID with how many there are; and no fewer than none.
	best, err := api.Place(ctx, &controllerv1.PlaceRequest{Inputs: []*controllerv1.VolumeRef{cref("ci", "res"), cref("ci", "tools")}, Limit: 1})
	require.NoError(t, err)
	require.Len(t, best.Nodes, 1)
	require.Equal(t, "node-b", best.Nodes[0].NodeId)
	first, err := api.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", "res")}, MaxNodes: 1})
	require.NoError(t, err)
	require.Equal(t, []string{"node-a"}, first.Volumes[0].Nodes)
	require.Equal(t, int32(2), first.Volumes[0].NodeCount)
	for name, call := range map[string]func() error{
		"a placement's limit": func() error { _, err := api.Place(ctx, &controllerv1.PlaceRequest{Limit: -1}); return err },
		"a lookup's max_nodes": func() error {
			_, err := api.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{MaxNodes: -1})
			return err
		},
		"a listing's max_nodes": func() error {
			_, err := api.ListVolumes(ctx, &controllerv1.ListVolumesRequest{MaxNodes: -1})
			return err
		},
	} {
		require.Equal(t, codes.InvalidArgument, code(call()), "%s below 0", name)
	}

	// The CSI controller answers from the same view.
	reader := nodes["node-b"].mount(map[string]string{"source": "tools"}, true)
	csiCtl := csi.NewControllerClient(ctl.Conn)
	eventually(t, "ListVolumes to show where tools is held and mounted", func() bool {
		resp, err := csiCtl.ListVolumes(ctx, &csi.ListVolumesRequest{})
		require.NoError(t, err)
		for _, e := range resp.Entries {
			if e.Volume.VolumeId == "ci/tools" {
				return len(e.Status.PublishedNodeIds) == 1 && e.Status.PublishedNodeIds[0] == "node-b"
			}
		}
		return false
	})
	page, err := csiCtl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 1})
	require.NoError(t, err)
	require.Equal(t, "ci/res", page.Entries[0].Volume.VolumeId)
	require.Len(t, page.Entries[0].Volume.AccessibleTopology, 2, "held by node-a and node-b")
	page, err = csiCtl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 1, StartingToken: page.NextToken})
	require.NoError(t, err)
	require.Equal(t, "ci/tools", page.Entries[0].Volume.VolumeId)
	require.Empty(t, page.NextToken)
	got, err := csiCtl.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: "ci/tools"})
	require.NoError(t, err)
	require.Greater(t, got.Volume.CapacityBytes, int64(4<<20))
	_, err = csiCtl.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: "ci/nope"})
	require.Equal(t, codes.NotFound, code(err))
	capacity, err := csiCtl.GetCapacity(ctx, &csi.GetCapacityRequest{
		AccessibleTopology: &csi.Topology{Segments: map[string]string{driver.TopologyKey: "node-c"}}})
	require.NoError(t, err)
	require.Positive(t, capacity.AvailableCapacity)
	nodes["node-b"].umount(reader)

	// A controller restart rebuilds the same view from the nodes.
	ctl.Restart()
	start := time.Now()
	eventually(t, "the restarted controller's view", func() bool {
		l := lookup()
		return strings.Join(l[0].Nodes, ",") == "node-a,node-b" && strings.Join(l[1].Nodes, ",") == "node-b"
	})
	t.Logf("a restarted controller had the whole view again after %s", time.Since(start).Round(time.Millisecond))

	// A killed node goes stalled and out of the answers.
	nodes["node-a"].p.Kill()
	eventually(t, "node-a to stall", func() bool { return strings.Join(lookup()[0].Nodes, ",") == "node-b" })
	listed, err := api.ListNodes(ctx, &controllerv1.ListNodesRequest{})
	require.NoError(t, err)
	require.Equal(t, "stalled", listed.Nodes[0].State)
	require.Equal(t, "running", listed.Nodes[1].State)

	// Back with a wiped state dir under its name, node-b holds nothing.
	b := nodes["node-b"]
	b.p.Kill()
	entries, err := os.ReadDir(b.p.StateDir)
	require.NoError(t, err)
	for _, e := range entries {
		require.NoError(t, os.RemoveAll(filepath.Join(b.p.StateDir, e.Name())))
	}
	b.p.Restart()
	eventually(t, "node-b's old volumes to be gone", func() bool {
		l := lookup()
		return !l[0].Found && !l[1].Found
	})
}

// The scheduler's garbage collection through the controller: destroyed
// volumes are gone from lookups at once and destroyed on every node that
// holds them; one a step still reads keeps working there and goes once it
// is released; a pin reaches the nodes too.
func TestGarbageCollectionThroughTheController(t *testing.T) {
	f := startFleet(t, nil, "node-a", "node-b")
	api, a, b, ctx := f.api, f.nodes["node-a"], f.nodes["node-b"], context.Background()
	for _, e := range []*env{a, b} {
		e.step("", "old", func(dir string) { write(t, dir, "f", "old") })
		e.step("", "keep", func(dir string) { write(t, dir, "f", "keep") })
	}
	reader := b.mount(map[string]string{"source": "old"}, true)
	found := func(h string) []string {
		resp, err := api.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", h)}})
		require.NoError(t, err)
		return resp.Volumes[0].Nodes
	}
	eventually(t, "both nodes to report", func() bool { return len(found("old")) == 2 && len(found("keep")) == 2 })

	resp, err := api.DestroyVolumes(ctx, &controllerv1.DestroyVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", "old")}})
	require.NoError(t, err)
	require.Equal(t, []string{"node-a", "node-b"}, resp.Volumes[0].Nodes)
	require.Empty(t, found("old"), "gone from lookups at once")
	onNode := func(e *env, h string) codes.Code {
		_, err := e.p.NodeAPI.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", h)})
		return code(err)
	}
	eventually(t, "both nodes to destroy it", func() bool {
		return onNode(a, "old") == codes.NotFound && onNode(b, "old") == codes.NotFound
	})
	require.Equal(t, "old", readFile(t, reader.Target, "f"), "a step reading it keeps working")
	b.umount(reader)
	eventually(t, "its data to go once released", func() bool {
		_, err := os.Stat(filepath.Join(b.p.StateDir, "volumes", "ci", "old"))
		return os.IsNotExist(err)
	})
	require.Len(t, found("keep"), 2, "the rest is untouched")

	_, err = api.PinVolumes(ctx, &controllerv1.PinVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", "keep")}})
	require.NoError(t, err)
	eventually(t, "the pin to reach both nodes", func() bool {
		for _, e := range []*env{a, b} {
			v, err := e.p.NodeAPI.GetVolume(ctx, &nodev1.GetVolumeRequest{Ref: vref("ci", "keep")})
			if err != nil || !v.Pinned {
				return false
			}
		}
		return true
	})
	a.noLeaks(t)
	b.noLeaks(t)
}

// Node lifecycle through the controller: a landed node takes no
// placements and refuses captures until resumed; a retiring node, once its
// steps are done, destroys everything it holds and leaves.
func TestNodeLifecycleThroughTheController(t *testing.T) {
	metrics := plugintest.FreeAddr(t)
	f := startFleet(t, []string{"--metrics-address=" + metrics}, "node-a", "node-b")
	api, a, b, ctx := f.api, f.nodes["node-a"], f.nodes["node-b"], context.Background()
	a.step("", "res", func(dir string) { write(t, dir, "f", "a") })
	b.step("", "res", func(dir string) { write(t, dir, "f", "b") })
	eventually(t, "both nodes to report", func() bool {
		resp, err := api.ListNodes(ctx, &controllerv1.ListNodesRequest{})
		return err == nil && len(resp.Nodes) == 2
	})
	_, err := api.SetNodeLifecycle(ctx, &controllerv1.SetNodeLifecycleRequest{NodeId: "node-x", Action: "land"})
	require.Equal(t, codes.NotFound, code(err))
	_, err = api.SetNodeLifecycle(ctx, &controllerv1.SetNodeLifecycleRequest{NodeId: "node-a", Action: "fly"})
	require.Equal(t, codes.InvalidArgument, code(err))

	st, err := api.SetNodeLifecycle(ctx, &controllerv1.SetNodeLifecycleRequest{NodeId: "node-a", Action: "land"})
	require.NoError(t, err)
	require.Equal(t, "landed", st.State, "no step uses its volumes")
	metric := func(line string) bool { return strings.Contains(scrape(t, &env{metrics: metrics}), line) }
	for _, line := range []string{`cowvol_controller_nodes{state="landed"} 1`, `cowvol_controller_nodes{state="running"} 1`,
		`cowvol_controller_requests_total{kind="land"} 1`, `cowvol_controller_volumes{state="ready"} 2`} {
		eventually(t, "the controller's metrics to show "+line, func() bool { return metric(line) })
	}
	placed, err := api.Place(ctx, &controllerv1.PlaceRequest{Inputs: []*controllerv1.VolumeRef{cref("ci", "res")}})
	require.NoError(t, err)
	require.Len(t, placed.Nodes, 1)
	require.Equal(t, "node-b", placed.Nodes[0].NodeId, "no placements on a landed node")
	eventually(t, "node-a to refuse captures", func() bool {
		v := a.volume(map[string]string{"capture": fmt.Sprintf("out-%d", a.n)}, false)
		err := a.publish(v)
		if err == nil {
			require.NoError(t, a.unpublish(v))
		}
		return code(err) == codes.Unavailable
	})
	a.read("res", func(dir string) { require.Equal(t, "a", readFile(t, dir, "f")) }) // its volumes are kept and readable
	n, err := a.p.NodeAPI.GetNode(ctx, &nodev1.GetNodeRequest{})
	require.NoError(t, err)
	require.Contains(t, n.CapturesRefused, "landed", "the node says why it refuses captures")
	_, err = api.SetNodeLifecycle(ctx, &controllerv1.SetNodeLifecycleRequest{NodeId: "node-a", Action: "resume"})
	require.NoError(t, err)
	retry(t, "a capture on the resumed node", func() error {
		v := a.volume(map[string]string{"capture": fmt.Sprintf("back-%d", a.n)}, false)
		if err := a.publish(v); err != nil {
			return err
		}
		return a.unpublish(v)
	})

	reader := b.mount(map[string]string{"source": "res"}, true)
	st, err = api.SetNodeLifecycle(ctx, &controllerv1.SetNodeLifecycleRequest{NodeId: "node-b", Action: "retire"})
	require.NoError(t, err)
	require.Equal(t, "retiring", st.State)
	time.Sleep(3 * time.Second)
	require.Equal(t, "b", readFile(t, reader.Target, "f"), "a running step keeps its volumes")
	b.umount(reader)
	eventually(t, "the retired node to empty and leave", func() bool {
		nodes, err := api.ListNodes(ctx, &controllerv1.ListNodesRequest{})
		require.NoError(t, err)
		list, err := b.p.NodeAPI.ListVolumes(ctx, &nodev1.ListVolumesRequest{})
		require.NoError(t, err)
		return len(nodes.Nodes) == 1 && len(list.Volumes) == 0
	})
	a.noLeaks(t)
	b.noLeaks(t)
}

// The controller's APIs over TLS with tokens: nothing without a token, a
// namespace's scheduler sees its own volumes and what others shared,
// cannot act on others' nor on nodes, and nodes report with theirs, each
// for itself alone.
func TestControllerAuthentication(t *testing.T) {
	testfs.Need(t)
	dir := t.TempDir()
	pki := netlab.NewPKI(t, filepath.Join(dir, "pki"), "cowvol-controller", "127.0.0.1")
	tokens := filepath.Join(dir, "tokens")
	require.NoError(t, os.WriteFile(tokens, []byte("# the controller's callers\n"+
		"node-token-0123456789,system:cowvol-node,*,node-a\nnode-z-token-0123456789,system:cowvol-node,*,node-z\n"+
		"admin-token-0123456789,admin,*\nci-token-0123456789ab,ci-scheduler,ci\n"), 0o600))
	nodeToken := filepath.Join(dir, "node-token")
	require.NoError(t, os.WriteFile(nodeToken, []byte("node-token-0123456789\n"), 0o600))
	addr := plugintest.FreeAddr(t)
	plugintest.Start(t, plugintest.Config{Mode: "controller", Args: []string{"--api-address=" + addr,
		"--tls-cert-file=" + pki.Cert, "--tls-key-file=" + pki.Key, "--tokens-file=" + tokens,
		"--peer-ca-cert-file=" + pki.CA, "--peer-ca-key-file=" + pki.CAKey}})
	n := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", Args: []string{"--controller-address=" + addr,
		"--tls-ca-file=" + pki.CA, "--token-file=" + nodeToken}})
	n.captureIn("ci", "mine", nil)
	n.captureIn("other", "private", nil)
	n.captureIn("other", "shared", map[string]string{"scope": "cluster"})

	dialConn := func(tok string) *grpc.ClientConn { return dialTLS(t, addr, pki.CA, tok) }
	dial := func(tok string) controllerv1.CacheClient { return controllerv1.NewCacheClient(dialConn(tok)) }
	admin, ci, nobody := dial("admin-token-0123456789"), dial("ci-token-0123456789ab"), dial("")
	// A namespace's scheduler is no node: read orders name the files of
	// every namespace's volumes.
	ciRegistry := controllerv1.NewRegistryClient(dialConn("ci-token-0123456789ab"))
	nodeRegistry := controllerv1.NewRegistryClient(dialConn("node-token-0123456789"))
	// Another node's credential, speaking for node-a.
	nodeZ := controllerv1.NewRegistryClient(dialConn("node-z-token-0123456789"))
	getOrder := func(r controllerv1.RegistryClient) error {
		_, err := r.GetReadOrder(context.Background(), &controllerv1.GetReadOrderRequest{Namespace: "ci", Name: "job"})
		return err
	}
	ctx := context.Background()
	lookup := func(c controllerv1.CacheClient, ns, h string) (bool, error) {
		resp, err := c.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref(ns, h)}})
		if err != nil {
			return false, err
		}
		return resp.Volumes[0].Found, nil
	}
	eventually(t, "the node to report over TLS with its token", func() bool {
		found, err := lookup(admin, "other", "private")
		return err == nil && found
	})
	tests := []struct {
		name      string
		call      func() error
		wantCode  codes.Code
		wantFound bool
	}{
		{"no token", func() error { _, err := lookup(nobody, "ci", "mine"); return err }, codes.Unauthenticated, false},
		{"a forged token", func() error { _, err := lookup(dial("forged-token-0123456789"), "ci", "mine"); return err }, codes.Unauthenticated, false},
		{"own namespace", func() error {
			found, err := lookup(ci, "ci", "mine")
			require.True(t, found)
			return err
		}, codes.OK, true},
		{"another's private volume is not found", func() error {
			found, err := lookup(ci, "other", "private")
			require.False(t, found)
			return err
		}, codes.OK, false},
		{"another's shared volume is", func() error {
			found, err := lookup(ci, "other", "shared")
			require.True(t, found)
			return err
		}, codes.OK, true},
		{"destroying another's", func() error {
			_, err := ci.DestroyVolumes(ctx, &controllerv1.DestroyVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("other", "shared")}})
			return err
		}, codes.PermissionDenied, false},
		{"listing nodes", func() error { _, err := ci.ListNodes(ctx, &controllerv1.ListNodesRequest{}); return err }, codes.PermissionDenied, false},
		{"landing a node", func() error {
			_, err := ci.SetNodeLifecycle(ctx, &controllerv1.SetNodeLifecycleRequest{NodeId: "node-a", Action: "land"})
			return err
		}, codes.PermissionDenied, false},
		{"the admin lists nodes", func() error { _, err := admin.ListNodes(ctx, &controllerv1.ListNodesRequest{}); return err }, codes.OK, false},
		{"a scheduler reading a read order", func() error { return getOrder(ciRegistry) }, codes.PermissionDenied, false},
		{"a scheduler sharing one", func() error {
			_, err := ciRegistry.ShareReadOrder(ctx, &controllerv1.ShareReadOrderRequest{Order: &controllerv1.ReadOrder{
				Namespace: "ci", Name: "job", Files: []string{"f"}}})
			return err
		}, codes.PermissionDenied, false},
		{"a node reading one none shared", func() error { return getOrder(nodeRegistry) }, codes.NotFound, false},
		{"another node's credential reporting as node-a", func() error {
			_, err := nodeZ.Report(ctx, &controllerv1.ReportRequest{NodeId: "node-a", StoreId: "wiped", Revision: 1, Full: true,
				PeerAddress: "10.0.0.1:7443"})
			return err
		}, codes.PermissionDenied, false},
		{"another node's credential claiming a copy as node-a", func() error {
			_, err := nodeZ.Report(ctx, &controllerv1.ReportRequest{NodeId: "node-a", StoreId: "s", Revision: 9, BaseRevision: 1,
				Upserts: []*controllerv1.VolumeSummary{{Ref: cref("ci", "mine"), State: "ready", Copies: 5}}})
			return err
		}, codes.PermissionDenied, false},
		{"another node's credential sharing node-a's read order", func() error {
			_, err := nodeZ.ShareReadOrder(ctx, &controllerv1.ShareReadOrderRequest{Order: &controllerv1.ReadOrder{
				NodeId: "node-a", Namespace: "ci", Name: "job", Files: []string{"f"}}})
			return err
		}, codes.PermissionDenied, false},
		{"a node's credential for itself", func() error {
			_, err := nodeZ.Report(ctx, &controllerv1.ReportRequest{NodeId: "node-z", StoreId: "z", Revision: 1, Full: true})
			return err
		}, codes.OK, false},
		{"another node's credential asking for node-a's peer certificate", func() error {
			_, err := signPeer(nodeZ, "node-a", peerRequest(t))
			return err
		}, codes.PermissionDenied, false},
		{"a scheduler asking for a peer certificate", func() error {
			_, err := signPeer(ciRegistry, "node-a", peerRequest(t))
			return err
		}, codes.PermissionDenied, false},
		{"a signing request that is none", func() error {
			_, err := signPeer(nodeZ, "node-z", []byte("not a request"))
			return err
		}, codes.InvalidArgument, false},
		{"a node's credential for its own peer certificate", func() error {
			cert, err := signPeer(nodeZ, "node-z", peerRequest(t))
			if err == nil {
				id, idErr := peerid.Of(cert)
				require.NoError(t, idErr)
				require.Equal(t, peerid.Node("node-z"), id)
			}
			return err
		}, codes.OK, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.wantCode, code(tc.call()))
		})
	}
	found, err := lookup(admin, "other", "private")
	require.NoError(t, err)
	require.True(t, found, "node-a's view untouched by node-z's claims")
	nodes, err := admin.ListNodes(ctx, &controllerv1.ListNodesRequest{})
	require.NoError(t, err)
	for _, n := range nodes.Nodes {
		require.NotEqual(t, "10.0.0.1:7443", n.GetPeerAddress(), "node %s's peer address", n.GetNodeId())
	}
	placed, err := ci.Place(ctx, &controllerv1.PlaceRequest{Inputs: []*controllerv1.VolumeRef{cref("other", "private")}})
	require.NoError(t, err)
	require.Zero(t, placed.Nodes[0].InputBytesHeld, "placement tells nothing of a volume the caller may not see")
	// Nor do the short answers: a count of holders, the best placement, a
	// listing naming one node a volume.
	best, err := ci.Place(ctx, &controllerv1.PlaceRequest{Inputs: []*controllerv1.VolumeRef{cref("other", "private")}, Limit: 1})
	require.NoError(t, err)
	require.Len(t, best.Nodes, 1)
	require.Zero(t, best.Nodes[0].InputBytesHeld)
	hidden, err := ci.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("other", "private")}, MaxNodes: 1})
	require.NoError(t, err)
	require.False(t, hidden.Volumes[0].Found)
	require.Zero(t, hidden.Volumes[0].NodeCount, "how many nodes hold another namespace's volume")
	require.Empty(t, hidden.Volumes[0].Nodes)
	listed, err := ci.ListVolumes(ctx, &controllerv1.ListVolumesRequest{MaxNodes: 1})
	require.NoError(t, err)
	for _, l := range listed.Volumes {
		require.True(t, l.Ref.Namespace == "ci" || l.Scope == "cluster", "listed %s/%s", l.Ref.Namespace, l.Ref.Handle)
	}
	plain, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer plain.Close()
	_, err = controllerv1.NewCacheClient(plain).ListNodes(ctx, &controllerv1.ListNodesRequest{})
	require.Equal(t, codes.Unavailable, code(err), "no plaintext")
}

// peerRequest is a signing request for a new key.
func peerRequest(t *testing.T) []byte {
	t.Helper()
	key, err := peerid.NewKey()
	require.NoError(t, err)
	csr, err := peerid.Request(key)
	require.NoError(t, err)
	return csr
}

// signPeer asks the controller to sign a peer certificate for node.
func signPeer(r controllerv1.RegistryClient, node string, csr []byte) (*x509.Certificate, error) {
	resp, err := r.SignPeerCertificate(context.Background(), &controllerv1.SignPeerCertificateRequest{NodeId: node, Request: csr})
	if err != nil {
		return nil, err
	}
	return x509.ParseCertificate(resp.GetCertificate())
}

// An idle node's heartbeats read no volume (the node counts them as
// heartbeats, not changes), yet keep it running in the controller's view
// and carry how full its disk is now; a change is reported at once.
func TestIdleNodeHeartbeatsReadNoVolume(t *testing.T) {
	testfs.Need(t)
	state := filepath.Join(testfs.Mount(t, testfs.XFS, 512<<20), "state")
	// Heartbeats come every 2 s: stalled after twice that.
	f := startFleet(t, []string{"--stalled-after=4s"})
	n := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", StateDir: state, Args: []string{"--controller-address=" + f.addr}})
	api, ctx := f.api, context.Background()
	for i := range 20 {
		n.step("", fmt.Sprintf("res-%d", i), func(dir string) { write(t, dir, "f", "x") })
	}
	status := func() *controllerv1.NodeStatus {
		resp, err := api.ListNodes(ctx, &controllerv1.ListNodesRequest{})
		require.NoError(t, err)
		require.Len(t, resp.Nodes, 1)
		return resp.Nodes[0]
	}
	eventually(t, "the controller to see every volume", func() bool { return status().Volumes == 20 })
	// A writable view, its writes not captured: the disk fills with no
	// change to any volume.
	scratch := n.mount(map[string]string{}, false)
	eventually(t, "the controller to have the node's last revision", func() bool {
		got, err := n.p.NodeAPI.GetNode(ctx, &nodev1.GetNodeRequest{})
		require.NoError(t, err)
		return status().Revision == got.Revision
	})
	time.Sleep(time.Second) // the node counts a report once its answer is back
	changes, beats, before := metricValue(t, n, `cowvol_node_reports_total{kind="changes"}`),
		metricValue(t, n, `cowvol_node_reports_total{kind="heartbeat"}`), status()

	write(t, scratch.Target, "fill", strings.Repeat("x", 64<<20))
	fill, err := os.Open(filepath.Join(scratch.Target, "fill"))
	require.NoError(t, err)
	require.NoError(t, fill.Sync())
	require.NoError(t, fill.Close())
	eventually(t, "a heartbeat to carry the disk's fill", func() bool {
		return status().BytesFree <= before.BytesFree-60<<20
	})
	time.Sleep(8 * time.Second) // twice --stalled-after
	after := status()
	require.Equal(t, "running", after.State, "heartbeats keep an idle node running")
	require.Equal(t, before.Revision, after.Revision)
	require.Equal(t, int32(20), after.Volumes)
	require.Equal(t, changes, metricValue(t, n, `cowvol_node_reports_total{kind="changes"}`), "nothing changed, nothing was read")
	require.GreaterOrEqual(t, metricValue(t, n, `cowvol_node_reports_total{kind="heartbeat"}`), beats+3)

	n.step("", "res-new", func(dir string) { write(t, dir, "f", "x") })
	eventually(t, "the new capture to be reported", func() bool { return status().Volumes == 21 })
	require.Greater(t, metricValue(t, n, `cowvol_node_reports_total{kind="changes"}`), changes)
	n.umount(scratch)
	n.noLeaks(t)
}

// A controller reading as many whole inventories as it may at once turns a
// node's away, telling it when to ask again: the node then asks with
// heartbeats, which reach the controller meanwhile, instead of sending its
// inventory blind again, and sends it once told there is room. (The test
// takes the controller's one slot with a report in parts that never sends
// its parts.)
func TestFullReportsDeferredWhileTheControllerIsBusy(t *testing.T) {
	metrics := plugintest.FreeAddr(t)
	f := startFleet(t, []string{"--full-reports-at-once=1", "--metrics-address=" + metrics})
	conn, err := grpc.NewClient(f.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	held, release := context.WithCancel(metadata.AppendToOutgoingContext(context.Background(),
		controllerv1.ReportNodeHeader, "stalled"))
	defer release()
	_, err = controllerv1.NewRegistryClient(conn).SendReport(held)
	require.NoError(t, err)

	n := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", Args: []string{"--controller-address=" + f.addr}})
	n.step("", "res-1", func(dir string) { write(t, dir, "f", "x") })
	eventually(t, "the node's inventory to be deferred", func() bool {
		return metricValue(t, n, `cowvol_node_reports_total{kind="full_deferred"}`) >= 1
	})
	beats := metricValue(t, n, `cowvol_node_reports_total{kind="heartbeat"}`)
	time.Sleep(6 * time.Second)
	require.Equal(t, 1.0, metricValue(t, n, `cowvol_node_reports_total{kind="full_deferred"}`), "it asks before it sends again")
	require.GreaterOrEqual(t, metricValue(t, n, `cowvol_node_reports_total{kind="heartbeat"}`), beats+2)
	ctlMetrics := func() string {
		resp, err := http.Get("http://" + metrics + "/metrics")
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(body)
	}
	require.Contains(t, ctlMetrics(), `cowvol_controller_full_reports_total{result="deferred"}`)
	nodes, err := f.api.ListNodes(context.Background(), &controllerv1.ListNodesRequest{})
	require.NoError(t, err)
	require.Len(t, nodes.GetNodes(), 1, "its heartbeats reach the controller meanwhile")
	require.Equal(t, "running", nodes.GetNodes()[0].GetState())
	require.Zero(t, nodes.GetNodes()[0].GetVolumes())

	release()
	eventually(t, "the node's inventory to be read once the slot is free", func() bool {
		resp, err := f.api.LookupVolumes(context.Background(), &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", "res-1")}})
		require.NoError(t, err)
		return slices.Contains(resp.GetVolumes()[0].GetNodes(), "node-a")
	})
	n.noLeaks(t)
}

// An output that asks for two copies is pulled by another node once it is
// captured, and the controller lists both; killed, the capturing node
// loses nothing: a step on the third node reads the copy. A destroy
// reaches every copy. The node-wide default (--output-copies) asks the
// same of outputs that name none.
func TestOutputsSurviveTheirNode(t *testing.T) {
	f := startFleet(t, []string{"--stalled-after=3s"})
	nodes := map[string]*env{}
	for _, id := range []string{"node-a", "node-b", "node-c"} {
		args := []string{"--controller-address=" + f.addr, "--peer-address=" + plugintest.FreeAddr(t), "--pull-wait=30s"}
		if id == "node-b" {
			args = append(args, "--output-copies=2")
		}
		nodes[id] = newEnv(t, plugintest.Config{Backend: "overlay", NodeID: id, Args: args})
	}
	ctx := context.Background()
	holders := func(handle string) []string {
		resp, err := f.api.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", handle)}})
		require.NoError(t, err)
		return resp.Volumes[0].Nodes
	}
	eventually(t, "every node to report", func() bool {
		resp, err := f.api.ListNodes(ctx, &controllerv1.ListNodesRequest{})
		return err == nil && len(resp.Nodes) == 3
	})
	nodes["node-a"].captureIn("ci", "out", map[string]string{driver.AttrCopies: "2"})
	nodes["node-a"].captureIn("ci", "single", nil)
	nodes["node-b"].captureIn("ci", "by-default", nil)
	eventually(t, "a second node to hold the output ready", func() bool { return len(holders("out")) == 2 })
	eventually(t, "the node-wide default to be copied too", func() bool { return len(holders("by-default")) == 2 })
	copyNode := holders("out")[1]
	if copyNode == "node-a" {
		copyNode = holders("out")[0]
	}
	time.Sleep(3 * time.Second) // a few reports more: no third copy, no copy of what asked for none
	require.Len(t, holders("out"), 2)
	require.Equal(t, []string{"node-a"}, holders("single"))

	nodes["node-a"].p.Kill()
	eventually(t, "node-a to stall", func() bool { return slices.Equal(holders("out"), []string{copyNode}) })
	third := "node-b"
	if copyNode == "node-b" {
		third = "node-c"
	}
	nodes[third].read("out", func(dir string) { require.Equal(t, "ci/out", readFile(t, dir, "file")) })
	eventually(t, "a copy again on the third node (node-a is gone)", func() bool { return len(holders("out")) == 2 })

	_, err := f.api.DestroyVolumes(ctx, &controllerv1.DestroyVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", "out")}})
	require.NoError(t, err)
	eventually(t, "the destroy to reach every copy", func() bool {
		for _, id := range []string{copyNode, third} {
			if volumeState(t, nodes[id], "out") != "gone" {
				return false
			}
		}
		return true
	})
}

// Copies are bounded by the operator: an output that asks for more nodes
// than --max-copies is refused InvalidArgument, and once a namespace has
// spent its budget (--namespace-copies), its outputs that ask for copies
// are refused ResourceExhausted at publish, another namespace's are not,
// and the budget comes back when a volume that had copies is destroyed.
// Outputs that ask for none are never refused, nor is a republish.
func TestCopiesAreBounded(t *testing.T) {
	f := startFleet(t, []string{"--max-copies=4", "--namespace-copies=3"}, "node-a")
	a, ctx := f.nodes["node-a"], context.Background()
	copies := func(n string) map[string]string { return map[string]string{driver.AttrCopies: n} }
	publishIn := func(ns, handle string, attrs map[string]string) error {
		attrs[driver.AttrCapture] = handle
		return a.publish(a.volumeIn(ns, attrs, false))
	}
	probes := 0
	eventually(t, "the node to hear the maximum", func() bool {
		probes++ // (one the node took before it heard stays published)
		return code(publishIn("ci", fmt.Sprintf("probe-%d", probes), copies("5"))) == codes.InvalidArgument
	})
	a.captureIn("ci", "first", copies("4")) // three extra copies: ci's budget
	live := a.volumeIn("ci", map[string]string{driver.AttrCapture: "live", driver.AttrCopies: "2"}, false)
	require.NoError(t, a.publish(live), "published before the budget is spent")
	eventually(t, "the node to hear that ci spent its budget", func() bool {
		return code(publishIn("ci", "second", copies("2"))) == codes.ResourceExhausted
	})
	err := publishIn("ci", "third", copies("5"))
	require.Equal(t, codes.InvalidArgument, code(err), "%v", err)
	require.Equal(t, codes.ResourceExhausted, code(publishIn("ci", "fourth", copies("4"))))
	require.NoError(t, publishIn("ci", "plain", map[string]string{}), "an output that asks for no copies")
	require.NoError(t, publishIn("other", "mine", copies("4")), "another namespace's budget is its own")
	require.NoError(t, a.publish(live), "a republish stands")

	_, err = f.api.DestroyVolumes(ctx, &controllerv1.DestroyVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", "first")}})
	require.NoError(t, err)
	eventually(t, "ci's budget to come back", func() bool { return publishIn("ci", "again", copies("2")) == nil })
}

// dialTLS reaches the controller at addr over TLS verified against ca,
// presenting token on every call ("" for none).
func dialTLS(t *testing.T, addr, ca, token string) *grpc.ClientConn {
	t.Helper()
	creds, err := credentials.NewClientTLSFromFile(ca, "")
	require.NoError(t, err)
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(client.Bearer{Token: token, Secure: true}))
	}
	conn, err := grpc.NewClient(addr, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

// peakRSS is the most memory a process has held (VmHWM), in bytes.
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var kb int64
			_, err := fmt.Sscanf(strings.TrimSpace(rest), "%d kB", &kb)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatalf("no VmHWM in /proc/%d/status", pid)
	return 0
}

// No caller, with or without a token, makes the controller read a message
// it was not asked for: ten 60 MiB calls at once without a token, ten with
// a scheduler's token, ten reports with a scheduler's and ten with a
// node's are each turned away before their message is read, and the
// controller's memory stays where an idle one's is (the whole 2.4 GB,
// read, would be far past the chart's limit).
func TestControllerReadsNoMessageItWasNotAskedFor(t *testing.T) {
	dir := t.TempDir()
	pki := netlab.NewPKI(t, filepath.Join(dir, "pki"), "cowvol-controller", "127.0.0.1")
	tokens := filepath.Join(dir, "tokens")
	require.NoError(t, os.WriteFile(tokens, []byte("node-token-0123456789,system:cowvol-node,*,node-a\nci-token-0123456789ab,ci-scheduler,ci\n"), 0o600))
	addr := plugintest.FreeAddr(t)
	ctl := plugintest.Start(t, plugintest.Config{Mode: "controller", Args: []string{"--api-address=" + addr,
		"--tls-cert-file=" + pki.Cert, "--tls-key-file=" + pki.Key, "--tokens-file=" + tokens}})
	dial := func(tok string) *grpc.ClientConn { return dialTLS(t, addr, pki.CA, tok) }
	ctx := t.Context()
	_, err := controllerv1.NewCacheClient(dial("ci-token-0123456789ab")).ListVolumes(ctx, &controllerv1.ListVolumesRequest{})
	require.NoError(t, err, "the controller serves")
	idle := peakRSS(t, ctl.PID())

	huge := strings.Repeat("x", 60<<20)
	lookup := &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", huge)}}
	report := &controllerv1.ReportRequest{NodeId: "node-a", StoreId: huge}
	tests := []struct {
		name     string
		call     func(conn *grpc.ClientConn) error
		token    string
		wantCode codes.Code
	}{
		{"lookups without a token", func(c *grpc.ClientConn) error {
			_, err := controllerv1.NewCacheClient(c).LookupVolumes(ctx, lookup)
			return err
		}, "", codes.Unauthenticated},
		{"lookups with a scheduler's token", func(c *grpc.ClientConn) error {
			_, err := controllerv1.NewCacheClient(c).LookupVolumes(ctx, lookup)
			return err
		}, "ci-token-0123456789ab", codes.ResourceExhausted},
		{"reports with a scheduler's token", func(c *grpc.ClientConn) error {
			_, err := controllerv1.NewRegistryClient(c).Report(ctx, report)
			return err
		}, "ci-token-0123456789ab", codes.PermissionDenied},
		{"reports with a node's token", func(c *grpc.ClientConn) error {
			_, err := controllerv1.NewRegistryClient(c).Report(ctx, report)
			return err
		}, "node-token-0123456789", codes.ResourceExhausted},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			conn := dial(tc.token)
			errs := make(chan error, 10)
			for range 10 {
				go func() { errs <- tc.call(conn) }()
			}
			for range 10 {
				require.Equal(t, tc.wantCode, code(<-errs))
			}
		})
	}
	peak := peakRSS(t, ctl.PID())
	t.Logf("the controller's peak RSS: %d MiB idle, %d MiB after 40 calls of 60 MiB", idle>>20, peak>>20)
	require.Less(t, peak-idle, int64(64<<20), "memory the calls cost the controller")
	require.True(t, ctl.Running())
}
