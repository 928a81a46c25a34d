package snapshotter

import (
	"os"
	"testing"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStack: a remote layer's empty dir is replaced by the volume's dirs
// wherever containerd's overlay snapshotter names it, and nothing else is
// touched.
func TestStack(t *testing.T) {
	dirs := map[string][]string{
		"/sn/snapshots/1/fs": {"/cache/b/rootfs", "/cache/a/rootfs"},
		"/sn/snapshots/7/fs": {"/cache/c/rootfs"},
	}
	tests := []struct {
		name string
		in   mount.Mount
		want mount.Mount
	}{
		{
			name: "a container over the remote layer",
			in: mount.Mount{Type: "overlay", Source: "overlay",
				Options: []string{"workdir=/sn/snapshots/2/work", "upperdir=/sn/snapshots/2/fs", "lowerdir=/sn/snapshots/1/fs", "index=off"}},
			want: mount.Mount{Type: "overlay", Source: "overlay",
				Options: []string{"workdir=/sn/snapshots/2/work", "upperdir=/sn/snapshots/2/fs", "lowerdir=/cache/b/rootfs:/cache/a/rootfs", "index=off"}},
		},
		{
			name: "layers over the remote layer keep their place",
			in:   mount.Mount{Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/sn/snapshots/3/fs:/sn/snapshots/1/fs"}},
			want: mount.Mount{Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/sn/snapshots/3/fs:/cache/b/rootfs:/cache/a/rootfs"}},
		},
		{
			name: "a view of a remote layer of several dirs",
			in:   mount.Mount{Type: "bind", Source: "/sn/snapshots/1/fs", Options: []string{"ro", "rbind"}},
			want: mount.Mount{Type: "overlay", Source: "overlay", Options: []string{"ro", "lowerdir=/cache/b/rootfs:/cache/a/rootfs"}},
		},
		{
			name: "a view of a remote layer of one dir",
			in:   mount.Mount{Type: "bind", Source: "/sn/snapshots/7/fs", Options: []string{"ro", "rbind"}},
			want: mount.Mount{Type: "bind", Source: "/cache/c/rootfs", Options: []string{"ro", "rbind"}},
		},
		{
			name: "an ordinary snapshot",
			in:   mount.Mount{Type: "bind", Source: "/sn/snapshots/9/fs", Options: []string{"rw", "rbind"}},
			want: mount.Mount{Type: "bind", Source: "/sn/snapshots/9/fs", Options: []string{"rw", "rbind"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := tt.in
			in.Options = append([]string(nil), tt.in.Options...)
			assert.Equal(t, []mount.Mount{tt.want}, stack([]mount.Mount{in}, dirs))
			assert.Equal(t, tt.in.Options, in.Options, "the mounts given are not changed")
		})
	}
	assert.Equal(t, []mount.Mount{{Type: "bind", Source: "/x"}}, stack([]mount.Mount{{Type: "bind", Source: "/x"}}, nil))
}

// TestDocumentedConfig: the containerd config docs/step-images.md shows is
// the one the e2e and the bench run.
func TestDocumentedConfig(t *testing.T) {
	readme, err := os.ReadFile("../../docs/step-images.md")
	require.NoError(t, err)
	assert.Contains(t, string(readme), "```toml\n"+ContainerdConfig("/run/cowvol/snapshotter.sock", "linux/amd64")+"```\n")
}
