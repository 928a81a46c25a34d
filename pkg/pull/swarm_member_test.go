package pull

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// A node relays its copy of a layer's stream only as a holder serves the
// layer: to a namespace that may read the layer, or the volume on top of
// it the copy was pulled for; any other ask looks like a copy it lacks.
func TestRelayTenancy(t *testing.T) {
	private := streamer.Layer{Ref: volume.Ref{Namespace: "team-a", Handle: "base"}, Scope: volume.ScopeNamespace}
	shared := streamer.Layer{Ref: volume.Ref{Namespace: "team-a", Handle: "tool"}, Base: private.Ref, Scope: volume.ScopeCluster}
	spool, err := streamer.NewSpool(t.TempDir(), streamer.S2, nil)
	require.NoError(t, err)
	pl := &Puller{relays: relays{byToken: map[string]*relayed{
		"under-shared": {spool: spool, layer: private, top: shared},
		"own":          {spool: spool, layer: private, top: private},
	}}}
	tests := []struct {
		name, namespace, token string
		ref, via               volume.Ref
		wantServed             bool
	}{
		{"its own namespace", "team-a", "own", private.Ref, volume.Ref{}, true},
		{"another namespace, via the shared volume on top", "team-b", "under-shared", private.Ref, shared.Ref, true},
		{"another namespace, naming no via", "team-b", "under-shared", private.Ref, volume.Ref{}, false},
		{"another namespace, via itself", "team-b", "under-shared", private.Ref, private.Ref, false},
		{"another namespace, the copy made for team-a's own use", "team-b", "own", private.Ref, shared.Ref, false},
		{"another layer than the copy's", "team-a", "own", shared.Ref, volume.Ref{}, false},
		{"a token no pull joined with", "team-a", "nope", private.Ref, volume.Ref{}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sp, err := pl.Relay(tc.namespace, tc.ref, tc.via, tc.token)
			if tc.wantServed {
				require.NoError(t, err)
				require.Same(t, spool, sp)
				return
			}
			require.ErrorIs(t, err, streamer.ErrNotHeld)
		})
	}
}
