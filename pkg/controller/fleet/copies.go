package fleet

import (
	"cmp"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/concourse/cowvol/pkg/volume"
)

// copies.go: volumes that asked (the copies attribute) to be kept on more
// nodes than hold them ready, and the nodes told to pull them.
//
// What a volume gets is bounded twice: by the operator's maximum
// (CopyLimits.Max, applied here whatever its node said) and by its
// namespace's budget of extra copies (CopyLimits.PerNamespace: the nodes
// past the first, all its volumes together), granted in the order the
// volumes are reported and given back when they go. Nodes are told the
// maximum and which namespaces have spent their budget, and refuse a
// publish that asks for more at once; the grant here is what holds.
//
// Copies are assigned by a periodic pass (AssignCopies), never on a
// report's path: a report only reads the orders its node was given. A
// volume that fits on no node is looked at again after a back-off that
// doubles up to copyMaxBackoff, or at once when a new node comes.

// CopyLimits bound the copies the controller has nodes make.
type CopyLimits struct {
	// Max is the most nodes a volume is kept on, whatever it asked (1 to
	// volume.MaxCopies).
	Max int
	// PerNamespace is the most extra copies (nodes past the first) a
	// namespace's volumes are granted together; 0: none.
	PerNamespace int
}

const (
	// copyTimeout is how long a node has to hold an assigned copy ready
	// before another node is asked instead.
	copyTimeout = 10 * time.Minute
	// A volume no node can take is looked at again after copyFirstBackoff,
	// then twice as long each time, up to copyMaxBackoff.
	copyFirstBackoff = 5 * time.Second
	copyMaxBackoff   = 2 * time.Minute
)

// copying is where a volume lacking copies stands: the nodes asked to pull
// it and since when, and when the pass looks at it next.
type copying struct {
	asked   map[*nodeState]time.Time
	next    time.Time
	backoff time.Duration
}

// LimitCopies sets the operator's bounds; a view that was never told has
// none but volume.MaxCopies. Call it before the first report.
func (v *View) LimitCopies(l CopyLimits) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.copyLimits = l
}

// copyRefusals is what nodes are told of the copy limits: the most nodes
// a volume is kept on (1 if namespaces get no extra copies at all), and
// the namespaces whose budget is spent, sorted. The caller holds the
// lock.
func (v *View) copyRefusals() (maxCopies int, spent []string) {
	if v.copyLimits.PerNamespace == 0 {
		return 1, nil
	}
	if v.spentStale {
		v.spent = v.spent[:0]
		for ns, used := range v.copyUse {
			if used >= v.copyLimits.PerNamespace {
				v.spent = append(v.spent, ns)
			}
		}
		slices.Sort(v.spent)
		v.spentStale = false
	}
	return v.copyLimits.Max, v.spent
}

// askedFor is how many nodes e asked to be kept on, within the operator's
// maximum.
func (v *View) askedFor(e *entry) int { return min(int(e.copies), v.copyLimits.Max) }

// grant sizes e's share of its namespace's budget to what it asks: more
// while the budget has room, less once it asks less. What it is short of
// is granted by a later pass, if room comes. The caller holds the lock.
func (v *View) grant(e *entry) {
	want, have := max(v.askedFor(e)-1, 0), int(e.granted)
	if want > have {
		room := max(v.copyLimits.PerNamespace-v.copyUse[e.ref.Namespace], 0)
		if room < want-have {
			v.shortOfBudget[e] = struct{}{}
		} else {
			delete(v.shortOfBudget, e)
		}
		want = have + min(want-have, room)
	} else {
		delete(v.shortOfBudget, e)
	}
	if want != have {
		v.setGranted(e, want)
	}
}

// setGranted gives e n extra copies of its namespace's budget. The caller
// holds the lock.
func (v *View) setGranted(e *entry, n int) {
	ns := e.ref.Namespace
	if v.copyUse[ns] += n - int(e.granted); v.copyUse[ns] == 0 {
		delete(v.copyUse, ns)
	}
	e.granted = uint8(n)
	v.spentStale = true
}

// release gives back what e was granted, and forgets that it lacks any:
// no node reports it any more. The caller holds the lock.
func (v *View) release(e *entry) {
	v.setGranted(e, 0)
	delete(v.shortOfBudget, e)
	if c, ok := v.lacking[e]; ok {
		v.doneCopying(e, c)
	}
}

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

// markLacking has the next pass look at whether e lacks copies: a node's
// report of it changed, or a holder stalled or went. The caller holds the
// lock.
func (v *View) markLacking(e *entry) {
	// The cheap tests first: this runs for every entry of every full
	// report, and few volumes are granted copies.
	if e.granted == 0 || len(e.holders) == 0 {
		return
	}
	if _, ok := v.lacking[e]; !ok {
		v.lacking[e] = &copying{asked: map[*nodeState]time.Time{}}
	}
}

// ask tells a to pull e. The caller holds the lock.
func (v *View) ask(e *entry, c *copying, a *nodeState, now time.Time) {
	c.asked[a] = now
	a.copyOrders[e] = struct{}{}
}

// unask takes back the order to a. The caller holds the lock.
func (v *View) unask(e *entry, c *copying, a *nodeState) {
	delete(c.asked, a)
	delete(a.copyOrders, e)
}

// doneCopying forgets that e lacks copies, and every order to pull it.
// The caller holds the lock.
func (v *View) doneCopying(e *entry, c *copying) {
	for a := range c.asked {
		v.unask(e, c, a)
	}
	delete(v.lacking, e)
}

// copyOrders are the volumes n is asked to pull and does not hold ready
// yet (the next pass takes back the orders it did), sorted. The caller
// holds the lock.
func (v *View) copyOrders(n *nodeState) []volume.Ref {
	var out []volume.Ref
	for e := range n.copyOrders {
		if rec, held := v.recordOf(e, n); !held || states[rec.state] != volume.StateReady {
			out = append(out, e.ref)
		}
	}
	slices.SortFunc(out, func(a, b volume.Ref) int {
		return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Handle, b.Handle))
	})
	return out
}

// AssignCopies is the periodic pass: it grants what budgets now have room
// for, and asks the live, running nodes with the most room to pull the
// volumes lacking copies that are due. It says how many volumes lack
// copies.
func (v *View) AssignCopies(now time.Time) (lacking int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for e := range v.shortOfBudget {
		v.grant(e)
		v.markLacking(e)
	}
	everyone := v.nodesGrew
	v.nodesGrew = false
	var room []*nodeState // made when first needed, once a pass
	for e, c := range v.lacking {
		if now.Before(c.next) && !everyone {
			continue
		}
		ready, destroyed := v.readyCopies(e, now)
		want := 1 + int(e.granted)
		if destroyed || ready >= want || len(e.holders) == 0 {
			v.doneCopying(e, c)
			continue
		}
		for a, since := range c.asked {
			rec, held := v.recordOf(e, a)
			if v.nodes[a.id] != a || !v.live(a, now) || now.Sub(since) > copyTimeout || (held && states[rec.state] == volume.StateReady) {
				v.unask(e, c, a)
			}
		}
		// Copies come from a ready holder: none yet (it is being made, or
		// its holders stalled), none is asked for.
		need := want - ready - len(c.asked)
		if need <= 0 || ready == 0 {
			continue
		}
		if room == nil {
			room = v.byRoom(now)
		}
		if v.askCopies(e, c, room, need, now) < need {
			c.backoff = min(max(2*c.backoff, copyFirstBackoff), copyMaxBackoff)
			c.next = now.Add(c.backoff)
		} else {
			c.backoff, c.next = 0, time.Time{}
		}
	}
	return len(v.lacking)
}

// byRoom are the nodes that may take copies, the most room first: live
// and running (not landing, landed, retiring or cordoned), under their
// high watermark, and serving peers. The caller holds the lock.
func (v *View) byRoom(now time.Time) []*nodeState {
	out := []*nodeState{}
	for _, n := range v.nodes {
		if v.state(n, now) == NodeRunning && !n.over && n.peerAddress != "" && n.bytesFree > 0 {
			out = append(out, n)
		}
	}
	slices.SortFunc(out, func(a, b *nodeState) int {
		return cmp.Or(cmp.Compare(b.bytesFree, a.bytesFree), cmp.Compare(a.id, b.id))
	})
	return out
}

// askCopies asks up to need of room (the most room first) that have room
// for e, hold it not and were not asked already to pull it, and says how
// many it asked. A volume bigger than any node's room costs one look. The
// caller holds the lock.
func (v *View) askCopies(e *entry, c *copying, room []*nodeState, need int, now time.Time) int {
	var size int64
	for _, h := range e.holders {
		size = max(size, h.rec.size)
	}
	asked := 0
	for _, n := range room {
		if n.bytesFree <= size || asked == need {
			break
		}
		if _, was := c.asked[n]; !was && !v.holds(n, e) {
			v.ask(e, c, n, now)
			asked++
		}
	}
	return asked
}

// noCopyLimits are a view's bounds until LimitCopies: the most any volume
// may ask, no namespace budget.
var noCopyLimits = CopyLimits{Max: volume.MaxCopies, PerNamespace: math.MaxInt32}
