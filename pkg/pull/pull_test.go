package pull

import (
	"fmt"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

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

// A failure to pull a layer the namespace may not name says what kind of
// failure it was, never the peer's words (which name the layer), and still
// unwraps to its cause for the pull's decisions.
func TestHiddenLayerErrors(t *testing.T) {
	peerSaid := func(code codes.Code) error {
		return fmt.Errorf("peer: volume other/secret-base is not held here: %w", &streamer.PeerError{Code: code})
	}
	tests := []struct {
		name  string
		cause error
		want  string
		is    error
	}{
		{"a full disk here", fmt.Errorf("writing: %w", syscall.ENOSPC), "pulling a volume other/shared-top stacks on: no space left on device", syscall.ENOSPC},
		{"gone from the peer", peerSaid(codes.NotFound), "pulling a volume other/shared-top stacks on: its holder no longer has it", nil},
		{"corrupt", fmt.Errorf("%w: bad digest of other/secret-base", streamer.ErrCorrupt), "pulling a volume other/shared-top stacks on: " + streamer.ErrCorrupt.Error(), streamer.ErrCorrupt},
		{"anything else", peerSaid(codes.Internal), "pulling a volume other/shared-top stacks on: failed (the node plugin's log says why)", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := hiddenLayerError{layer: "a volume other/shared-top stacks on", err: tc.cause}
			require.Equal(t, tc.want, err.Error())
			require.NotContains(t, err.Error(), "secret-base")
			require.ErrorIs(t, err, tc.cause)
			if tc.is != nil {
				require.ErrorIs(t, err, tc.is)
			}
		})
	}
}
