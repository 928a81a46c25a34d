package node

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// captureSized captures handle in ci over source (may be empty) with a file
// of size bytes, and returns the volume.
func (f *fixture) captureSized(handle, source string, size int) cache.Volume {
	f.t.Helper()
	v := f.volume("ci", source, handle)
	require.NoError(f.t, f.publish(v))
	require.NoError(f.t, os.WriteFile(filepath.Join(v.Target.Full, handle), make([]byte, size), 0o644))
	require.NoError(f.t, f.unpublish(v))
	require.Eventually(f.t, func() bool {
		vol, err := f.store.Get(ref("ci", handle))
		return err == nil && vol.SizeBytes >= 0
	}, 30*time.Second, 10*time.Millisecond, "the capture is measured")
	vol, err := f.store.Get(ref("ci", handle))
	require.NoError(f.t, err)
	return vol
}

func (f *fixture) gone(handle string) bool {
	_, err := f.store.Get(ref("ci", handle))
	return err != nil
}

// Destroying a volume hides it at once; a child built on it and a step
// reading it keep working, and its data goes once they are gone.
func TestDestroyHoldsDataForChildrenAndReaders(t *testing.T) {
	f := newFixture(t)
	parent := f.captureSized("parent", "", 1<<20)
	f.captureSized("child", "parent", 1<<10)
	reader := f.volume("ci", "child", "")
	require.NoError(t, f.publish(reader))

	require.NoError(t, f.engine.Destroy(ref("ci", "parent"), ref("ci", "child")))
	require.ErrorIs(t, f.publish(f.volume("ci", "parent", "")), cache.ErrNotFound, "hidden at once")
	require.ErrorIs(t, f.publish(f.volume("ci", "child", "")), cache.ErrNotFound)
	_, err := os.Stat(filepath.Join(reader.Target.Full, "parent"))
	require.NoError(t, err, "the reader still sees the parent's data through the child")
	f.engine.reapRound() // a whole round, run here: not a sleep a slow round outlasts
	_, err = os.Stat(f.store.DataPath(parent))
	require.NoError(t, err, "held while read")

	require.NoError(t, f.unpublish(reader))
	require.Eventually(t, func() bool { return f.gone("parent") && f.gone("child") }, 30*time.Second, 10*time.Millisecond)
	_, err = os.Stat(f.store.VolumeDir(ref("ci", "parent")))
	require.ErrorIs(t, err, os.ErrNotExist)
}

// A volume destroyed while a peer streams it is held until the stream
// ends, and its data goes as the stream lets go: not at the reaper's next
// round, up to reapInterval later.
func TestDestroyWaitsForAStreamAndNoLonger(t *testing.T) {
	f := newFixture(t)
	vol := f.captureSized("streamed", "", 1<<10)
	layer, release, err := f.engine.PeerHolder().OpenLayer("ci", ref("ci", "streamed"), volume.Ref{})
	require.NoError(t, err)
	dir := layer.Dir
	require.Equal(t, f.store.DataPath(vol), dir)

	require.NoError(t, f.engine.Destroy(ref("ci", "streamed")))
	f.engine.reapRound()
	_, err = os.Stat(dir)
	require.NoError(t, err, "held while streamed")

	release()
	require.Eventually(t, func() bool {
		_, err := os.Stat(dir)
		return errors.Is(err, os.ErrNotExist)
	}, reapInterval/4, 10*time.Millisecond, "freed as the stream ended")
}

// A volume destroyed while it fills is gone to every reader that names it
// (a read of its files, a step image's rootfs, a peer's pull), as it is
// to a step's publish: a destroy hides it at once, whatever still holds
// its data.
func TestAVolumeDestroyedWhileItFillsIsGoneToReaders(t *testing.T) {
	f := newFixture(t)
	r := ref("ci", "src")
	v, err := f.store.ReservePull(cache.Volume{Namespace: "ci", Handle: "src", Scope: volume.ScopeNamespace}, "pull-src")
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(f.store.DataPath(v), 0o755))
	_, err = f.store.CommitPullFilling(r, "pull-src", 10)
	require.NoError(t, err)
	version, err := f.engine.VolumeVersion("ci", r, volume.NeedTree)
	require.NoError(t, err, "read as it fills")
	_, err = f.engine.VolumeVersion("other", r, volume.NeedTree)
	require.ErrorIs(t, err, streamer.ErrNotHeld, "never to another namespace")

	require.NoError(t, f.engine.Destroy(r))
	got, err := f.store.Get(r)
	require.NoError(t, err)
	require.Equal(t, volume.StateFilling, got.State, "its data stays while its fill runs")
	_, err = f.engine.VolumeVersion("ci", r, volume.NeedTree)
	require.ErrorIs(t, err, streamer.ErrNotHeld, "a read of its files")
	_, err = f.engine.OpenVolume("ci", r, "", streamer.FormatTar, volume.NeedTree)
	require.ErrorIs(t, err, streamer.ErrNotHeld, "a read of its files")
	_, err = f.engine.ImageRootfs("k8s.io/1/container", "ci", r, version)
	require.ErrorIs(t, err, streamer.ErrNotHeld, "a step image's rootfs")
	_, err = f.engine.PeerHolder().Chain("ci", r)
	require.ErrorIs(t, err, streamer.ErrNotHeld, "a peer's pull")
	require.ErrorIs(t, f.publish(f.volume("ci", "src", "")), cache.ErrNotFound, "a step's publish")
}

// A destroyed volume that only a fill (or a stream) holds keeps the
// reaper's ticks looking, however idle the node: the hold may end just
// after a round looked, without waking another. (A fill's end once woke
// the reaper a moment before it let go; the round found the data held,
// and the idle node's ticks did not look again for minutes.)
func TestReaperLooksWhileADestroyedVolumeWaitsOnALiveHold(t *testing.T) {
	f := newFixture(t)
	f.captureSized("filling", "", 1<<10)
	release := f.store.Hold(ref("ci", "filling"), cache.HoldFill)
	// Destroyed behind the reaper's back, and one round run by hand: no
	// round the test did not run frees it.
	require.NoError(t, f.store.Destroy(ref("ci", "filling")))
	f.engine.reapRound()
	require.False(t, f.gone("filling"), "held by its fill")

	release() // wakes nothing
	f.engine.reapTick()
	require.True(t, f.gone("filling"), "the next tick frees it")
	f.engine.reapTick()
	f.engine.reaping.Lock()
	defer f.engine.reaping.Unlock()
	require.False(t, f.engine.swept.leftToFree, "nothing is left to look for")
}

// What the end of a stream wakes: the reaper only where the stream's hold
// may have kept it from something, the janitor only where there are
// replaced layers to prune.
func TestWakeAfterStream(t *testing.T) {
	for _, tc := range []struct {
		name           string
		v              cache.Volume
		err            error
		overHigh       bool
		wantReap, tidy bool
	}{
		{name: "ready: nothing waited", v: cache.Volume{State: volume.StateReady}},
		{name: "destroyed meanwhile", v: cache.Volume{State: volume.StateDestroying}, wantReap: true},
		{name: "failed meanwhile", v: cache.Volume{State: volume.StateFailed}, wantReap: true},
		{name: "over the high watermark", v: cache.Volume{State: volume.StateReady}, overHigh: true, wantReap: true},
		{name: "replaced layers to prune", v: cache.Volume{State: volume.StateReady, OldLayers: []string{"old"}}, tidy: true},
		{name: "gone", err: cache.ErrNotFound, wantReap: true, tidy: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reap, tidy := wakeAfterStream(tc.v, tc.err, tc.overHigh)
			require.Equal(t, tc.wantReap, reap, "reaper")
			require.Equal(t, tc.tidy, tidy, "janitor")
		})
	}
}

// A volume with a TTL is destroyed that long after its last use, unless
// pinned.
func TestTTLDestroysUnusedVolumes(t *testing.T) {
	f := newFixture(t)
	// kept is pinned at once, well within its TTL (a slow machine may take
	// a while between two calls); the reaper is then kicked past the TTL.
	const keptTTL = time.Second
	for _, v := range []struct {
		handle string
		ttl    time.Duration
	}{{"kept", keptTTL}, {"brief", 200 * time.Millisecond}} {
		r := f.volume("ci", "", v.handle)
		r.TTL = v.ttl
		require.NoError(t, f.publish(r))
		require.NoError(t, f.unpublish(r))
		if v.handle == "kept" {
			_, err := f.engine.Pin(ref("ci", "kept"), time.Time{})
			require.NoError(t, err)
		}
	}
	keptSince := time.Now()
	require.Eventually(t, func() bool { f.engine.kick(f.engine.reaper); return f.gone("brief") }, 30*time.Second, 50*time.Millisecond)
	for time.Since(keptSince) < 2*keptTTL {
		f.engine.kick(f.engine.reaper)
		time.Sleep(50 * time.Millisecond)
	}
	require.False(t, f.gone("kept"), "a pinned volume outlives its TTL")
	_, err := f.engine.Unpin(ref("ci", "kept"))
	require.NoError(t, err)
	require.Eventually(t, func() bool { f.engine.kick(f.engine.reaper); return f.gone("kept") }, 30*time.Second, 50*time.Millisecond)
}

// Over its high watermark the node evicts unpinned, unused volumes, least
// recently used first, until it is under its low one; while it cannot get
// under the high mark it refuses captures and empty volumes, but serves
// views of cached volumes, and it recovers on its own once space frees.
func TestEvictionUnderPressure(t *testing.T) {
	dir := testfs.Mount(t, testfs.Ext4, 96<<20)
	f := newFixtureWith(t, dir, func(c *Config) { c.Watermarks = Watermarks{High: 70, Low: 50} })
	// Six volumes of 8 MiB, oldest first; then one pinned, one mounted.
	for i := range 6 {
		f.captureSized(fmt.Sprintf("v%d", i), "", 8<<20)
	}
	f.captureSized("pinned", "", 8<<20)
	f.captureSized("mounted", "", 8<<20)
	_, err := f.engine.Pin(ref("ci", "pinned"), time.Time{})
	require.NoError(t, err)
	reader := f.volume("ci", "mounted", "")
	require.NoError(t, f.publish(reader))
	// Fill the disk past the high mark from outside the cache.
	filler := filepath.Join(dir, "filler")
	fillDisk(t, filler, dir, 75)
	f.engine.reapRound()
	require.True(t, f.gone("v0"), "the least recently used goes first")
	require.False(t, f.gone("pinned"), "pinned volumes stay")
	require.False(t, f.gone("mounted"), "volumes in use stay")
	d, err := measureDisk(dir)
	require.NoError(t, err)
	require.Less(t, d.pct, 70, "under the high mark")
	for i := 5; i >= 0; i-- {
		if f.gone(fmt.Sprintf("v%d", i)) {
			for j := range i {
				require.True(t, f.gone(fmt.Sprintf("v%d", j)), "evicted in LRU order")
			}
			break
		}
	}

	// Nothing left to evict: captures and empty volumes are refused,
	// views of cached volumes are not. The disk is filled again after a
	// round that evicted what was left: how far that round brought it
	// down depends on the filesystem's accounting (once, in CI, just under
	// the high mark), so the second fill, not arithmetic, puts it over.
	fillDisk(t, filler+"2", dir, 98)
	f.engine.reapRound()
	for i := range 6 {
		require.True(t, f.gone(fmt.Sprintf("v%d", i)), "over the high mark, every unused volume goes")
	}
	fillDisk(t, filler+"3", dir, 98)
	f.engine.reapRound()
	require.ErrorIs(t, f.publish(f.volume("ci", "", "refused")), ErrNodeFull)
	require.ErrorIs(t, f.publish(f.volume("ci", "", "")), ErrNodeFull)
	view := f.volume("ci", "pinned", "")
	require.NoError(t, f.publish(view), "a view of a cached volume still works")
	require.NoError(t, f.unpublish(view))

	for _, p := range []string{filler + "3", filler + "2", filler} {
		require.NoError(t, os.Remove(p))
	}
	f.engine.reapRound()
	require.NoError(t, f.publish(f.volume("ci", "", "accepted")), "the node recovers on its own")
	require.NoError(t, f.unpublish(reader))
}

// A volume used within the eviction grace stays however full the disk is
// (a step's output waits for the next step, or its scheduler's pin): the
// node refuses captures instead, saying why, and evicts it once the grace
// has passed.
func TestEvictionGrace(t *testing.T) {
	dir := testfs.Mount(t, testfs.Ext4, 96<<20)
	f := newFixtureWith(t, dir, func(c *Config) { c.Watermarks = Watermarks{High: 70, Low: 50, Grace: time.Hour} })
	for i := range 4 {
		f.captureSized(fmt.Sprintf("v%d", i), "", 8<<20)
	}
	fillDisk(t, filepath.Join(dir, "filler"), dir, 75)
	f.engine.reapRound()
	for i := range 4 {
		require.False(t, f.gone(fmt.Sprintf("v%d", i)), "a volume made within the grace stays")
	}
	err := f.publish(f.volume("ci", "", "refused"))
	require.ErrorIs(t, err, ErrNodeFull)
	require.ErrorContains(t, err, "used in the last 1h0m0s")

	f.engine.relievePressure(time.Now().Add(2 * time.Hour))
	require.True(t, f.gone("v0"), "once the grace has passed, the least recently used goes")
	d, err := measureDisk(dir)
	require.NoError(t, err)
	require.Less(t, d.pct, 70, "under the high mark")
}

// fill writes into path until the filesystem at dir is pct full.
func fillDisk(t *testing.T, path, dir string, pct int) {
	t.Helper()
	file, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	require.NoError(t, err)
	defer file.Close()
	chunk := make([]byte, 1<<20)
	for {
		d, err := measureDisk(dir)
		require.NoError(t, err)
		if d.pct >= pct {
			return
		}
		if _, err := file.Write(chunk); err != nil {
			require.ErrorIs(t, err, unix.ENOSPC)
			return
		}
		require.NoError(t, file.Sync())
	}
}

// On a filesystem filled to the last block, destroying still works: the
// metadata's reserve makes room, and the data is freed.
func TestDestroyOnAFullDisk(t *testing.T) {
	dir := testfs.Mount(t, testfs.Ext4, 64<<20)
	f := newFixtureWith(t, dir, func(c *Config) { c.Watermarks = Watermarks{High: 100, Low: 99} })
	f.captureSized("big", "", 8<<20)
	require.Eventually(t, func() bool { _, err := os.Stat(filepath.Join(dir, "reserve")); return err == nil }, 30*time.Second, 10*time.Millisecond)
	fillDisk(t, filepath.Join(dir, "filler"), dir, 101)
	var fs unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &fs))
	require.Zero(t, fs.Bavail, "the disk is full")
	require.NoError(t, f.engine.Destroy(ref("ci", "big")))
	require.Eventually(t, func() bool { f.engine.kick(f.engine.reaper); return f.gone("big") }, 30*time.Second, 50*time.Millisecond)
}

// The reaper's ticks read no volume on an idle node: with the store as its
// last full round scanned it, a tick only watches the disk. A change to
// the store, or a TTL running out, makes the next tick a full round.
func TestReaperTicksOnAnIdleNode(t *testing.T) {
	f := newFixture(t)
	brief := f.volume("ci", "", "brief")
	brief.TTL = 3 * time.Second
	require.NoError(t, f.publish(brief))
	require.NoError(t, f.unpublish(brief))
	f.captureSized("other", "", 1<<10)
	lastFull := func() time.Time {
		f.engine.reaping.Lock()
		defer f.engine.reaping.Unlock()
		return f.engine.swept.at
	}
	// Once what the captures kicked off has settled, a tick is idle.
	require.Eventually(t, func() bool {
		before := lastFull()
		f.engine.reapTick()
		return lastFull().Equal(before)
	}, 10*time.Second, 50*time.Millisecond, "a tick on an idle node scans nothing")
	require.False(t, f.gone("brief"), "its TTL has not run out")

	// Destroyed behind the reaper's back (nothing kicks it): the store's
	// revision moved, so the next tick scans and frees it.
	require.NoError(t, f.store.Destroy(ref("ci", "other")))
	f.engine.reapTick()
	require.True(t, f.gone("other"))

	// Nothing changes while brief's TTL runs out: the tick after that
	// scans.
	require.Eventually(t, func() bool { f.engine.reapTick(); return f.gone("brief") }, 10*time.Second, 100*time.Millisecond)
}
