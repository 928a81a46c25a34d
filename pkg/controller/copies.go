package controller

import (
	"cmp"
	"slices"
	"time"

	"github.com/concourse/cowvol/pkg/volume"
)

// copies.go: volumes that asked (the copies attribute) to be kept on more
// nodes than hold them ready, and the nodes told to pull them. Only the
// volumes lacking copies are looked at on a report, never the whole view.

// copyTimeout is how long a node has to hold an assigned copy ready before
// another node is asked instead.
const copyTimeout = 10 * time.Minute

// copying is where a volume lacking copies stands: the nodes asked to pull
// it, and since when.
type copying map[*nodeState]time.Time

// readyCopies counts the live nodes holding e ready that no scheduler told
// to destroy it; destroyed says whether one did (e is going: no copy is
// made). The caller holds the lock.
func (v *View) readyCopies(e *entry, now time.Time) (ready int, destroyed bool) {
	for _, h := range e.holders {
		n := v.byIndex[h.node]
		if n.destroyed(e) {
			return 0, true
		}
		if v.live(n, now) && states[h.rec.state] == volume.StateReady {
			ready++
		}
	}
	return ready, false
}

// markLacking has the next report look at whether e lacks copies: a
// node's report of it changed, or a holder stalled or went. The caller
// holds the lock.
func (v *View) markLacking(e *entry) {
	// The cheap tests first: this runs for every entry of every full
	// report, and few volumes ask for copies.
	if e.copies <= 1 || len(e.holders) == 0 {
		return
	}
	if _, ok := v.lacking[e]; !ok {
		v.lacking[e] = copying{}
	}
}

// assignCopies asks nodes to pull the volumes lacking copies, the live,
// running nodes that hold them not, with the most room first; and
// returns what n is asked to pull. The caller holds the lock.
func (v *View) assignCopies(n *nodeState, now time.Time) []volume.Ref {
	var mine []volume.Ref
	for e, asked := range v.lacking {
		ready, destroyed := v.readyCopies(e, now)
		if destroyed || ready >= int(e.copies) || len(e.holders) == 0 {
			delete(v.lacking, e)
			continue
		}
		for a, since := range asked {
			rec, held := v.recordOf(e, a)
			if v.nodes[a.id] != a || !v.live(a, now) || now.Sub(since) > copyTimeout || (held && states[rec.state] == volume.StateReady) {
				delete(asked, a)
			}
		}
		// Copies come from a ready holder: none yet (it is being made, or
		// its holders stalled), none is asked for.
		if need := int(e.copies) - ready - len(asked); need > 0 && ready > 0 {
			targets := v.copyTargets(e, asked, now)
			for _, c := range targets[:min(need, len(targets))] {
				asked[c] = now
			}
		}
		if _, ok := asked[n]; ok {
			mine = append(mine, e.ref)
		}
	}
	return mine
}

// copyTargets are the nodes that may take a copy of e, the most room
// first: live and running (not landing, landed, retiring or cordoned), under
// their high watermark with room for it, holding it not, and not asked
// already. The caller holds the lock.
func (v *View) copyTargets(e *entry, asked copying, now time.Time) []*nodeState {
	var size int64
	for _, h := range e.holders {
		size = max(size, h.rec.size)
	}
	var out []*nodeState
	for _, n := range v.nodes {
		holds := v.holds(n, e)
		_, wasAsked := asked[n]
		if !holds && !wasAsked && v.state(n, now) == NodeRunning && !n.over && n.peerAddress != "" && n.bytesFree > size {
			out = append(out, n)
		}
	}
	slices.SortFunc(out, func(a, b *nodeState) int {
		return cmp.Or(cmp.Compare(b.bytesFree, a.bytesFree), cmp.Compare(a.id, b.id))
	})
	return out
}
