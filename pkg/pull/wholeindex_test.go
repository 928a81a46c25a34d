package pull

import (
	"errors"
	"io"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/volume"
)

// A volume ready as its whole index is made a plain layer holding the
// same tree, whether this process knows the blob's layout (each file's
// data cloned from the blob where the filesystem clones) or not (copied
// from the mount); the copy keeps the index's sums (taken, not read: a sum
// kept wrong is the copy's too), and its stub tree. Only the layer it
// copied is swapped: a volume destroyed meanwhile keeps its layer, and
// nothing of the copy is left.
func TestMakePlain(t *testing.T) {
	testfs.Need(t)
	if err := IndexSupported(t.TempDir()); err != nil {
		t.Skip(err)
	}
	tests := []struct {
		name    string
		meddle  func(t *testing.T, s *cache.Store, r volume.Ref)
		wantErr error
	}{
		{name: "cloned by the layout read back from the image"},
		{name: "destroyed meanwhile", wantErr: cache.ErrUnusable,
			meddle: func(t *testing.T, s *cache.Store, r volume.Ref) { require.NoError(t, s.Destroy(r)) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			store, err := cache.Open(testfs.Mount(t, testfs.XFS, 1<<30)) // (a filesystem that clones)
			require.NoError(t, err)
			t.Cleanup(func() { store.Close() })
			v, _ := wholeIndex(t, store)
			data := store.DataPath(v)
			want := testfs.Describe(t, data)
			read, err := filesum.OfTree(t.Context(), data)
			require.NoError(t, err)
			table := maps.Collect(read.All())
			require.Contains(t, table, "big")
			table["big"] = filesum.Sum{7} // wrong: taken, not read
			require.NoError(t, filesum.TableOf(table).WriteFile(cache.SumsFile(data)))
			require.NoError(t, os.WriteFile(store.StubsPath(v), []byte("kept tree"), 0o600))
			w := NewWholeIndexes(store)
			if tc.meddle != nil {
				tc.meddle(t, store, v.Ref())
			}

			stats, err := w.MakePlain(t.Context(), v)
			require.ErrorIs(t, err, tc.wantErr)
			staged, lerr := os.ReadDir(store.StagingDir())
			require.NoError(t, lerr)
			require.Empty(t, staged)
			cur, gerr := store.Get(v.Ref())
			require.NoError(t, gerr)
			if tc.wantErr != nil {
				require.Equal(t, v.Layer, cur.Layer)
				left, err := os.ReadDir(store.VolumeDir(v.Ref()))
				require.NoError(t, err)
				var names []string
				for _, e := range left {
					names = append(names, e.Name())
				}
				require.ElementsMatch(t, []string{v.Layer, v.Layer + ".index", v.Layer + ".sums", v.Layer + ".stubs"}, names,
					"nothing of the copy is left")
				return
			}
			require.NotEqual(t, v.Layer, cur.Layer)
			require.Equal(t, []string{v.Layer}, cur.OldLayers, "the index goes once no view mounts it")
			plain := store.DataPath(cur)
			var st unix.Statfs_t
			require.NoError(t, unix.Statfs(plain, &st))
			require.NotEqualValues(t, unix.EROFS_SUPER_MAGIC_V1, st.Type, "a plain layer")
			require.Equal(t, want, testfs.Describe(t, plain))
			sums, err := store.LayerSums(cur)
			require.NoError(t, err)
			require.Equal(t, table, maps.Collect(sums.All()))
			kept, err := os.ReadFile(store.StubsPath(cur))
			require.NoError(t, err)
			require.Equal(t, "kept tree", string(kept))
			require.Positive(t, stats.Cloned, "files cloned out of the blob, by the layout in the image")
			require.Positive(t, stats.Files)
		})
	}
}

// blobOffsets reads the layout back from a whole index's image, and says
// no offset (the copy reads through the mount) where it cannot.
func TestBlobOffsets(t *testing.T) {
	testfs.Need(t)
	if err := IndexSupported(t.TempDir()); err != nil {
		t.Skip(err)
	}
	store := openStore(t)
	v, layout := wholeIndex(t, store)
	image := filepath.Join(cache.IndexDir(store.DataPath(v)), indexImage)
	at := blobOffsets(v, image)
	require.Positive(t, layout.Len())
	for i := range layout.Len() {
		e := layout.Extent(i)
		off, ok := at(e.Path)
		require.True(t, ok, e.Path)
		require.Equal(t, e.Offset, off, e.Path)
	}

	torn := filepath.Join(t.TempDir(), "torn")
	whole, err := os.ReadFile(image)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(torn, whole[:len(whole)/2], 0o600))
	for _, bad := range []string{torn, filepath.Join(t.TempDir(), "missing")} {
		_, ok := blobOffsets(v, bad)(layout.Extent(0).Path)
		require.False(t, ok, bad)
	}
}

// wholeIndex makes a ready volume of store whose layer is a whole index
// of testfs.LayerTree, mounted, taken down after the test.
func wholeIndex(t *testing.T, store *cache.Store) (cache.Volume, *index.Layout) {
	t.Helper()
	src := t.TempDir()
	testfs.LayerTree(t, src)
	root, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(root)

	id := cache.NewPullID()
	v, err := store.ReservePull(cache.Volume{Namespace: "ci", Handle: "indexed", Scope: volume.ScopeNamespace}, id)
	require.NoError(t, err)
	data := store.DataPath(v)
	t.Cleanup(func() { require.NoError(t, overlay.RemoveTree(store.VolumeDir(v.Ref()))) })
	require.NoError(t, os.MkdirAll(data, 0o755))
	dir := cache.IndexDir(data)
	require.NoError(t, os.Mkdir(dir, 0o700))
	image, err := os.Create(filepath.Join(dir, indexImage))
	require.NoError(t, err)
	layout, err := index.Build(root, image, index.Options{KeepSetuid: true})
	require.NoError(t, errors.Join(err, image.Close()))
	blob, err := os.Create(filepath.Join(dir, indexBlob))
	require.NoError(t, err)
	_, err = io.Copy(blob, io.NewSectionReader(index.Blob{Root: root, Layout: layout}, 0, layout.Size))
	require.NoError(t, errors.Join(err, blob.Close()))
	require.NoError(t, overlay.MountIndex(filepath.Join(dir, indexImage), filepath.Join(dir, indexBlob), data))
	_, err = store.CommitPullFilling(v.Ref(), id, layout.Size)
	require.NoError(t, err)
	v, err = store.Filled(v.Ref())
	require.NoError(t, err)
	return v, layout
}
