package overlay

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
)

// TestSubdirLayers: which layers' rootfs/ stack into what the chain shows
// at rootfs/, for each way an upper layer can hide the ones below.
func TestSubdirLayers(t *testing.T) {
	testfs.Need(t) // whiteouts are device nodes, opaque marks trusted xattrs
	type layer func(t *testing.T, dir string)
	dir := func(t *testing.T, d string) { require.NoError(t, os.Mkdir(filepath.Join(d, "rootfs"), 0o755)) }
	none := func(t *testing.T, d string) {}
	whiteout := func(t *testing.T, d string) {
		require.NoError(t, unix.Mknod(filepath.Join(d, "rootfs"), unix.S_IFCHR|0o000, 0))
	}
	opaqueDir := func(t *testing.T, d string) {
		dir(t, d)
		require.NoError(t, unix.Lsetxattr(filepath.Join(d, "rootfs"), "trusted.overlay.opaque", []byte("y"), 0))
	}
	file := func(t *testing.T, d string) {
		require.NoError(t, os.WriteFile(filepath.Join(d, "rootfs"), nil, 0o644))
	}
	tests := []struct {
		name    string
		layers  []layer // top first
		want    []int   // indexes of the layers whose rootfs/ stacks
		wantErr bool
	}{
		{name: "one layer", layers: []layer{dir}, want: []int{0}},
		{name: "every layer", layers: []layer{dir, dir, dir}, want: []int{0, 1, 2}},
		{name: "layers without it are passed over", layers: []layer{none, dir, none, dir}, want: []int{1, 3}},
		{name: "a whiteout hides what is below", layers: []layer{dir, whiteout, dir}, want: []int{0}},
		{name: "an opaque dir is the last", layers: []layer{dir, opaqueDir, dir}, want: []int{0, 1}},
		{name: "a file in its place hides what is below", layers: []layer{dir, file, dir}, want: []int{0}},
		{name: "whited out at the top", layers: []layer{whiteout, dir}, wantErr: true},
		{name: "in no layer", layers: []layer{none, none}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var chain, want []string
			for _, mk := range tt.layers {
				d := t.TempDir()
				mk(t, d)
				chain = append(chain, d)
			}
			for _, i := range tt.want {
				want = append(want, filepath.Join(chain[i], "rootfs"))
			}
			got, err := SubdirLayers(chain, "rootfs")
			if tt.wantErr {
				assert.ErrorIs(t, err, os.ErrNotExist)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, want, got)
		})
	}
	for _, bad := range []string{"", ".", "..", "a/b"} {
		_, err := SubdirLayers([]string{t.TempDir()}, bad)
		assert.Error(t, err, bad)
	}
}
