package driver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/volume"
)

// fixture is an in-process node service on a real overlay state dir.
type fixture struct {
	t        *testing.T
	opts     Options
	store    *cache.Store
	node     *nodeService
	mounter  *faultyMounter
	pods     string
	n        int
	stateDir string
}

// faultyMounter is the real mounter with injectable failures, for the error
// paths a real mount cannot be made to take on demand.
type faultyMounter struct {
	overlay.Mounter
	mu          sync.Mutex
	failMount   error
	failUnmount error
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

// newFixtureAt runs a node service on stateDir, reading the boot ID from
// bootIDFile (the kernel's when empty).
func newFixtureAt(t *testing.T, stateDir, bootIDFile string) *fixture {
	t.Helper()
	testfs.Need(t)
	f := &fixture{t: t, pods: t.TempDir(), stateDir: stateDir, mounter: &faultyMounter{Mounter: overlay.NewSysMounter()}}
	f.opts = Options{Endpoint: "unix:///unused.sock", Mode: ModeNode, NodeID: "node-1", StateDir: f.stateDir,
		Backend: "overlay", FlattenDepth: 64, KubeletDir: f.pods, bootIDFile: bootIDFile}
	require.NoError(t, f.opts.Validate())
	f.start()
	t.Cleanup(f.teardown)
	return f
}

// teardown unpublishes what a test left published, as the kubelet would,
// so that no mount outlives the test.
func (f *fixture) teardown() {
	if f.node == nil {
		return
	}
	for _, v := range f.store.ListViews() {
		_, err := f.node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: v.VolumeID, TargetPath: v.Target})
		assert.NoError(f.t, err, "unpublishing %s at teardown", v.VolumeID)
	}
	f.stop()
}

func (f *fixture) start() {
	store, err := cache.Open(f.stateDir)
	require.NoError(f.t, err)
	node, err := newNodeService(f.opts, store, f.mounter, newMetrics(), nil)
	require.NoError(f.t, err)
	f.store, f.node = store, node
}

func (f *fixture) stop() {
	if f.node != nil {
		f.node.stop()
		f.store.Close()
		f.node = nil
	}
}

// restart is a new process on the same state dir (without a crash).
func (f *fixture) restart() {
	f.stop()
	f.start()
}

func (f *fixture) volume(ns string, attrs map[string]string) InlineVolume {
	f.n++
	v := NewInlineVolume(f.pods, NewPod(ns, fmt.Sprintf("pod-%d", f.n)), "vol", attrs)
	require.NoError(f.t, os.MkdirAll(filepath.Dir(v.Target), 0o750))
	return v
}

func (f *fixture) publish(v InlineVolume) error {
	_, err := f.node.NodePublishVolume(context.Background(), v.PublishRequest())
	return err
}

func (f *fixture) unpublish(v InlineVolume) error {
	_, err := f.node.NodeUnpublishVolume(context.Background(), v.UnpublishRequest())
	return err
}

// capture makes a ready cached volume handle in namespace ns with one file.
func (f *fixture) capture(ns, handle string, extra map[string]string) {
	f.t.Helper()
	attrs := map[string]string{AttrCapture: handle}
	for k, v := range extra {
		attrs[k] = v
	}
	v := f.volume(ns, attrs)
	require.NoError(f.t, f.publish(v))
	require.NoError(f.t, os.WriteFile(filepath.Join(v.Target, "file"), []byte(handle), 0o644))
	require.NoError(f.t, f.unpublish(v))
}

func TestNodeGetInfoAndCapabilities(t *testing.T) {
	f := newFixture(t)
	info, err := f.node.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
	require.NoError(t, err)
	assert.Equal(t, "node-1", info.NodeId)
	assert.Equal(t, "node-1", info.AccessibleTopology.Segments[TopologyKey])
	caps, err := f.node.NodeGetCapabilities(context.Background(), &csi.NodeGetCapabilitiesRequest{})
	require.NoError(t, err)
	require.Len(t, caps.Capabilities, 1)
	assert.Equal(t, csi.NodeServiceCapability_RPC_GET_VOLUME_STATS, caps.Capabilities[0].GetRpc().GetType())
}

// A publish whose mount fails leaves nothing: no view, no reservation, no
// dirs, and the capture handle is free for the retry.
func TestFailedPublishLeavesNothing(t *testing.T) {
	f := newFixture(t)
	v := f.volume("ci", map[string]string{AttrCapture: "out-1"})
	f.mounter.set(&f.mounter.failMount, errors.New("injected mount failure"))
	require.Equal(t, codes.Internal, status.Code(f.publish(v)))
	f.mounter.set(&f.mounter.failMount, nil)
	_, err := f.store.GetView(v.VolumeID)
	require.ErrorIs(t, err, cache.ErrNotFound)
	_, err = os.Lstat(v.Target)
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

func ref(ns, h string) volume.Ref { return volume.Ref{Namespace: ns, Handle: h} }

// A capture whose unmount fails is retried by the kubelet and completes.
func TestFailedCaptureCompletesOnRetry(t *testing.T) {
	f := newFixture(t)
	v := f.volume("ci", map[string]string{AttrCapture: "out-2"})
	require.NoError(t, f.publish(v))
	require.NoError(t, os.WriteFile(filepath.Join(v.Target, "f"), []byte("data"), 0o644))
	f.mounter.set(&f.mounter.failUnmount, unix.EBUSY)
	require.Equal(t, codes.Internal, status.Code(f.unpublish(v)))
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

// A state dir that runs out of inodes fails publishes with
// ResourceExhausted and leaves the store consistent.
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
	v := f.volume("ci", map[string]string{AttrCapture: "full"})
	require.Equal(t, codes.ResourceExhausted, status.Code(f.publish(v)))
	_, err := f.store.Get(ref("ci", "full"))
	require.ErrorIs(t, err, cache.ErrNotFound, "the reservation was released")
}

// Many volumes published, captured and torn down in parallel (run with
// -race): every one succeeds and every capture is complete.
func TestParallelPublishAndCapture(t *testing.T) {
	f := newFixture(t)
	f.capture("ci", "shared", nil)
	const workers = 16
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	vols := make([]InlineVolume, workers)
	for i := range vols {
		vols[i] = f.volume("ci", map[string]string{AttrSource: "shared", AttrCapture: fmt.Sprintf("par-%d", i)})
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
			if err := os.WriteFile(filepath.Join(v.Target, "mine"), []byte(v.VolumeID), 0o644); err != nil {
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
	v := f.volume("ci", map[string]string{AttrCapture: "dup"})
	var wg sync.WaitGroup
	codesSeen := make(chan codes.Code, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codesSeen <- status.Code(f.publish(v))
		}()
	}
	wg.Wait()
	close(codesSeen)
	for c := range codesSeen {
		require.Contains(t, []codes.Code{codes.OK, codes.Aborted}, c)
	}
	require.NoError(t, f.publish(v))
	require.Len(t, f.store.ListViews(), 1)
	require.NoError(t, f.unpublish(v))
}

// A ready volume whose data vanished is marked failed at start-up and
// refused as a source, never served half-there.
func TestMissingDataIsMarkedFailed(t *testing.T) {
	f := newFixture(t)
	f.capture("ci", "doomed", nil)
	vol, err := f.store.Get(ref("ci", "doomed"))
	require.NoError(t, err)
	require.NoError(t, os.RemoveAll(f.store.DataPath(vol)))
	f.restart()
	vol, err = f.store.Get(ref("ci", "doomed"))
	require.NoError(t, err)
	require.Equal(t, volume.StateFailed, vol.State)
	err = f.publish(f.volume("ci", map[string]string{AttrSource: "doomed"}))
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "err: %v", err)
}

func TestOptionsValidate(t *testing.T) {
	good := func() Options {
		return Options{Endpoint: "unix:///csi/csi.sock", Mode: ModeNode, NodeID: "n", StateDir: "/var/lib/cowvol",
			Backend: "auto", FlattenDepth: 64, KubeletDir: "/var/lib/kubelet"}
	}
	tests := []struct {
		name    string
		mut     func(*Options)
		wantErr string
	}{
		{"ok", func(*Options) {}, ""},
		{"tcp endpoint", func(o *Options) { o.Endpoint = "tcp://127.0.0.1:10000" }, ""},
		{"controller needs no state", func(o *Options) { o.Mode = ModeController; o.StateDir = "" }, ""},
		{"bad scheme", func(o *Options) { o.Endpoint = "http://x" }, "endpoint"},
		{"no socket path", func(o *Options) { o.Endpoint = "unix://" }, "socket path"},
		{"bad mode", func(o *Options) { o.Mode = "both" }, "mode"},
		{"no node ID", func(o *Options) { o.NodeID = "" }, "node ID"},
		{"relative state dir", func(o *Options) { o.StateDir = "state" }, "absolute"},
		{"bad backend", func(o *Options) { o.Backend = "zfs" }, "unknown COW backend"},
		{"flatten depth too deep", func(o *Options) { o.FlattenDepth = 600 }, "flatten depth"},
		{"relative kubelet dir", func(o *Options) { o.KubeletDir = "kubelet" }, "kubelet dir"},
		{"negative limit", func(o *Options) { o.MaxSizeLimit = -1 }, "negative"},
		{"default over max", func(o *Options) { o.DefaultSizeLimit, o.MaxSizeLimit = 2, 1 }, "exceeds the maximum"},
		{"registration in controller mode", func(o *Options) { o.Mode = ModeController; o.RegistrationSocket = "/r.sock" }, "node plugins"},
		{"registration needs a unix endpoint", func(o *Options) {
			o.Endpoint = "tcp://127.0.0.1:1"
			o.RegistrationSocket = "/r.sock"
		}, "unix endpoint"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := good()
			tc.mut(&o)
			err := o.Validate()
			if tc.wantErr == "" {
				require.NoError(t, err)
				require.Equal(t, DefaultDriverName, o.DriverName)
				return
			}
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

// After a reboot (a new boot ID, the mounts gone), a step volume of the
// old boot is torn down without being captured (what it wrote may be torn),
// while synced cached volumes stay ready.
func TestRebootDiscardsOldStepVolumes(t *testing.T) {
	bootFile := filepath.Join(t.TempDir(), "boot_id")
	require.NoError(t, os.WriteFile(bootFile, []byte("boot-1\n"), 0o644))

	f := newFixtureAt(t, t.TempDir(), bootFile)
	f.capture("ci", "durable", nil)
	require.Eventually(t, func() bool { return len(f.store.Unsynced()) == 0 },
		30*time.Second, 10*time.Millisecond, "captures are synced in the background")
	v := f.volume("ci", map[string]string{AttrSource: "durable", AttrCapture: "in-flight"})
	require.NoError(t, f.publish(v))
	require.NoError(t, os.WriteFile(filepath.Join(v.Target, "half"), []byte("written"), 0o644))

	f.stop()
	require.NoError(t, unix.Unmount(v.Target, 0))
	require.NoError(t, os.WriteFile(bootFile, []byte("boot-2\n"), 0o644))
	f.start()

	require.NoError(t, f.unpublish(v))
	_, err := f.store.Get(ref("ci", "in-flight"))
	require.ErrorIs(t, err, cache.ErrNotFound, "a step from before the reboot is not captured")
	vol, err := f.store.Get(ref("ci", "durable"))
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, vol.State)
	require.NoError(t, f.publish(f.volume("ci", map[string]string{AttrSource: "durable"})))
}
