package controller

import (
	"bytes"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// reportFromMessage is a report read through the generated types, checked
// as decodeReport checks it: the reference decodeReport is held to.
func reportFromMessage(req *controllerv1.ReportRequest) (fleet.Report, error) {
	r := fleet.Report{NodeID: req.GetNodeId(), StoreID: req.GetStoreId(), Revision: req.GetRevision(), BaseRevision: req.GetBaseRevision(),
		Full: req.GetFull(), BytesFree: req.GetBytesFree(), OverHighWatermark: req.GetOverHighWatermark(),
		StepVolumes: req.GetStepVolumes(), PeerAddress: req.GetPeerAddress(), PullMode: req.GetPullMode(), Upserts: make([]fleet.Held, len(req.GetUpserts()))}
	if err := checkPullMode(r.PullMode); err != nil {
		return fleet.Report{}, err
	}
	// Every volume's properties in one array: a full report of 10,000
	// volumes is otherwise 10,000 small allocations more than the
	// message's own, on the path every node's report takes.
	total := 0
	for _, s := range req.GetUpserts() {
		total += len(s.GetProperties())
	}
	props := make([]fleet.Property, 0, total)
	for i, s := range req.GetUpserts() {
		ref, err := refFromWire(s.GetRef())
		if err != nil {
			return fleet.Report{}, err
		}
		h := fleet.Held{Ref: ref, State: volume.State(s.GetState()), SizeBytes: s.GetSizeBytes(), Scope: volume.Scope(s.GetScope()),
			StepVolumes: s.GetStepVolumes(), Pinned: s.GetPinned(), Copies: s.GetCopies()}
		if p := s.GetParent(); p.GetHandle() != "" {
			if h.Parent, err = refFromWire(p); err != nil {
				return fleet.Report{}, err
			}
		}
		if h.Vouch, err = vouchFromWire(s.GetLayerDigest(), s.GetViewDigest(), s.GetFirstHand()); err != nil {
			return fleet.Report{}, err
		}
		if ps := s.GetProperties(); len(ps) > 0 {
			from := len(props)
			for _, p := range ps {
				props = append(props, fleet.Property{Key: p.GetKey(), Value: p.GetValue()})
			}
			h.Properties = props[from:len(props):len(props)]
		}
		r.Upserts[i] = h
	}
	var err error
	if r.Deletes, err = refsFromWire(req.GetDeletes()); err != nil {
		return fleet.Report{}, err
	}
	return r, nil
}

// decodeReport reads what the generated types read, and refuses what they
// refuse, on whatever bytes it is given; and it never panics.
func FuzzDecodeReport(f *testing.F) {
	good := &controllerv1.VolumeSummary{Ref: wireRef("ci", "a"), State: "ready", SizeBytes: 7, Parent: wireRef("ci", "p"),
		Base: wireRef("ci", "b"), Scope: "cluster", Properties: []*controllerv1.Property{{Key: "k", Value: "v"}, {Key: "l", Value: ""}},
		StepVolumes: 2, Pinned: true, Copies: 3, LayerDigest: bytes.Repeat([]byte{1}, 32), ViewDigest: bytes.Repeat([]byte{2}, 32), FirstHand: true}
	for _, req := range []*controllerv1.ReportRequest{
		{},
		{NodeId: "n", StoreId: "s", Revision: 9, Full: true, BaseRevision: 8, Upserts: []*controllerv1.VolumeSummary{good, {Ref: wireRef("ci", "c")}},
			Deletes: []*controllerv1.VolumeRef{wireRef("ci", "d")}, BytesFree: -5, OverHighWatermark: true, StepVolumes: 3, PeerAddress: "10.0.0.1:7071",
			PullMode: "lazy (index)"},
		{NodeId: "n", StoreId: "s", PullMode: "lazy\x1b[31m"}, // a terminal's escape, printed to an operator
		{NodeId: "n", StoreId: "s", PullMode: strings.Repeat("lazy ", 10)},
	} {
		raw, err := proto.Marshal(req)
		require.NoError(f, err)
		f.Add(raw)
	}
	// A field said twice, on another wire type, of an unknown number, and
	// a group.
	merged := protowire.AppendTag(nil, 6, protowire.BytesType)
	merged = protowire.AppendBytes(merged, func() []byte {
		b := protowire.AppendTag(nil, 1, protowire.BytesType)
		b = protowire.AppendBytes(b, protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "ci"))
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendBytes(b, protowire.AppendString(protowire.AppendTag(nil, 2, protowire.BytesType), "x"))
		b = protowire.AppendTag(b, 3, protowire.Fixed64Type)
		b = protowire.AppendFixed64(b, 7)
		b = protowire.AppendTag(b, 99, protowire.StartGroupType)
		b = protowire.AppendTag(b, 99, protowire.EndGroupType)
		return b
	}())
	f.Add(merged)
	// A pull mode said twice: the last is the one read, so a bad first one
	// is no fault.
	twice := protowire.AppendString(protowire.AppendTag(nil, 12, protowire.BytesType), "0000000000000")
	f.Add(protowire.AppendString(protowire.AppendTag(twice, 12, protowire.BytesType), "eager"))
	f.Add([]byte{0x32, 0x05, 0x0a, 0x03, 0x12, 0x01, 0xff}) // a handle that is not UTF-8
	for _, digests := range [][2][]byte{{make([]byte, 31), make([]byte, 32)}, {make([]byte, 32), nil}} {
		raw, err := proto.Marshal(&controllerv1.ReportRequest{NodeId: "n", StoreId: "s", Upserts: []*controllerv1.VolumeSummary{
			{Ref: wireRef("ci", "a"), State: "ready", LayerDigest: digests[0], ViewDigest: digests[1]}}})
		require.NoError(f, err)
		f.Add(raw)
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, err := decodeReport(raw)
		var msg controllerv1.ReportRequest
		want, wantErr := fleet.Report{}, proto.Unmarshal(raw, &msg)
		if wantErr == nil {
			want, wantErr = reportFromMessage(&msg)
		}
		if wantErr != nil {
			require.Error(t, err, "the generated types refuse it: %v", wantErr)
			require.ErrorIs(t, err, fleet.ErrInvalid)
			return
		}
		require.NoError(t, err)
		require.Equal(t, normalized(want), normalized(got))
	})
}

// normalized is r with its empty lists nil.
func normalized(r fleet.Report) fleet.Report {
	if len(r.Upserts) == 0 {
		r.Upserts = nil
	}
	if len(r.Deletes) == 0 {
		r.Deletes = nil
	}
	for i := range r.Upserts {
		if len(r.Upserts[i].Properties) == 0 {
			r.Upserts[i].Properties = nil
		}
	}
	return r
}

// The view keeps nothing of a report's bytes: its strings share them, and
// what the view keeps it copies. Bytes scribbled over once the report is
// applied change nothing it answers.
func TestTheViewKeepsNoneOfAReportsBytes(t *testing.T) {
	req := &controllerv1.ReportRequest{NodeId: "node-a", StoreId: "store-a", Revision: 1, Full: true, PeerAddress: "10.0.0.1:7071",
		Upserts: []*controllerv1.VolumeSummary{
			{Ref: wireRef("ci", "out"), State: "ready", SizeBytes: 5, Parent: wireRef("team", "gone"), Scope: "cluster",
				Properties: []*controllerv1.Property{{Key: "resource", Value: "repo"}}},
			{Ref: wireRef("team", "in"), State: "creating"},
		}}
	raw, err := proto.Marshal(req)
	require.NoError(t, err)
	report, err := decodeReport(raw)
	require.NoError(t, err)
	v := fleet.NewView(time.Minute, time.Hour)
	now := time.Now()
	_, err = v.Report(report, now)
	require.NoError(t, err)
	for i := range raw {
		raw[i] = 'x'
	}
	locs, _, err := v.List(fleet.ListQuery{}, now)
	require.NoError(t, err)
	require.Len(t, locs, 2)
	require.Equal(t, volume.Ref{Namespace: "ci", Handle: "out"}, locs[0].Ref)
	require.Equal(t, volume.Ref{Namespace: "team", Handle: "gone"}, locs[0].Parent)
	require.Equal(t, map[string]string{"resource": "repo"}, locs[0].Properties)
	require.Equal(t, []string{"node-a"}, locs[0].Nodes)
	require.Equal(t, []string{"10.0.0.1:7071"}, locs[0].PeerAddresses)
	require.Equal(t, volume.Ref{Namespace: "team", Handle: "in"}, locs[1].Ref)
	require.Equal(t, volume.StateCreating, locs[1].State)
	nodes := v.Nodes(now)
	require.Equal(t, "node-a", nodes[0].NodeID)
	require.Equal(t, "store-a", nodes[0].StoreID)
}

// A report whose entries cost the sender a couple of bytes each is refused
// for its count before anything is made at that count: ten million empty
// volumes (20 MB) would otherwise cost about 1.4 GB of Held.
func TestDecodeReportBoundsItsCountsFirst(t *testing.T) {
	entry := func(num protowire.Number, n int) []byte {
		var one []byte
		one = protowire.AppendTag(one, num, protowire.BytesType)
		one = protowire.AppendBytes(one, nil)
		return bytes.Repeat(one, n)
	}
	var withProps []byte
	for range controllerv1.MaxReportVolumes/2 + 1 {
		withProps = protowire.AppendTag(withProps, 6, protowire.BytesType)
		withProps = protowire.AppendBytes(withProps, entry(7, 9))
	}
	tests := []struct {
		name string
		raw  []byte
	}{
		{"ten million volumes", entry(6, 10_000_000)},
		{"one volume more than the bound", entry(6, controllerv1.MaxReportVolumes+1)},
		{"ten million deletions", entry(7, 10_000_000)},
		{"more properties than the bound", withProps},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			_, err := decodeReport(tc.raw)
			runtime.ReadMemStats(&after)
			require.ErrorIs(t, err, fleet.ErrInvalid)
			require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20), "bytes allocated refusing it")
		})
	}
	_, err := decodeReport(entry(6, controllerv1.MaxReportVolumes))
	require.ErrorIs(t, err, fleet.ErrInvalid, "as many as the bound are read, and refused for what they are (no ref)")
	require.NotContains(t, err.Error(), "more than")
}
