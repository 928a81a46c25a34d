package main

import (
	"cmp"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/duration"
	"sigs.k8s.io/yaml"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// table is what a command prints: rows for -o json and -o yaml (a list
// under "items", as kubectl prints lists), and their columns for people.
type table interface {
	header() []string
	cells() [][]string
	items() any
}

func (o *options) print(t table) error {
	switch o.output {
	case "json", "yaml":
		raw, err := json.MarshalIndent(map[string]any{"items": t.items()}, "", "  ")
		if err != nil {
			return err
		}
		if o.output == "yaml" {
			if raw, err = yaml.JSONToYAML(raw); err != nil {
				return err
			}
		}
		_, err = fmt.Fprintln(o.out, string(raw))
		return err
	}
	w := tabwriter.NewWriter(o.out, 0, 8, 3, ' ', 0)
	fmt.Fprintln(w, strings.Join(t.header(), "\t"))
	for _, row := range t.cells() {
		fmt.Fprintln(w, strings.Join(row, "\t"))
	}
	return w.Flush()
}

func bytes(n int64) string {
	if n < 0 {
		return "<unmeasured>"
	}
	return resource.NewQuantity(n, resource.BinarySI).String()
}

func list(s []string) string {
	if len(s) == 0 {
		return "<none>"
	}
	return strings.Join(s, ",")
}

// Node is one node, as -o json and -o yaml print it.
type Node struct {
	Name              string    `json:"name"`
	State             string    `json:"state"`
	StoreID           string    `json:"storeID"`
	Volumes           int32     `json:"volumes"`
	Bytes             int64     `json:"bytes"`
	BytesFree         int64     `json:"bytesFree"`
	OverHighWatermark bool      `json:"overHighWatermark"`
	LastReport        time.Time `json:"lastReport"`
	Revision          uint64    `json:"revision"`
	// PullMode is how the node pulls the sources it lacks: eager, lazy
	// (stubs) or lazy (index).
	PullMode string `json:"pullMode,omitempty"`
}

type nodeTable struct {
	nodes []Node
	now   time.Time
}

func nodeRows(in []*controllerv1.NodeStatus, now time.Time) nodeTable {
	t := nodeTable{nodes: []Node{}, now: now}
	for _, n := range in {
		t.nodes = append(t.nodes, Node{Name: n.GetNodeId(), State: n.GetState(), StoreID: n.GetStoreId(), Volumes: n.GetVolumes(),
			Bytes: n.GetBytes(), BytesFree: n.GetBytesFree(), OverHighWatermark: n.GetOverHighWatermark(),
			LastReport: n.GetLastReport().AsTime(), Revision: n.GetRevision(), PullMode: n.GetPullMode()})
	}
	return t
}

func (t nodeTable) header() []string {
	return []string{"NAME", "STATE", "STORE", "VOLUMES", "BYTES", "FREE", "PULLS", "LAST HEARTBEAT"}
}
func (t nodeTable) items() any { return t.nodes }
func (t nodeTable) cells() [][]string {
	var out [][]string
	for _, n := range t.nodes {
		free := bytes(n.BytesFree)
		if n.OverHighWatermark {
			free += " (full)"
		}
		out = append(out, []string{n.Name, n.State, n.StoreID, fmt.Sprint(n.Volumes), bytes(n.Bytes), free, cmp.Or(n.PullMode, "<none>"),
			duration.HumanDuration(t.now.Sub(n.LastReport)) + " ago"})
	}
	return out
}

// Volume is one cached volume, as -o json and -o yaml print it.
type Volume struct {
	Namespace string `json:"namespace"`
	Handle    string `json:"handle"`
	State     string `json:"state"`
	// StepResult is how the step it was captured from ended (the
	// property cowvol.concourse-ci.org/step-result), if that is known.
	StepResult string `json:"stepResult,omitempty"`
	// Owner is the object it belongs to (captured with owner:
	// controller), as kubectl names one: Kind.group/name.
	Owner      string            `json:"owner,omitempty"`
	SizeBytes  int64             `json:"sizeBytes"`
	Scope      string            `json:"scope"`
	Parent     string            `json:"parent,omitempty"`
	Properties map[string]string `json:"properties,omitempty"`
	Nodes      []string          `json:"nodes"`
	InUseOn    []string          `json:"inUseOn,omitempty"`
	Pinned     bool              `json:"pinned,omitempty"`
}

type volumeTable []Volume

func volumeRows(in []*controllerv1.VolumeLocation) volumeTable {
	t := volumeTable{}
	for _, l := range in {
		v := Volume{Namespace: l.GetRef().GetNamespace(), Handle: l.GetRef().GetHandle(), State: l.GetState(),
			SizeBytes: l.GetSizeBytes(), Scope: l.GetScope(), Properties: l.GetProperties(), Nodes: l.GetNodes(),
			InUseOn: l.GetPublishedNodes(), Pinned: l.GetPinned(), StepResult: l.GetProperties()[volume.PropertyStepResult],
			Owner: l.GetProperties()[volume.PropertyOwner]}
		if p := l.GetParent(); p.GetHandle() != "" {
			v.Parent = p.GetNamespace() + "/" + p.GetHandle()
		}
		if v.Nodes == nil {
			v.Nodes = []string{}
		}
		t = append(t, v)
	}
	return t
}

func (t volumeTable) header() []string {
	return []string{"NAMESPACE", "HANDLE", "STATE", "STEP", "SIZE", "SCOPE", "PARENT", "OWNER", "NODES", "IN USE ON", "PROPERTIES"}
}
func (t volumeTable) items() any { return []Volume(t) }
func (t volumeTable) cells() [][]string {
	var out [][]string
	for _, v := range t {
		var props []string
		for k, val := range v.Properties {
			switch k {
			case volume.PropertyStepResult, volume.PropertyOwner, volume.PropertyOwnerUID: // their own columns (the UID in -o json)
			default:
				props = append(props, k+"="+val)
			}
		}
		sort.Strings(props)
		state := v.State
		if v.Pinned {
			state += ",pinned"
		}
		parent := v.Parent
		if parent == "" {
			parent = "<none>"
		}
		step := v.StepResult
		if step == "" {
			step = "<unknown>"
		}
		owner := v.Owner
		if owner == "" {
			owner = "<none>"
		}
		out = append(out, []string{v.Namespace, v.Handle, state, step, bytes(v.SizeBytes), v.Scope, parent, owner, list(v.Nodes),
			list(v.InUseOn), list(props)})
	}
	return out
}

// Asked is what a destroy, pin or unpin did to one volume: which nodes
// were told.
type Asked struct {
	Namespace string   `json:"namespace"`
	Handle    string   `json:"handle"`
	Nodes     []string `json:"nodes"`
}

type askedTable struct {
	verb  string
	asked []Asked
}

func askedRows(verb string, in []*controllerv1.VolumeNodes) askedTable {
	t := askedTable{verb: verb, asked: []Asked{}}
	for _, v := range in {
		nodes := v.GetNodes()
		if nodes == nil {
			nodes = []string{}
		}
		t.asked = append(t.asked, Asked{Namespace: v.GetRef().GetNamespace(), Handle: v.GetRef().GetHandle(), Nodes: nodes})
	}
	return t
}

func (t askedTable) header() []string {
	return []string{"NAMESPACE", "HANDLE", strings.ToUpper(t.verb) + " ASKED OF"}
}
func (t askedTable) items() any { return t.asked }
func (t askedTable) cells() [][]string {
	var out [][]string
	for _, a := range t.asked {
		nodes := list(a.Nodes)
		if len(a.Nodes) == 0 {
			nodes = "<no node holds it>"
		}
		out = append(out, []string{a.Namespace, a.Handle, nodes})
	}
	return out
}

// Cache is one cache key, as -o json and -o yaml print it.
type Cache struct {
	Namespace string `json:"namespace"`
	Key       string `json:"key"`
	// Version is the handle of its newest version a live node holds
	// ("": none does).
	Version    string    `json:"version,omitempty"`
	Bytes      int64     `json:"bytes"`
	Nodes      []string  `json:"nodes"`
	InUseOn    []string  `json:"inUseOn,omitempty"`
	PromotedAt time.Time `json:"promotedAt,omitzero"`
	PromotedBy string    `json:"promotedBy,omitempty"`
	// Versions counts those of its versions live nodes hold ready.
	Versions int32 `json:"versions"`
}

type cacheTable struct {
	caches []Cache
	now    time.Time
}

func cacheRows(in []*controllerv1.CacheLocation, now time.Time) cacheTable {
	t := cacheTable{caches: []Cache{}, now: now}
	for _, c := range in {
		row := Cache{Namespace: c.GetNamespace(), Key: c.GetKey(), Nodes: c.GetVersion().GetNodes(), InUseOn: c.GetVersion().GetPublishedNodes(),
			Bytes: c.GetBytes(), PromotedBy: c.GetPromotedBy(), Versions: c.GetVersions()}
		if c.GetFound() {
			row.Version, row.PromotedAt = c.GetVersion().GetRef().GetHandle(), c.GetPromotedAt().AsTime()
		}
		if row.Nodes == nil {
			row.Nodes = []string{}
		}
		t.caches = append(t.caches, row)
	}
	return t
}

func (t cacheTable) header() []string {
	return []string{"NAMESPACE", "KEY", "VERSION", "SIZE", "NODES", "PROMOTED", "BY", "VERSIONS"}
}
func (t cacheTable) items() any { return t.caches }
func (t cacheTable) cells() [][]string {
	var out [][]string
	for _, c := range t.caches {
		if c.Version == "" {
			out = append(out, []string{c.Namespace, c.Key, "<none>", "-", "<none>", "-", "-", "0"})
			continue
		}
		out = append(out, []string{c.Namespace, c.Key, c.Version, bytes(c.Bytes), list(c.Nodes),
			duration.HumanDuration(t.now.Sub(c.PromotedAt)) + " ago", c.PromotedBy, fmt.Sprint(c.Versions)})
	}
	return out
}

// Cleared is what clearing one cache key did: which nodes were told to
// destroy its versions.
type Cleared struct {
	Namespace string   `json:"namespace"`
	Key       string   `json:"key"`
	Versions  int      `json:"versions"`
	Nodes     []string `json:"nodes"`
}

type clearedTable []Cleared

func clearedRows(namespace string, in []*controllerv1.ClearedCache) clearedTable {
	t := clearedTable{}
	for _, c := range in {
		nodes := []string{}
		for _, v := range c.GetVersions() {
			nodes = append(nodes, v.GetNodes()...)
		}
		slices.Sort(nodes)
		t = append(t, Cleared{Namespace: namespace, Key: c.GetKey(), Versions: len(c.GetVersions()), Nodes: slices.Compact(nodes)})
	}
	return t
}

func (t clearedTable) header() []string {
	return []string{"NAMESPACE", "KEY", "VERSIONS", "CLEAR ASKED OF"}
}
func (t clearedTable) items() any { return []Cleared(t) }
func (t clearedTable) cells() [][]string {
	var out [][]string
	for _, c := range t {
		nodes := list(c.Nodes)
		if len(c.Nodes) == 0 {
			nodes = "<no node holds a version>"
		}
		out = append(out, []string{c.Namespace, c.Key, fmt.Sprint(c.Versions), nodes})
	}
	return out
}
