package snapshotter

import (
	"context"
	"flag"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"
	"github.com/containerd/errdefs"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/image"
	"github.com/concourse/cowvol/pkg/volume"
)

// noVolumes is a node that holds no image volume: what every snapshot
// but a remote layer's meets.
type noVolumes struct{}

func (noVolumes) ImageRootfs(string, string, volume.Ref, string) ([]string, error) {
	return nil, errdefs.ErrNotFound
}
func (noVolumes) ReleaseImage(string) error { return nil }
func (noVolumes) ImageHolders() []string    { return nil }

// TestContainerdSuite runs containerd's snapshotter conformance suite
// against the cowvol snapshotter: every snapshot that is not a remote
// layer must behave exactly as containerd's overlay snapshotter's does.
func TestContainerdSuite(t *testing.T) {
	testfs.Need(t)
	// The suite's mounts ask for containerd's root flag.
	require.NoError(t, flag.Set("test.root", "true"))
	var key image.LayerKey
	// The name selects what the suite expects of an overlayfs
	// snapshotter: renaming a lower layer's dir fails (EXDEV) without
	// redirect_dir, as under containerd's own.
	testsuite.SnapshotterSuite(t, "overlayfs", func(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
		s, err := New(ctx, root, image.NewPullGrants(key, time.Minute), noVolumes{})
		if err != nil {
			return nil, nil, err
		}
		return s, s.Close, nil
	})
}
