package overlay

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
)

// idmapLayers makes a two-layer chain (top first) on a filesystem of kind.
func idmapLayers(t *testing.T, kind testfs.Kind) (root string, lowers []string) {
	t.Helper()
	root = testfs.Mount(t, kind, 512<<20)
	for i, files := range []map[string]string{{"top": "2"}, {"bottom": "1", "top": "1"}} {
		l := filepath.Join(root, "layer", string(rune('a'+i)))
		require.NoError(t, os.MkdirAll(l, 0o755))
		for name, data := range files {
			require.NoError(t, os.WriteFile(filepath.Join(l, name), []byte(data), 0o644))
		}
		lowers = append(lowers, l)
	}
	return root, lowers
}

// A pod with a user namespace of its own has every volume mount idmapped
// by its runtime; the kernel cannot idmap an overlay mount. So its views
// are binds of plain trees, and where the backend has none to give the
// publish says so.
func TestIdmappedViews(t *testing.T) {
	testfs.Need(t, "mkfs.xfs")
	m := NewSysMounter()
	tests := []struct {
		name     string
		kind     Kind
		readOnly bool
		lowers   int
		idmapped bool
		wantErr  error // from Prepare
		// wantIdmap says whether the runtime could idmap the view.
		wantIdmap bool
	}{
		{"overlay view as today cannot be idmapped (the runtime's StartError)", KindOverlay, false, 2, false, nil, false},
		{"overlay read-only chain as today cannot either", KindOverlay, true, 2, false, nil, false},
		{"overlay refuses a writable view to be idmapped", KindOverlay, false, 1, true, ErrNotIdmappable, false},
		{"overlay refuses a read-only chain to be idmapped", KindOverlay, true, 2, true, ErrNotIdmappable, false},
		{"overlay read-only single layer is a bind", KindOverlay, true, 1, true, nil, true},
		{"overlay empty volume is a bind", KindOverlay, false, 0, true, nil, true},
		{"reflink writable clone", KindReflink, false, 2, true, nil, true},
		{"reflink read-only chain is a clone of its own", KindReflink, true, 2, true, nil, true},
		{"reflink read-only chain otherwise stays an overlay", KindReflink, true, 2, false, nil, false},
		{"copy read-only chain is a copy of its own", KindCopy, true, 2, true, nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			root, lowers := idmapLayers(t, testfs.XFS)
			lowers = lowers[len(lowers)-tc.lowers:]
			b, err := New(tc.kind, m, nil)
			require.NoError(t, err)
			target := filepath.Join(root, "target")
			require.NoError(t, os.Mkdir(target, 0o755))
			s := Spec{Dir: filepath.Join(root, "view"), Target: target, Lowers: lowers,
				Attrs: Attrs{ReadOnly: tc.readOnly}, Idmapped: tc.idmapped}
			err = b.Prepare(context.Background(), s)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, Unmount(m, s)) })
			if tc.lowers > 0 {
				data, err := os.ReadFile(filepath.Join(target, "top"))
				require.NoError(t, err)
				want := map[int]string{1: "1", 2: "2"}[tc.lowers] // the bottom layer alone, or the merge
				require.Equal(t, want, string(data), "the merged view")
			}
			if tc.readOnly {
				require.ErrorIs(t, os.WriteFile(filepath.Join(target, "new"), nil, 0o644), unix.EROFS)
			}
			err = testfs.Idmap(t, target)
			if tc.wantIdmap {
				require.NoError(t, err)
			} else {
				require.ErrorIs(t, err, unix.EINVAL)
			}
			require.NoError(t, Unmount(m, s))
			require.NoError(t, b.Prepare(context.Background(), s), "a restarted plugin mounts it the same way")
			require.Equal(t, tc.wantIdmap, testfs.Idmap(t, target) == nil)
		})
	}
}
