package fleet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/volume"
)

// A volume that asked for copies is pulled by the running node with the
// most room, until it is ready there; another node is asked once a holder
// stalls; landing or full nodes, and destroyed volumes, get no copy.
func TestCopies(t *testing.T) {
	v := NewView(time.Minute, time.Hour)
	now := time.Now()
	revs := map[string]uint64{}
	// Each report after a pass, as the controller's tendView makes them
	// every second.
	report := func(at time.Time, node string, free int64, vols ...Held) []string {
		t.Helper()
		v.AssignCopies(at)
		base := revs[node]
		revs[node]++
		resp, err := v.Report(Report{NodeID: node, StoreID: node, Revision: revs[node], Full: base == 0,
			BaseRevision: base, Upserts: vols, BytesFree: free, PeerAddress: node + ":7443"}, at)
		require.NoError(t, err)
		var got []string
		for _, r := range resp.Copy {
			got = append(got, r.Handle)
		}
		return got
	}
	twice := func(h, state string) Held {
		s := vol(h, state, 100)
		s.Copies = 2
		return s
	}
	report(now, "b", 5000)
	report(now, "c", 9000)
	report(now, "d", 1<<20)
	_, err := v.SetLifecycle("d", "land", now)
	require.NoError(t, err)
	require.Empty(t, report(now, "a", 1000, twice("out", "creating"), vol("plain", "ready", 100)), "nothing asks while it is made")

	report(now, "a", 1000, twice("out", "ready"))
	require.Equal(t, []string{"out"}, report(now, "c", 9000), "the running node with the most room, not the landing one")
	require.Empty(t, report(now, "b", 5000), "one copy asked for, one node asked")
	require.Equal(t, []string{"out"}, report(now, "c", 9000, vol("out", "creating", -1)), "asked until it is ready there")
	require.Empty(t, report(now, "c", 9000, vol("out", "ready", 100)), "a copy made")
	require.Zero(t, v.AssignCopies(now), "nothing lacks copies")

	// c stalls: its copy is no longer served, and b is asked.
	later := now.Add(2 * time.Minute)
	report(later, "a", 1000)
	report(later, "d", 1<<20)
	report(later, "b", 5000)
	v.Sweep(later)
	require.Equal(t, []string{"out"}, report(later, "b", 5000))

	// Destroyed, it is copied nowhere.
	v.Destroy([]volume.Ref{ref("out")}, later)
	require.Empty(t, report(later, "b", 5000))

	// A node over its high watermark, or without room, takes none.
	report(later, "a", 1000, twice("big", "ready"))
	_, err = v.Report(Report{NodeID: "b", StoreID: "b", Revision: revs["b"] + 1, BaseRevision: revs["b"],
		BytesFree: 50, PeerAddress: "b:7443"}, later)
	require.NoError(t, err)
	revs["b"]++
	require.Contains(t, v.lacking, v.find(volume.Ref{Namespace: "ci", Handle: "big"}), "big still lacks its copy: b has no room")
}

// copyFleet is a view whose nodes report through it, each report after a
// copy pass as tendView makes them.
type copyFleet struct {
	t    *testing.T
	v    *View
	revs map[string]uint64
}

func newCopyFleet(t *testing.T, l CopyLimits) *copyFleet {
	v := NewView(time.Minute, time.Hour)
	v.LimitCopies(l)
	return &copyFleet{t: t, v: v, revs: map[string]uint64{}}
}

func (f *copyFleet) report(at time.Time, node string, free int64, vols ...Held) Answer {
	f.t.Helper()
	f.v.AssignCopies(at)
	base := f.revs[node]
	f.revs[node]++
	a, err := f.v.Report(Report{NodeID: node, StoreID: node, Revision: f.revs[node], Full: base == 0,
		BaseRevision: base, Upserts: vols, BytesFree: free, PeerAddress: node + ":7443"}, at)
	require.NoError(f.t, err)
	return a
}

func asking(ns, h string, copies int32) Held {
	return Held{Ref: volume.Ref{Namespace: ns, Handle: h}, State: volume.StateReady, SizeBytes: 100, Copies: copies}
}

func handles(refs []volume.Ref) (out []string) {
	for _, r := range refs {
		out = append(out, r.Namespace+"/"+r.Handle)
	}
	return out
}

// The operator's maximum caps what a volume is kept on whatever it asked;
// a namespace's budget of extra copies is granted in the order volumes
// come (in part to the one that finds it nearly spent), is told to every
// node once spent, and comes back when a volume that had some goes. One
// namespace spending its budget takes nothing from another's.
func TestCopyLimits(t *testing.T) {
	f := newCopyFleet(t, CopyLimits{Max: 3, PerNamespace: 3})
	now := time.Now()
	for _, n := range []string{"b", "c", "d", "e"} {
		f.report(now, n, 1<<30)
	}
	a := f.report(now, "a", 1<<20, asking("ci", "five", 5))
	require.Equal(t, 3, a.MaxCopies)
	require.Empty(t, a.CopiesSpent, "two of ci's three extra copies granted")
	a = f.report(now, "a", 1<<20, asking("ci", "two", 2), asking("ci", "more", 3))
	require.Equal(t, []string{"ci"}, a.CopiesSpent, "the third granted: ci's budget is spent")
	// Every node is told, and each volume is copied to the nodes granted.
	require.Equal(t, []string{"ci"}, f.report(now, "e", 1<<30).CopiesSpent)
	f.v.AssignCopies(now)
	ordered := map[string]int{}
	for _, n := range []string{"b", "c", "d", "e"} {
		for _, h := range handles(f.report(now, n, 1<<30).Copy) {
			ordered[h]++
		}
	}
	require.Equal(t, map[string]int{"ci/five": 2, "ci/two": 1}, ordered, "five kept on 3 nodes (the maximum), two on 2, more on 1 (nothing left)")
	// Another namespace has a budget of its own.
	a = f.report(now, "a", 1<<20, asking("other", "x", 2))
	require.Equal(t, []string{"ci"}, a.CopiesSpent)

	// five goes: its two extra copies come back, and more, short of
	// them, gets them on the next pass.
	f.v.Destroy([]volume.Ref{{Namespace: "ci", Handle: "five"}}, now)
	_, err := f.v.Report(Report{NodeID: "a", StoreID: "a", Revision: f.revs["a"] + 1, BaseRevision: f.revs["a"],
		Deletes: []volume.Ref{{Namespace: "ci", Handle: "five"}}, BytesFree: 1 << 20, PeerAddress: "a:7443"}, now)
	require.NoError(t, err)
	f.revs["a"]++
	f.v.AssignCopies(now)
	require.Equal(t, 3, f.v.copyUse["ci"], "two for more, one for two")
	require.Equal(t, []string{"ci"}, f.report(now, "b", 1<<30).CopiesSpent, "spent again by more")

	// No budget at all: nodes are told that a volume is kept on one.
	none := newCopyFleet(t, CopyLimits{Max: 5, PerNamespace: 0})
	a = none.report(now, "a", 1<<20, asking("ci", "two", 2))
	require.Equal(t, 1, a.MaxCopies)
	require.Zero(t, none.v.AssignCopies(now), "nothing granted, nothing lacks copies")
}

// A volume that fits on no node is looked at after a back-off that
// doubles, not on every pass; a node that comes ends the wait.
func TestCopiesBackOff(t *testing.T) {
	f := newCopyFleet(t, noCopyLimits)
	now := time.Now()
	f.report(now, "b", 50)
	f.report(now, "a", 1<<20, asking("ci", "big", 2)) // 100 bytes: b has room for none
	require.Equal(t, 1, f.v.AssignCopies(now))
	// b makes room; the volume is not looked at until its back-off ends.
	f.report(now.Add(time.Second), "b", 1<<20)
	require.Empty(t, f.report(now.Add(2*time.Second), "b", 1<<20).Copy, "backed off")
	require.Equal(t, []string{"ci/big"}, handles(f.report(now.Add(copyFirstBackoff+time.Second), "b", 1<<20).Copy))

	// Fits nowhere again: the back-off doubles each time.
	g := newCopyFleet(t, noCopyLimits)
	g.report(now, "b", 50)
	g.report(now, "a", 1<<20, asking("ci", "big", 2))
	at := now
	for _, want := range []time.Duration{copyFirstBackoff, 2 * copyFirstBackoff, 4 * copyFirstBackoff} {
		g.v.AssignCopies(at)
		c := g.v.lacking[g.v.find(ref("big"))]
		require.Equal(t, want, c.backoff)
		at = c.next
	}
	// A new node: looked at on the next pass, backed off or not.
	g.report(now.Add(time.Second), "c", 1<<20)
	require.Equal(t, []string{"ci/big"}, handles(g.report(now.Add(3*time.Second), "c", 1<<20).Copy))
}
