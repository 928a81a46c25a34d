package cache

import (
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/volume"
)

// A layer's sums are computed once and kept beside it: read back after a
// change to the layer (they are the capture's, not the disk's now), kept by
// recovery with their layer, and dropped by it when their layer is not the
// volume's.
func TestLayerSumsAreKeptWithTheirLayer(t *testing.T) {
	s := openStore(t)
	v := ready(t, s, "ci", "summed", volume.Ref{}, volume.ScopeNamespace, nil)
	require.NoError(t, os.WriteFile(filepath.Join(s.DataPath(v), "f"), []byte("captured"), 0o644))
	sums, err := s.LayerSums(v)
	require.NoError(t, err)
	want, err := filesum.OfTree(t.Context(), s.DataPath(v))
	require.NoError(t, err)
	require.Equal(t, maps.Collect(want.All()), maps.Collect(sums.All()))

	require.NoError(t, os.WriteFile(filepath.Join(s.DataPath(v), "f"), []byte("rotted!!"), 0o644))
	s.sums = newSumsCache() // as after a restart: read from the file, not computed
	again, err := s.LayerSums(v)
	require.NoError(t, err)
	require.Equal(t, maps.Collect(want.All()), maps.Collect(again.All()), "the capture's sums, not the disk's now")

	kept := s.StubsPath(v)
	require.NoError(t, os.WriteFile(kept, []byte("its stub tree"), 0o600))
	for _, stray := range []string{
		s.sumsPath(v.Ref(), "not-a-layer"),
		s.LayerPath(v.Ref(), "not-a-layer") + stubsSuffix,
		kept + ".tmp123", // a kept stub tree a crash left half written
	} {
		require.NoError(t, os.WriteFile(stray, []byte("x"), 0o600))
	}
	rep, err := s.Recover(os.RemoveAll, false)
	require.NoError(t, err)
	require.Equal(t, 3, rep.RemovedOrphans, "the sums and stub tree of no layer, and a stub tree half kept")
	for _, own := range []string{s.sumsPath(v.Ref(), v.Layer), kept} {
		_, err = os.Stat(own)
		require.NoError(t, err, "the layer's own sums and stub tree stay")
	}
}

// A layer's sums are read back from the file they were written to as the
// layer was walked, their sums left there (a file gone under them answers
// none); sums that cannot be written (a full disk, here a dir in their
// place) are still answered, from memory: the node goes on serving what it
// holds.
func TestLayerSumsLeftInTheirFile(t *testing.T) {
	for _, tc := range []struct {
		name         string
		cannotBeKept bool
	}{
		{"kept", false},
		{"cannot be kept", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t)
			v := ready(t, s, "ci", "summed", volume.Ref{}, volume.ScopeNamespace, nil)
			require.NoError(t, os.WriteFile(filepath.Join(s.DataPath(v), "f"), []byte("data"), 0o644))
			path := s.sumsPath(v.Ref(), v.Layer)
			if tc.cannotBeKept {
				require.NoError(t, os.MkdirAll(filepath.Join(path, "in-the-way"), 0o755))
			}
			sums, err := s.LayerSums(v)
			require.NoError(t, err)
			require.Equal(t, 1, sums.Len())
			want, err := filesum.Of(strings.NewReader("data"))
			require.NoError(t, err)

			require.NoError(t, os.RemoveAll(path))
			got, ok := sums.Sum("f")
			if tc.cannotBeKept {
				require.True(t, ok, "held in memory")
				require.Equal(t, want, got)
			} else {
				require.False(t, ok, "read from the file, which is gone")
			}
		})
	}
}

// A new layer's name is one path element, never taken for what lies
// beside a layer (which recovery keeps only with its layer), and never an
// earlier layer's of the same volume.
func TestNewLayerNames(t *testing.T) {
	now := time.Now()
	seen := map[string]bool{}
	for _, kind := range []LayerKind{LayerCaptured, LayerPulled, LayerFlattened} {
		name := NewLayerName(kind, now)
		require.Equal(t, filepath.Base(name), name)
		require.Empty(t, layerBeside(name), "%s is not beside a layer", name)
		require.Equal(t, byte(kind), name[0], "its kind starts it")
		require.False(t, seen[name])
		seen[name] = true
		require.NotEqual(t, name, NewLayerName(kind, now.Add(time.Nanosecond)), "a later layer of its kind")
	}
}
