package controller

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// wire.go turns api/controller/v1's messages into the view's types and
// back. Every name coming in is checked here (ErrInvalid): the view takes
// only well-formed refs.

func refFromWire(r *controllerv1.VolumeRef) (volume.Ref, error) {
	ref := volume.Ref{Namespace: r.GetNamespace(), Handle: r.GetHandle()}
	if err := ref.Validate(); err != nil {
		return ref, fmt.Errorf("volume: %w: %w", err, fleet.ErrInvalid)
	}
	return ref, nil
}

func cachesFromWire(caches []*controllerv1.CacheRef) ([]volume.CacheRef, error) {
	out := make([]volume.CacheRef, len(caches))
	for i, c := range caches {
		if err := volume.ValidateNamespace(c.GetNamespace()); err != nil {
			return nil, fmt.Errorf("cache: %w: %w", err, fleet.ErrInvalid)
		}
		if err := volume.ValidateCacheKey(c.GetKey()); err != nil {
			return nil, fmt.Errorf("%w: %w", err, fleet.ErrInvalid)
		}
		out[i] = volume.CacheRef{Namespace: c.GetNamespace(), Key: c.GetKey()}
	}
	return out, nil
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

func toWireAnswer(a fleet.Answer) *controllerv1.ReportResponse {
	resp := &controllerv1.ReportResponse{Resync: a.Resync, Revision: a.Revision, Destroy: controllerv1.RefsOf(a.Destroy),
		Copy: controllerv1.RefsOf(a.Copy), RefuseCaptures: a.RefuseCaptures, MaxCopies: int32(a.MaxCopies), CopiesSpent: a.CopiesSpent}
	for _, d := range a.DestroyOwned {
		resp.DestroyOwned = append(resp.DestroyOwned, &controllerv1.OwnedVolume{Ref: controllerv1.RefOf(d.Ref), OwnerUid: d.OwnerUID})
	}
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

func toWireLocation(l fleet.Location) *controllerv1.VolumeLocation {
	loc := &controllerv1.VolumeLocation{Ref: controllerv1.RefOf(l.Ref), Found: l.Found, State: string(l.State), SizeBytes: l.SizeBytes,
		Parent: controllerv1.RefOf(l.Parent), Scope: string(l.Scope), Properties: l.Properties, Nodes: l.Nodes,
		PublishedNodes: l.PublishedNodes, Pinned: l.Pinned, PeerAddresses: l.PeerAddresses, NodeCount: int32(l.NodeCount)}
	if l.Vouch.Known() {
		loc.LayerDigest, loc.ViewDigest = l.Vouch.Layer[:], l.Vouch.View[:]
	}
	return loc
}

func toWireLocations(locs []fleet.Location) []*controllerv1.VolumeLocation {
	out := make([]*controllerv1.VolumeLocation, len(locs))
	for i, l := range locs {
		out[i] = toWireLocation(l)
	}
	return out
}

// toWirePlacements converts placements, the Missing that several share
// (View.Place gives every node missing all inputs the same) once.
func toWirePlacements(ps []fleet.Placement) []*controllerv1.NodePlacement {
	out := make([]*controllerv1.NodePlacement, len(ps))
	var shared []volume.Ref
	var sharedWire []*controllerv1.VolumeRef
	for i, p := range ps {
		missing := sharedWire
		if len(p.Missing) == 0 || len(p.Missing) != len(shared) || &p.Missing[0] != &shared[0] {
			missing = controllerv1.RefsOf(p.Missing)
			shared, sharedWire = p.Missing, missing
		}
		out[i] = &controllerv1.NodePlacement{NodeId: p.NodeID, InputBytesHeld: p.InputBytesHeld, BytesFree: p.BytesFree, Missing: missing}
	}
	return out
}

func toWireNodeStatus(s fleet.NodeStatus) *controllerv1.NodeStatus {
	return &controllerv1.NodeStatus{NodeId: s.NodeID, StoreId: s.StoreID, State: s.State, LastReport: timestamppb.New(s.LastReport),
		Revision: s.Revision, Volumes: s.Volumes, Bytes: s.Bytes, BytesFree: s.BytesFree, OverHighWatermark: s.OverHighWatermark,
		PeerAddress: s.PeerAddress, PullMode: s.PullMode}
}

func toWireVolumeNodes(vns []fleet.VolumeNodes) []*controllerv1.VolumeNodes {
	out := make([]*controllerv1.VolumeNodes, len(vns))
	for i, vn := range vns {
		out[i] = &controllerv1.VolumeNodes{Ref: controllerv1.RefOf(vn.Ref), Nodes: vn.Nodes}
	}
	return out
}

func toWireCaches(cs []fleet.CacheLocation) []*controllerv1.CacheLocation {
	out := make([]*controllerv1.CacheLocation, len(cs))
	for i, c := range cs {
		out[i] = &controllerv1.CacheLocation{Namespace: c.Namespace, Key: c.Key, Found: c.Found}
		if c.Found {
			out[i].Version, out[i].PromotedAt, out[i].PromotedBy = toWireLocation(c.Version), timestamppb.New(c.PromotedAt), c.PromotedBy
			out[i].Versions, out[i].Bytes = int32(c.Versions), c.Bytes
		}
	}
	return out
}
