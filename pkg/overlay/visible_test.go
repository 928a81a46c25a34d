package overlay

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/filesum"
)

// VisibleFiles is what a real overlay of the chain shows: each way a layer
// hides what is below it (a whiteout, a file over a dir, a dir over a
// file, an opaque dir, a symlink over a dir), and a dir merging with a dir.
func TestVisibleFiles(t *testing.T) {
	testfs.Need(t) // whiteouts are device nodes, opaque marks trusted xattrs, and the check mounts
	root := t.TempDir()
	type entry struct{ path, kind, data string }
	layers := [][]entry{
		{ // the top
			{"a", "file", "alpha, changed"},
			{"e", "dir", ""}, {"e/top", "file", "over a file over a dir"},
			{"n", "whiteout", ""},
			{"f", "dir", ""}, {"f/deep", "dir", ""}, {"f/deep/g2", "file", "new beneath an opaque dir"},
			{"d", "dir", ""}, {"d/y", "file", "changed again"},
		},
		{
			{"d", "dir", ""}, {"d/x", "whiteout", ""}, {"d/y", "file", "changed"},
			{"e", "file", "a file over a dir"},
			{"f", "opaque", ""}, {"f/new", "file", "in an opaque dir"},
			{"h", "dir", ""}, {"h/in", "file", "a dir over a file"},
			{"k", "symlink", "/elsewhere"},
			{"n", "file", "whited out above"},
			{"w", "whiteout", ""},
		},
		{ // the lowest
			{"a", "file", "alpha"},
			{"d", "dir", ""}, {"d/x", "file", "x"}, {"d/y", "file", "y"}, {"d/z", "file", "kept"},
			{"e", "dir", ""}, {"e/z", "file", "under a file"},
			{"f", "dir", ""}, {"f/deep", "dir", ""}, {"f/deep/g", "file", "under an opaque dir"},
			{"h", "file", "under a dir"},
			{"k", "dir", ""}, {"k/m", "file", "under a symlink"},
			{"w", "dir", ""}, {"w/1", "file", "under a whiteout"},
			{"same", "file", "the same bytes"}, {"same-again", "file", "the same bytes"},
		},
	}
	var dirs []string
	var tables []*filesum.Table
	for i, entries := range layers {
		dir := filepath.Join(root, "l"+string(rune('0'+i)))
		require.NoError(t, os.Mkdir(dir, 0o755))
		for _, e := range entries {
			p := filepath.Join(dir, e.path)
			switch e.kind {
			case "file":
				require.NoError(t, os.WriteFile(p, []byte(e.data), 0o644))
			case "dir":
				require.NoError(t, os.Mkdir(p, 0o755))
			case "opaque":
				require.NoError(t, os.Mkdir(p, 0o755))
				require.NoError(t, unix.Lsetxattr(p, opaqueXattr, []byte("y"), 0))
			case "whiteout":
				require.NoError(t, unix.Mknod(p, unix.S_IFCHR|0o000, 0))
			case "symlink":
				require.NoError(t, os.Symlink(e.data, p))
			}
		}
		table, err := filesum.OfTree(t.Context(), dir)
		require.NoError(t, err)
		dirs, tables = append(dirs, dir), append(tables, table)
	}

	got, err := VisibleFiles(t.Context(), dirs, tables)
	require.NoError(t, err)

	mnt := filepath.Join(root, "mnt")
	require.NoError(t, os.Mkdir(mnt, 0o755))
	m := NewSysMounter()
	require.NoError(t, m.Overlay(mnt, dirs, "", "", Attrs{ReadOnly: true}))
	t.Cleanup(func() { _ = m.Unmount(mnt) })
	shown, err := filesum.OfTree(context.Background(), mnt)
	require.NoError(t, err)
	visible := maps.Collect(got.All())
	require.Equal(t, maps.Collect(shown.All()), visible)
	require.Equal(t, shown.Digest(), got.Digest())
	require.Contains(t, visible, "f/deep/g2")
	require.Contains(t, visible, "d/z")
	require.NotContains(t, visible, "e/z")

	one, err := VisibleFiles(t.Context(), dirs[2:], tables[2:])
	require.NoError(t, err)
	require.Equal(t, maps.Collect(tables[2].All()), maps.Collect(one.All()), "a chain of one is its own table")
	_, err = VisibleFiles(t.Context(), dirs, tables[1:])
	require.Error(t, err)
}
