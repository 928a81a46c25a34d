package node

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// What a pod's namespace is told of a pull's layers: those it may use
// itself by name, another namespace's private one under a shared source
// never.
func TestPullNamesOnlyWhatTheNamespaceMayRead(t *testing.T) {
	shared := volume.Ref{Namespace: "other", Handle: "shared-top"}
	p := &pull{key: pullKey{namespace: "ci", ref: shared}}
	tests := []struct {
		name  string
		layer streamer.Layer
		want  string
	}{
		{"the source itself", streamer.Layer{Ref: shared, Scope: volume.ScopeCluster}, "other/shared-top"},
		{"the namespace's own", streamer.Layer{Ref: volume.Ref{Namespace: "ci", Handle: "mine"}, Scope: volume.ScopeNamespace}, "ci/mine"},
		{"another's shared", streamer.Layer{Ref: volume.Ref{Namespace: "other", Handle: "res"}, Scope: volume.ScopeCluster}, "other/res"},
		{"another's private", streamer.Layer{Ref: volume.Ref{Namespace: "other", Handle: "secret-base"}, Scope: volume.ScopeNamespace},
			"a volume other/shared-top stacks on"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, p.layerName(tc.layer))
		})
	}
}
