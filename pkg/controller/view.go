// Package controller owns the cluster-wide view of the node caches: which
// node holds which volume in what state, which nodes are live, and the
// answers a scheduler gets from that view (lookups, placement). It keeps no
// database: the view is what the nodes report, and after a restart it is
// rebuilt from their next reports. It never touches a volume: nodes do.
package controller

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
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
type View struct {
	mu                 sync.RWMutex
	nodes              map[string]*nodeState
	stalledAfter       time.Duration
	forgetStalledAfter time.Duration
	// cordoned are the Kubernetes Nodes marked unschedulable: landing.
	cordoned map[string]bool
}

type nodeState struct {
	id, storeID string
	revision    uint64
	lastReport  time.Time
	volumes     map[volume.Ref]*controllerv1.VolumeSummary
	bytesFree   int64
	over        bool
	// What schedulers asked of the node, until its reports show it done.
	destroy map[volume.Ref]bool
	pins    map[volume.Ref]*controllerv1.PinCommand
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
	delete(v.nodes, node)
	delete(v.cordoned, node)
}

// NewView makes an empty view; nodes fill it as they report.
func NewView(stalledAfter, forgetStalledAfter time.Duration) *View {
	return &View{nodes: map[string]*nodeState{}, stalledAfter: stalledAfter, forgetStalledAfter: forgetStalledAfter,
		cordoned: map[string]bool{}}
}

// ErrInvalid marks a malformed report or query.
var ErrInvalid = errors.New("invalid")

func refOf(r *controllerv1.VolumeRef) (volume.Ref, error) {
	ref := volume.Ref{Namespace: r.GetNamespace(), Handle: r.GetHandle()}
	if err := ref.Validate(); err != nil {
		return ref, fmt.Errorf("volume: %w: %w", err, ErrInvalid)
	}
	return ref, nil
}

// Report applies a node's report and says whether the controller needs the
// whole inventory instead. A node that reports a new store ID is believed
// to hold nothing it held before, at once.
func (v *View) Report(req *controllerv1.ReportRequest, now time.Time) (*controllerv1.ReportResponse, error) {
	if req.GetNodeId() == "" || req.GetStoreId() == "" {
		return nil, fmt.Errorf("a report needs the node's ID and its store's: %w", ErrInvalid)
	}
	upserts := make(map[volume.Ref]*controllerv1.VolumeSummary, len(req.GetUpserts()))
	for _, s := range req.GetUpserts() {
		r, err := refOf(s.GetRef())
		if err != nil {
			return nil, err
		}
		upserts[r] = s
	}
	deletes := make([]volume.Ref, 0, len(req.GetDeletes()))
	for _, d := range req.GetDeletes() {
		r, err := refOf(d)
		if err != nil {
			return nil, err
		}
		deletes = append(deletes, r)
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	n := v.nodes[req.GetNodeId()]
	if n == nil || n.storeID != req.GetStoreId() {
		// New, or back with a wiped state dir: nothing it held before.
		fresh := &nodeState{id: req.GetNodeId(), storeID: req.GetStoreId(), volumes: map[volume.Ref]*controllerv1.VolumeSummary{},
			destroy: map[volume.Ref]bool{}, pins: map[volume.Ref]*controllerv1.PinCommand{}}
		if n != nil {
			fresh.lifecycle = n.lifecycle // taken out of service by name, not by store
		}
		n = fresh
		v.nodes[n.id] = n
	}
	n.lastReport, n.bytesFree, n.over, n.stepVolumes = now, req.GetBytesFree(), req.GetOverHighWatermark(), req.GetStepVolumes()
	n.stallSeen = false
	switch {
	case req.GetFull():
		n.volumes = upserts
	case n.revision == 0 || req.GetBaseRevision() != n.revision:
		return &controllerv1.ReportResponse{Resync: true, Revision: n.revision}, nil
	default:
		for r, s := range upserts {
			n.volumes[r] = s
		}
		for _, r := range deletes {
			delete(n.volumes, r)
		}
	}
	n.revision = req.GetRevision()
	if n.lifecycle == NodeRetiring && n.stepVolumes == 0 {
		if len(n.volumes) == 0 {
			delete(v.nodes, n.id) // retired: it leaves
			return &controllerv1.ReportResponse{Revision: n.revision, RefuseCaptures: "the node is retired"}, nil
		}
		for r := range n.volumes {
			n.destroy[r] = true // released: everything it holds goes
		}
	}
	resp := &controllerv1.ReportResponse{Revision: n.revision, Destroy: n.pendingDestroys(), Pins: n.pendingPins()}
	if v.lifecycle(n) != "" {
		resp.RefuseCaptures = "the node is " + v.state(n, now) + ": schedule steps that capture elsewhere"
	}
	return resp, nil
}

// ErrUnknownNode: no node by that name reported.
var ErrUnknownNode = errors.New("unknown node")

// SetLifecycle lands, retires or resumes a node.
func (v *View) SetLifecycle(nodeID, action string, now time.Time) (*controllerv1.NodeStatus, error) {
	next, ok := map[string]string{"land": NodeLanding, "retire": NodeRetiring, "resume": ""}[action]
	if !ok {
		return nil, fmt.Errorf("action %s: want land, retire or resume: %w", volume.Quote(action), ErrInvalid)
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	n := v.nodes[nodeID]
	if n == nil {
		return nil, fmt.Errorf("node %s: %w", volume.Quote(nodeID), ErrUnknownNode)
	}
	n.lifecycle = next
	return v.status(n, now), nil
}

// pendingDestroys are the destroys the node has not done yet: volumes it
// still reports. Done ones are dropped. The caller holds the lock.
func (n *nodeState) pendingDestroys() []*controllerv1.VolumeRef {
	var out []*controllerv1.VolumeRef
	for r := range n.destroy {
		if _, held := n.volumes[r]; !held {
			delete(n.destroy, r)
			continue
		}
		out = append(out, toRef(r))
	}
	return out
}

// has is the volume as the node holds it, unless a scheduler destroyed it:
// then it is gone from every answer at once, whatever the node still says.
func (n *nodeState) has(r volume.Ref) *controllerv1.VolumeSummary {
	if n.destroy[r] {
		return nil
	}
	return n.volumes[r]
}

// pendingPins are the pin changes the node's reports do not show yet.
func (n *nodeState) pendingPins() []*controllerv1.PinCommand {
	var out []*controllerv1.PinCommand
	for r, c := range n.pins {
		if s, held := n.volumes[r]; !held || s.GetPinned() == !c.GetUnpin() {
			delete(n.pins, r)
			continue
		}
		out = append(out, c)
	}
	return out
}

func toRef(r volume.Ref) *controllerv1.VolumeRef {
	return &controllerv1.VolumeRef{Namespace: r.Namespace, Handle: r.Handle}
}

// Destroy hides each volume from lookups at once and asks every node that
// reported it to destroy it, saying which nodes were asked.
func (v *View) Destroy(refs []*controllerv1.VolumeRef) ([]*controllerv1.VolumeNodes, error) {
	return v.command(refs, func(n *nodeState, r volume.Ref) { n.destroy[r] = true })
}

// Pin asks every node that reported each volume to pin (until until, or
// for good) or unpin it.
func (v *View) Pin(refs []*controllerv1.VolumeRef, unpin bool, until *timestamppb.Timestamp) ([]*controllerv1.VolumeNodes, error) {
	return v.command(refs, func(n *nodeState, r volume.Ref) {
		n.pins[r] = &controllerv1.PinCommand{Ref: toRef(r), Unpin: unpin, Until: until}
	})
}

// command runs ask on every node holding each volume (live or stalled: a
// stalled node that comes back gets the command too).
func (v *View) command(refs []*controllerv1.VolumeRef, ask func(*nodeState, volume.Ref)) ([]*controllerv1.VolumeNodes, error) {
	parsed := make([]volume.Ref, len(refs))
	for i, r := range refs {
		var err error
		if parsed[i], err = refOf(r); err != nil {
			return nil, err
		}
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make([]*controllerv1.VolumeNodes, len(parsed))
	for i, r := range parsed {
		out[i] = &controllerv1.VolumeNodes{Ref: refs[i]}
		for _, n := range v.nodes {
			if _, held := n.volumes[r]; held {
				ask(n, r)
				out[i].Nodes = append(out[i].Nodes, n.id)
			}
		}
		sort.Strings(out[i].Nodes)
	}
	return out, nil
}

func (v *View) live(n *nodeState, now time.Time) bool { return now.Sub(n.lastReport) <= v.stalledAfter }

// liveNodes lists the nodes that reported lately, by ID. The caller holds
// the lock.
func (v *View) liveNodes(now time.Time) []*nodeState {
	var out []*nodeState
	for _, n := range v.nodes {
		if v.live(n, now) {
			out = append(out, n)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out
}

var stateRank = map[string]int{string(volume.StateReady): 3, string(volume.StateCreating): 2, string(volume.StateFailed): 1}

// Lookup says where each volume is, among live nodes.
func (v *View) Lookup(refs []*controllerv1.VolumeRef, now time.Time) ([]*controllerv1.VolumeLocation, error) {
	parsed := make([]volume.Ref, len(refs))
	for i, r := range refs {
		var err error
		if parsed[i], err = refOf(r); err != nil {
			return nil, err
		}
	}
	v.mu.RLock()
	defer v.mu.RUnlock()
	live := v.liveNodes(now)
	out := make([]*controllerv1.VolumeLocation, len(parsed))
	for i, r := range parsed {
		loc := &controllerv1.VolumeLocation{Ref: refs[i]}
		for _, n := range live {
			s := n.has(r)
			if s == nil {
				continue
			}
			if !loc.Found || stateRank[s.GetState()] > stateRank[loc.State] {
				loc.Found, loc.State, loc.SizeBytes = true, s.GetState(), s.GetSizeBytes()
				loc.Parent, loc.Scope, loc.Properties = s.GetParent(), s.GetScope(), s.GetProperties()
			}
			if s.GetState() == string(volume.StateReady) {
				loc.Nodes = append(loc.Nodes, n.id)
			}
		}
		out[i] = loc
	}
	return out, nil
}

// Place ranks the live nodes that take captures (not over their high
// watermark) for a step with these inputs: most input bytes held ready
// first, then most free space, then by ID.
func (v *View) Place(inputs []*controllerv1.VolumeRef, now time.Time) ([]*controllerv1.NodePlacement, error) {
	parsed := make([]volume.Ref, len(inputs))
	for i, r := range inputs {
		var err error
		if parsed[i], err = refOf(r); err != nil {
			return nil, err
		}
	}
	v.mu.RLock()
	defer v.mu.RUnlock()
	var out []*controllerv1.NodePlacement
	for _, n := range v.liveNodes(now) {
		if n.over || v.lifecycle(n) != "" {
			continue
		}
		p := &controllerv1.NodePlacement{NodeId: n.id, BytesFree: n.bytesFree}
		for i, r := range parsed {
			if s := n.has(r); s != nil && s.GetState() == string(volume.StateReady) {
				p.InputBytesHeld += max(s.GetSizeBytes(), 0)
			} else {
				p.Missing = append(p.Missing, inputs[i])
			}
		}
		out = append(out, p)
	}
	slices.SortStableFunc(out, func(a, b *controllerv1.NodePlacement) int {
		switch {
		case a.InputBytesHeld != b.InputBytesHeld:
			return cmpDesc(a.InputBytesHeld, b.InputBytesHeld)
		case a.BytesFree != b.BytesFree:
			return cmpDesc(a.BytesFree, b.BytesFree)
		}
		return 0 // already by ID
	})
	return out, nil
}

func cmpDesc(a, b int64) int {
	if a > b {
		return -1
	}
	return 1
}

// Nodes lists every node the controller knows, with its state.
func (v *View) Nodes(now time.Time) []*controllerv1.NodeStatus {
	v.mu.RLock()
	defer v.mu.RUnlock()
	var out []*controllerv1.NodeStatus
	for _, n := range v.nodes {
		out = append(out, v.status(n, now))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].NodeId < out[j].NodeId })
	return out
}

// status is what a scheduler sees of a node. The caller holds the lock.
func (v *View) status(n *nodeState, now time.Time) *controllerv1.NodeStatus {
	st := &controllerv1.NodeStatus{NodeId: n.id, StoreId: n.storeID, State: v.state(n, now), Revision: n.revision,
		Volumes: int32(len(n.volumes)), BytesFree: n.bytesFree, OverHighWatermark: n.over,
		LastReport: timestamppb.New(n.lastReport)}
	for _, s := range n.volumes {
		st.Bytes += max(s.GetSizeBytes(), 0)
	}
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
			delete(v.nodes, id)
			forgotten = append(forgotten, id)
		case !v.live(n, now) && !n.stallSeen:
			n.stallSeen = true
			stalled = append(stalled, id)
		}
	}
	sort.Strings(stalled)
	sort.Strings(forgotten)
	return stalled, forgotten
}

// Entry is one cached volume across the live nodes.
type Entry struct {
	Ref       volume.Ref
	SizeBytes int64
	// Ready lists the live nodes holding it ready; Published, those where
	// step volumes mount it. Both sorted.
	Ready, Published []string
}

// Volumes lists every volume some live node holds ready, in (namespace,
// handle) order.
func (v *View) Volumes(now time.Time) []Entry {
	v.mu.RLock()
	defer v.mu.RUnlock()
	byRef := map[volume.Ref]*Entry{}
	for _, n := range v.liveNodes(now) {
		for r, s := range n.volumes {
			if s.GetState() != string(volume.StateReady) || n.destroy[r] {
				continue
			}
			e := byRef[r]
			if e == nil {
				e = &Entry{Ref: r, SizeBytes: max(s.GetSizeBytes(), 0)}
				byRef[r] = e
			}
			e.Ready = append(e.Ready, n.id)
			if s.GetStepVolumes() > 0 {
				e.Published = append(e.Published, n.id)
			}
		}
	}
	out := make([]Entry, 0, len(byRef))
	for _, e := range byRef {
		out = append(out, *e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Ref.String() < out[j].Ref.String() })
	return out
}

// Free is the room a live node has left under its high watermark (all live
// nodes' together for ""), and whether the node is known and live.
func (v *View) Free(nodeID string, now time.Time) (int64, bool) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	var sum int64
	found := false
	for _, n := range v.liveNodes(now) {
		if nodeID == "" || n.id == nodeID {
			sum += n.bytesFree
			found = true
		}
	}
	return sum, found || nodeID == ""
}
