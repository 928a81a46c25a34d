package pull

import (
	"errors"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/overlay"
)

// Lazy pulls mount indexes only where asked and where the node can; a
// node that cannot (a kernel without file-backed EROFS, which no machine
// here lacks: the probe's answer is given) makes stub trees and says why.
func TestChooseIndex(t *testing.T) {
	noMounts := errors.Join(overlay.ErrNoIndexMounts, errors.New("no such device"))
	tests := []struct {
		name      string
		asked     bool
		probe     error
		wantIndex bool
		wantWhy   string
	}{
		{name: "not asked", asked: false, probe: noMounts, wantIndex: false, wantWhy: ""},
		{name: "asked, and the kernel can", asked: true, wantIndex: true, wantWhy: "; as indexes mounted file-backed (EROFS), not stub trees"},
		{name: "asked, and the kernel cannot", asked: true, probe: noMounts, wantIndex: false,
			wantWhy: "; as stub trees, not indexes: " + noMounts.Error()},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			probed := false
			index, why := chooseIndex(tc.asked, func() error { probed = true; return tc.probe })
			require.Equal(t, tc.wantIndex, index)
			require.Equal(t, tc.wantWhy, why)
			require.Equal(t, tc.asked, probed, "probed only where asked")
		})
	}
}

// The probe mounts an index on this machine's kernel (6.12 and later with
// file-backed EROFS), as root, and leaves nothing behind.
func TestIndexSupported(t *testing.T) {
	testfs.Need(t)
	dir := t.TempDir()
	err := IndexSupported(dir)
	if errors.Is(err, overlay.ErrNoIndexMounts) {
		t.Skip(err)
	}
	require.NoError(t, err)
	mounts, err := overlay.MountsUnder(dir)
	require.NoError(t, err)
	require.Empty(t, mounts)
	left, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, left)
}

// A lazily pulled layer, filled (here: copied out of a whole index), is
// summed from the sums its data was checked against (here: its layout's),
// not read (a sum said wrong shows it was taken), and kept only where the
// table comes out as the digest its stub tree carried: else the layer is
// refused, and nothing is kept; with no digest known it is left to be
// read when asked.
func TestKeepLayerSums(t *testing.T) {
	tree := t.TempDir()
	for name, data := range map[string]string{"a": "alpha", "b": "beta", "empty": ""} {
		require.NoError(t, os.WriteFile(filepath.Join(tree, name), []byte(data), 0o644))
	}
	require.NoError(t, os.Link(filepath.Join(tree, "b"), filepath.Join(tree, "c")))
	table, err := filesum.OfTree(t.Context(), tree)
	require.NoError(t, err)
	read := maps.Collect(table.All())
	rotted := maps.Clone(read)
	rotted["b"], rotted["c"] = filesum.Sum{1}, filesum.Sum{1}
	// What a layout of a and b says (the hard link c, and the empty
	// file, have no extent of their own).
	layout := func(sums map[string]filesum.Sum) func(string) (filesum.Sum, bool) {
		return func(path string) (filesum.Sum, bool) {
			sum, ok := sums[path]
			return sum, ok && (path == "a" || path == "b")
		}
	}
	tests := []struct {
		name    string
		layout  func(string) (filesum.Sum, bool)
		files   filesum.Sum
		want    map[string]filesum.Sum // kept; nil: none
		wantErr error
	}{
		{name: "the records' table", layout: layout(read), files: table.Digest(), want: read},
		{name: "a layout that does not say every sum", layout: layout(map[string]filesum.Sum{"a": read["a"]}), files: table.Digest(), want: read},
		{name: "sums taken, not read", layout: layout(rotted), files: filesum.TableOf(rotted).Digest(), want: rotted},
		{name: "not the records' table", layout: layout(rotted), files: table.Digest(), wantErr: filesum.ErrMismatch},
		{name: "no digest known", layout: layout(read)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sums := filepath.Join(t.TempDir(), "layer.sums")
			require.ErrorIs(t, keepLayerSums(t.Context(), tree, tc.layout, tc.files, sums), tc.wantErr)
			got, err := filesum.ReadFile(sums)
			if tc.want == nil {
				require.ErrorIs(t, err, fs.ErrNotExist, "nothing kept")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, maps.Collect(got.All()))
		})
	}
}
