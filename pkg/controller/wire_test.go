package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

func wireRef(ns, h string) *controllerv1.VolumeRef {
	return &controllerv1.VolumeRef{Namespace: ns, Handle: h}
}

// Every name a node or a scheduler sends is checked on the way in: the
// view takes only well-formed refs.
func TestReportOnTheWire(t *testing.T) {
	good := &controllerv1.VolumeSummary{Ref: wireRef("ci", "a"), State: "ready", SizeBytes: 7, Parent: wireRef("ci", "p"),
		Scope: "cluster", Properties: []*controllerv1.Property{{Key: "k", Value: "v"}}, StepVolumes: 2, Pinned: true, Copies: 3}
	for _, tc := range []struct {
		name    string
		req     *controllerv1.ReportRequest
		wantErr bool
	}{
		{name: "well formed", req: &controllerv1.ReportRequest{NodeId: "n", StoreId: "s", Upserts: []*controllerv1.VolumeSummary{good},
			Deletes: []*controllerv1.VolumeRef{wireRef("ci", "b")}}},
		{name: "an upsert without a namespace", req: &controllerv1.ReportRequest{Upserts: []*controllerv1.VolumeSummary{{Ref: wireRef("", "x")}}}, wantErr: true},
		{name: "an upsert without a ref", req: &controllerv1.ReportRequest{Upserts: []*controllerv1.VolumeSummary{{State: "ready"}}}, wantErr: true},
		{name: "a malformed parent", req: &controllerv1.ReportRequest{Upserts: []*controllerv1.VolumeSummary{
			{Ref: wireRef("ci", "a"), Parent: wireRef("CI", "p")}}}, wantErr: true},
		{name: "a malformed delete", req: &controllerv1.ReportRequest{Deletes: []*controllerv1.VolumeRef{wireRef("ci", "../x")}}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw, err := proto.Marshal(tc.req)
			require.NoError(t, err)
			r, err := decodeReport(raw)
			if tc.wantErr {
				require.ErrorIs(t, err, fleet.ErrInvalid)
				return
			}
			require.NoError(t, err)
			require.Equal(t, fleet.Report{NodeID: "n", StoreID: "s", Deletes: []volume.Ref{{Namespace: "ci", Handle: "b"}},
				Upserts: []fleet.Held{{Ref: volume.Ref{Namespace: "ci", Handle: "a"}, State: volume.StateReady, SizeBytes: 7,
					Parent: volume.Ref{Namespace: "ci", Handle: "p"}, Scope: volume.ScopeCluster, Properties: []fleet.Property{{Key: "k", Value: "v"}},
					StepVolumes: 2, Pinned: true, Copies: 3}}}, r)
		})
	}
	_, err := refsFromWire([]*controllerv1.VolumeRef{wireRef("ci", "a"), nil})
	require.ErrorIs(t, err, fleet.ErrInvalid, "a lookup or a command naming no volume")
}

// A pin for good travels as no time at all, both ways.
func TestPinsOnTheWire(t *testing.T) {
	until := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	resp := toWireAnswer(fleet.Answer{Pins: []fleet.PinCommand{{Ref: volume.Ref{Namespace: "ci", Handle: "a"}}, {Ref: volume.Ref{Namespace: "ci", Handle: "b"}, Until: until}}})
	require.Nil(t, resp.Pins[0].Until)
	require.True(t, untilFromWire(resp.Pins[0].Until).IsZero())
	require.Equal(t, until, untilFromWire(resp.Pins[1].Until))
	require.Equal(t, timestamppb.New(until).AsTime(), resp.Pins[1].Until.AsTime())
}

// Placements sharing their Missing (every node missing all the inputs)
// are converted once, and say each node's own where it has one.
func TestToWirePlacements(t *testing.T) {
	inputs := []volume.Ref{{Namespace: "ci", Handle: "a"}, {Namespace: "ci", Handle: "b"}}
	ps := []fleet.Placement{
		{NodeID: "n1", InputBytesHeld: 5, Missing: inputs[1:]},
		{NodeID: "n2", Missing: inputs},
		{NodeID: "n3", Missing: inputs},
		{NodeID: "n4", InputBytesHeld: 7},
		{NodeID: "n5", Missing: []volume.Ref{inputs[1]}},
	}
	got := toWirePlacements(ps)
	require.Len(t, got, len(ps))
	for i, p := range ps {
		require.Equal(t, p.NodeID, got[i].GetNodeId())
		require.Equal(t, p.InputBytesHeld, got[i].GetInputBytesHeld())
		missing, err := refsFromWire(got[i].GetMissing())
		require.NoError(t, err)
		if len(p.Missing) == 0 {
			require.Empty(t, missing)
			continue
		}
		require.Equal(t, p.Missing, missing, p.NodeID)
	}
	require.Same(t, got[1].GetMissing()[0], got[2].GetMissing()[0], "converted once")
}
