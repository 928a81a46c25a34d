package test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/overlay"
)

// noLeaks checks that nothing is mounted under the state dir or the pods'
// dirs, and that no step volume dir or staging leftover remains.
func (e *env) noLeaks(t *testing.T) {
	t.Helper()
	for _, dir := range []string{e.p.StateDir, e.p.KubeletDir} {
		mounts, err := overlay.MountsUnder(dir)
		require.NoError(t, err)
		mounts = slices.DeleteFunc(mounts, func(mp string) bool { return mp == dir }) // a test filesystem
		require.Empty(t, mounts, "leaked mounts under %s", dir)
	}
	for _, sub := range []string{"views", "staging"} {
		entries, err := os.ReadDir(filepath.Join(e.p.StateDir, sub))
		require.NoError(t, err)
		require.Empty(t, entries, "leftovers in %s", sub)
	}
}

// TestCrashPoints kills the plugin (SIGKILL) exactly between the steps of a
// publish, a capture and a discard, restarts it, and lets the kubelet's
// retries finish the job. Nothing half-made may become visible, the source
// must be intact, the output complete, and no mount may leak.
func TestCrashPoints(t *testing.T) {
	testfs.Need(t)
	points := []struct {
		name    string
		capture bool // the crash is in unpublish, after a normal publish
		scratch bool // a volume without capture
	}{
		{"publish-recorded", false, false},
		{"publish-mounted", false, false},
		{"capture-unmounted", true, false},
		{"capture-renamed", true, false},
		{"capture-committed", true, false},
		{"discard-unmounted", true, true},
	}
	for _, pt := range points {
		t.Run(pt.name, func(t *testing.T) {
			// A publish of the half-made output waits this long before it
			// is refused.
			e := newEnv(t, plugintest.Config{Backend: "overlay", Args: []string{"--capture-wait=1s"}})
			e.step("", "base", func(dir string) {
				write(t, dir, "keep", "base data")
				write(t, dir, "drop", "deleted by the step")
			})
			var baseTree testfs.Tree
			e.read("base", func(dir string) { baseTree = testfs.Describe(t, dir) })

			attrs := map[string]string{driver.AttrSource: "base", driver.AttrCapture: "out"}
			if pt.scratch {
				attrs = map[string]string{driver.AttrSource: "base"}
			}
			v := e.volume(attrs, false)
			work := func() {
				write(t, v.Target, "new", "written by the step")
				require.NoError(t, os.Remove(filepath.Join(v.Target, "drop")))
			}
			if pt.capture {
				require.NoError(t, e.publish(v))
				work()
				e.p.Restart("COWVOL_CRASH_AT=" + pt.name) // a SIGKILL while published, too
				require.Error(t, e.unpublish(v), "the plugin dies in the call")
			} else {
				e.p.Restart("COWVOL_CRASH_AT=" + pt.name)
				require.Error(t, e.publish(v), "the plugin dies in the call")
			}
			require.NoError(t, e.p.Wait(10*time.Second), "the plugin stopped at the crash point")
			e.p.Restart()

			// Before the kubelet retries, the output is not visible: it
			// is reserved by the view (recorded published before its
			// tree was built and mounted) or by its half-made capture.
			if !pt.scratch && pt.name != "capture-committed" {
				require.Equal(t, codes.Unavailable, code(e.publish(e.volume(map[string]string{driver.AttrSource: "out"}, true))),
					"a half-made volume is never served")
			}
			if !pt.capture {
				retry(t, "publish", func() error { return e.publish(v) })
				require.Equal(t, "base data", readFile(t, v.Target, "keep"))
				work()
			}
			retry(t, "unpublish", func() error { return e.unpublish(v) })
			if !pt.scratch {
				e.read("out", func(dir string) {
					require.Equal(t, "base data", readFile(t, dir, "keep"))
					require.Equal(t, "written by the step", readFile(t, dir, "new"))
					absent(t, dir, "drop")
				})
			}
			e.read("base", func(dir string) { require.Equal(t, baseTree, testfs.Describe(t, dir)) })
			e.noLeaks(t)
		})
	}
}

// TestRestartAdoptsAndRemounts: volumes published before a SIGKILL stay
// usable and are torn down (and captured) by the new process; a mount that
// vanished while the plugin was down (a reboot) is made again.
func TestRestartAdoptsAndRemounts(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	e.step("", "src", func(dir string) { write(t, dir, "f", "src") })
	adopted := e.mount(map[string]string{driver.AttrSource: "src", driver.AttrCapture: "adopted-out"}, false)
	lost := e.mount(map[string]string{driver.AttrSource: "src", driver.AttrCapture: "lost-out"}, false)
	write(t, lost.Target, "before", "reboot")
	adoptedMount := mountID(t, adopted.Target)
	e.p.Kill()
	m := overlay.NewSysMounter()
	require.NoError(t, m.Unmount(lost.Target))
	require.Zero(t, mountID(t, lost.Target))
	e.p.Restart()
	require.Equal(t, adoptedMount, mountID(t, adopted.Target), "adopted as it was, not mounted again")
	require.NotZero(t, mountID(t, lost.Target), "the vanished mount is made again at start")

	write(t, adopted.Target, "after", "restart")
	require.Equal(t, "reboot", readFile(t, lost.Target, "before"), "the remount shows the step's earlier writes")
	require.NoError(t, e.publish(adopted), "a repeated publish of an adopted volume is a success")
	e.umount(adopted)
	e.umount(lost)
	e.read("adopted-out", func(dir string) { require.Equal(t, "restart", readFile(t, dir, "after")) })
	e.read("lost-out", func(dir string) { require.Equal(t, "reboot", readFile(t, dir, "before")) })
	e.noLeaks(t)
}

// TestKillAtRandomInstants runs a stream of steps (publish, write, capture)
// and SIGKILLs the plugin at random instants. After each restart, the calls
// in flight are retried until they succeed; at the end every captured
// volume is complete and nothing leaked.
func TestKillAtRandomInstants(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	e.step("", "root", func(dir string) { write(t, dir, "gen", "0") })
	rng := rand.New(rand.NewPCG(1, 2))
	const steps = 24
	prev := "root"
	kills := 0
	// underFire makes a kubelet call while the plugin may be SIGKILLed
	// at a random instant, restarts it if it was, and retries the call
	// until it succeeds.
	underFire := func(what string, call func() error) {
		killed := make(chan struct{})
		delay, kill := time.Duration(rng.IntN(3000))*time.Microsecond, rng.IntN(2) == 0
		go func() {
			defer close(killed)
			time.Sleep(delay)
			if kill {
				e.p.Kill()
			}
		}()
		err := call()
		<-killed
		if !e.p.Running() {
			kills++
			e.p.Restart()
		}
		if err != nil {
			retry(t, what, call)
		}
	}
	for i := 1; i <= steps; i++ {
		handle := fmt.Sprintf("gen-%d", i)
		v := e.volume(map[string]string{driver.AttrSource: prev, driver.AttrCapture: handle}, false)
		underFire("publish", func() error { return e.publish(v) })
		require.Equal(t, fmt.Sprint(i-1), readFile(t, v.Target, "gen"))
		write(t, v.Target, "gen", fmt.Sprint(i))
		underFire("unpublish", func() error { return e.unpublish(v) })
		prev = handle
	}
	t.Logf("%d steps, %d kills", steps, kills)
	require.Positive(t, kills)
	for i := 1; i <= steps; i++ {
		e.read(fmt.Sprintf("gen-%d", i), func(dir string) {
			require.Equal(t, fmt.Sprint(i), readFile(t, dir, "gen"))
		})
	}
	e.noLeaks(t)
}

// TestBackendSwitch: a plugin restarted with another COW backend tears
// down the views the old one built (capturing them) and serves the old
// backend's layer chains through its own mechanism.
func TestBackendSwitch(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	e.step("", "sw-1", func(dir string) { write(t, dir, "a", "1"); write(t, dir, "gone", "x") })
	e.step("sw-1", "sw-2", func(dir string) {
		write(t, dir, "b", "2")
		require.NoError(t, os.Remove(filepath.Join(dir, "gone")))
	})
	live := e.mount(map[string]string{driver.AttrSource: "sw-2", driver.AttrCapture: "sw-3"}, false)
	write(t, live.Target, "c", "3")

	e.p.Backend = "copy"
	e.p.Restart()
	require.Equal(t, "copy", e.backend(t))
	check := func(dir string, want map[string]string) {
		for name, content := range want {
			require.Equal(t, content, readFile(t, dir, name))
		}
		absent(t, dir, "gone")
	}
	// A copy of the overlay chain, with the deletion kept.
	e.step("sw-2", "sw-copy", func(dir string) { check(dir, map[string]string{"a": "1", "b": "2"}) })
	// The overlay view published before the switch is captured as it was.
	e.umount(live)
	e.read("sw-3", func(dir string) { check(dir, map[string]string{"a": "1", "b": "2", "c": "3"}) })
	e.noLeaks(t)
}

// A crash while a destroyed volume's data is being freed (here one whose
// TTL ran out) leaves nothing half-deleted visible: after a restart the
// volume is gone for good, its dir too, and the rest is untouched.
func TestCrashMidDestroy(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	e.step("", "keep", func(dir string) { write(t, dir, "f", "kept") })
	e.p.Restart("COWVOL_CRASH_AT=reap-data-removed")
	v := e.mount(map[string]string{driver.AttrCapture: "brief", driver.AttrTTL: "1s"}, false)
	write(t, v.Target, "f", "brief")
	e.umount(v)
	require.NoError(t, e.p.Wait(60*time.Second), "the plugin dies after freeing the data, before forgetting the volume")
	e.p.Restart()
	eventually(t, "the destroyed volume to be forgotten", func() bool {
		_, err := os.Stat(filepath.Join(e.p.StateDir, "volumes", "ci", "brief"))
		return errors.Is(err, os.ErrNotExist) && code(e.publish(e.volume(map[string]string{driver.AttrSource: "brief"}, true))) == codes.NotFound
	})
	e.read("keep", func(dir string) { require.Equal(t, "kept", readFile(t, dir, "f")) })
	e.noLeaks(t)
}
