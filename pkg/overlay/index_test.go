package overlay

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/internal/indextest"
	"github.com/concourse/cowvol/internal/testfs"
)

// An index whose blob is whole becomes a plain tree of its own: the
// entries, bytes, owners, modes, times, xattrs, links and holes the mount
// shows, each file's data cloned from the blob where the filesystem
// clones (not a byte copied on XFS), and copied where it does not (ext4).
func TestCopyIndex(t *testing.T) {
	for _, kind := range []testfs.Kind{testfs.XFS, testfs.Ext4} {
		t.Run(string(kind), func(t *testing.T) {
			testfs.Need(t)
			fs := testfs.Mount(t, kind, 1<<30)
			layer, work, mnt := filepath.Join(fs, "layer"), filepath.Join(fs, "work"), filepath.Join(fs, "mnt")
			for _, d := range []string{layer, work, mnt} {
				require.NoError(t, os.Mkdir(d, 0o755))
			}
			testfs.LayerTree(t, layer)
			require.NoError(t, os.WriteFile(filepath.Join(layer, "tail"), bytes.Repeat([]byte("t"), 5000), 0o640))
			require.NoError(t, os.Link(filepath.Join(layer, "tail"), filepath.Join(layer, "sub", "tail-again")))
			sparse, err := os.Create(filepath.Join(layer, "holes"))
			require.NoError(t, err)
			_, err = sparse.WriteAt([]byte("head"), 0)
			require.NoError(t, err)
			_, err = sparse.WriteAt([]byte("middle"), 3<<20)
			require.NoError(t, err)
			require.NoError(t, sparse.Truncate(4<<20+10))
			require.NoError(t, sparse.Close())

			image, blob, layout := indextest.Whole(t, layer, work)
			err = MountIndex(image, blob, mnt)
			if errors.Is(err, ErrNoIndexMounts) {
				t.Skip(err)
			}
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, unix.Unmount(mnt, unix.MNT_DETACH)) })

			// A file of a block or more is cloned (its last block's part
			// copied), a smaller one copied: a block of the blob's, as
			// CopyIndex takes it.
			var blobSt unix.Stat_t
			require.NoError(t, unix.Stat(blob, &blobSt))
			withBlocks, underABlock := 0, 0
			for i := range layout.Len() {
				switch e := layout.Extent(i); {
				case e.Size >= int64(blobSt.Blksize):
					withBlocks++
				case e.Size > 0:
					underABlock++
				}
			}
			dst := filepath.Join(fs, "copy")
			stats, err := CopyIndex(t.Context(), mnt, blob, layout.Offset, dst)
			require.NoError(t, err)
			require.Equal(t, testfs.Describe(t, mnt), testfs.Describe(t, dst))
			require.Equal(t, extraNames(t, layer), stats.Links, "each file's names after its first, linked")
			if kind == testfs.XFS {
				require.Equal(t, int64(withBlocks), stats.Cloned, "every file of a block or more cloned from the blob")
				require.Equal(t, int64(underABlock), stats.Copied)
			} else {
				require.Zero(t, stats.Cloned)
				require.Equal(t, int64(withBlocks+underABlock), stats.Copied)
			}
			var st unix.Stat_t
			require.NoError(t, unix.Stat(filepath.Join(dst, "holes"), &st))
			require.Less(t, st.Blocks*512, int64(1<<20), "holes stay holes")
		})
	}
}

// extraNames counts the names of the regular files under dir after each
// one's first (a walk by descriptors: the layer's paths are long).
func extraNames(t *testing.T, dir string) int64 {
	t.Helper()
	root, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(root)
	names, inodes := int64(0), map[uint64]bool{}
	require.NoError(t, fdtree.Walk(root, fdtree.Visitor{Visit: func(e *fdtree.Entry) (bool, error) {
		if e.Stat.Mode&unix.S_IFMT == unix.S_IFREG {
			names++
			inodes[e.Stat.Ino] = true
		}
		return true, nil
	}}))
	return names - int64(len(inodes))
}

// A tree with an index mounted in it goes whole: the index is detached
// first (it is read-only, nothing under it is deleted), while any other
// mount under a tree being removed still stops the removal.
func TestRemoveTreeDetachesItsIndexes(t *testing.T) {
	testfs.Need(t)
	fs := testfs.Mount(t, testfs.XFS, 1<<30)
	layer, tree := filepath.Join(fs, "layer"), filepath.Join(fs, "tree")
	for _, d := range []string{layer, filepath.Join(tree, "layer.index"), filepath.Join(tree, "layer")} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	require.NoError(t, os.WriteFile(filepath.Join(layer, "f"), []byte("kept"), 0o644))
	image, blob, _ := indextest.Whole(t, layer, filepath.Join(tree, "layer.index"))
	err := MountIndex(image, blob, filepath.Join(tree, "layer"))
	if errors.Is(err, ErrNoIndexMounts) {
		t.Skip(err)
	}
	require.NoError(t, err)
	require.NoError(t, RemoveTree(tree))
	_, err = os.Lstat(tree)
	require.ErrorIs(t, err, os.ErrNotExist)
	mounts, err := MountsUnder(tree)
	require.NoError(t, err)
	require.Empty(t, mounts)

	bound := filepath.Join(fs, "bound")
	require.NoError(t, os.MkdirAll(filepath.Join(bound, "in"), 0o755))
	require.NoError(t, unix.Mount(layer, filepath.Join(bound, "in"), "", unix.MS_BIND, ""))
	t.Cleanup(func() { _ = unix.Unmount(filepath.Join(bound, "in"), unix.MNT_DETACH) })
	require.ErrorContains(t, RemoveTree(bound), "is mounted", "a bind mount is not a layer's index")
	data, err := os.ReadFile(filepath.Join(layer, "f"))
	require.NoError(t, err)
	require.Equal(t, "kept", string(data))
}
