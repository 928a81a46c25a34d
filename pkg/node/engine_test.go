package node

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/mountid"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/target"
	"github.com/concourse/cowvol/pkg/volume"
)

// fixture is an in-process engine on a real overlay state dir.
type fixture struct {
	t        *testing.T
	cfg      Config
	store    *cache.Store
	engine   *Engine
	mounter  *faultyMounter
	pods     string
	n        int
	stateDir string
	// events are what the engine told pods and the node.
	events recordedEvents
}

// recordedEvents keeps the Events the engine sends.
type recordedEvents struct {
	mu   sync.Mutex
	sent []string // "pod reason: message"
}

func (r *recordedEvents) Event(pod volume.Pod, _, reason, message string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sent = append(r.sent, pod.Name+" "+reason+": "+message)
}

func (r *recordedEvents) NodeEvent(_, reason, message string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sent = append(r.sent, "node "+reason+": "+message)
}

// of lists the Events a pod got, each "reason: message".
func (r *recordedEvents) of(pod string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.sent {
		if rest, ok := strings.CutPrefix(e, pod+" "); ok {
			out = append(out, rest)
		}
	}
	return out
}

// faultyMounter is the real mounter with injectable failures, for the error
// paths a real mount cannot be made to take on demand.
type faultyMounter struct {
	overlay.Mounter
	mu          sync.Mutex
	failMount   error
	failUnmount error
	detached    int // mounts made attached nowhere (staged)
}

func (f *faultyMounter) fault(which *error) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return *which
}

func (f *faultyMounter) Overlay(target string, lowers []string, upper, work string, a overlay.Attrs) error {
	if err := f.fault(&f.failMount); err != nil {
		return err
	}
	return f.Mounter.Overlay(target, lowers, upper, work, a)
}

func (f *faultyMounter) OverlayDetached(lowers []string, upper, work string, a overlay.Attrs) (overlay.Detached, error) {
	f.mu.Lock()
	f.detached++
	f.mu.Unlock()
	if err := f.fault(&f.failMount); err != nil {
		return nil, err
	}
	return f.Mounter.OverlayDetached(lowers, upper, work, a)
}

func (f *faultyMounter) BindDetached(source string, a overlay.Attrs) (overlay.Detached, error) {
	f.mu.Lock()
	f.detached++
	f.mu.Unlock()
	if err := f.fault(&f.failMount); err != nil {
		return nil, err
	}
	return f.Mounter.BindDetached(source, a)
}

func (f *faultyMounter) Bind(source, target string, a overlay.Attrs) error {
	if err := f.fault(&f.failMount); err != nil {
		return err
	}
	return f.Mounter.Bind(source, target, a)
}

func (f *faultyMounter) set(which *error, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	*which = err
}

func (f *faultyMounter) Unmount(target string) error {
	if err := f.fault(&f.failUnmount); err != nil {
		return err
	}
	return f.Mounter.Unmount(target)
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	return newFixtureAt(t, t.TempDir(), "")
}

// newFixtureAt runs an engine on stateDir, reading the boot ID from
// bootIDFile (the kernel's when empty).
func newFixtureAt(t *testing.T, stateDir, bootIDFile string) *fixture {
	t.Helper()
	return newFixtureWith(t, stateDir, func(c *Config) { c.BootIDFile = bootIDFile })
}

// newFixtureWith runs an engine on stateDir, its config changed by change.
func newFixtureWith(t *testing.T, stateDir string, change func(*Config)) *fixture {
	t.Helper()
	testfs.Need(t)
	f := &fixture{t: t, pods: t.TempDir(), stateDir: stateDir, mounter: &faultyMounter{Mounter: overlay.NewSysMounter()}}
	f.cfg = Config{NodeID: "node-1", StateDir: f.stateDir, Backend: "overlay", FlattenDepth: 64, KubeletDir: f.pods}
	change(&f.cfg)
	f.start()
	t.Cleanup(f.teardown)
	return f
}

// teardown unpublishes what a test left published, as the kubelet would,
// so that no mount outlives the test.
func (f *fixture) teardown() {
	if f.engine == nil {
		return
	}
	for _, v := range f.store.ListViews() {
		tp, err := f.engine.Layout().Parse(v.Target)
		require.NoError(f.t, err)
		assert.NoError(f.t, f.engine.Unpublish(v.VolumeID, tp), "unpublishing %s at teardown", v.VolumeID)
	}
	f.stop()
}

func (f *fixture) start() {
	store, err := cache.Open(f.stateDir)
	require.NoError(f.t, err)
	engine, err := New(f.cfg, store, f.mounter, &f.events)
	require.NoError(f.t, err)
	f.store, f.engine = store, engine
}

func (f *fixture) stop() {
	if f.engine != nil {
		f.engine.Close()
		f.store.Close()
		f.engine = nil
	}
}

// restart is a new process on the same state dir (without a crash).
func (f *fixture) restart() {
	f.stop()
	f.start()
}

// volume is a request for a new pod's volume in namespace ns, its dir made
// as the kubelet makes it; source names a volume of ns.
func (f *fixture) volume(ns, source, capture string) PublishRequest {
	f.n++
	uid := fmt.Sprintf("0b4a8c1e-3f2d-4c5b-9a6e-%012d", f.n)
	p := filepath.Join(f.pods, "pods", uid, "volumes", "kubernetes.io~csi", "vol", "mount")
	require.NoError(f.t, os.MkdirAll(filepath.Dir(p), 0o750))
	tp, err := f.engine.Layout().Parse(p)
	require.NoError(f.t, err)
	r := PublishRequest{VolumeID: fmt.Sprintf("csi-%d", f.n), Target: tp, Capture: capture, Scope: volume.ScopeNamespace,
		Pod: volume.Pod{Namespace: ns, Name: fmt.Sprintf("pod-%d", f.n), UID: uid}}
	if source != "" {
		r.Source = ref(ns, source)
	}
	return r
}

func (f *fixture) publish(r PublishRequest) error   { return f.engine.Publish(r) }
func (f *fixture) unpublish(r PublishRequest) error { return f.engine.Unpublish(r.VolumeID, r.Target) }

// capture makes a ready cached volume handle in namespace ns with one file.
func (f *fixture) capture(ns, handle string) {
	f.t.Helper()
	v := f.volume(ns, "", handle)
	require.NoError(f.t, f.publish(v))
	require.NoError(f.t, os.WriteFile(filepath.Join(v.Target.Full, "file"), []byte(handle), 0o644))
	require.NoError(f.t, f.unpublish(v))
}

// A publish whose mount fails leaves nothing: no view, no reservation, no
// dirs, and the capture handle is free for the retry.
func TestFailedPublishLeavesNothing(t *testing.T) {
	f := newFixture(t)
	v := f.volume("ci", "", "out-1")
	injected := errors.New("injected mount failure")
	f.mounter.set(&f.mounter.failMount, injected)
	require.ErrorIs(t, f.publish(v), injected)
	f.mounter.set(&f.mounter.failMount, nil)
	_, err := f.store.GetView(v.VolumeID)
	require.ErrorIs(t, err, cache.ErrNotFound)
	_, err = os.Lstat(v.Target.Full)
	require.ErrorIs(t, err, os.ErrNotExist, "the target dir made for it is gone")
	_, err = f.store.Get(ref("ci", "out-1"))
	require.ErrorIs(t, err, cache.ErrNotFound)
	entries, err := os.ReadDir(f.store.ViewsDir())
	require.NoError(t, err)
	require.Empty(t, entries)
	require.NoError(t, f.publish(v), "the retry succeeds")
	require.NoError(t, f.unpublish(v))
	vol, err := f.store.Get(ref("ci", "out-1"))
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, vol.State)
}

// A writable view is made while its record commits (its target, tree and
// mount); a publish that then fails or is refused leaves nothing of it.
func TestStagedPublishLeavesNothing(t *testing.T) {
	tests := []struct {
		name    string
		source  string
		capture string
		fail    error // the mount fails so
		wantErr error
	}{
		{name: "the mount fails", source: "src", capture: "out", fail: errors.New("injected mount failure")},
		{name: "the record refuses it", source: "src", capture: "taken", wantErr: cache.ErrExists},
		{name: "the record refuses an empty volume", capture: "taken", wantErr: cache.ErrExists},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.capture("ci", "src")
			f.capture("ci", "taken")
			v := f.volume("ci", tc.source, tc.capture)
			f.mounter.mu.Lock()
			f.mounter.detached = 0
			f.mounter.mu.Unlock()
			f.mounter.set(&f.mounter.failMount, tc.fail)
			err := f.publish(v)
			f.mounter.set(&f.mounter.failMount, nil)
			f.mounter.mu.Lock()
			require.Equal(t, 1, f.mounter.detached, "the mount was made before the record")
			f.mounter.mu.Unlock()
			if tc.fail != nil {
				require.ErrorIs(t, err, tc.fail)
			} else {
				require.ErrorIs(t, err, tc.wantErr)
			}
			_, err = f.store.GetView(v.VolumeID)
			require.ErrorIs(t, err, cache.ErrNotFound)
			_, err = os.Lstat(v.Target.Full)
			require.ErrorIs(t, err, os.ErrNotExist, "the target dir made for it is gone")
			entries, err := os.ReadDir(f.store.ViewsDir())
			require.NoError(t, err)
			require.Empty(t, entries, "no tree is left")
			if tc.fail != nil {
				require.NoError(t, f.publish(v), "the retry succeeds")
				got, err := os.ReadFile(filepath.Join(v.Target.Full, "file"))
				require.NoError(t, err)
				require.Equal(t, "src", string(got))
				require.NoError(t, f.unpublish(v))
			}
		})
	}
}

// A tree made ahead that a dead process left and that cannot be removed
// (an immutable file in it) never keeps the node from starting, nor from
// staging views.
func TestStuckTreeDoesNotStopTheNode(t *testing.T) {
	testfs.Need(t, "chattr")
	stateDir := t.TempDir()
	stuck := filepath.Join(stateDir, "trees", "t1", "upper", "stuck")
	require.NoError(t, os.MkdirAll(filepath.Dir(stuck), 0o700))
	require.NoError(t, os.WriteFile(stuck, nil, 0o644))
	if out, err := exec.Command("chattr", "+i", stuck).CombinedOutput(); err != nil {
		t.Skipf("chattr +i on %s: %v: %s (the temp dir's filesystem has no immutable flag)", stuck, err, out)
	}
	t.Cleanup(func() { _ = exec.Command("chattr", "-i", stuck).Run() })
	f := newFixtureAt(t, stateDir, "")
	f.capture("ci", "src")
	v := f.volume("ci", "src", "out")
	require.NoError(t, f.publish(v))
	got, err := os.ReadFile(filepath.Join(v.Target.Full, "file"))
	require.NoError(t, err)
	require.Equal(t, "src", string(got))
	require.NoFileExists(t, filepath.Join(v.Target.Full, "upper"))
	require.NoError(t, f.unpublish(v))
}

func ref(ns, h string) volume.Ref { return volume.Ref{Namespace: ns, Handle: h} }

// A capture whose unmount fails is retried by the kubelet and completes.
func TestFailedCaptureCompletesOnRetry(t *testing.T) {
	f := newFixture(t)
	v := f.volume("ci", "", "out-2")
	require.NoError(t, f.publish(v))
	require.NoError(t, os.WriteFile(filepath.Join(v.Target.Full, "f"), []byte("data"), 0o644))
	f.mounter.set(&f.mounter.failUnmount, unix.EBUSY)
	require.ErrorIs(t, f.unpublish(v), unix.EBUSY)
	vol, err := f.store.Get(ref("ci", "out-2"))
	require.NoError(t, err)
	require.Equal(t, volume.StateCreating, vol.State, "nothing half-made is visible")
	f.mounter.set(&f.mounter.failUnmount, nil)
	require.NoError(t, f.unpublish(v))
	vol, err = f.store.Get(ref("ci", "out-2"))
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, vol.State)
	data, err := os.ReadFile(filepath.Join(f.store.DataPath(vol), "f"))
	require.NoError(t, err)
	require.Equal(t, "data", string(data))
}

// A state dir that runs out of inodes fails publishes, with ENOSPC or, once
// the reaper has seen the disk over its high watermark, ErrNodeFull (the CSI
// adapter answers both ResourceExhausted), and leaves the store consistent.
func TestDiskFullIsResourceExhausted(t *testing.T) {
	testfs.Need(t)
	dir := t.TempDir()
	require.NoError(t, unix.Mount("tmpfs", dir, "tmpfs", 0, "size=64m,nr_inodes=64"))
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	f := newFixtureAt(t, dir, "")
	for i := 0; ; i++ {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("filler-%d", i)), nil, 0o600); err != nil {
			require.ErrorIs(t, err, unix.ENOSPC)
			break
		}
	}
	v := f.volume("ci", "", "full")
	err := f.publish(v)
	require.True(t, errors.Is(err, unix.ENOSPC) || errors.Is(err, ErrNodeFull), "err: %v", err)
	_, err = f.store.Get(ref("ci", "full"))
	require.ErrorIs(t, err, cache.ErrNotFound, "the reservation was released")
}

// Many volumes published, captured and torn down in parallel (run with
// -race): every one succeeds and every capture is complete.
func TestParallelPublishAndCapture(t *testing.T) {
	f := newFixture(t)
	f.capture("ci", "shared")
	const workers = 16
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	vols := make([]PublishRequest, workers)
	for i := range vols {
		vols[i] = f.volume("ci", "shared", fmt.Sprintf("par-%d", i))
	}
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			v := vols[i]
			if err := f.publish(v); err != nil {
				errs <- err
				return
			}
			if err := os.WriteFile(filepath.Join(v.Target.Full, "mine"), []byte(v.VolumeID), 0o644); err != nil {
				errs <- err
				return
			}
			errs <- f.unpublish(v)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for i, v := range vols {
		vol, err := f.store.Get(ref("ci", fmt.Sprintf("par-%d", i)))
		require.NoError(t, err)
		require.Equal(t, volume.StateReady, vol.State)
		require.Equal(t, ref("ci", "shared"), vol.Base)
		data, err := os.ReadFile(filepath.Join(f.store.DataPath(vol), "mine"))
		require.NoError(t, err)
		require.Equal(t, v.VolumeID, string(data))
	}
}

// Two concurrent publishes of one volume: one does the work, the other is
// told to retry or sees it done; never two volumes.
func TestConcurrentDuplicatePublish(t *testing.T) {
	f := newFixture(t)
	v := f.volume("ci", "", "dup")
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- f.publish(v)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			require.ErrorIs(t, err, ErrBusy)
		}
	}
	require.NoError(t, f.publish(v))
	require.Len(t, f.store.ListViews(), 1)
	require.NoError(t, f.unpublish(v))
}

// A ready volume whose data vanished is marked failed at start-up, never
// served half-there, destroyed in the background; its handle then backs
// off before it can be captured again.
func TestMissingDataIsMarkedFailed(t *testing.T) {
	f := newFixture(t)
	f.capture("ci", "doomed")
	vol, err := f.store.Get(ref("ci", "doomed"))
	require.NoError(t, err)
	require.NoError(t, os.RemoveAll(f.store.DataPath(vol)))
	f.restart()
	err = f.publish(f.volume("ci", "doomed", ""))
	require.True(t, errors.Is(err, cache.ErrUnusable) || errors.Is(err, cache.ErrNotFound), "refused: %v", err)
	require.Eventually(t, func() bool { return errors.Is(f.publish(f.volume("ci", "doomed", "")), cache.ErrNotFound) },
		30*time.Second, 10*time.Millisecond, "the failed volume is destroyed")
	require.ErrorIs(t, f.publish(f.volume("ci", "", "doomed")), cache.ErrBackoff, "its handle backs off")
}

// After a reboot (a new boot ID, the mounts gone), a step volume of the
// old boot is torn down without being captured (what it wrote may be torn),
// while synced cached volumes stay ready.
func TestRebootDiscardsOldStepVolumes(t *testing.T) {
	bootFile := filepath.Join(t.TempDir(), "boot_id")
	require.NoError(t, os.WriteFile(bootFile, []byte("boot-1\n"), 0o644))

	f := newFixtureAt(t, t.TempDir(), bootFile)
	f.capture("ci", "durable")
	require.Eventually(t, func() bool { return len(f.store.Unsynced()) == 0 },
		30*time.Second, 10*time.Millisecond, "captures are synced in the background")
	v := f.volume("ci", "durable", "in-flight")
	require.NoError(t, f.publish(v))
	require.NoError(t, os.WriteFile(filepath.Join(v.Target.Full, "half"), []byte("written"), 0o644))

	f.stop()
	require.NoError(t, unix.Unmount(v.Target.Full, 0))
	require.NoError(t, os.WriteFile(bootFile, []byte("boot-2\n"), 0o644))
	f.start()

	require.NoError(t, f.unpublish(v))
	_, err := f.store.Get(ref("ci", "in-flight"))
	require.ErrorIs(t, err, cache.ErrNotFound, "a step from before the reboot is not captured")
	vol, err := f.store.Get(ref("ci", "durable"))
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, vol.State)
	require.NoError(t, f.publish(f.volume("ci", "durable", "")))
}

// A publish records its view in one transaction and mounts it; the mount's
// ID is recorded after the publish returned, and from then on only that
// mount is ever unmounted at the target.
func TestPublishRecordsItsMountAfterwards(t *testing.T) {
	f := newFixture(t)
	f.capture("ci", "src")
	v := f.volume("ci", "src", "out")
	require.NoError(t, f.publish(v))
	id, root, err := mountid.Of(v.Target.Full)
	require.NoError(t, err)
	require.True(t, root)
	require.Eventually(t, func() bool {
		view, err := f.store.GetView(v.VolumeID)
		return err == nil && view.MountID == id && view.MountRoot != ""
	}, 10*time.Second, 10*time.Millisecond, "the mount is recorded in the background")

	// Something mounted over the step volume is not cowvol's: refused,
	// and left mounted, until it goes.
	require.NoError(t, unix.Mount("tmpfs", v.Target.Full, "tmpfs", 0, "size=1m"))
	require.ErrorIs(t, f.unpublish(v), target.ErrUnsafe)
	require.NoError(t, unix.Unmount(v.Target.Full, 0))
	require.NoError(t, f.unpublish(v))
	_, err = f.store.Get(ref("ci", "out"))
	require.NoError(t, err, "captured once cowvol's own mount was on top again")
}

// A publish whose source is a step's output on this node still being
// captured waits for the capture (a CI engine creates the next step the
// moment the last one's containers end, before the kubelet tears its
// volumes down), and answers Unavailable only once the wait is over; a
// source another namespace is writing is answered at once, as one that
// does not exist.
func TestPublishWaitsForACapture(t *testing.T) {
	f := newFixtureWith(t, t.TempDir(), func(c *Config) { c.CaptureWait = 2 * time.Second })
	out := f.volume("ci", "", "out")
	require.NoError(t, f.publish(out))
	require.NoError(t, os.WriteFile(filepath.Join(out.Target.Full, "made"), []byte("by the last step"), 0o644))

	next := f.volume("ci", "out", "")
	published := make(chan error, 1)
	start := time.Now()
	go func() { published <- f.publish(next) }()
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, f.unpublish(out), "the last step's volume torn down: its capture")
	require.NoError(t, <-published, "the next step waited for its source")
	require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)
	got, err := os.ReadFile(filepath.Join(next.Target.Full, "made"))
	require.NoError(t, err)
	require.Equal(t, "by the last step", string(got))

	running := f.volume("ci", "", "running")
	require.NoError(t, f.publish(running))
	start = time.Now()
	require.ErrorIs(t, f.publish(f.volume("ci", "running", "")), cache.ErrNotReady, "a step still running: Unavailable, after the wait")
	require.GreaterOrEqual(t, time.Since(start), 2*time.Second)
	other := f.volume("other", "", "")
	other.Source = volume.Ref{Namespace: "ci", Handle: "running"} // sourceNamespace: ci
	start = time.Now()
	require.ErrorIs(t, f.publish(other), cache.ErrNotFound)
	require.Less(t, time.Since(start), time.Second, "another namespace's output is not waited for")
}
