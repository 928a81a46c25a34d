package fleet

import (
	"time"

	"github.com/concourse/cowvol/pkg/volume"
)

// The view's own words: what it takes from nodes and gives schedulers.
// The gRPC layer (wire.go) turns api/controller/v1's messages into these
// and back, checking every name on the way in, so that the view's memory
// layout owes nothing to the generated types.

// Report is what a node says of its cache: its whole inventory (Full), or
// what changed since the revision the controller acknowledged
// (BaseRevision), with how full it is.
type Report struct {
	NodeID, StoreID   string
	Revision          uint64
	BaseRevision      uint64
	Full              bool
	Upserts           []Held
	Deletes           []volume.Ref
	BytesFree         int64
	OverHighWatermark bool
	StepVolumes       int32
	PeerAddress       string
	// PullMode is how the node pulls the sources it lacks, in a word or
	// two (CheckPullMode).
	PullMode string
}

// Held is a node's word on one volume it holds: its copy's state, size,
// pin and step volumes, and what is the volume's own (lineage, scope,
// properties, the copies it asked for).
type Held struct {
	Ref         volume.Ref
	State       volume.State
	SizeBytes   int64
	Parent      volume.Ref
	Scope       volume.Scope // empty: the default, the namespace's own
	Properties  []Property
	StepVolumes int32
	Pinned      bool
	Copies      int32
	// Vouch are the digests the volume's maker vouches for it with, as
	// the node says (first hand, or those its pull was checked against).
	Vouch volume.Digests
}

// Property is one of a volume's properties, as a node lists them.
type Property struct{ Key, Value string }

// Answer is what the controller tells a node that reported: to send its
// whole inventory instead (Resync), or what schedulers asked of it.
type Answer struct {
	Resync   bool
	Revision uint64
	Destroy  []volume.Ref
	// DestroyOwned are the owner sweep's destroys, each said once.
	DestroyOwned []OwnedDestroy
	Pins         []PinCommand
	// Copy are the volumes the node is asked to pull and keep.
	Copy []volume.Ref
	// MaxCopies is the most nodes a volume may ask to be kept on, and
	// CopiesSpent the namespaces that may ask for no more than one: the
	// node refuses a publish that asks for more.
	MaxCopies   int
	CopiesSpent []string
	// RefuseCaptures says why the node takes no captures ("": it does).
	RefuseCaptures string
}

// OwnedDestroy asks a node to destroy a volume if its own record names
// the owner whose UID is OwnerUID (the owner sweep found that owner gone).
type OwnedDestroy struct {
	Ref      volume.Ref
	OwnerUID string
}

// PinCommand asks a node to pin a volume until Until (zero: for good), or
// to unpin it.
type PinCommand struct {
	Ref   volume.Ref
	Unpin bool
	Until time.Time
}

// Location is what the live nodes say of a volume: the best state any
// holds it in, with that copy's metadata, and which nodes hold it ready and
// which have it mounted.
type Location struct {
	Ref        volume.Ref
	Found      bool
	State      volume.State
	SizeBytes  int64
	Parent     volume.Ref
	Scope      volume.Scope
	Properties map[string]string
	// Nodes hold it ready, sorted; PeerAddresses are theirs, in the same
	// order; PublishedNodes are those where step volumes mount it. Each
	// is at most the query's MaxNodes long; NodeCount is how many nodes
	// hold it ready.
	Nodes, PeerAddresses, PublishedNodes []string
	NodeCount                            int
	Pinned                               bool
	// Vouch are what the volume's maker vouches for it with (zero: none
	// known; FirstHand unset).
	Vouch volume.Digests
}

// Placement is one node's fitness for a step.
type Placement struct {
	NodeID         string
	InputBytesHeld int64
	BytesFree      int64
	// Missing are the step's inputs the node lacks.
	Missing []volume.Ref
}

// NodeStatus is what a scheduler sees of a node.
type NodeStatus struct {
	NodeID, StoreID   string
	State             string
	LastReport        time.Time
	Revision          uint64
	Volumes           int32
	Bytes, BytesFree  int64
	OverHighWatermark bool
	PeerAddress       string
	PullMode          string
}

// VolumeNodes says which nodes a command about a volume went to.
type VolumeNodes struct {
	Ref   volume.Ref
	Nodes []string
}
