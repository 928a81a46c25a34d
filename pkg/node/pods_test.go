package node

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/volume"
)

// fakePods answers for pods as the API server would: which run in a user
// namespace of their own, how their steps ended, and what controls them.
type fakePods struct {
	mu      sync.Mutex
	userns  map[string]bool
	results map[string]volume.StepResult
	owners  map[string]volume.Owner
	fail    error
}

func (p *fakePods) Controller(_ context.Context, pod volume.Pod) (volume.Owner, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	o, ok := p.owners[pod.Name]
	return o, ok, p.fail
}

func (p *fakePods) UserNamespace(_ context.Context, pod volume.Pod) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.userns[pod.Name], p.fail
}

func (p *fakePods) StepResult(_ context.Context, pod volume.Pod) (volume.StepResult, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r, ok := p.results[pod.Name]
	return r, ok
}

func (p *fakePods) set(pod string, userns bool, result volume.StepResult) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.userns[pod] = userns
	if result != "" {
		p.results[pod] = result
	}
}

func newPodsFixture(t *testing.T, stateDir string) (*fixture, *fakePods) {
	pods := &fakePods{userns: map[string]bool{}, results: map[string]volume.StepResult{}, owners: map[string]volume.Owner{}}
	f := newFixtureWith(t, stateDir, func(c *Config) { c.Pods = pods })
	return f, pods
}

// A pod with a user namespace of its own (hostUsers: false) has its
// volumes idmapped by its runtime, which cannot idmap an overlay mount. On
// an overlay node whose state dir clones (XFS), its views are reflink
// clones: get as root, a user-namespace task changing its input and
// capturing, and a read-only user-namespace view of a chain all work, and
// what is captured keeps node-side owners with no chown walk.
func TestUserNamespaceViewsOnOverlay(t *testing.T) {
	testfs.Need(t, "mkfs.xfs")
	f, pods := newPodsFixture(t, testfs.Mount(t, testfs.XFS, 1<<30))

	get := f.volume("ci", "", "res")
	pods.set(get.Pod.Name, false, volume.StepSucceeded)
	require.NoError(t, f.publish(get))
	for name, uid := range map[string]int{"root-file": 0, "user-file": 1000} {
		p := filepath.Join(get.Target.Full, name)
		require.NoError(t, os.WriteFile(p, []byte(name), 0o644))
		require.NoError(t, os.Lchown(p, uid, uid))
	}
	require.NoError(t, f.unpublish(get))

	task := f.volume("ci", "res", "built")
	pods.set(task.Pod.Name, true, volume.StepFailed)
	require.NoError(t, f.publish(task))
	view, err := f.store.GetView(task.VolumeID)
	require.NoError(t, err)
	require.Equal(t, string(overlay.KindReflink), view.Backend)
	require.True(t, view.UserNamespace)
	require.NoError(t, testfs.Idmap(t, task.Target.Full), "the runtime can idmap it")
	require.NoError(t, os.WriteFile(filepath.Join(task.Target.Full, "out"), []byte("built"), 0o644))
	require.NoError(t, f.unpublish(task))
	built, err := f.store.Get(ref("ci", "built"))
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, built.State)
	require.Equal(t, ref("ci", "res"), built.Parent)
	require.Equal(t, string(volume.StepFailed), built.Properties[volume.PropertyStepResult])
	var st unix.Stat_t
	require.NoError(t, unix.Lstat(filepath.Join(f.store.DataPath(built), "user-file"), &st))
	require.Equal(t, uint32(1000), st.Uid, "node-side owners, unchanged")

	// A chain (an overlay capture over res) read by a user-namespace pod.
	next := f.volume("ci", "res", "next")
	require.NoError(t, f.publish(next))
	require.NoError(t, os.WriteFile(filepath.Join(next.Target.Full, "next"), nil, 0o644))
	require.NoError(t, f.unpublish(next))
	read := f.volume("ci", "next", "")
	read.ReadOnly = true
	pods.set(read.Pod.Name, true, "")
	require.NoError(t, f.publish(read))
	require.NoError(t, testfs.Idmap(t, read.Target.Full))
	for _, name := range []string{"root-file", "user-file", "next"} {
		_, err := os.Lstat(filepath.Join(read.Target.Full, name))
		require.NoError(t, err, name)
	}
	require.NoError(t, f.unpublish(read))

	// The same read by a pod sharing the host's users is an overlay, as
	// before, which the runtime could not idmap.
	plain := f.volume("ci", "next", "")
	plain.ReadOnly = true
	require.NoError(t, f.publish(plain))
	require.ErrorIs(t, testfs.Idmap(t, plain.Target.Full), unix.EINVAL)
	require.NoError(t, f.unpublish(plain))
}

// On a state dir without reflink clones, an overlay node refuses a
// user-namespace pod a writable view of a source, saying what the node
// needs, instead of leaving the pod to the runtime's StartError; empty
// volumes still work. An API server that cannot answer is retried.
func TestUserNamespaceViewsWithoutClones(t *testing.T) {
	f, pods := newPodsFixture(t, t.TempDir())
	f.capture("ci", "res")

	task := f.volume("ci", "res", "out")
	pods.set(task.Pod.Name, true, "")
	err := f.publish(task)
	require.ErrorIs(t, err, overlay.ErrNotIdmappable)
	require.ErrorContains(t, err, "reflink")
	_, err = f.store.Get(ref("ci", "out"))
	require.ErrorIs(t, err, cache.ErrNotFound, "nothing left reserved")

	empty := f.volume("ci", "", "empty-out")
	pods.set(empty.Pod.Name, true, "")
	require.NoError(t, f.publish(empty))
	require.NoError(t, testfs.Idmap(t, empty.Target.Full))
	require.NoError(t, f.unpublish(empty))

	pods.fail = errors.New("connection refused")
	err = f.publish(f.volume("ci", "res", ""))
	require.ErrorIs(t, err, ErrPodUnknown)
}

// A volume captured with owner: controller records the object that
// controls its pod, read at publish while the pod surely exists; a pod
// that no object controls is refused before anything is reserved, and an
// API server that cannot answer is retried.
func TestOwnedByController(t *testing.T) {
	f, pods := newPodsFixture(t, t.TempDir())
	wf := volume.Owner{Group: "argoproj.io", Kind: "Workflow", Name: "build-x7k2p", UID: "6f1c4d1e-8a55-4c43-9a3e-1d2b3c4d5e6f"}

	out := f.volume("ci", "", "owned")
	out.OwnedByController = true
	out.Properties = map[string]string{"job": "unit"}
	pods.owners[out.Pod.Name] = wf
	require.NoError(t, f.publish(out))
	require.NoError(t, f.publish(out), "a publish again is the same publish")
	require.NoError(t, f.unpublish(out))
	vol, err := f.store.Get(ref("ci", "owned"))
	require.NoError(t, err)
	require.Equal(t, "Workflow.argoproj.io/build-x7k2p", vol.Properties[volume.PropertyOwner])
	require.Equal(t, "unit", vol.Properties["job"], "the step's own properties stay")
	got, ok := volume.OwnerOf(vol.Properties)
	require.True(t, ok)
	require.Equal(t, wf, got)

	// The owner sweep's destroy is checked against this node's record of
	// the owner: another UID (a node that lied about the owner, or a
	// controller's answer corrupted on the way), a volume that names none,
	// the same handle in another namespace, is kept.
	plain := f.volume("ci", "", "plain")
	require.NoError(t, f.publish(plain))
	require.NoError(t, f.unpublish(plain))
	for _, tt := range []struct {
		name       string
		ns, handle string
		uid        string
	}{
		{"another owner's UID", "ci", "owned", "00000000-0000-4000-8000-00000000000f"},
		{"no UID", "ci", "owned", ""},
		{"the UID in upper case", "ci", "owned", strings.ToUpper(wf.UID)},
		{"the UID with a space", "ci", "owned", wf.UID + " "},
		{"a prefix of the UID", "ci", "owned", wf.UID[:8]},
		{"a volume that names no owner", "ci", "plain", wf.UID},
		{"a volume this node lacks", "ci", "missing", wf.UID},
		{"the handle in another namespace", "other", "owned", wf.UID},
	} {
		did, err := f.engine.DestroyIfOwned(ref(tt.ns, tt.handle), tt.uid)
		require.NoError(t, err, tt.name)
		require.False(t, did, tt.name)
	}
	kept, err := f.store.Get(ref("ci", "owned"))
	require.NoError(t, err)
	require.Equal(t, volume.StateReady, kept.State, "kept")
	// Pinned after the sweep read the view: the pin is the word here.
	_, err = f.engine.Pin(ref("ci", "owned"), time.Time{})
	require.NoError(t, err)
	did, err := f.engine.DestroyIfOwned(ref("ci", "owned"), wf.UID)
	require.NoError(t, err)
	require.False(t, did, "a pinned volume is kept")
	_, err = f.engine.Unpin(ref("ci", "owned"))
	require.NoError(t, err)
	did, err = f.engine.DestroyIfOwned(ref("ci", "owned"), wf.UID)
	require.NoError(t, err)
	require.True(t, did)
	if gone, err := f.store.Get(ref("ci", "owned")); err == nil {
		require.Equal(t, volume.StateDestroying, gone.State, "destroyed: its owner is the one gone")
	} else {
		require.ErrorIs(t, err, cache.ErrNotFound)
	}

	orphan := f.volume("ci", "", "orphan")
	orphan.OwnedByController = true
	require.ErrorIs(t, f.publish(orphan), ErrNoOwner)
	_, err = f.store.Get(ref("ci", "orphan"))
	require.ErrorIs(t, err, cache.ErrNotFound, "nothing left reserved")

	pods.fail = errors.New("connection refused")
	require.ErrorIs(t, f.publish(orphan), ErrPodUnknown)

	noAPI := newFixture(t)
	unowned := noAPI.volume("ci", "", "owned")
	unowned.OwnedByController = true
	require.ErrorIs(t, noAPI.publish(unowned), ErrNoOwner, "without an API server nothing can say what owns a pod")
}
