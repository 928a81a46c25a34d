package client

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

func TestStepVolumes(t *testing.T) {
	res := volume.Ref{Namespace: "ci", Handle: "res-7f3a"}
	shared := volume.Ref{Namespace: "platform", Handle: "tools-v3"}
	tests := []struct {
		name     string
		got      func() (map[string]string, bool)
		want     map[string]string
		readOnly bool
	}{
		{"own input", func() (map[string]string, bool) {
			v := Input("repo", res, "ci")
			return v.CSI.VolumeAttributes, *v.CSI.ReadOnly
		}, map[string]string{"source": "res-7f3a"}, true},
		{"input read in a recorded order", func() (map[string]string, bool) {
			v := WithReadProfile(Input("repo", res, "ci"), "main/unit/repo")
			return v.CSI.VolumeAttributes, *v.CSI.ReadOnly
		}, map[string]string{"source": "res-7f3a", "readProfile": "main/unit/repo"}, true},
		{"another namespace's shared input", func() (map[string]string, bool) {
			v := Input("tools", shared, "ci")
			return v.CSI.VolumeAttributes, *v.CSI.ReadOnly
		}, map[string]string{"source": "tools-v3", "sourceNamespace": "platform"}, true},
		{"output", func() (map[string]string, bool) {
			v := OutputVolume("built", Output{Capture: "out-91c2", Shared: true, Properties: map[string]string{"version": "v1"},
				SizeLimit: 10 << 30, TTL: 72 * time.Hour, Copies: 2}, "ci")
			return v.CSI.VolumeAttributes, *v.CSI.ReadOnly
		}, map[string]string{"capture": "out-91c2", "scope": "cluster", "property.version": "v1", "sizeLimit": "10Gi", "ttl": "72h0m0s", "copies": "2"}, false},
		{"output over an input", func() (map[string]string, bool) {
			v := OutputVolume("repo", Output{Capture: "out-55aa", Source: &res}, "ci")
			return v.CSI.VolumeAttributes, *v.CSI.ReadOnly
		}, map[string]string{"capture": "out-55aa", "source": "res-7f3a"}, false},
		{"first task cache", func() (map[string]string, bool) {
			v := TaskCache("cache", nil, "cache-b1", "ci")
			return v.CSI.VolumeAttributes, *v.CSI.ReadOnly
		}, map[string]string{"capture": "cache-b1"}, false},
		{"task cache", func() (map[string]string, bool) {
			last := volume.Ref{Namespace: "ci", Handle: "cache-b1"}
			v := TaskCache("cache", &last, "cache-b2", "ci")
			return v.CSI.VolumeAttributes, *v.CSI.ReadOnly
		}, map[string]string{"capture": "cache-b2", "source": "cache-b1"}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			attrs, ro := tc.got()
			require.Equal(t, tc.want, attrs)
			require.Equal(t, tc.readOnly, ro)
		})
	}
}

func TestPreferNodes(t *testing.T) {
	require.Nil(t, PreferNodes(nil))
	a := PreferNodes([]*controllerv1.NodePlacement{{NodeId: "node-b"}, {NodeId: "node-a"}})
	terms := a.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution
	require.Len(t, terms, 2)
	require.Equal(t, int32(100), terms[0].Weight)
	require.Equal(t, []string{"node-b"}, terms[0].Preference.MatchFields[0].Values)
	require.Greater(t, terms[0].Weight, terms[1].Weight)
}

// A node's report carries properties as repeated (key, value) messages:
// on the wire exactly what map<string, string> was, so a node and a
// controller of either encoding understand each other.
func TestPropertiesAreWireCompatibleWithAMap(t *testing.T) {
	var entry []byte // one map<string, string> entry: key = 1, value = 2
	entry = protowire.AppendTag(entry, 1, protowire.BytesType)
	entry = protowire.AppendString(entry, "version")
	entry = protowire.AppendTag(entry, 2, protowire.BytesType)
	entry = protowire.AppendString(entry, "v3")
	var raw []byte // VolumeSummary.properties = 7
	raw = protowire.AppendTag(raw, 7, protowire.BytesType)
	raw = protowire.AppendBytes(raw, entry)

	var s controllerv1.VolumeSummary
	require.NoError(t, proto.Unmarshal(raw, &s))
	require.Len(t, s.Properties, 1)
	require.Equal(t, "version", s.Properties[0].Key)
	require.Equal(t, "v3", s.Properties[0].Value)
	out, err := proto.Marshal(&controllerv1.VolumeSummary{Properties: Properties(map[string]string{"version": "v3"})})
	require.NoError(t, err)
	require.Equal(t, raw, out)
}
