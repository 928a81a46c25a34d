// Package fleet is the controller's model of the node caches: which node
// holds which volume in what state, which nodes are live, the answers a
// scheduler gets from that (lookups, listings, placement), the copies
// volumes asked for and who is told to make them, and the read orders
// nodes share. It keeps no database: the view is what the nodes report,
// and after a restart it is rebuilt from their next reports. It speaks its
// own types (types.go), never the API's, and knows nothing of gRPC, of who
// may ask, or of how a report arrives: pkg/controller serves it. It never
// touches a volume: nodes do, when their reports are answered.
package fleet

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/google/btree"

	"github.com/concourse/cowvol/pkg/volume"
)

// Node states a scheduler sees.
const (
	NodeRunning = "running"
	// NodeLanding: no new placements, captures refused, volumes kept;
	// NodeLanded once no step uses its volumes.
	NodeLanding = "landing"
	NodeLanded  = "landed"
	// NodeRetiring: as landing, then everything it holds is destroyed
	// and it is forgotten.
	NodeRetiring = "retiring"
	// NodeStalled: no report within the stalled-after time. Its volumes
	// are left out of lookups and placement until it reports again.
	NodeStalled = "stalled"
)

// View is the controller's picture of every node's cache. It is safe for
// concurrent use.
//
// It is built for a fleet of a thousand nodes holding ten thousand volumes
// each (bench: BenchmarkControllerFleet): one entry per volume, indexed by
// namespace and handle, lists the nodes holding it, each by index with the
// compact record of its copy beside it. A lookup or a placement touches
// only the entries it names, reading their holders in one sweep. The ten
// million copies hold no pointers (holders name nodes by index, nodes name
// the entries they hold by ID): the garbage collector traces the half
// million entries, not the copies.
type View struct {
	mu sync.RWMutex
	// reporting serializes each node's reports (by a hash of its ID):
	// a full report is checked under the read lock before it is applied.
	reporting [64]sync.Mutex
	nodes     map[string]*nodeState
	// byIndex are the nodes by their index, which entries' holders name
	// them by (freeIndexes: those no node has now).
	byIndex            []*nodeState
	freeIndexes        []uint32
	stalledAfter       time.Duration
	forgetStalledAfter time.Duration
	// cordoned are the Kubernetes Nodes marked unschedulable: landing.
	cordoned map[string]bool
	// byNamespace indexes every volume some node reports: namespace,
	// then handle. entries are the same by ID (freeEntries: the IDs no
	// entry has now).
	byNamespace map[string]map[string]*entry
	entries     []*entry
	freeEntries []uint32
	// ordered holds the same entries in (namespace, handle) order: a
	// listing's page starts where the last one stopped, in O(log n),
	// instead of sorting a million volumes for every page. shared holds
	// the scope cluster ones alone, in the same order: a caller who sees
	// few namespaces pages through those and what others shared, not
	// through everything.
	ordered, shared *btree.BTreeG[*entry]
	// names interns the namespaces a million entries repeat, so that they
	// do not hold a million copies.
	names interner
	// awaiting are the nodes a controller that just began to lead has
	// not had a whole inventory from yet, waited for until awaitUntil:
	// until then its view lacks their volumes, and it says so.
	awaiting   map[string]bool
	awaitUntil time.Time
	// unheard are what schedulers asked of volumes (destroys, pins) while
	// some node was still awaited: it may hold one (the command then
	// reaches no node of it), and its first whole inventory is answered
	// with the command for each volume it names. They are forgotten once
	// no node is awaited, or forgetStalledAfter after the wait: a node
	// silent so long brings its volumes back as they were, as a forgotten
	// node does.
	unheard      map[volume.Ref]unheardCommand
	unheardUntil time.Time
	// lacking are the volumes held ready on fewer nodes than they were
	// granted, with the nodes asked to pull them (copies.go); nodesGrew:
	// a node came since the last pass, which looks at every one of them.
	lacking   map[*entry]*copying
	nodesGrew bool
	// copyUse is the extra copies granted to each namespace's volumes,
	// within copyLimits; shortOfBudget are the volumes granted fewer than
	// they asked for; spent are the namespaces with none left (once
	// spentStale is false).
	copyLimits    CopyLimits
	copyUse       map[string]int
	shortOfBudget map[*entry]struct{}
	spent         []string
	spentStale    bool
	// clears are the cache keys cleared, each with when (this view's
	// clock): a version promoted before then that a node reports later (it
	// had not reported it when the key was cleared) is destroyed then.
	clears map[volume.CacheRef]time.Time
}

// entry is one volume across the nodes that report it, with what is the
// volume's own and not a copy's: its lineage, scope and properties, as the
// last node to report it said.
type entry struct {
	ref volume.Ref
	// id is its place in View.entries, by which nodes name what they hold.
	id uint32
	// holders are the nodes reporting it, by ID, each with its record
	// beside it: a lookup or a placement reads them in one sweep, not a
	// map probe per node. Most volumes are on one node: holders starts in
	// one, saving an object per volume for the garbage collector to trace.
	holders []holding
	one     [1]holding
	parent  *volume.Ref
	// props are the properties, sorted by key, each key and value
	// length-prefixed (encodeProps): one string, sharing its allocation
	// with the handle's.
	props string
	scope scopeCode
	// copies is how many nodes the volume asked to be kept on (its
	// capturing node's word; 0 or 1: no more than one); granted are the
	// nodes past the first its namespace's budget gives it (copies.go).
	copies, granted uint8
	// vouch are the digests the volume is vouched for with (nil: none
	// known): see vouchAfter.
	vouch *vouched
}

// vouched are a volume's digests and the node that said them.
type vouched struct {
	volume.Digests
	node uint32
}

// vouchAfter is what e is vouched for with once n has said d of it (nil:
// nothing), and whether that differs from what it is now. The word of the
// node that made the volume (first hand) stands over a pulled copy's, and
// the first said over a later one that differs, which a node could only
// say to spoil a pull; but a maker that holds the volume no more gives way
// to the next maker to report it (a volume destroyed and made again).
// Second-hand digests are taken only while no first-hand ones are known:
// they are what the first pull was checked against, or, if the maker was
// gone by then, what the first copy's pull said. The caller holds the lock.
func (v *View) vouchAfter(e *entry, n *nodeState, d volume.Digests) (*vouched, bool) {
	if !d.Known() {
		return e.vouch, false
	}
	cur := e.vouch
	switch {
	case cur == nil:
	case cur.Digests == d:
		return cur, false
	case !d.FirstHand:
		return cur, false
	case cur.FirstHand:
		if maker := v.byIndex[cur.node]; maker != nil && maker != n {
			if _, held := v.holderAt(e, maker); held {
				return cur, false
			}
		}
	}
	return &vouched{Digests: d, node: n.index}, true
}

// holding is one node's copy of a volume: the node by its index (no
// pointer: ten million copies the garbage collector need not trace), and
// its record.
type holding struct {
	node uint32
	rec  record
}

// holderAt is where n is, or would go, among e's holders. The caller holds
// the lock.
func (v *View) holderAt(e *entry, n *nodeState) (int, bool) {
	i, found := slices.BinarySearchFunc(e.holders, n.id, func(h holding, id string) int { return strings.Compare(v.byIndex[h.node].id, id) })
	return i, found && e.holders[i].node == n.index
}

// recordOf is n's record of its copy of e. The caller holds the lock.
func (v *View) recordOf(e *entry, n *nodeState) (record, bool) {
	if i, ok := v.holderAt(e, n); ok {
		return e.holders[i].rec, true
	}
	return record{}, false
}

// indexNode gives n an index. The caller holds the lock.
func (v *View) indexNode(n *nodeState) {
	if k := len(v.freeIndexes); k > 0 {
		n.index, v.freeIndexes = v.freeIndexes[k-1], v.freeIndexes[:k-1]
		v.byIndex[n.index] = n
		return
	}
	n.index = uint32(len(v.byIndex))
	v.byIndex = append(v.byIndex, n)
}

// record is what one node reports of its copy of a volume, kept small: a
// fleet holds ten million of them.
type record struct {
	size   int64
	steps  int32
	state  stateCode
	pinned bool
	// sync is the full sync that last named it (replace drops the others).
	sync uint16
}

// stateCode and scopeCode are a record's state and an entry's scope in a
// byte; a report naming any other is refused.
type (
	stateCode uint8
	scopeCode uint8
)

var (
	states = []volume.State{volume.StateCreating, volume.StateReady, volume.StateFailed}
	scopes = []volume.Scope{volume.ScopeNamespace, volume.ScopeCluster}
)

func (c stateCode) String() string { return string(states[c]) }

func (e *entry) properties() map[string]string {
	if e.props == "" {
		return nil
	}
	m := map[string]string{}
	for rest := e.props; rest != ""; {
		var k, v string
		k, rest = cutPrefixed(rest)
		v, rest = cutPrefixed(rest)
		m[k] = v
	}
	return m
}

// encodeProps packs properties into one string: for each key in order, its
// length, the key, the value's length, the value. A key said twice keeps
// its last value, as a map would.
func encodeProps(props []Property) string { return string(appendProps(nil, props)) }

// appendProps appends properties to b as encodeProps packs them.
func appendProps(b []byte, props []Property) []byte {
	byKey := func(a, b Property) int { return strings.Compare(a.Key, b.Key) }
	if !slices.IsSortedFunc(props, byKey) {
		props = slices.Clone(props)
		slices.SortStableFunc(props, byKey)
	}
	for i, p := range props {
		if i+1 < len(props) && props[i+1].Key == p.Key {
			continue // said again later
		}
		b = binary.AppendUvarint(b, uint64(len(p.Key)))
		b = append(b, p.Key...)
		b = binary.AppendUvarint(b, uint64(len(p.Value)))
		b = append(b, p.Value...)
	}
	return b
}

// cutPrefixed splits a length-prefixed string off the front of s.
func cutPrefixed(s string) (string, string) {
	n, w := binary.Uvarint([]byte(s[:min(len(s), binary.MaxVarintLen64)]))
	return s[w : w+int(n)], s[w+int(n):]
}

// interner hands out one copy of each string it is given, up to a bound
// (past it, a copy each time): the namespaces and property keys of a
// cluster are few. What it is given may share a whole report's bytes.
type interner struct{ seen map[string]string }

const maxInterned = 1 << 16

func (in *interner) intern(s string) string {
	if c, ok := in.seen[s]; ok {
		return c
	}
	if in.seen == nil {
		in.seen = map[string]string{}
	}
	s = strings.Clone(s)
	if len(in.seen) < maxInterned {
		in.seen[s] = s
	}
	return s
}

type nodeState struct {
	id, storeID string
	index       uint32
	revision    uint64
	lastReport  time.Time
	// held are the IDs of the entries it reports (their records are the
	// entries' holders'); bytes and states total them, for its status and
	// the metrics, which would otherwise read every record of the fleet.
	held   map[uint32]struct{}
	bytes  int64
	states [3]int32
	// syncs counts its full syncs, to mark what each one named.
	syncs     uint16
	bytesFree int64
	over      bool
	// peerAddress is where the node serves its volumes to pulling peers,
	// and pullMode how it pulls what it lacks.
	peerAddress string
	pullMode    string
	// What schedulers asked of the node, until its reports show it done.
	destroy map[*entry]bool
	pins    map[*entry]PinCommand
	// destroyOwned are the owner sweep's destroys, with the owner's UID
	// each, until the node's next answer says them (DestroyIfOwned).
	destroyOwned map[*entry]string
	// copyOrders are the volumes it is asked to pull (copies.go).
	copyOrders map[*entry]struct{}
	// lifecycle is running, landing or retiring, as set through the API;
	// stepVolumes is how many step volumes it last reported.
	lifecycle   string
	stepVolumes int32
	// stallSeen: the sweep has told of this node's stall.
	stallSeen bool
}

// lifecycle is the node's, where a cordoned Kubernetes Node is landing.
func (v *View) lifecycle(n *nodeState) string {
	if n.lifecycle == "" && v.cordoned[n.id] {
		return NodeLanding
	}
	return n.lifecycle
}

// state is what a scheduler sees of the node.
func (v *View) state(n *nodeState, now time.Time) string {
	switch lc := v.lifecycle(n); {
	case !v.live(n, now):
		return NodeStalled
	case lc == NodeLanding && n.stepVolumes == 0:
		return NodeLanded
	case lc != "":
		return lc
	}
	return NodeRunning
}

// SetCordoned follows a Kubernetes Node's unschedulable mark.
func (v *View) SetCordoned(node string, cordoned bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if cordoned {
		v.cordoned[node] = true
	} else {
		delete(v.cordoned, node)
	}
}

// ForgetNode forgets a node at once (its Kubernetes Node was deleted).
func (v *View) ForgetNode(node string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if n := v.nodes[node]; n != nil {
		v.drop(n)
	}
	delete(v.cordoned, node)
}

// NewView makes an empty view; nodes fill it as they report.
func NewView(stalledAfter, forgetStalledAfter time.Duration) *View {
	return &View{nodes: map[string]*nodeState{}, stalledAfter: stalledAfter, forgetStalledAfter: forgetStalledAfter,
		cordoned: map[string]bool{}, byNamespace: map[string]map[string]*entry{}, ordered: btree.NewG(32, entryLess), shared: btree.NewG(32, entryLess),
		lacking: map[*entry]*copying{}, copyLimits: noCopyLimits, copyUse: map[string]int{}, shortOfBudget: map[*entry]struct{}{},
		clears: map[volume.CacheRef]time.Time{}}
}

// AwaitReports makes the view incomplete (Unsettled says so) until each of
// nodes has reported its whole inventory, or until until: a controller
// that begins to lead knows nothing of the nodes' volumes, which their
// first reports to it bring within seconds, and a scheduler told then that
// a volume is held nowhere, or that a destroy reached no node, would be
// told wrong. A node that does not report by until is stalled anyway.
func (v *View) AwaitReports(nodes []string, until time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.awaiting, v.awaitUntil = map[string]bool{}, until
	v.unheard, v.unheardUntil = nil, until.Add(v.forgetStalledAfter)
	for _, id := range nodes {
		if n := v.nodes[id]; n == nil || n.syncs == 0 {
			v.awaiting[id] = true
		}
	}
}

// Unsettled lists the nodes the view still awaits a whole inventory from
// (nil once they all reported, or the wait is over).
func (v *View) Unsettled(now time.Time) []string {
	v.mu.RLock()
	defer v.mu.RUnlock()
	if len(v.awaiting) == 0 || now.After(v.awaitUntil) {
		return nil
	}
	out := make([]string, 0, len(v.awaiting))
	for id := range v.awaiting {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// entryLess orders entries by namespace, then handle: volume ID order.
func entryLess(a, b *entry) bool {
	if a.ref.Namespace != b.ref.Namespace {
		return a.ref.Namespace < b.ref.Namespace
	}
	return a.ref.Handle < b.ref.Handle
}

// ErrInvalid marks a malformed report or query.
var ErrInvalid = errors.New("invalid")

// upsert is one volume of a report, checked before the view is locked.
type upsert struct {
	ref    volume.Ref
	rec    record
	parent volume.Ref
	props  string
	scope  scopeCode
	copies uint8
	vouch  volume.Digests
}

func parseUpserts(in []Held) ([]upsert, error) {
	out := make([]upsert, len(in))
	// Every volume's properties packed in one string: a full report's
	// ten thousand are otherwise as many allocations (put copies what an
	// entry keeps).
	size := 0
	for _, h := range in {
		for _, p := range h.Properties {
			size += len(p.Key) + len(p.Value) + 2*binary.MaxVarintLen32
		}
	}
	packed, ends := make([]byte, 0, size), make([]int, len(in))
	for i, h := range in {
		packed = appendProps(packed, h.Properties)
		ends[i] = len(packed)
	}
	props := string(packed)
	for i, h := range in {
		state := slices.Index(states, h.State)
		scope := 0 // unsaid: the default, the namespace's own
		if h.Scope != "" {
			scope = slices.Index(scopes, h.Scope)
		}
		if state < 0 || scope < 0 {
			return nil, fmt.Errorf("volume %s: state %s, scope %s: %w", h.Ref, volume.Quote(string(h.State)), volume.Quote(string(h.Scope)), ErrInvalid)
		}
		if h.Copies < 0 || h.Copies > volume.MaxCopies {
			return nil, fmt.Errorf("volume %s: %d copies: want 0 to %d: %w", h.Ref, h.Copies, volume.MaxCopies, ErrInvalid)
		}
		from := 0
		if i > 0 {
			from = ends[i-1]
		}
		out[i] = upsert{ref: h.Ref, parent: h.Parent, props: props[from:ends[i]], scope: scopeCode(scope), copies: uint8(h.Copies), vouch: h.Vouch,
			rec: record{size: h.SizeBytes, steps: h.StepVolumes, pinned: h.Pinned, state: stateCode(state)}}
	}
	return out, nil
}

// Report applies a node's report and says whether the controller needs the
// whole inventory instead. A node that reports a new store ID is believed
// to hold nothing it held before, at once.
func (v *View) Report(req Report, now time.Time) (Answer, error) {
	if req.NodeID == "" || req.StoreID == "" {
		return Answer{}, fmt.Errorf("a report needs the node's ID and its store's: %w", ErrInvalid)
	}
	upserts, err := parseUpserts(req.Upserts)
	if err != nil {
		return Answer{}, err
	}
	reporting := &v.reporting[maphash.String(reportingSeed, req.NodeID)%uint64(len(v.reporting))]
	reporting.Lock()
	defer reporting.Unlock()
	// Most full reports are a node's periodic resync, naming what the view
	// has of it already: that is found under the read lock, which lookups
	// share, and only the node's own fields are written.
	var unchanged *nodeState
	if req.Full {
		unchanged = v.reportsWhatItHas(req, upserts)
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	n := v.nodes[req.NodeID]
	if n == nil || n.storeID != req.StoreID {
		// New, or back with a wiped state dir: nothing it held before.
		fresh := &nodeState{id: req.NodeID, storeID: req.StoreID, held: map[uint32]struct{}{},
			destroy: map[*entry]bool{}, pins: map[*entry]PinCommand{}, copyOrders: map[*entry]struct{}{}, destroyOwned: map[*entry]string{}}
		v.indexNode(fresh)
		v.nodesGrew = true
		if n != nil {
			fresh.lifecycle = n.lifecycle // taken out of service by name, not by store
			v.drop(n)
		}
		n = fresh
		v.nodes[n.id] = n
	}
	n.lastReport, n.bytesFree, n.over, n.stepVolumes = now, req.BytesFree, req.OverHighWatermark, req.StepVolumes
	n.peerAddress, n.pullMode = req.PeerAddress, req.PullMode
	n.stallSeen = false
	switch {
	case req.Full:
		if n != unchanged { // (dropped and back since, if not nil)
			v.replace(n, upserts)
		} else {
			n.nextSync()
		}
		if v.awaiting[n.id] {
			v.tellUnheard(n, upserts, now)
			if delete(v.awaiting, n.id); len(v.awaiting) == 0 {
				v.unheard = nil
			}
		}
	case n.revision == 0 || req.BaseRevision != n.revision:
		return Answer{Resync: true, Revision: n.revision}, nil
	default:
		for _, u := range upserts {
			v.put(n, u)
		}
		for _, r := range req.Deletes {
			if e := v.find(r); e != nil {
				v.remove(n, e)
			}
		}
	}
	n.revision = req.Revision
	if n.lifecycle == NodeRetiring && n.stepVolumes == 0 {
		if len(n.held) == 0 {
			v.drop(n) // retired: it leaves
			return Answer{Revision: n.revision, RefuseCaptures: "the node is retired"}, nil
		}
		for id := range n.held {
			n.destroy[v.entries[id]] = true // released: everything it holds goes
		}
	}
	a := Answer{Revision: n.revision, Destroy: v.pendingDestroys(n), DestroyOwned: n.takeOwnedDestroys(), Pins: v.pendingPins(n), Copy: v.copyOrders(n)}
	a.MaxCopies, a.CopiesSpent = v.copyRefusals()
	if v.lifecycle(n) != "" {
		a.RefuseCaptures = "the node is " + v.state(n, now) + ": schedule steps that capture elsewhere"
	}
	return a, nil
}

// reportingSeed hashes node IDs to the View's reporting locks.
var reportingSeed = maphash.MakeSeed()

// find is the entry of a volume some node reports. The caller holds the
// lock.
func (v *View) find(r volume.Ref) *entry { return v.byNamespace[r.Namespace][r.Handle] }

// put records a node's copy of a volume, and says whether it is the first
// time the node's current full sync names it. The caller holds the lock.
func (v *View) put(n *nodeState, u upsert) (e *entry, first bool) {
	e = v.find(u.ref)
	if e == nil {
		ns := v.names.intern(u.ref.Namespace)
		e = v.newEntry()
		e.ref.Namespace = ns
		e.ref.Handle, e.props = keep(u.ref.Handle, u.props)
		if v.byNamespace[ns] == nil {
			v.byNamespace[ns] = map[string]*entry{}
		}
		v.byNamespace[ns][e.ref.Handle] = e
		v.ordered.ReplaceOrInsert(e)
	}
	// In node ID order: answers list nodes sorted, without sorting.
	if at, held := v.holderAt(e, n); held {
		first = e.holders[at].rec.sync != u.rec.sync
		n.count(e.holders[at].rec, -1)
		e.holders[at].rec = u.rec
	} else {
		first = true
		e.holders = slices.Insert(e.holders, at, holding{node: n.index, rec: u.rec})
		n.held[e.id] = struct{}{}
	}
	n.count(u.rec, 1)
	if e.scope != u.scope {
		if scopes[e.scope] == volume.ScopeCluster {
			v.shared.Delete(e)
		}
		if e.scope = u.scope; scopes[e.scope] == volume.ScopeCluster {
			v.shared.ReplaceOrInsert(e)
		}
	}
	if e.props != u.props { // equal ones stay in the handle's allocation
		e.props = strings.Clone(u.props) // (not the whole report's)
	}
	e.vouch, _ = v.vouchAfter(e, n, u.vouch)
	if u.copies > 0 && u.copies != e.copies { // a pulled copy's report leaves the capturing node's word
		e.copies = u.copies
		v.grant(e)
	}
	v.markLacking(e)
	if v.clearedBefore(e) {
		destroyOn(n, e) // it missed the key's clear
	}
	switch p := u.parent; {
	case p.Handle == "":
		e.parent = nil
	case e.parent == nil || *e.parent != p:
		if pe := v.find(p); pe != nil {
			p = pe.ref
		} else {
			p = volume.Ref{Namespace: v.names.intern(p.Namespace), Handle: strings.Clone(p.Handle)}
		}
		e.parent = &p
	}
	return e, first
}

// keep copies a volume's handle and properties out of the report they were
// decoded from, in one allocation (handle + props would be handle itself,
// the report's bytes, where props is empty).
func keep(handle, props string) (string, string) {
	var all strings.Builder
	all.Grow(len(handle) + len(props))
	all.WriteString(handle)
	all.WriteString(props)
	return all.String()[:len(handle)], all.String()[len(handle):]
}

// reportsWhatItHas is the node a full report is from if the report names
// exactly what the view has of it, as it has it, and nil otherwise. It
// takes the read lock; the caller serializes the node's reports.
func (v *View) reportsWhatItHas(req Report, upserts []upsert) *nodeState {
	v.mu.RLock()
	defer v.mu.RUnlock()
	n := v.nodes[req.NodeID]
	if n == nil || n.storeID != req.StoreID || len(n.held) != len(upserts) {
		return nil
	}
	// As many as it holds, each held and none named twice: exactly those.
	named := make([]uint64, (len(v.entries)+63)/64)
	for _, u := range upserts {
		e := v.find(u.ref)
		if e == nil || named[e.id/64]&(1<<(e.id%64)) != 0 {
			return nil
		}
		named[e.id/64] |= 1 << (e.id % 64)
		if rec, held := v.recordOf(e, n); !held || !rec.sameAs(u.rec) || !e.says(u) {
			return nil
		}
		if _, changed := v.vouchAfter(e, n, u.vouch); changed {
			return nil
		}
	}
	return n
}

// sameAs says two records of a copy say the same, whichever sync named
// them.
func (r record) sameAs(o record) bool {
	r.sync = o.sync
	return r == o
}

// says is whether e already says what u says of the volume (what put
// would leave unchanged).
func (e *entry) says(u upsert) bool {
	parent := e.parent == nil && u.parent.Handle == "" || e.parent != nil && *e.parent == u.parent
	return parent && e.scope == u.scope && e.props == u.props && (u.copies == 0 || e.copies == u.copies)
}

// nextSync numbers the node's next full sync.
func (n *nodeState) nextSync() {
	if n.syncs++; n.syncs == 0 {
		n.syncs = 1 // 0 marks records that only changes named
	}
}

// replace makes a node's inventory exactly upserts. The caller holds the
// lock.
func (v *View) replace(n *nodeState, upserts []upsert) {
	n.nextSync()
	named := 0
	for _, u := range upserts {
		u.rec.sync = n.syncs
		if _, first := v.put(n, u); first {
			named++
		}
	}
	if len(n.held) == named {
		return // (a periodic resync's common case: it holds what it held)
	}
	for id := range n.held {
		e := v.entries[id]
		if rec, _ := v.recordOf(e, n); rec.sync != n.syncs {
			v.remove(n, e)
		}
	}
}

// remove forgets a node's copy of a volume, and the volume once no node
// reports it. The caller holds the lock.
func (v *View) remove(n *nodeState, e *entry) {
	if !v.holds(n, e) {
		return
	}
	delete(n.held, e.id)
	if at, held := v.holderAt(e, n); held {
		n.count(e.holders[at].rec, -1)
		e.holders = slices.Delete(e.holders, at, at+1)
	}
	v.markLacking(e)
	if len(e.holders) == 0 {
		v.release(e)
		handles := v.byNamespace[e.ref.Namespace]
		delete(handles, e.ref.Handle)
		if len(handles) == 0 {
			delete(v.byNamespace, e.ref.Namespace)
		}
		v.ordered.Delete(e)
		v.shared.Delete(e)
		v.entries[e.id] = nil
		v.freeEntries = append(v.freeEntries, e.id)
	}
}

// newEntry is an empty entry with an ID. The caller holds the lock.
func (v *View) newEntry() *entry {
	e := &entry{}
	e.holders = e.one[:0]
	if k := len(v.freeEntries); k > 0 {
		e.id, v.freeEntries = v.freeEntries[k-1], v.freeEntries[:k-1]
		v.entries[e.id] = e
		return e
	}
	e.id = uint32(len(v.entries))
	v.entries = append(v.entries, e)
	return e
}

// holds says n reports e (e may be one no node reports any more, whose ID
// another entry has now). The caller holds the lock.
func (v *View) holds(n *nodeState, e *entry) bool {
	_, held := n.held[e.id]
	return held && v.entries[e.id] == e
}

// drop forgets a node and everything it reported. The caller holds the
// lock.
func (v *View) drop(n *nodeState) {
	for id := range n.held {
		v.remove(n, v.entries[id])
	}
	if v.nodes[n.id] == n {
		delete(v.nodes, n.id)
	}
	if v.byIndex[n.index] == n {
		v.byIndex[n.index] = nil
		v.freeIndexes = append(v.freeIndexes, n.index)
	}
}

// ErrUnknownNode: no node by that name reported.
var ErrUnknownNode = errors.New("unknown node")

// SetLifecycle lands, retires or resumes a node.
func (v *View) SetLifecycle(nodeID, action string, now time.Time) (NodeStatus, error) {
	next, ok := map[string]string{"land": NodeLanding, "retire": NodeRetiring, "resume": ""}[action]
	if !ok {
		return NodeStatus{}, fmt.Errorf("action %s: want land, retire or resume: %w", volume.Quote(action), ErrInvalid)
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	n := v.nodes[nodeID]
	if n == nil {
		return NodeStatus{}, fmt.Errorf("node %s: %w", volume.Quote(nodeID), ErrUnknownNode)
	}
	n.lifecycle = next
	return v.status(n, now), nil
}

// pendingDestroys are the destroys the node has not done yet: volumes it
// still reports. Done ones are dropped. The caller holds the lock.
func (v *View) pendingDestroys(n *nodeState) []volume.Ref {
	var out []volume.Ref
	for e := range n.destroy {
		if !v.holds(n, e) {
			delete(n.destroy, e)
			continue
		}
		out = append(out, e.ref)
	}
	return out
}

// has is the node's record of the volume, unless a scheduler destroyed it.
// The caller holds the lock.
func (v *View) has(n *nodeState, e *entry) (record, bool) {
	if n.destroyed(e) {
		return record{}, false
	}
	return v.recordOf(e, n)
}

// destroyed says a scheduler destroyed e on n: it is gone from every answer
// at once, whatever the node still says.
func (n *nodeState) destroyed(e *entry) bool { return len(n.destroy) > 0 && n.destroy[e] }

// count adds a record to the node's totals (sign 1) or takes it out (-1).
func (n *nodeState) count(r record, sign int) {
	n.bytes += int64(sign) * max(r.size, 0)
	n.states[r.state] += int32(sign)
}

// pendingPins are the pin changes the node's reports do not show yet.
func (v *View) pendingPins(n *nodeState) []PinCommand {
	var out []PinCommand
	for e, c := range n.pins {
		if rec, held := v.recordOf(e, n); !held || rec.pinned == !c.Unpin {
			delete(n.pins, e)
			continue
		}
		out = append(out, c)
	}
	return out
}

// Destroy hides each volume from lookups at once and asks every node that
// reported it to destroy it, saying which nodes were asked. While a node
// is awaited (AwaitReports), the view also asks it, in answer to its first
// whole inventory, to destroy any of refs it names there.
func (v *View) Destroy(refs []volume.Ref, now time.Time) []VolumeNodes {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.remember(refs, now, func(c *unheardCommand) { c.destroy = true })
	return v.commandLocked(refs, destroyOn)
}

// unheardCommand is what was last asked of a volume while a node was
// unheard: its destroy (which no pin undoes), or a pin or an unpin.
type unheardCommand struct {
	destroy bool
	pin     *PinCommand
}

// remember notes ask of each of refs while some node is still awaited,
// and forgets what it noted once none is. The caller holds the lock.
func (v *View) remember(refs []volume.Ref, now time.Time, ask func(*unheardCommand)) {
	if !v.stillUnheard(now) {
		return
	}
	if v.unheard == nil {
		v.unheard = map[volume.Ref]unheardCommand{}
	}
	for _, r := range refs {
		c, ok := v.unheard[r]
		if !ok && len(v.unheard) >= maxUnheard {
			continue
		}
		ask(&c)
		v.unheard[r] = c
	}
}

// maxUnheard bounds the volumes the view remembers commands for while a
// node is unheard (a dead node whose CSINode stays is awaited for the
// whole of forgetStalledAfter): a caller allowed to destroy or pin, asking
// of volumes by the thousand all that while, is not to grow the
// controller's memory without end. Past it, a command reaches the nodes
// that reported the volume, as without the wait.
const maxUnheard = 1 << 18

// stillUnheard says whether some node is still awaited, and the view
// keeps what was asked meanwhile; it forgets that once it is not. The
// caller holds the lock.
func (v *View) stillUnheard(now time.Time) bool {
	if len(v.awaiting) > 0 && now.Before(v.unheardUntil) {
		return true
	}
	v.unheard = nil
	return false
}

// tellUnheard asks n, awaited until this whole inventory of upserts, what
// was asked meanwhile of the volumes it names. The caller holds the lock.
func (v *View) tellUnheard(n *nodeState, upserts []upsert, now time.Time) {
	if !v.stillUnheard(now) || len(v.unheard) == 0 {
		return
	}
	for _, u := range upserts {
		c, ok := v.unheard[u.ref]
		if !ok {
			continue
		}
		switch e := v.find(u.ref); {
		case e == nil:
		case c.destroy:
			destroyOn(n, e)
		case c.pin != nil:
			c.pin.askOf(n, e)
		}
	}
}

// destroyOn asks n to destroy e, which leaves every answer at once.
func destroyOn(n *nodeState, e *entry) { n.destroy[e] = true }

// DestroyIfOwned asks every node that reported each volume, in its next
// answer, to destroy it if the node's own record names the owner whose UID
// is ownerUID. The owner sweep reads a volume's owner from the properties
// the view keeps, which are the last reporter's word; each holder checks
// that word against its own record, so a node that lied about an owner has
// only its own copy destroyed. Unlike Destroy, lookups go on showing each
// volume until its nodes report it gone; a node that did not hear is asked
// again by the next sweep.
func (v *View) DestroyIfOwned(refs []volume.Ref, ownerUID string) []VolumeNodes {
	return v.command(refs, func(n *nodeState, e *entry) { n.destroyOwned[e] = ownerUID })
}

// takeOwnedDestroys are the owner sweep's destroys for n, said once. The
// caller holds the lock.
func (n *nodeState) takeOwnedDestroys() []OwnedDestroy {
	if len(n.destroyOwned) == 0 {
		return nil
	}
	out := make([]OwnedDestroy, 0, len(n.destroyOwned))
	for e, uid := range n.destroyOwned {
		out = append(out, OwnedDestroy{Ref: e.ref, OwnerUID: uid})
	}
	clear(n.destroyOwned)
	return out
}

// Pin asks every node that reported each volume to pin (until until, or
// for good: zero) or unpin it; a node still awaited is asked with its
// first whole inventory, as for Destroy.
func (v *View) Pin(refs []volume.Ref, unpin bool, until, now time.Time) []VolumeNodes {
	v.mu.Lock()
	defer v.mu.Unlock()
	pin := PinCommand{Unpin: unpin, Until: until}
	v.remember(refs, now, func(c *unheardCommand) { c.pin = &pin })
	return v.commandLocked(refs, pin.askOf)
}

// askOf asks n to pin or unpin e as p says. The caller holds the lock.
func (p PinCommand) askOf(n *nodeState, e *entry) {
	p.Ref = e.ref
	n.pins[e] = p
}

// command runs ask on every node holding each volume (live or stalled: a
// stalled node that comes back gets the command too).
func (v *View) command(refs []volume.Ref, ask func(*nodeState, *entry)) []VolumeNodes {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.commandLocked(refs, ask)
}

// commandLocked is command, for a caller that holds the lock.
func (v *View) commandLocked(refs []volume.Ref, ask func(*nodeState, *entry)) []VolumeNodes {
	out := make([]VolumeNodes, len(refs))
	for i, r := range refs {
		out[i].Ref = r
		if e := v.find(r); e != nil {
			for _, h := range e.holders {
				n := v.byIndex[h.node]
				ask(n, e)
				out[i].Nodes = append(out[i].Nodes, n.id)
			}
		}
		sort.Strings(out[i].Nodes)
	}
	return out
}

func (v *View) live(n *nodeState, now time.Time) bool { return now.Sub(n.lastReport) <= v.stalledAfter }

// Nodes lists every node the controller knows, with its state.
func (v *View) Nodes(now time.Time) []NodeStatus {
	v.mu.RLock()
	defer v.mu.RUnlock()
	out := make([]NodeStatus, 0, len(v.nodes))
	for _, n := range v.nodes {
		out = append(out, v.status(n, now))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].NodeID < out[j].NodeID })
	return out
}

// PeerAddress is where a node serves its volumes ("" if it does not, or
// is unknown).
func (v *View) PeerAddress(nodeID string) string {
	v.mu.RLock()
	defer v.mu.RUnlock()
	if n := v.nodes[nodeID]; n != nil {
		return n.peerAddress
	}
	return ""
}

// status is what a scheduler sees of a node. The caller holds the lock.
func (v *View) status(n *nodeState, now time.Time) NodeStatus {
	st := NodeStatus{NodeID: n.id, StoreID: n.storeID, State: v.state(n, now), Revision: n.revision,
		Volumes: int32(len(n.held)), Bytes: n.bytes, BytesFree: n.bytesFree, OverHighWatermark: n.over,
		LastReport: n.lastReport, PeerAddress: n.peerAddress, PullMode: n.pullMode}
	return st
}

// Sweep says which nodes stalled since the last sweep, and forgets (and
// says) those stalled for longer than the forget time.
func (v *View) Sweep(now time.Time) (stalled, forgotten []string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for id, n := range v.nodes {
		switch {
		case now.Sub(n.lastReport) > v.forgetStalledAfter:
			v.drop(n)
			forgotten = append(forgotten, id)
		case !v.live(n, now) && !n.stallSeen:
			n.stallSeen = true
			stalled = append(stalled, id)
			for id := range n.held {
				v.markLacking(v.entries[id]) // its copies are no longer served
			}
		}
	}
	sort.Strings(stalled)
	sort.Strings(forgotten)
	return stalled, forgotten
}

// Free is the room a live node has left under its high watermark (all live
// nodes' together for ""), and whether the node is known and live.
func (v *View) Free(nodeID string, now time.Time) (int64, bool) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	var sum int64
	found := false
	for _, n := range v.nodes {
		if v.live(n, now) && (nodeID == "" || n.id == nodeID) {
			sum += n.bytesFree
			found = true
		}
	}
	return sum, found || nodeID == ""
}
