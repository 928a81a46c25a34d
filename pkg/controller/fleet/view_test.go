package fleet

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/volume"
)

func vol(h, state string, size int64) Held {
	return Held{Ref: volume.Ref{Namespace: "ci", Handle: h}, State: volume.State(state), SizeBytes: size}
}

func ref(h string) volume.Ref {
	return volume.Ref{Namespace: "ci", Handle: h}
}

func TestReportsAndResyncs(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	tests := []struct {
		name       string
		req        Report
		wantResync bool
		wantErr    bool
		wantVols   int
	}{
		{"no node ID", Report{StoreID: "s1"}, false, true, 0},
		{"a state the view does not know", Report{NodeID: "n", StoreID: "s1", Full: true,
			Upserts: []Held{{Ref: ref("x"), State: "gone"}}}, false, true, 0},
		{"a scope the view does not know", Report{NodeID: "n", StoreID: "s1", Full: true,
			Upserts: []Held{{Ref: ref("x"), State: "ready", Scope: "world"}}}, false, true, 0},
		{"copies past the most", Report{NodeID: "n", StoreID: "s1", Full: true,
			Upserts: []Held{{Ref: ref("x"), State: "ready", Copies: volume.MaxCopies + 1}}}, false, true, 0},
		{"changes from an unknown node", Report{NodeID: "n", StoreID: "s1", Revision: 5, BaseRevision: 4}, true, false, 0},
		{"full", Report{NodeID: "n", StoreID: "s1", Revision: 5, Full: true,
			Upserts: []Held{vol("a", "ready", 10), vol("b", "ready", 20)}}, false, false, 2},
		{"changes", Report{NodeID: "n", StoreID: "s1", Revision: 7, BaseRevision: 5,
			Upserts: []Held{vol("c", "creating", -1)}, Deletes: []volume.Ref{ref("a")}}, false, false, 2},
		{"changes from a revision the controller never saw", Report{NodeID: "n", StoreID: "s1", Revision: 9, BaseRevision: 8}, true, false, 2},
		{"heartbeat", Report{NodeID: "n", StoreID: "s1", Revision: 7, BaseRevision: 7}, false, false, 2},
		{"a wiped node back under its name", Report{NodeID: "n", StoreID: "s2", Revision: 1, BaseRevision: 7}, true, false, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := v.Report(tc.req, now)
			if tc.wantErr {
				require.ErrorIs(t, err, ErrInvalid)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.wantResync, resp.Resync)
			nodes := v.Nodes(now)
			require.Len(t, nodes, 1)
			require.Equal(t, int32(tc.wantVols), nodes[0].Volumes)
		})
	}
}

// A controller that begins to lead is unsettled until each node it awaits
// has reported its whole inventory (changes, answered with a resync, do
// not count), or until the wait is over; a node that reported in full
// before is not awaited.
func TestAwaitReports(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	full := func(node string) Report {
		return Report{NodeID: node, StoreID: "s-" + node, Revision: 3, Full: true,
			Upserts: []Held{vol(node+"-out", "ready", 10)}}
	}
	_, err := v.Report(full("early"), now)
	require.NoError(t, err)
	v.AwaitReports([]string{"early", "n1", "n2"}, now.Add(30*time.Second))
	require.Equal(t, []string{"n1", "n2"}, v.Unsettled(now))

	_, err = v.Report(full("n1"), now)
	require.NoError(t, err)
	resp, err := v.Report(Report{NodeID: "n2", StoreID: "s-n2", Revision: 4, BaseRevision: 3}, now)
	require.NoError(t, err)
	require.True(t, resp.Resync)
	require.Equal(t, []string{"n2"}, v.Unsettled(now), "changes are not an inventory")
	require.Empty(t, v.Unsettled(now.Add(31*time.Second)), "the wait is over: a node silent so long is stalled")
	_, err = v.Report(full("n2"), now)
	require.NoError(t, err)
	require.Empty(t, v.Unsettled(now))
}

// A destroy made while a node is still awaited (a controller that began to
// lead, past its wait, serves without that node's inventory) reaches the
// node when its first whole inventory comes: the volumes it names there
// are destroyed and never shown. So does a pin, which no pin undoes
// a destroy. Only that inventory: what the node captures later under a
// handle destroyed before is its own. Once every awaited node has
// reported, or forgetStalledAfter after the wait, the view remembers
// none.
func TestCommandsReachNodesNotYetHeard(t *testing.T) {
	v := NewView(30*time.Second, 10*time.Minute)
	now := time.Now()
	revs := map[string]uint64{}
	report := func(at time.Time, node string, full bool, vols ...Held) Answer {
		base := revs[node]
		revs[node]++
		resp, err := v.Report(Report{NodeID: node, StoreID: "s-" + node, Revision: revs[node], BaseRevision: base, Full: full, Upserts: vols}, at)
		require.NoError(t, err)
		return resp
	}
	found := func(at time.Time, h string) bool { return v.Lookup([]volume.Ref{ref(h)}, 0, at)[0].Found }

	report(now, "n1", true, vol("held-by-n1", "ready", 1))
	v.AwaitReports([]string{"n1", "n2", "n3", "dead"}, now.Add(30*time.Second))
	served := now.Add(31 * time.Second) // the wait is over: the view serves
	require.Empty(t, v.Unsettled(served))
	out := v.Destroy([]volume.Ref{ref("held-by-n1"), ref("held-by-n2"), ref("later-again")}, served)
	require.Equal(t, []string{"n1"}, out[0].Nodes)
	require.Empty(t, out[1].Nodes, "the view does not know n2 holds it")
	until := served.Add(time.Hour)
	v.Pin([]volume.Ref{ref("kept"), ref("held-by-n2")}, false, until, served)

	resp := report(served.Add(time.Second), "n2", true, vol("held-by-n2", "ready", 1), vol("kept", "ready", 1))
	require.Equal(t, []volume.Ref{ref("held-by-n2")}, resp.Destroy, "n2's first inventory is answered with the destroy made before it")
	require.False(t, found(served.Add(time.Second), "held-by-n2"), "and the volume is never shown")
	require.True(t, found(served.Add(time.Second), "kept"))
	require.Equal(t, []PinCommand{{Ref: ref("kept"), Until: until}}, resp.Pins, "and with the pin: a pin after a destroy does not undo it")

	resp = report(served.Add(2*time.Second), "n2", false, vol("later-again", "ready", 1))
	require.Equal(t, []volume.Ref{ref("held-by-n2")}, resp.Destroy, "asked until done; a volume n2 captured after its first inventory is its own")
	require.True(t, found(served.Add(2*time.Second), "later-again"))

	// dead never reports: what is destroyed now is remembered until
	// forgetStalledAfter after the wait, and then no more.
	v.Destroy([]volume.Ref{ref("gone-while-n3-was-away")}, served.Add(time.Minute))
	resp = report(served.Add(2*time.Minute), "n3", true, vol("gone-while-n3-was-away", "ready", 1))
	require.Equal(t, []volume.Ref{ref("gone-while-n3-was-away")}, resp.Destroy)
	late := now.Add(30*time.Second + 10*time.Minute + time.Second)
	v.Destroy([]volume.Ref{ref("too-late")}, late)
	resp = report(late, "dead", true, vol("too-late", "ready", 1))
	require.Empty(t, resp.Destroy, "past forgetStalledAfter, a node back brings its volumes as they were")
	require.True(t, found(late, "too-late"))

	// A caller asking of volumes by the thousand while a node is unheard
	// grows the view's memory only up to maxUnheard.
	v.AwaitReports([]string{"n4"}, late.Add(time.Second))
	refs := make([]volume.Ref, 1000)
	for i := 0; i < maxUnheard/len(refs)+2; i++ {
		for j := range refs {
			refs[j] = ref(fmt.Sprintf("junk-%d-%d", i, j))
		}
		v.Destroy(refs, late)
	}
	require.Equal(t, maxUnheard, len(v.unheard), "remembered past the bound")
	v.Pin([]volume.Ref{ref("junk-0-0")}, false, time.Time{}, late)
	require.NotNil(t, v.unheard[ref("junk-0-0")].pin, "a volume remembered takes commands past the bound")

	// Every awaited node has reported: none is remembered.
	v.AwaitReports([]string{"n4"}, late.Add(time.Second))
	v.Destroy([]volume.Ref{ref("before-n4")}, late)
	require.Len(t, v.unheard, 1)
	report(late, "n4", true)
	require.Nil(t, v.unheard, "forgotten once no node is awaited")
	resp = report(late, "n5", true, vol("before-n4", "ready", 1))
	require.Empty(t, resp.Destroy, "n5 was never awaited")
}

// A node's full report that says what the view has of it already is found
// so under the read lock and leaves the view as it is; one that differs in
// anything a record or an entry keeps is applied, as the first was.
func TestAFullReportChangingAnythingIsApplied(t *testing.T) {
	base := func() []Held {
		return []Held{
			{Ref: ref("a"), State: volume.StateReady, SizeBytes: 10, Parent: ref("p"), Scope: volume.ScopeNamespace,
				Properties: []Property{{"k", "v"}}, StepVolumes: 1, Pinned: true, Copies: 2, Vouch: digests(1, true)},
			{Ref: ref("b"), State: volume.StateCreating, SizeBytes: -1},
		}
	}
	tests := []struct {
		name   string
		change func([]Held) []Held
	}{
		{"nothing", func(h []Held) []Held { return h }},
		{"the order", func(h []Held) []Held { return []Held{h[1], h[0]} }},
		{"a size", func(h []Held) []Held { h[0].SizeBytes++; return h }},
		{"a state", func(h []Held) []Held { h[1].State = volume.StateReady; return h }},
		{"a pin", func(h []Held) []Held { h[0].Pinned = false; return h }},
		{"the step volumes", func(h []Held) []Held { h[0].StepVolumes = 0; return h }},
		{"a property", func(h []Held) []Held { h[0].Properties[0].Value = "w"; return h }},
		{"the scope", func(h []Held) []Held { h[0].Scope = volume.ScopeCluster; return h }},
		{"the parent", func(h []Held) []Held { h[0].Parent = ref("q"); return h }},
		{"no parent", func(h []Held) []Held { h[0].Parent = volume.Ref{}; return h }},
		{"the copies", func(h []Held) []Held { h[0].Copies = 3; return h }},
		{"the digests", func(h []Held) []Held { h[0].Vouch = digests(2, true); return h }},
		{"digests first known", func(h []Held) []Held { h[1].Vouch = digests(3, false); return h }},
		{"one gone", func(h []Held) []Held { return h[:1] }},
		{"one more", func(h []Held) []Held { return append(h, vol("c", "ready", 5)) }},
		{"one named twice instead of another", func(h []Held) []Held { return []Held{h[0], h[0]} }},
		{"one in another's place", func(h []Held) []Held { h[1] = vol("c", "ready", 5); return h }},
	}
	// seen is what the view says of node n's volumes, and what each asked
	// for in copies.
	seen := func(v *View, now time.Time) ([]Location, map[string]uint8) {
		locs, _, err := v.List(ListQuery{Node: "n"}, now)
		require.NoError(t, err)
		copies := map[string]uint8{}
		for _, l := range locs {
			copies[l.Ref.Handle] = v.find(l.Ref).copies
		}
		return locs, copies
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			now := time.Now()
			report := func(v *View, held []Held) {
				_, err := v.Report(Report{NodeID: "n", StoreID: "s", Revision: 1, Full: true, Upserts: held}, now)
				require.NoError(t, err)
			}
			v := NewView(time.Minute, time.Hour)
			report(v, base())
			report(v, tc.change(base()))
			want := NewView(time.Minute, time.Hour)
			report(want, tc.change(base()))
			gotLocs, gotCopies := seen(v, now)
			wantLocs, wantCopies := seen(want, now)
			require.Equal(t, wantLocs, gotLocs)
			require.Equal(t, wantCopies, gotCopies)
			require.Equal(t, want.Nodes(now)[0].Bytes, v.Nodes(now)[0].Bytes)
		})
	}
}

func TestLookupPlaceAndStalls(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	report := func(node string, at time.Time, free int64, over bool, vols ...Held) {
		_, err := v.Report(Report{NodeID: node, StoreID: node + "-store", Revision: 1, Full: true,
			Upserts: vols, BytesFree: free, OverHighWatermark: over}, at)
		require.NoError(t, err)
	}
	report("a", now, 100, false, vol("small", "ready", 10))
	report("b", now, 50, false, vol("small", "ready", 10), vol("big", "ready", 1000))
	report("c", now, 900, false)
	report("d", now, 900, true, vol("big", "ready", 1000))
	report("gone", now.Add(-2*time.Minute), 900, false, vol("big", "ready", 1000))

	locs := v.Lookup([]volume.Ref{ref("small"), ref("big"), ref("nope")}, 0, now)
	require.Equal(t, []string{"a", "b"}, locs[0].Nodes)
	require.Equal(t, []string{"b", "d"}, locs[1].Nodes, "a stalled node is left out")
	require.Equal(t, 2, locs[1].NodeCount)
	require.False(t, locs[2].Found)
	one := v.Lookup([]volume.Ref{ref("big")}, 1, now)[0]
	require.Equal(t, []string{"b"}, one.Nodes, "the first by ID")
	require.Len(t, one.PeerAddresses, 1)
	require.Equal(t, 2, one.NodeCount, "and how many hold it")

	placed := v.Place([]volume.Ref{ref("small"), ref("big")}, nil, 0, now)
	var order []string
	for _, p := range placed {
		order = append(order, p.NodeID)
	}
	require.Equal(t, []string{"b", "a", "c"}, order, "bytes held first, then free space; over the mark and stalled left out")
	require.Equal(t, int64(1010), placed[0].InputBytesHeld)
	require.Len(t, placed[2].Missing, 2)
	best := v.Place([]volume.Ref{ref("small"), ref("big")}, nil, 2, now)
	require.Equal(t, placed[:2], best, "the best two of the same ranking")
	hidden := v.Place([]volume.Ref{ref("small")}, func(string) bool { return false }, 0, now)
	for _, p := range hidden {
		require.Zero(t, p.InputBytesHeld, "another namespace's private input is held nowhere")
		require.Len(t, p.Missing, 1)
	}

	require.Equal(t, "stalled", v.Nodes(now)[4].State)
	stalled, forgotten := v.Sweep(now)
	require.Equal(t, []string{"gone"}, stalled)
	require.Empty(t, forgotten)
	stalled, _ = v.Sweep(now)
	require.Empty(t, stalled, "a stall is told once")
	_, forgotten = v.Sweep(now.Add(59 * time.Minute))
	require.Equal(t, []string{"gone"}, forgotten)
}

// A scheduler's destroy hides the volume at once and is repeated to each
// node holding it until the node's reports show it gone; a pin, until they
// show it pinned.
func TestDestroyAndPinCommands(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	report := func(node string, rev uint64, full bool, base uint64, vols []Held, deletes ...volume.Ref) Answer {
		resp, err := v.Report(Report{NodeID: node, StoreID: node, Revision: rev, Full: full, BaseRevision: base,
			Upserts: vols, Deletes: deletes}, now)
		require.NoError(t, err)
		return resp
	}
	report("a", 1, true, 0, []Held{vol("x", "ready", 1), vol("y", "ready", 1)})
	report("b", 1, true, 0, []Held{vol("x", "ready", 1)})

	out := v.Destroy([]volume.Ref{ref("x"), ref("nope")}, now)
	require.Equal(t, []string{"a", "b"}, out[0].Nodes)
	require.Empty(t, out[1].Nodes)
	locs := v.Lookup([]volume.Ref{ref("x")}, 0, now)
	require.False(t, locs[0].Found, "gone from lookups at once")

	resp := report("a", 1, false, 1, nil)
	require.Equal(t, []volume.Ref{ref("x")}, resp.Destroy, "asked until done")
	resp = report("a", 2, false, 1, nil, ref("x"))
	require.Empty(t, resp.Destroy, "done once the node reports it gone")
	require.NotEmpty(t, report("b", 1, false, 1, nil).Destroy, "b has not done it yet")

	v.Pin([]volume.Ref{ref("y")}, false, time.Time{}, now)
	resp = report("a", 2, false, 2, nil)
	require.Len(t, resp.Pins, 1)
	pinned := vol("y", "ready", 1)
	pinned.Pinned = true
	resp = report("a", 3, false, 2, []Held{pinned})
	require.Empty(t, resp.Pins, "done once the node reports it pinned")
}

func TestLifecycle(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	report := func(node string, rev uint64, steps int32, vols ...Held) Answer {
		resp, err := v.Report(Report{NodeID: node, StoreID: node, Revision: rev, Full: true,
			Upserts: vols, StepVolumes: steps, BytesFree: 10}, now)
		require.NoError(t, err)
		return resp
	}
	report("a", 1, 1, vol("x", "ready", 1))
	report("b", 1, 0, vol("x", "ready", 1))
	_, err := v.SetLifecycle("nope", "land", now)
	require.ErrorIs(t, err, ErrUnknownNode)
	_, err = v.SetLifecycle("a", "fly", now)
	require.ErrorIs(t, err, ErrInvalid)

	st, err := v.SetLifecycle("a", "land", now)
	require.NoError(t, err)
	require.Equal(t, NodeLanding, st.State, "a step still uses it")
	require.NotEmpty(t, report("a", 2, 1, vol("x", "ready", 1)).RefuseCaptures)
	placed := v.Place([]volume.Ref{ref("x")}, nil, 0, now)
	require.Len(t, placed, 1, "no placements on a landing node")
	report("a", 3, 0, vol("x", "ready", 1))
	require.Equal(t, NodeLanded, v.Nodes(now)[0].State)
	_, err = v.SetLifecycle("a", "resume", now)
	require.NoError(t, err)
	require.Empty(t, report("a", 4, 0, vol("x", "ready", 1)).RefuseCaptures)

	_, err = v.SetLifecycle("b", "retire", now)
	require.NoError(t, err)
	resp := report("b", 2, 0, vol("x", "ready", 1))
	require.Equal(t, []volume.Ref{ref("x")}, resp.Destroy, "released: everything goes")
	report("b", 3, 0)
	require.Len(t, v.Nodes(now), 1, "retired: it leaves")
}

// A cordoned Kubernetes Node is landing until uncordoned; a deleted one is
// forgotten at once.
func TestKubernetesNodes(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	v.SetCordoned("a", true) // before it ever reports
	resp, err := v.Report(Report{NodeID: "a", StoreID: "s", Revision: 1, Full: true}, now)
	require.NoError(t, err)
	require.Contains(t, resp.RefuseCaptures, "landed")
	placed := v.Place(nil, nil, 0, now)
	require.Empty(t, placed)
	v.SetCordoned("a", false)
	require.Equal(t, NodeRunning, v.Nodes(now)[0].State)
	v.ForgetNode("a")
	require.Empty(t, v.Nodes(now))
}

// Listings by namespace, node and property selector, paged, showing a
// caller only its namespaces and what others shared; and the index forgets
// a volume once no node reports it.
func TestList(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	withProps := func(ns, h, state, scope string, props []Property) Held {
		return Held{Ref: volume.Ref{Namespace: ns, Handle: h}, State: volume.State(state), SizeBytes: 1,
			Scope: volume.Scope(scope), Properties: props}
	}
	repo := func(version string) []Property { // not sorted, as a hostile node might send
		return []Property{{Key: "version", Value: version}, {Key: "resource", Value: "repo"}}
	}
	_, err := v.Report(Report{NodeID: "a", StoreID: "a", Revision: 1, Full: true, Upserts: []Held{
		withProps("ci", "r1", "ready", "namespace", repo("1")), withProps("ci", "r2", "ready", "namespace", repo("2")),
		withProps("ci", "out", "creating", "namespace", nil), withProps("other", "secret", "ready", "namespace", repo("1")),
		withProps("other", "shared", "ready", "cluster", repo("3")),
	}}, now)
	require.NoError(t, err)
	_, err = v.Report(Report{NodeID: "b", StoreID: "b", Revision: 1, Full: true, Upserts: []Held{
		withProps("ci", "r2", "ready", "namespace", repo("2")), withProps("ci", "broken", "failed", "namespace", nil),
	}}, now)
	require.NoError(t, err)

	ciOnly := func(ns string) bool { return ns == "ci" }
	handles := func(locs []Location) (out []string) {
		for _, l := range locs {
			out = append(out, l.Ref.Namespace+"/"+l.Ref.Handle)
		}
		return out
	}
	tests := []struct {
		name     string
		q        ListQuery
		want     []string
		wantMore bool
		wantErr  error
	}{
		{name: "everything, for a cluster-wide caller", q: ListQuery{},
			want: []string{"ci/broken", "ci/out", "ci/r1", "ci/r2", "other/secret", "other/shared"}},
		{name: "a namespace's caller sees its own and what was shared", q: ListQuery{Visible: ciOnly},
			want: []string{"ci/broken", "ci/out", "ci/r1", "ci/r2", "other/shared"}},
		{name: "by namespace", q: ListQuery{Namespace: "other", Visible: ciOnly}, want: []string{"other/shared"}},
		{name: "by node, every state it holds", q: ListQuery{Node: "b"}, want: []string{"ci/broken", "ci/r2"}},
		{name: "by selector", q: ListQuery{Selector: "resource=repo,version in (1,3)", Visible: ciOnly},
			want: []string{"ci/r1", "other/shared"}},
		{name: "a page", q: ListQuery{Limit: 2}, want: []string{"ci/broken", "ci/out"}, wantMore: true},
		{name: "the next page", q: ListQuery{Limit: 2, After: "ci/out"}, want: []string{"ci/r1", "ci/r2"}, wantMore: true},
		{name: "the last page", q: ListQuery{Limit: 2, After: "ci/r2"}, want: []string{"other/secret", "other/shared"}},
		{name: "a bad selector", q: ListQuery{Selector: "version in ("}, wantErr: ErrInvalid},
		{name: "a bad page token", q: ListQuery{After: "no-slash"}, wantErr: ErrInvalid},
		{name: "an unknown node", q: ListQuery{Node: "z"}, wantErr: ErrUnknownNode},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			locs, more, err := v.List(tc.q, now)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, handles(locs))
			require.Equal(t, tc.wantMore, more)
		})
	}

	locs, _, err := v.List(ListQuery{Node: "a", Selector: "version=2"}, now)
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b"}, locs[0].Nodes, "a node's listing still says where else it is")

	// b comes back wiped: what only it held is gone from the index.
	_, err = v.Report(Report{NodeID: "b", StoreID: "b2", Revision: 1, Full: true}, now)
	require.NoError(t, err)
	require.Nil(t, v.find(volume.Ref{Namespace: "ci", Handle: "broken"}))
	require.Len(t, v.find(volume.Ref{Namespace: "ci", Handle: "r2"}).holders, 1)
	v.ForgetNode("a")
	require.Empty(t, v.byNamespace, "nothing left once no node reports anything")
	require.Zero(t, v.ordered.Len(), "nor in the listing order")
}

// volumeIDOrder orders volume IDs as listings do: by namespace, then
// handle ("ci/x" before "ci-2/x").
func volumeIDOrder(a, b string) int {
	ans, ah, _ := strings.Cut(a, "/")
	bns, bh, _ := strings.Cut(b, "/")
	return cmp.Or(strings.Compare(ans, bns), strings.Compare(ah, bh))
}

// Paging stays exact while nodes report, delete, resync, come back wiped
// and are forgotten: every page resumes after the last one's volume (even
// one gone since), each namespace's listing is its slice of the whole,
// and the listing order holds exactly the volumes some node reports.
func TestPagingThroughChurn(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	rng := rand.New(rand.NewPCG(1, 2))
	namespaces := []string{"a", "ci", "ci-2", "team"}
	random := func() Held {
		scope := volume.ScopeNamespace
		if rng.IntN(3) == 0 {
			scope = volume.ScopeCluster // a node may say otherwise of the same volume later
		}
		return Held{State: "ready", SizeBytes: 1, Scope: scope, Ref: volume.Ref{
			Namespace: namespaces[rng.IntN(len(namespaces))], Handle: fmt.Sprintf("v%d", rng.IntN(300))}}
	}
	revisions := map[string]uint64{}
	report := func(node string, full bool, store string, n int) {
		req := Report{NodeID: node, StoreID: store, Full: full, BaseRevision: revisions[node]}
		revisions[node]++
		req.Revision = revisions[node]
		for range n {
			req.Upserts = append(req.Upserts, random())
			if !full && rng.IntN(2) == 0 {
				req.Deletes = append(req.Deletes, random().Ref)
			}
		}
		_, err := v.Report(req, now)
		require.NoError(t, err)
	}
	everything := func() (want []string) {
		for ns, handles := range v.byNamespace {
			for h := range handles {
				want = append(want, ns+"/"+h)
			}
		}
		slices.SortFunc(want, volumeIDOrder)
		return want
	}
	page := func(namespace string, visible func(string) bool, limit int, churn bool) (got []string) {
		after := ""
		for {
			locs, more, err := v.List(ListQuery{Namespace: namespace, Visible: visible, After: after, Limit: limit}, now)
			require.NoError(t, err)
			for _, l := range locs {
				got = append(got, l.Ref.Namespace+"/"+l.Ref.Handle)
			}
			if !more {
				return got
			}
			after = got[len(got)-1]
			if churn { // the page's last volume goes before the next page
				last := locs[len(locs)-1]
				for _, node := range last.Nodes {
					_, err := v.Report(Report{NodeID: node, StoreID: node, BaseRevision: revisions[node],
						Revision: revisions[node] + 1, Deletes: []volume.Ref{last.Ref}}, now)
					require.NoError(t, err)
					revisions[node]++
				}
			}
		}
	}
	for round := range 40 {
		for _, node := range []string{"n1", "n2", "n3"} {
			report(node, revisions[node] == 0 || rng.IntN(5) == 0, node, 1+rng.IntN(60))
		}
		switch round % 10 {
		case 4:
			revisions["n2"] = 0
			report("n2", true, fmt.Sprintf("n2-wiped-%d", round), rng.IntN(20)) // back wiped
		case 9:
			v.ForgetNode("n3")
			revisions["n3"] = 0
		}
		want := everything()
		require.Equal(t, len(want), v.ordered.Len(), "round %d: the listing order holds what the index holds", round)
		require.Equal(t, want, page("", nil, 1+rng.IntN(25), false), "round %d", round)
		// A caller who sees one namespace: its volumes and the shared ones.
		mine := namespaces[rng.IntN(len(namespaces))]
		var visible []string
		shared := 0
		for _, id := range want {
			ns, h, _ := strings.Cut(id, "/")
			isShared := scopes[v.find(volume.Ref{Namespace: ns, Handle: h}).scope] == volume.ScopeCluster
			if isShared {
				shared++
			}
			if ns == mine || isShared {
				visible = append(visible, id)
			}
		}
		require.Equal(t, shared, v.shared.Len(), "round %d: the shared order holds the shared volumes", round)
		require.Equal(t, visible, page("", func(ns string) bool { return ns == mine }, 1+rng.IntN(25), false),
			"round %d: as %s sees it", round, mine)
		ns := namespaces[rng.IntN(len(namespaces))]
		var inNS []string
		for _, id := range want {
			if strings.HasPrefix(id, ns+"/") {
				inNS = append(inNS, id)
			}
		}
		require.Equal(t, inNS, page(ns, nil, 1+rng.IntN(10), false), "round %d: namespace %s", round, ns)
		// Pages resume past a volume deleted since: none is listed twice,
		// none skipped but those deleted.
		before := everything()
		got := page("", nil, 1+rng.IntN(25), true)
		require.Subset(t, before, got)
		require.True(t, slices.IsSortedFunc(got, volumeIDOrder) && len(slices.Compact(slices.Clone(got))) == len(got),
			"round %d: in order, once each", round)
		for _, id := range before {
			if !slices.Contains(got, id) {
				require.NotContains(t, everything(), id, "round %d: %s skipped though still held", round, id)
			}
		}
	}
}

func TestEncodeProps(t *testing.T) {
	p := func(kv ...string) (out []Property) {
		for i := 0; i < len(kv); i += 2 {
			out = append(out, Property{Key: kv[i], Value: kv[i+1]})
		}
		return out
	}
	tests := []struct {
		name string
		in   []Property
		want map[string]string
	}{
		{"none", nil, nil},
		{"sorted", p("a", "1", "b", "2"), map[string]string{"a": "1", "b": "2"}},
		{"unsorted", p("b", "2", "a", "1"), map[string]string{"a": "1", "b": "2"}},
		{"a key said twice keeps its last value", p("a", "1", "b", "2", "a", "3"), map[string]string{"a": "3", "b": "2"}},
		{"empty and odd strings", p("", "", "k\x00", "v\xff"+strings.Repeat("x", 300)), map[string]string{"": "", "k\x00": "v\xff" + strings.Repeat("x", 300)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := &entry{props: encodeProps(tc.in)}
			require.Equal(t, tc.want, e.properties())
		})
	}
}

// Each node's totals (its bytes and its copies by state, which node status
// and the metrics read instead of every record) stay those of the records
// its volumes' holders keep, through full syncs, changes, deletes, a new
// store and a drop; and every copy is both in the node's set and among the
// entry's holders, in node order.
func TestNodeTotalsFollowTheRecords(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	r := rand.New(rand.NewPCG(39, 2))
	stateNames := []string{"creating", "ready", "failed"}
	randomVol := func() Held {
		return vol(fmt.Sprintf("v%d", r.IntN(40)), stateNames[r.IntN(3)], int64(r.IntN(1000)-100))
	}
	revisions := map[string]uint64{}
	for round := range 400 {
		node := fmt.Sprintf("n%d", r.IntN(5))
		store := "s"
		if round%97 == 96 {
			store = fmt.Sprintf("s%d", round) // back with a wiped state dir
		}
		req := Report{NodeID: node, StoreID: store, Revision: revisions[node] + 1, BaseRevision: revisions[node], Full: r.IntN(4) == 0}
		for range r.IntN(20) {
			req.Upserts = append(req.Upserts, randomVol())
		}
		for range r.IntN(5) {
			req.Deletes = append(req.Deletes, ref(fmt.Sprintf("v%d", r.IntN(40))))
		}
		a, err := v.Report(req, now)
		require.NoError(t, err)
		if a.Resync {
			req.Full, req.Deletes = true, nil
			_, err = v.Report(req, now)
			require.NoError(t, err)
		}
		revisions[node] = req.Revision
		if round%53 == 52 {
			v.drop(v.nodes[node])
			delete(revisions, node)
		}
		for _, handles := range v.byNamespace {
			for _, e := range handles {
				for _, h := range e.holders {
					require.NotNil(t, v.byIndex[h.node], "a holder names a node that went")
				}
			}
		}
		for _, n := range v.nodes {
			require.Same(t, n, v.byIndex[n.index])
			var want nodeState
			copies := 0
			for _, handles := range v.byNamespace {
				for _, e := range handles {
					require.True(t, slices.IsSortedFunc(e.holders, func(a, b holding) int { return strings.Compare(v.byIndex[a.node].id, v.byIndex[b.node].id) }))
					if rec, ok := v.recordOf(e, n); ok {
						copies++
						want.count(rec, 1)
						require.Contains(t, n.held, e.id)
					}
				}
			}
			require.Len(t, n.held, copies, "round %d, node %s", round, n.id)
			require.Equal(t, want.bytes, n.bytes, "round %d, node %s", round, n.id)
			require.Equal(t, want.states, n.states, "round %d, node %s", round, n.id)
		}
	}
}

// digests are a volume's, made up from one byte.
func digests(b byte, firstHand bool) volume.Digests {
	var d volume.Digests
	d.Layer[0], d.View[0], d.View[1], d.FirstHand = b, b, 1, firstHand
	return d
}

// A volume is vouched for by the node that made it: a pulled copy's
// digests only while its maker's are unknown, the first said over a later
// one that differs, and a maker's over a copy's; a maker that holds the
// volume no more gives way to the next maker to report it.
func TestVouchedDigests(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	report := func(node string, d volume.Digests, held bool) {
		var upserts []Held
		if held {
			h := vol("a", "ready", 1)
			h.Vouch = d
			upserts = append(upserts, h)
		}
		_, err := v.Report(Report{NodeID: node, StoreID: node, Revision: 1, Full: true, Upserts: upserts}, now)
		require.NoError(t, err)
	}
	vouched := func() volume.Digests {
		locs := v.Lookup([]volume.Ref{ref("a")}, 0, now)
		require.Len(t, locs, 1)
		return locs[0].Vouch
	}
	want := func(b byte) volume.Digests { return digests(b, false) } // lookups say no hand

	report("copy-1", volume.Digests{}, true)
	require.False(t, vouched().Known(), "none said")
	report("copy-1", digests(1, false), true)
	require.Equal(t, want(1), vouched(), "a copy's, while no maker's is known")
	report("copy-2", digests(2, false), true)
	require.Equal(t, want(1), vouched(), "the first copy's, over a later one that differs")
	report("maker", digests(3, true), true)
	require.Equal(t, want(3), vouched(), "the maker's, over a copy's")
	report("copy-2", digests(2, false), true)
	report("liar", digests(4, true), true)
	require.Equal(t, want(3), vouched(), "the first maker's, while it holds the volume")
	report("maker", volume.Digests{}, true)
	require.Equal(t, want(3), vouched(), "a report without digests changes nothing")
	report("maker", volume.Digests{}, false)
	require.Equal(t, want(3), vouched(), "kept once the maker holds it no more")
	report("liar", digests(4, true), true)
	require.Equal(t, want(4), vouched(), "the next maker's, once the first holds it no more")
}
