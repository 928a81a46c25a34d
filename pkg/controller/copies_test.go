package controller

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
	report := func(at time.Time, node string, free int64, vols ...Held) []string {
		t.Helper()
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
	require.Empty(t, v.lacking, "nothing lacks copies")

	// c stalls: its copy is no longer served, and b is asked.
	later := now.Add(2 * time.Minute)
	report(later, "a", 1000)
	report(later, "d", 1<<20)
	v.Sweep(later)
	require.Equal(t, []string{"out"}, report(later, "b", 5000))

	// Destroyed, it is copied nowhere.
	v.Destroy([]volume.Ref{ref("out")})
	require.Empty(t, report(later, "b", 5000))

	// A node over its high watermark, or without room, takes none.
	report(later, "a", 1000, twice("big", "ready"))
	_, err = v.Report(Report{NodeID: "b", StoreID: "b", Revision: revs["b"] + 1, BaseRevision: revs["b"],
		BytesFree: 50, PeerAddress: "b:7443"}, later)
	require.NoError(t, err)
	revs["b"]++
	require.Contains(t, v.lacking, v.find(volume.Ref{Namespace: "ci", Handle: "big"}), "big still lacks its copy: b has no room")
}
