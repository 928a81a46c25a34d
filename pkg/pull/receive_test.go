package pull

import (
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// A received layer whose extraction said its table (Limits.Tabled) keeps
// it beside it as its sums, read as the layer's from then on without
// reading the layer (a table that is not what the layer holds shows it
// was not); one that said none keeps none, its sums read from the layer
// when asked; and one that failed leaves neither.
func TestReceiveKeepsTheTableItChecked(t *testing.T) {
	store := openStore(t)
	said := filesum.TableOf(map[string]filesum.Sum{"file": {1}}) // not "data"'s sum: taken, not read
	tests := []struct {
		name    string
		table   *filesum.Table
		fails   error
		want    *filesum.Table
		wantErr error
	}{
		{name: "a table said", table: said, want: said},
		{name: "none said"},
		{name: "the extraction failed", table: said, fails: streamer.ErrCorrupt, wantErr: streamer.ErrCorrupt},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l := streamer.Layer{Ref: volume.Ref{Namespace: "ci", Handle: filepath.Base(t.Name())}, Scope: volume.ScopeNamespace}
			commit := func(v cache.Volume, id, _ string, synced bool) (cache.Volume, error) {
				return store.CommitPull(v.Ref(), id, 4, -1, synced)
			}
			vol, err := Receive(store, overlay.KindOverlay, l, volume.Digests{}, cache.NewPullID(), func(tree, _ string) (streamer.Summary, error) {
				if err := os.WriteFile(filepath.Join(tree, "file"), []byte("data"), 0o644); err != nil {
					return streamer.Summary{}, err
				}
				return streamer.Summary{Table: tc.table}, tc.fails
			}, commit, SyncBefore)
			require.ErrorIs(t, err, tc.wantErr)
			if tc.wantErr != nil {
				left, err := filepath.Glob(filepath.Join(store.StagingDir(), "*"))
				require.NoError(t, err)
				require.Empty(t, left, "nothing of the layer staged")
				return
			}
			sums, err := store.LayerSums(vol)
			require.NoError(t, err)
			read, err := filesum.OfTree(t.Context(), store.DataPath(vol))
			require.NoError(t, err)
			if tc.want == nil {
				require.Equal(t, maps.Collect(read.All()), maps.Collect(sums.All()), "read from the layer")
				return
			}
			require.Equal(t, maps.Collect(tc.want.All()), maps.Collect(sums.All()))
			kept, err := filesum.ReadFile(cache.SumsFile(store.DataPath(vol)))
			require.NoError(t, err)
			require.Equal(t, maps.Collect(tc.want.All()), maps.Collect(kept.All()), "kept beside the layer")
		})
	}
}

// openStore opens a node store in a dir of the test's, closed after it.
func openStore(t *testing.T) *cache.Store {
	t.Helper()
	store, err := cache.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	return store
}
