package controller

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// wire.go turns api/controller/v1's messages into the view's types and
// back. Every name coming in is checked here (ErrInvalid): the view takes
// only well-formed refs.

func refFromWire(r *controllerv1.VolumeRef) (volume.Ref, error) {
	ref := volume.Ref{Namespace: r.GetNamespace(), Handle: r.GetHandle()}
	if err := ref.Validate(); err != nil {
		return ref, fmt.Errorf("volume: %w: %w", err, ErrInvalid)
	}
	return ref, nil
}

func refsFromWire(refs []*controllerv1.VolumeRef) ([]volume.Ref, error) {
	out := make([]volume.Ref, len(refs))
	for i, r := range refs {
		var err error
		if out[i], err = refFromWire(r); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// reportFromWire checks a node's report's names; its states, scopes and
// counts the view checks.
func reportFromWire(req *controllerv1.ReportRequest) (Report, error) {
	r := Report{NodeID: req.GetNodeId(), StoreID: req.GetStoreId(), Revision: req.GetRevision(), BaseRevision: req.GetBaseRevision(),
		Full: req.GetFull(), BytesFree: req.GetBytesFree(), OverHighWatermark: req.GetOverHighWatermark(),
		StepVolumes: req.GetStepVolumes(), PeerAddress: req.GetPeerAddress(), Upserts: make([]Held, len(req.GetUpserts()))}
	// Every volume's properties in one array: a full report of 10,000
	// volumes is otherwise 10,000 small allocations more than the
	// message's own, on the path every node's report takes.
	total := 0
	for _, s := range req.GetUpserts() {
		total += len(s.GetProperties())
	}
	props := make([]Property, 0, total)
	for i, s := range req.GetUpserts() {
		ref, err := refFromWire(s.GetRef())
		if err != nil {
			return Report{}, err
		}
		h := Held{Ref: ref, State: volume.State(s.GetState()), SizeBytes: s.GetSizeBytes(), Scope: volume.Scope(s.GetScope()),
			StepVolumes: s.GetStepVolumes(), Pinned: s.GetPinned(), Copies: s.GetCopies()}
		if p := s.GetParent(); p.GetHandle() != "" {
			if h.Parent, err = refFromWire(p); err != nil {
				return Report{}, err
			}
		}
		if ps := s.GetProperties(); len(ps) > 0 {
			from := len(props)
			for _, p := range ps {
				props = append(props, Property{Key: p.GetKey(), Value: p.GetValue()})
			}
			h.Properties = props[from:len(props):len(props)]
		}
		r.Upserts[i] = h
	}
	var err error
	if r.Deletes, err = refsFromWire(req.GetDeletes()); err != nil {
		return Report{}, err
	}
	return r, nil
}

func toWireAnswer(a Answer) *controllerv1.ReportResponse {
	resp := &controllerv1.ReportResponse{Resync: a.Resync, Revision: a.Revision, Destroy: controllerv1.RefsOf(a.Destroy),
		Copy: controllerv1.RefsOf(a.Copy), RefuseCaptures: a.RefuseCaptures}
	for _, p := range a.Pins {
		c := &controllerv1.PinCommand{Ref: controllerv1.RefOf(p.Ref), Unpin: p.Unpin}
		if !p.Until.IsZero() {
			c.Until = timestamppb.New(p.Until)
		}
		resp.Pins = append(resp.Pins, c)
	}
	return resp
}

// untilFromWire is a pin's end (zero: for good).
func untilFromWire(u *timestamppb.Timestamp) time.Time {
	if u == nil {
		return time.Time{}
	}
	return u.AsTime()
}

func toWireLocation(l Location) *controllerv1.VolumeLocation {
	return &controllerv1.VolumeLocation{Ref: controllerv1.RefOf(l.Ref), Found: l.Found, State: string(l.State), SizeBytes: l.SizeBytes,
		Parent: controllerv1.RefOf(l.Parent), Scope: string(l.Scope), Properties: l.Properties, Nodes: l.Nodes,
		PublishedNodes: l.PublishedNodes, Pinned: l.Pinned, PeerAddresses: l.PeerAddresses}
}

func toWireLocations(locs []Location) []*controllerv1.VolumeLocation {
	out := make([]*controllerv1.VolumeLocation, len(locs))
	for i, l := range locs {
		out[i] = toWireLocation(l)
	}
	return out
}

func toWirePlacements(ps []Placement) []*controllerv1.NodePlacement {
	out := make([]*controllerv1.NodePlacement, len(ps))
	for i, p := range ps {
		out[i] = &controllerv1.NodePlacement{NodeId: p.NodeID, InputBytesHeld: p.InputBytesHeld, BytesFree: p.BytesFree,
			Missing: controllerv1.RefsOf(p.Missing)}
	}
	return out
}

func toWireNodeStatus(s NodeStatus) *controllerv1.NodeStatus {
	return &controllerv1.NodeStatus{NodeId: s.NodeID, StoreId: s.StoreID, State: s.State, LastReport: timestamppb.New(s.LastReport),
		Revision: s.Revision, Volumes: s.Volumes, Bytes: s.Bytes, BytesFree: s.BytesFree, OverHighWatermark: s.OverHighWatermark,
		PeerAddress: s.PeerAddress}
}

func toWireVolumeNodes(vns []VolumeNodes) []*controllerv1.VolumeNodes {
	out := make([]*controllerv1.VolumeNodes, len(vns))
	for i, vn := range vns {
		out[i] = &controllerv1.VolumeNodes{Ref: controllerv1.RefOf(vn.Ref), Nodes: vn.Nodes}
	}
	return out
}
