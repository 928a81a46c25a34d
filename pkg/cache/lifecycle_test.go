package cache

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/volume"
)

var (
	owner    = viewLease("csi-1")
	stranger = Lease{Kind: LeasePull, ID: "pull-9"}
)

// volumeIn is a volume of namespace ci in state st; hidden marks it
// destroyed while it was being made or filled.
func volumeIn(st volume.State, hidden bool) Volume {
	v := Volume{Namespace: "ci", Handle: "h", State: st, Scope: volume.ScopeNamespace, DestroyOnCommit: hidden}
	if st == volume.StateCreating {
		v.Lease = owner
	}
	return v
}

// Every event from every state: where it leads, or that it is refused.
func TestTransitions(t *testing.T) {
	const (
		creating   = volume.StateCreating
		filling    = volume.StateFilling
		ready      = volume.StateReady
		failed     = volume.StateFailed
		destroying = volume.StateDestroying
	)
	tests := []struct {
		name       string
		from       volume.State
		hidden     bool
		ev         Event
		by         Lease
		want       volume.State
		wantHidden bool
		wantErr    error
	}{
		{name: "commit by the owner", from: creating, ev: EventCommit, by: owner, want: ready},
		{name: "commit of one destroyed meanwhile", from: creating, hidden: true, ev: EventCommit, by: owner, want: destroying, wantHidden: true},
		{name: "commit by another", from: creating, ev: EventCommit, by: stranger, want: creating, wantErr: ErrExists},
		{name: "commit of a ready volume", from: ready, ev: EventCommit, by: owner, want: ready, wantErr: ErrExists},
		{name: "commit of a filling volume", from: filling, ev: EventCommit, by: owner, want: filling, wantErr: ErrExists},
		{name: "lazy commit by the owner", from: creating, ev: EventCommitFilling, by: owner, want: filling},
		{name: "lazy commit of one destroyed meanwhile stays hidden while it fills", from: creating, hidden: true,
			ev: EventCommitFilling, by: owner, want: filling, wantHidden: true},
		{name: "lazy commit by another", from: creating, ev: EventCommitFilling, by: stranger, want: creating, wantErr: ErrExists},
		{name: "filled", from: filling, ev: EventFilled, want: ready},
		{name: "filled after a destroy", from: filling, hidden: true, ev: EventFilled, want: destroying, wantHidden: true},
		{name: "filled when not filling", from: ready, ev: EventFilled, want: ready, wantErr: ErrUnusable},
		{name: "filled after failing", from: failed, ev: EventFilled, want: failed, wantErr: ErrUnusable},
		{name: "filled while being made", from: creating, ev: EventFilled, want: creating, wantErr: ErrUnusable},
		{name: "fail a ready volume", from: ready, ev: EventFail, want: failed},
		{name: "fail a filling volume", from: filling, ev: EventFail, want: failed},
		{name: "fail a failed volume", from: failed, ev: EventFail, want: failed},
		{name: "fail a destroyed volume", from: destroying, ev: EventFail, want: destroying},
		{name: "fail a reservation", from: creating, ev: EventFail, want: creating, wantErr: ErrNotReady},
		{name: "destroy a ready volume", from: ready, ev: EventDestroy, want: destroying},
		{name: "destroy a failed volume", from: failed, ev: EventDestroy, want: destroying},
		{name: "destroy a destroyed volume", from: destroying, ev: EventDestroy, want: destroying},
		{name: "destroy a reservation", from: creating, ev: EventDestroy, want: creating, wantHidden: true},
		{name: "destroy a filling volume", from: filling, ev: EventDestroy, want: filling, wantHidden: true},
		{name: "an unknown event", from: ready, ev: "melt", want: ready, wantErr: errUnknownEvent},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v := volumeIn(tc.from, tc.hidden)
			err := v.apply(tc.ev, tc.by)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
			} else {
				require.NoError(t, err)
			}
			require.Equal(t, tc.want, v.State)
			require.Equal(t, tc.wantHidden || tc.want == destroying, v.Hidden(), "hidden")
			if err == nil && (tc.ev == EventCommit || tc.ev == EventCommitFilling) {
				require.Zero(t, v.Lease, "a commit ends the lease")
			}
		})
	}
}

// What each state, with its holds, allows.
func TestWhatAStateAllows(t *testing.T) {
	now := time.Now()
	viewHold := Holders{Views: []string{"csi-2"}}
	childHold := Holders{Children: []volume.Ref{ref("ci", "child")}}
	streamHold := Holders{Streams: 1}
	fillHold := Holders{Fillers: 1}
	tests := []struct {
		name   string
		v      Volume
		holds  Holders
		mount  error // for a pod of the volume's own namespace
		top    bool  // mountable as the top of a chain
		below  bool  // mountable as a layer below the top
		copyOK bool  // copyable out as the top of a chain
		tree   bool  // readable with its data arriving (volume.NeedTree)
		whole  bool  // readable with all its data here (volume.NeedWhole)
		serve  bool
		reap   bool
		evict  bool
		told   volume.State
	}{
		{name: "creating", v: volumeIn(volume.StateCreating, false), mount: ErrNotReady, told: volume.StateCreating},
		{name: "creating, destroyed meanwhile", v: volumeIn(volume.StateCreating, true), mount: ErrNotFound, told: volume.StateCreating},
		{name: "filling", v: volumeIn(volume.StateFilling, false), holds: fillHold, top: true, below: true, tree: true, told: volume.StateCreating},
		{name: "filling, no filler", v: volumeIn(volume.StateFilling, false), top: true, below: true, tree: true, told: volume.StateCreating},
		{name: "filling, destroyed meanwhile", v: volumeIn(volume.StateFilling, true), holds: childHold, mount: ErrNotFound,
			top: true, below: true, told: volume.StateCreating},
		{name: "ready", v: volumeIn(volume.StateReady, false), top: true, below: true, copyOK: true, tree: true, whole: true, serve: true, evict: true, told: volume.StateReady},
		{name: "ready, mounted", v: volumeIn(volume.StateReady, false), holds: viewHold, top: true, below: true, copyOK: true, tree: true, whole: true, serve: true, told: volume.StateReady},
		{name: "ready, streaming", v: volumeIn(volume.StateReady, false), holds: streamHold, top: true, below: true, copyOK: true, tree: true, whole: true, serve: true, told: volume.StateReady},
		{name: "ready, pinned", v: func() Volume { v := volumeIn(volume.StateReady, false); v.Pin = Pin{Pinned: true}; return v }(),
			top: true, below: true, copyOK: true, tree: true, whole: true, serve: true, told: volume.StateReady},
		{name: "failed", v: volumeIn(volume.StateFailed, false), mount: ErrUnusable, evict: true, told: volume.StateFailed},
		{name: "destroying", v: volumeIn(volume.StateDestroying, false), mount: ErrNotFound, below: true, reap: true, told: volume.StateDestroying},
		{name: "destroying, a base", v: volumeIn(volume.StateDestroying, false), holds: childHold, mount: ErrNotFound, below: true, serve: true, told: volume.StateDestroying},
		{name: "destroying, streaming", v: volumeIn(volume.StateDestroying, false), holds: streamHold, mount: ErrNotFound, below: true, told: volume.StateDestroying},
		{name: "destroying, filled by a filler", v: volumeIn(volume.StateDestroying, false), holds: fillHold, mount: ErrNotFound, below: true, told: volume.StateDestroying},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v := tc.v
			if tc.mount == nil {
				require.NoError(t, v.mountable("ci"))
			} else {
				require.ErrorIs(t, v.mountable("ci"), tc.mount)
			}
			require.ErrorIs(t, v.mountable("other"), ErrNotFound, "another namespace never sees it")
			require.Equal(t, tc.top, v.layerMountable(true), "mountable as the top")
			require.Equal(t, tc.below, v.layerMountable(false), "mountable below the top")
			require.Equal(t, tc.copyOK, v.layerComplete(true), "copyable as the top")
			require.Equal(t, tc.tree, v.ReadableAs("ci", volume.NeedTree), "readable as its data arrives")
			require.Equal(t, tc.whole, v.ReadableAs("ci", volume.NeedWhole), "readable whole")
			require.False(t, v.ReadableAs("other", volume.NeedTree), "another namespace never reads it")
			require.Equal(t, tc.serve, v.Servable(tc.holds), "servable")
			require.Equal(t, tc.reap, v.reapable(tc.holds), "reapable")
			require.Equal(t, tc.evict, v.evictable(tc.holds, now), "evictable")
			require.Equal(t, tc.told, v.Advertised())
		})
	}
}

func TestRecovery(t *testing.T) {
	live := map[string]bool{"csi-1": true}
	tests := []struct {
		name string
		v    Volume
		want recovery
	}{
		{name: "reserved by a live step volume", v: volumeIn(volume.StateCreating, false), want: recoveryKeep},
		{name: "reserved by a step volume gone", v: Volume{State: volume.StateCreating, Lease: viewLease("csi-gone")}, want: recoveryDrop},
		{name: "reserved by a pull", v: Volume{State: volume.StateCreating, Lease: stranger}, want: recoveryDrop},
		{name: "reserved by an owner unknown here", v: Volume{State: volume.StateCreating, Lease: Lease{Kind: "future"}}, want: recoveryDrop},
		{name: "filling: its filler died", v: volumeIn(volume.StateFilling, false), want: recoveryFail},
		{name: "ready", v: volumeIn(volume.StateReady, false), want: recoveryKeep},
		{name: "destroying", v: volumeIn(volume.StateDestroying, false), want: recoveryKeep},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { require.Equal(t, tc.want, tc.v.recovered(live)) })
	}
}

// pullLazily makes a volume as a lazy pull does: reserved, then committed
// filling.
func pullLazily(t *testing.T, s *Store, ns, handle string, base volume.Ref) Volume {
	t.Helper()
	v, err := s.ReservePull(Volume{Namespace: ns, Handle: handle, Base: base, Scope: volume.ScopeNamespace}, "pull-"+handle)
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(s.DataPath(v), 0o755))
	_, err = s.CommitPullFilling(v.Ref(), "pull-other", 10)
	require.ErrorIs(t, err, ErrExists, "only its pull commits it")
	v, err = s.CommitPullFilling(v.Ref(), "pull-"+handle, 10)
	require.NoError(t, err)
	require.Equal(t, volume.StateFilling, v.State)
	return v
}

// A filling volume is mounted by overlays here but never copied out (not
// to peers, not into a user namespace's tree), not evicted, and a child
// pulled over it stacks on it; filled, it is ready; a restart fails it,
// its filler dead, and no volume of a pod that mounted it captures.
func TestFillingVolumesInTheStore(t *testing.T) {
	s := openStore(t)
	pullLazily(t, s, "ci", "base", volume.Ref{})
	pullLazily(t, s, "ci", "top", ref("ci", "base"))

	view, err := s.Publish(View{VolumeID: "reader", Source: ref("ci", "top"), Pod: pod("ci")})
	require.NoError(t, err, "an overlay over filling layers mounts")
	require.Len(t, view.Lowers, 2)
	_, err = s.Publish(View{VolumeID: "userns", Source: ref("ci", "top"), Pod: pod("ci"), UserNamespace: true})
	require.ErrorIs(t, err, ErrNotReady, "a copy of the chain waits for its data")
	_, _, err = s.ChainOf(ref("ci", "top"), volume.NeedWhole)
	require.ErrorIs(t, err, ErrNotReady, "a chain with a layer not all here is not copied out")
	_, dirs, err := s.ChainOf(ref("ci", "top"), volume.NeedTree)
	require.NoError(t, err, "a chain still filling is read through, its data arriving as files are opened")
	require.Len(t, dirs, 2)
	held, err := s.HoldImage("k8s.io/1/container", ref("ci", "top"), func(Volume) error { return nil })
	require.NoError(t, err, "a container may run on a step image still filling")
	require.Equal(t, dirs, held)
	again, err := s.HoldImage("k8s.io/1/container", ref("ci", "top"), func(Volume) error { return errors.New("not asked") })
	require.NoError(t, err, "its mounts asked for again while it fills")
	require.Equal(t, dirs, again)
	require.NotContains(t, refs(s.Candidates(time.Now().Add(time.Hour))), ref("ci", "top"))
	require.NoError(t, s.ReleaseImage("k8s.io/1/container"))
	require.NotContains(t, refs(s.Candidates(time.Now().Add(time.Hour))), ref("ci", "base"), "never evicted while filling")

	v, err := s.Filled(ref("ci", "top"))
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, v.State)
	require.True(t, v.Synced)
	_, err = s.Filled(ref("ci", "top"))
	require.ErrorIs(t, err, ErrUnusable, "filled once")

	// The reader's pod writes its output to a volume of its own; another
	// pod's output never read the layer.
	_, err = s.Publish(View{VolumeID: "reader-out", Capture: "out", Pod: pod("ci")})
	require.NoError(t, err)
	_, err = s.Publish(View{VolumeID: "other-out", Capture: "other", Pod: volume.Pod{Namespace: "ci", Name: "q", UID: "u2"}})
	require.NoError(t, err)

	require.False(t, view.InputIncomplete)
	rep, err := s.Recover(os.RemoveAll, false)
	require.NoError(t, err)
	require.Equal(t, 1, rep.MarkedFailed)
	view, err = s.GetView("reader")
	require.NoError(t, err)
	require.True(t, view.InputIncomplete, "a step over a layer that failed captures nothing ready")
	view, err = s.GetView("reader-out")
	require.NoError(t, err)
	require.True(t, view.InputIncomplete, "nor does its pod's output: the step may have read holes (a plugin that died under its reader)")
	view, err = s.GetView("other-out")
	require.NoError(t, err)
	require.False(t, view.InputIncomplete, "another pod's output is captured")
	// The pod's output published after the failure (its publish retried
	// while the plugin was down) is incomplete from the start; another
	// pod's is not.
	late, err := s.Publish(View{VolumeID: "reader-late-out", Capture: "late", Pod: pod("ci")})
	require.NoError(t, err)
	require.True(t, late.InputIncomplete, "a volume joining a pod that may have read holes")
	other, err := s.Publish(View{VolumeID: "other-late-out", Capture: "other-late", Pod: volume.Pod{Namespace: "ci", Name: "q", UID: "u2"}})
	require.NoError(t, err)
	require.False(t, other.InputIncomplete)
	v, err = s.Get(ref("ci", "base"))
	require.NoError(t, err)
	require.Equal(t, volume.StateFailed, v.State)
	require.ErrorIs(t, s.CheckBackoff(ref("ci", "base")), ErrBackoff, "a failed fill backs off as a failed volume does")
}

// Live holds (streams, fillers) keep a destroyed volume's data and its old
// layers as recorded holds do, until released.
func TestLiveHoldsKeepData(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "v", volume.Ref{}, volume.ScopeNamespace, nil)
	for _, kind := range []HoldKind{HoldStream, HoldFill} {
		release := s.Hold(ref("ci", "v"), kind)
		require.False(t, s.Holders(ref("ci", "v")).Empty(), kind)
		require.NotContains(t, refs(s.Candidates(time.Now())), ref("ci", "v"), kind)
		release()
		release() // a second release is a no-op, not a negative count
		require.True(t, s.Holders(ref("ci", "v")).Empty(), kind)
	}

	release := s.Hold(ref("ci", "v"), HoldStream)
	require.False(t, s.WaitingOnLiveHolds(), "held, but not destroyed")
	require.NoError(t, s.Destroy(ref("ci", "v")))
	require.Empty(t, s.Reapable())
	require.True(t, s.WaitingOnLiveHolds(), "destroyed, and only the stream keeps it")
	require.ErrorIs(t, s.Reap(ref("ci", "v"), os.RemoveAll), ErrInUse)
	release()
	require.False(t, s.WaitingOnLiveHolds())
	require.Equal(t, []volume.Ref{ref("ci", "v")}, refs(s.Reapable()))
	require.NoError(t, s.Reap(ref("ci", "v"), os.RemoveAll))
}

// A destroyed volume that a child keeps waits on the child, not on a
// stream of it: its stream's end frees nothing.
func TestWaitingOnLiveHoldsLooksPastRecordedHolds(t *testing.T) {
	s := openStore(t)
	ready(t, s, "ci", "parent", volume.Ref{}, volume.ScopeNamespace, nil)
	ready(t, s, "ci", "child", ref("ci", "parent"), volume.ScopeNamespace, nil)
	release := s.Hold(ref("ci", "parent"), HoldStream)
	defer release()
	require.NoError(t, s.Destroy(ref("ci", "parent")))
	require.False(t, s.WaitingOnLiveHolds())
}

// A volume pulled as an index is ready as its index; its plain copy is
// swapped in for it later, in one transaction that leaves its base alone
// and takes only the layer it copied; its index (the dir beside its layer)
// stays while the layer does, is pruned with it once no view mounts it,
// and is never taken for an orphan by recovery.
func TestAVolumePulledAsAnIndexIsSwappedForItsPlainCopy(t *testing.T) {
	s := openStore(t)
	v := pullLazily(t, s, "ci", "indexed", volume.Ref{})
	indexed := s.DataPath(v)
	require.NoError(t, os.MkdirAll(IndexDir(indexed), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(IndexDir(indexed), "blob"), []byte("x"), 0o600))
	rep, err := s.Recover(os.RemoveAll, false)
	require.NoError(t, err)
	require.Zero(t, rep.RemovedOrphans, "an index goes with its layer")
	require.DirExists(t, IndexDir(indexed))
	base := pullLazily(t, s, "ci", "base", volume.Ref{}) // (recovery failed the first)
	_, err = s.Filled(base.Ref())
	require.NoError(t, err)
	v = pullLazily(t, s, "ci", "again", base.Ref())
	indexed = s.DataPath(v)
	require.NoError(t, os.MkdirAll(IndexDir(indexed), 0o755))
	require.ErrorIs(t, s.SwapLayer(v.Ref(), v.Layer, "plain"), ErrUnusable, "a volume still filling keeps its index")
	view, err := s.Publish(View{VolumeID: "reader", Source: v.Ref(), Pod: pod("ci")})
	require.NoError(t, err)
	require.Contains(t, view.Lowers, indexed)

	v, err = s.Filled(v.Ref())
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, v.State)
	require.Equal(t, indexed, s.DataPath(v), "ready as its index")
	require.NoError(t, os.MkdirAll(s.LayerPath(v.Ref(), "plain"), 0o755))
	require.ErrorIs(t, s.SwapLayer(v.Ref(), "other", "plain"), ErrUnusable, "only the layer copied is swapped")
	require.NoError(t, s.SwapLayer(v.Ref(), v.Layer, "plain"))
	v, err = s.Get(v.Ref())
	require.NoError(t, err)
	require.Equal(t, "plain", v.Layer)
	require.Equal(t, base.Ref(), v.Base, "a copy of one layer rests on the same base")
	require.NoError(t, s.PruneLayers(os.RemoveAll))
	require.DirExists(t, IndexDir(indexed), "kept while a view mounts the index")
	_, err = s.DropView("reader")
	require.NoError(t, err)
	require.NoError(t, s.PruneLayers(os.RemoveAll))
	require.NoDirExists(t, indexed)
	require.NoDirExists(t, IndexDir(indexed))
	require.DirExists(t, s.DataPath(v))
	cur, err := s.Get(v.Ref())
	require.NoError(t, err)
	require.Empty(t, cur.OldLayers)
}
