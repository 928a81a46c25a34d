package cache

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/volume"
)

// A pull reserves a creating volume that holds its base, commits it ready
// (synced or not, as the caller says), or aborts it leaving nothing; a restart drops a reservation
// whose pull died with the process.
func TestPullReservations(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "base", volume.Ref{}, volume.ScopeNamespace, nil)
	child := Volume{Namespace: "ci", Handle: "child", Parent: ref("ci", "base"), Base: ref("ci", "base"),
		Scope: volume.ScopeCluster, Properties: map[string]string{"k": "v"}}

	_, err := s.ReservePull(Volume{Namespace: "ci", Handle: "x", Base: ref("ci", "missing")}, "p0")
	require.ErrorIs(t, err, ErrNotReady, "a base must be here first")

	v, err := s.ReservePull(child, "p1")
	require.NoError(t, err)
	require.Equal(t, volume.StateCreating, v.State)
	_, err = s.ReservePull(child, "p2")
	require.ErrorIs(t, err, ErrExists, "one pull per volume")
	require.Equal(t, []volume.Ref{ref("ci", "child")}, s.Holders(ref("ci", "base")).Children, "the base is held while it is pulled")
	_, err = s.Publish(View{VolumeID: "v", Source: ref("ci", "child"), Pod: pod("ci")})
	require.ErrorIs(t, err, ErrNotReady, "nothing is published from a half-pulled volume")

	_, err = s.CommitPull(ref("ci", "child"), "p2", 10, 1, true)
	require.ErrorIs(t, err, ErrExists, "only the owning pull commits")
	require.NoError(t, os.MkdirAll(s.DataPath(v), 0o755))
	got, err := s.CommitPull(ref("ci", "child"), "p1", 10, 1, false)
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, got.State)
	require.False(t, got.Synced, "committed before its data was synced")
	require.Contains(t, s.Unsynced(), ref("ci", "child"), "the next sync round covers it")
	require.Equal(t, map[string]string{"k": "v"}, got.Properties)
	require.Equal(t, volume.ScopeCluster, got.Scope)

	// An aborted pull leaves nothing; the handle backs off once told to.
	other, err := s.ReservePull(Volume{Namespace: "ci", Handle: "other", Scope: volume.ScopeNamespace}, "p3")
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(other), 0o755))
	require.NoError(t, s.AbortPull(ref("ci", "other"), "p3", os.RemoveAll))
	_, err = s.Get(ref("ci", "other"))
	require.ErrorIs(t, err, ErrNotFound)
	require.NoDirExists(t, s.VolumeDir(ref("ci", "other")))
	require.NoError(t, s.CheckBackoff(ref("ci", "other")))
	require.NoError(t, s.NoteFailure(ref("ci", "other")))
	require.ErrorIs(t, s.CheckBackoff(ref("ci", "other")), ErrBackoff)
	_, err = s.ReservePull(Volume{Namespace: "ci", Handle: "other"}, "p4")
	require.ErrorIs(t, err, ErrBackoff)

	// A reservation a crash left is dropped by recovery, its data too.
	dead, err := s.ReservePull(Volume{Namespace: "ci", Handle: "dead", Base: ref("ci", "base")}, "p5")
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(dead), 0o755))
	rep, err := s.Recover(os.RemoveAll, false)
	require.NoError(t, err)
	require.Equal(t, 1, rep.DroppedReservations)
	_, err = s.Get(ref("ci", "dead"))
	require.ErrorIs(t, err, ErrNotFound)
	require.NoDirExists(t, s.VolumeDir(ref("ci", "dead")))
	require.Equal(t, []volume.Ref{ref("ci", "child")}, s.Holders(ref("ci", "base")).Children, "the dead pull let go of the base")

	// The pulled child, still unsynced, survives a restart of the plugin
	// (its data is in the page cache), and a reboot fails it: it may be
	// torn, and is pulled again.
	got, err = s.Get(ref("ci", "child"))
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, got.State)
	_, err = s.Recover(os.RemoveAll, true)
	require.NoError(t, err)
	got, err = s.Get(ref("ci", "child"))
	require.NoError(t, err)
	require.Equal(t, volume.StateFailed, got.State)
}

// A layer its holder keeps only as a base (destroyed there) is pulled
// destroyed, and what stacks on it is pulled over it: its data stays for
// its child, and it is never a source of its own.
func TestPullOverADestroyedBase(t *testing.T) {
	s := openStore(t)
	base, err := s.ReservePull(Volume{Namespace: "ci", Handle: "old-version", Scope: volume.ScopeNamespace, DestroyOnCommit: true}, "p1")
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(base), 0o755))
	got, err := s.CommitPull(base.Ref(), "p1", 10, 1, true)
	require.NoError(t, err)
	require.Equal(t, volume.StateDestroying, got.State, "destroyed, as its holder has it")
	child, err := s.ReservePull(Volume{Namespace: "ci", Handle: "new-version", Base: base.Ref(), Scope: volume.ScopeNamespace}, "p2")
	require.NoError(t, err, "stacked on the destroyed base")
	require.Equal(t, []volume.Ref{child.Ref()}, s.Holders(base.Ref()).Children, "which its child holds from now on")
	require.NoError(t, os.MkdirAll(s.DataPath(child), 0o755))
	_, err = s.CommitPull(child.Ref(), "p2", 10, 1, true)
	require.NoError(t, err)
	dirs, err := s.Chain(child.Ref())
	require.NoError(t, err)
	require.Len(t, dirs, 2)
	_, err = s.Publish(View{VolumeID: "v", Source: base.Ref(), Pod: pod("ci")})
	require.ErrorIs(t, err, ErrNotFound, "the destroyed base is no source")
}
