package filesum

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A tree's table names each regular file's sum by its path, follows no
// symlink, and is kept and read back whole; a torn or rotted file of sums
// reads as none.
func TestTable(t *testing.T) {
	root := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(root, "d/e"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(root, "a"), []byte("alpha"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(root, "d/e/b"), []byte("beta"), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(root, "d/empty"), nil, 0o644))
	require.NoError(t, os.Symlink("/etc/passwd", filepath.Join(root, "link")))
	table, err := OfTree(t.Context(), root)
	require.NoError(t, err)
	require.Len(t, table, 3)
	want, err := Of(strings.NewReader("beta"))
	require.NoError(t, err)
	require.Equal(t, want, table["d/e/b"])
	require.NoError(t, Check(strings.NewReader("beta"), table["d/e/b"]))
	require.ErrorIs(t, Check(strings.NewReader("betA"), table["d/e/b"]), ErrMismatch)
	parsed, err := Parse(want.String())
	require.NoError(t, err)
	require.Equal(t, want, parsed)
	for _, bad := range []string{"", "xyz", strings.Repeat("g", 64), strings.Repeat("0", 63)} {
		_, err := Parse(bad)
		require.Error(t, err, "%q", bad)
	}

	kept := filepath.Join(t.TempDir(), "sums")
	require.NoError(t, table.WriteFile(kept))
	back, err := ReadFile(kept)
	require.NoError(t, err)
	require.Equal(t, table, back)
	raw, err := os.ReadFile(kept)
	require.NoError(t, err)
	for name, broken := range map[string][]byte{
		"torn":    raw[:len(raw)-7],
		"rotted":  bytes.Replace(raw, []byte("d/e/b"), []byte("d/e/c"), 1),
		"no head": raw[5:],
	} {
		require.NoError(t, os.WriteFile(kept, broken, 0o600))
		_, err := ReadFile(kept)
		require.ErrorIs(t, err, ErrBadFile, name)
	}
}

// What a layer's sums cost: a tree of 20,000 files, 1 GiB in all, on
// tmpfs (the page cache, as a layer a step just wrote is), read and summed
// once. The figure is the bytes summed a second, against reading them
// alone in the same run.
func BenchmarkOfTree(b *testing.B) {
	root := b.TempDir()
	if dir := os.Getenv("COWVOL_BENCH_TMPFS"); dir != "" {
		root = dir
	}
	const files, size = 20_000, 1 << 30
	buf := make([]byte, size/files)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	for i := range files {
		d := filepath.Join(root, fmt.Sprintf("d%03d", i/200))
		require.NoError(b, os.MkdirAll(d, 0o755))
		require.NoError(b, os.WriteFile(filepath.Join(d, fmt.Sprintf("f%05d", i)), buf, 0o644))
	}
	b.SetBytes(int64(files * len(buf)))
	b.ResetTimer()
	for range b.N {
		if _, err := OfTree(context.Background(), root); err != nil {
			b.Fatal(err)
		}
	}
}
