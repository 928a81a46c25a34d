package fleet

import (
	"cmp"
	"encoding/base64"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/btree"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/concourse/cowvol/pkg/volume"
)

// stateRank orders the states a volume's copies are in, by stateCode: the
// best one is the volume's (ready, then creating, then failed).
var stateRank = func() []int {
	rank := map[volume.State]int{volume.StateReady: 3, volume.StateCreating: 2, volume.StateFailed: 1}
	out := make([]int, len(states))
	for i, s := range states {
		out[i] = rank[s]
	}
	return out
}()

// nodeFlags are, by node index, what a query asks of every holder it
// reads: whether the node is live, and whether a scheduler destroyed
// anything there. Made once a query, they spare a sweep over a popular
// volume's thousand holders a thousand node structs and clock reads.
type nodeFlags []uint8

const (
	nodeLive uint8 = 1 << iota
	nodeDestroying
)

// flags are the nodes' flags now. The caller holds the lock.
func (v *View) flags(now time.Time) nodeFlags {
	f := make(nodeFlags, len(v.byIndex))
	for i, n := range v.byIndex {
		if n == nil {
			continue
		}
		if v.live(n, now) {
			f[i] |= nodeLive
		}
		if len(n.destroy) > 0 {
			f[i] |= nodeDestroying
		}
	}
	return f
}

// serves says whether a live node holds e for schedulers (no scheduler
// destroyed it there).
func (v *View) serves(f nodeFlags, h holding, e *entry) bool {
	return f[h.node]&nodeLive != 0 && (f[h.node]&nodeDestroying == 0 || !v.byIndex[h.node].destroyed(e))
}

// location is what the live nodes say of one volume: the best state any
// holds it in, with that copy's metadata, and which hold it ready and which
// have it mounted, the first maxNodes of each (all: 0). The caller holds
// the lock.
func (v *View) location(e *entry, maxNodes int, f nodeFlags) Location {
	loc := Location{Ref: e.ref}
	if maxNodes <= 0 {
		maxNodes = len(e.holders)
	}
	var best record
	for _, h := range e.holders {
		if !v.serves(f, h, e) {
			continue
		}
		rec := h.rec
		if !loc.Found || stateRank[rec.state] > stateRank[best.state] {
			loc.Found, best = true, rec
		}
		if states[rec.state] == volume.StateReady {
			if loc.NodeCount++; len(loc.Nodes) < maxNodes {
				n := v.byIndex[h.node]
				loc.Nodes = append(loc.Nodes, n.id)
				loc.PeerAddresses = append(loc.PeerAddresses, n.peerAddress)
			}
			if rec.steps > 0 && len(loc.PublishedNodes) < maxNodes {
				loc.PublishedNodes = append(loc.PublishedNodes, v.byIndex[h.node].id)
			}
		}
		loc.Pinned = loc.Pinned || rec.pinned
	}
	if loc.Found {
		describe(&loc, e, best) // Nodes are sorted: holders are kept so
		if e.vouch != nil {
			loc.Vouch = e.vouch.Digests
			loc.Vouch.FirstHand = false
		}
	}
	return loc
}

// describe fills in a volume's metadata, and the state and size of one
// node's copy.
func describe(loc *Location, e *entry, rec record) {
	loc.State, loc.SizeBytes, loc.Scope, loc.Properties = states[rec.state], rec.size, scopes[e.scope], e.properties()
	if e.parent != nil {
		loc.Parent = *e.parent
	}
}

// Lookup says where each volume is, among live nodes, naming the first
// maxNodes of its nodes (all: 0).
func (v *View) Lookup(refs []volume.Ref, maxNodes int, now time.Time) []Location {
	v.mu.RLock()
	defer v.mu.RUnlock()
	out := make([]Location, len(refs))
	f := v.flags(now)
	for i, r := range refs {
		if e := v.find(r); e != nil {
			out[i] = v.location(e, maxNodes, f)
		} else {
			out[i] = Location{Ref: r}
		}
	}
	return out
}

// Place ranks the live nodes that take captures (not over their high
// watermark) for a step with these inputs: most input bytes held ready
// first, then most free space, then by ID; and answers the best limit of
// them (all: 0). An input of a namespace not visible (nil: all are) that
// was not shared counts as held nowhere, as if it did not exist. A node
// missing every input is given inputs itself as its Missing (most nodes,
// in a big fleet): the caller must not change it.
func (v *View) Place(inputs []volume.Ref, visible func(namespace string) bool, limit int, now time.Time) []Placement {
	v.mu.RLock()
	defer v.mu.RUnlock()
	// Per node, by index, which inputs it holds ready (held, k a node)
	// and their bytes: one pass over the holders of each input, and no
	// allocation per node.
	k := len(inputs)
	held, bytes := make([]bool, len(v.byIndex)*k), make([]int64, len(v.byIndex))
	for i, r := range inputs {
		e := v.find(r)
		if e == nil || (visible != nil && scopes[e.scope] != volume.ScopeCluster && !visible(r.Namespace)) {
			continue
		}
		for _, hd := range e.holders {
			if v.byIndex[hd.node].destroyed(e) || states[hd.rec.state] != volume.StateReady {
				continue
			}
			if at := int(hd.node)*k + i; !held[at] {
				held[at] = true
				bytes[hd.node] += max(hd.rec.size, 0)
			}
		}
	}
	type ranked struct {
		n     *nodeState
		bytes int64
	}
	nodes := make([]ranked, 0, len(v.nodes))
	for _, n := range v.nodes {
		if v.placeable(n, now) {
			nodes = append(nodes, ranked{n, bytes[n.index]})
		}
	}
	slices.SortFunc(nodes, func(a, b ranked) int {
		return cmp.Or(cmp.Compare(b.bytes, a.bytes), cmp.Compare(b.n.bytesFree, a.n.bytesFree), strings.Compare(a.n.id, b.n.id))
	})
	if limit > 0 && len(nodes) > limit {
		nodes = nodes[:limit]
	}
	all := inputs[:k:k]
	out := make([]Placement, len(nodes))
	for j, r := range nodes {
		out[j] = Placement{NodeID: r.n.id, BytesFree: r.n.bytesFree, InputBytesHeld: r.bytes, Missing: all}
		if mine := held[int(r.n.index)*k : int(r.n.index+1)*k]; slices.Contains(mine, true) {
			out[j].Missing = nil
			for i, has := range mine {
				if !has {
					out[j].Missing = append(out[j].Missing, inputs[i])
				}
			}
		}
	}
	return out
}

// placeable says whether a step may be placed on n at now: live, in
// service and under its high watermark. The caller holds the lock.
func (v *View) placeable(n *nodeState, now time.Time) bool {
	return !n.over && v.lifecycle(n) == "" && v.live(n, now)
}

// Making lists the live nodes that take captures and are making one of
// inputs (a step there is writing it: the node holds it creating) while no
// live node holds it ready: where a step that reads it should go, for the
// volume will be there first. An input namespace may not see (visible
// says which; a cluster-scoped one anyone may) is passed over. Sorted.
func (v *View) Making(inputs []volume.Ref, visible func(namespace string) bool, now time.Time) []string {
	v.mu.RLock()
	defer v.mu.RUnlock()
	var out []string
	for _, r := range inputs {
		e := v.find(r)
		if e == nil || (visible != nil && scopes[e.scope] != volume.ScopeCluster && !visible(r.Namespace)) {
			continue
		}
		var makers []string
		ready := false
		for _, h := range e.holders {
			n := v.byIndex[h.node]
			if !v.live(n, now) || n.destroyed(e) {
				continue
			}
			switch states[h.rec.state] {
			case volume.StateReady:
				ready = true
			case volume.StateCreating:
				if v.placeable(n, now) {
					makers = append(makers, n.id)
				}
			}
		}
		if !ready {
			out = append(out, makers...)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// Entry is one cached volume across the live nodes.
type Entry struct {
	Ref       volume.Ref
	SizeBytes int64
	// Ready lists the live nodes holding it ready; Published, those where
	// step volumes mount it. Both sorted.
	Ready, Published []string
}

// Volumes lists the volumes some live node holds ready, in (namespace,
// handle) order, after the volume ID after (all for ""), at most limit of
// them (all for 0); more says whether others follow.
func (v *View) Volumes(after string, limit int, now time.Time) (out []Entry, more bool) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	f := v.flags(now)
	ascend(v.ordered, "", after, func(e *entry) bool {
		loc := v.location(e, 0, f)
		if len(loc.Nodes) == 0 {
			return true
		}
		if limit > 0 && len(out) == limit {
			more = true
			return false
		}
		out = append(out, Entry{Ref: e.ref, SizeBytes: max(loc.SizeBytes, 0), Ready: loc.Nodes, Published: loc.PublishedNodes})
		return true
	})
	return out, more
}

// Volume is one volume some live node holds ready.
func (v *View) Volume(r volume.Ref, now time.Time) (Entry, bool) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	if e := v.find(r); e != nil {
		if loc := v.location(e, 0, v.flags(now)); len(loc.Nodes) > 0 {
			return Entry{Ref: e.ref, SizeBytes: max(loc.SizeBytes, 0), Ready: loc.Nodes, Published: loc.PublishedNodes}, true
		}
	}
	return Entry{}, false
}

// ascend calls fn with the entries of tree after the volume ID after (all
// for ""), in (namespace, handle) order, only namespace ns's unless ns is
// "", until fn returns false, and says whether fn did. The caller holds the
// lock.
func ascend(tree *btree.BTreeG[*entry], ns, after string, fn func(*entry) bool) (stopped bool) {
	afterNS, afterHandle, _ := strings.Cut(after, "/")
	from := &entry{ref: volume.Ref{Namespace: afterNS, Handle: afterHandle}}
	if ns > afterNS {
		from.ref = volume.Ref{Namespace: ns}
	}
	tree.AscendGreaterOrEqual(from, func(e *entry) bool {
		switch {
		case e.ref.Namespace == afterNS && e.ref.Handle == afterHandle:
			return true // the last page's last entry
		case ns != "" && e.ref.Namespace != ns:
			return false
		}
		stopped = !fn(e)
		return !stopped
	})
	return stopped
}

// ascendVisible is ascend over what a caller who sees only the namespaces
// visible says may be listed: those namespaces' entries and the shared
// ones of the others, namespace by namespace, so that the entries of the
// namespaces it may not see are never walked. The caller holds the lock.
func (v *View) ascendVisible(visible func(string) bool, after string, fn func(*entry) bool) {
	afterNS, _, _ := strings.Cut(after, "/")
	namespaces := make([]string, 0, len(v.byNamespace))
	for ns := range v.byNamespace {
		if ns >= afterNS {
			namespaces = append(namespaces, ns)
		}
	}
	slices.Sort(namespaces)
	for _, ns := range namespaces {
		tree := v.shared
		if visible(ns) {
			tree = v.ordered
		}
		if ascend(tree, ns, after, fn) {
			return
		}
	}
}

// PageToken is the opaque token that resumes a listing after volume r
// (for Cache.ListVolumes and the CSI ListVolumes alike).
func PageToken(r volume.Ref) string { return base64.RawURLEncoding.EncodeToString([]byte(r.String())) }

// AfterToken is the volume ID a page token resumes after, or an error
// for a token no listing handed out.
func AfterToken(tok string) (string, error) {
	raw, err := base64.RawURLEncoding.DecodeString(tok)
	if err == nil {
		_, err = volume.ParseRef(string(raw))
	}
	if err != nil {
		return "", fmt.Errorf("page token %s is not one this controller handed out: %w", volume.Quote(tok), ErrInvalid)
	}
	return string(raw), nil
}

// ListQuery selects volumes for List.
type ListQuery struct {
	// Visible says which namespaces' volumes the caller may see whole;
	// others' appear only when shared (scope cluster).
	Visible   func(namespace string) bool
	Namespace string
	// Node: the volumes this node holds, in the state it holds them in.
	Node     string
	Selector string
	After    string
	Limit    int
	// MaxNodes is as Lookup's.
	MaxNodes int
}

// List answers a ListQuery: the matching volumes in (namespace, handle)
// order, and whether more follow.
func (v *View) List(q ListQuery, now time.Time) (out []Location, more bool, err error) {
	sel, err := labels.Parse(q.Selector)
	if err != nil {
		return nil, false, fmt.Errorf("selector %s: %w: %w", volume.Quote(q.Selector), err, ErrInvalid)
	}
	if q.After != "" {
		if _, err := volume.ParseRef(q.After); err != nil {
			return nil, false, fmt.Errorf("page token: %w: %w", err, ErrInvalid)
		}
	}
	if q.Namespace != "" {
		if err := volume.ValidateNamespace(q.Namespace); err != nil {
			return nil, false, fmt.Errorf("namespace: %w: %w", err, ErrInvalid)
		}
	}
	v.mu.RLock()
	defer v.mu.RUnlock()
	var node *nodeState
	if q.Node != "" {
		if node = v.nodes[q.Node]; node == nil {
			return nil, false, fmt.Errorf("node %s: %w", volume.Quote(q.Node), ErrUnknownNode)
		}
	}
	f := v.flags(now)
	each := func(e *entry) bool {
		var loc Location
		if node != nil {
			rec, ok := v.has(node, e)
			if !ok {
				return true
			}
			loc = v.location(e, q.MaxNodes, f)
			loc.Found = true
			describe(&loc, e, rec)
		} else if loc = v.location(e, q.MaxNodes, f); !loc.Found {
			return true
		}
		if q.Visible != nil && !q.Visible(e.ref.Namespace) && loc.Scope != volume.ScopeCluster {
			return true
		}
		if !sel.Matches(labels.Set(loc.Properties)) {
			return true
		}
		if q.Limit > 0 && len(out) == q.Limit {
			more = true
			return false
		}
		out = append(out, loc)
		return true
	}
	if q.Visible != nil && q.Namespace == "" {
		v.ascendVisible(q.Visible, q.After, each)
	} else {
		ascend(v.ordered, q.Namespace, q.After, each)
	}
	return out, more, nil
}

// Owned is a volume that belongs to an owner (owner: controller), as the
// live nodes hold it.
type Owned struct {
	Ref   volume.Ref
	Owner volume.Owner
	// State is the best state a live node holds it in; Pinned, whether
	// one has it pinned.
	State  volume.State
	Pinned bool
}

// Owned lists the owned volumes some live node holds, in (namespace,
// handle) order after the volume ID after (all for ""), walking at most
// scan entries under the view's lock, so that a sweep of a big view never
// holds writers up for long: next is the volume ID the next call resumes
// after ("" once every entry was walked). An entry whose properties do
// not name the owner's UID key is passed over without being decoded.
func (v *View) Owned(after string, scan int, now time.Time) (out []Owned, next string) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	f := v.flags(now)
	walked := 0
	stopped := ascend(v.ordered, "", after, func(e *entry) bool {
		if walked == scan {
			return false
		}
		walked++
		next = e.ref.String()
		if !strings.Contains(e.props, volume.PropertyOwnerUID) {
			return true
		}
		o, ok := volume.OwnerOf(e.properties())
		if !ok {
			return true
		}
		if loc := v.location(e, 1, f); loc.Found {
			out = append(out, Owned{Ref: e.ref, Owner: o, State: loc.State, Pinned: loc.Pinned})
		}
		return true
	})
	if !stopped {
		next = ""
	}
	return out, next
}
