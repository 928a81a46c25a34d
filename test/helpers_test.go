// Package test drives the real cowvol-plugin binary over gRPC with real
// mounts: the behavioural suite on every COW backend, the CSI contract
// (codes, idempotency) and crash safety.
package test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/internal/mountid"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/overlay"
)

// env is one plugin and its pretend pods.
type env struct {
	t       *testing.T
	p       *plugintest.Plugin
	metrics string // host:port of its /metrics
	n       int
}

func newEnv(t *testing.T, cfg plugintest.Config) *env {
	t.Helper()
	if cfg.StateDir == "" {
		cfg.StateDir = t.TempDir()
	}
	if cfg.KubeletDir == "" {
		cfg.KubeletDir = kubeletDir(t)
	}
	metrics := plugintest.FreeAddr(t)
	cfg.Args = append([]string{"--metrics-address=" + metrics}, cfg.Args...)
	// A plugin that stops leaves the indexes of the volumes it pulled as
	// indexes and did not fill mounted, for the views over them (a
	// restarted plugin fails those volumes, and its reaper takes their
	// indexes down); once the test and its plugin end they go, as a
	// reboot would take them. (Registered before the plugin: its stop
	// comes first.)
	t.Cleanup(func() {
		for _, mp := range erofsMountsUnder(t, cfg.StateDir) {
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
	})
	return &env{t: t, p: plugintest.Start(t, cfg), metrics: metrics}
}

// kubeletDir is a dir for pretend pods' volumes. A test that fails half-way
// leaves volumes published; they are detached when it ends so that no
// mount outlives it (a passing test checks it left none with noLeaks).
func kubeletDir(t *testing.T) string {
	dir := t.TempDir()
	t.Cleanup(func() {
		mounts, _ := overlay.MountsUnder(dir)
		for _, mp := range mounts {
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
	})
	return dir
}

// volume makes a new inline volume for a pretend pod in namespace "ci".
func (e *env) volume(attrs map[string]string, readOnly bool) kubeletsim.InlineVolume {
	return e.volumeIn("ci", attrs, readOnly)
}

// volumeIn makes a new inline volume for a pretend pod in namespace ns.
func (e *env) volumeIn(ns string, attrs map[string]string, readOnly bool) kubeletsim.InlineVolume {
	e.n++
	v := e.p.Volume(ns, fmt.Sprintf("pod-%d", e.n), "vol", attrs)
	v.ReadOnly = readOnly
	return v
}

func (e *env) publish(v kubeletsim.InlineVolume) error   { return e.p.Publish(v) }
func (e *env) unpublish(v kubeletsim.InlineVolume) error { return e.p.Unpublish(v) }

// mount publishes a new volume and fails the test if that fails.
func (e *env) mount(attrs map[string]string, readOnly bool) kubeletsim.InlineVolume {
	e.t.Helper()
	v := e.volume(attrs, readOnly)
	require.NoError(e.t, e.publish(v), "publishing %v", attrs)
	return v
}

func (e *env) umount(v kubeletsim.InlineVolume) {
	e.t.Helper()
	require.NoError(e.t, e.unpublish(v), "unpublishing %s", v.VolumeID)
	_, err := os.Lstat(v.Target)
	require.True(e.t, errors.Is(err, os.ErrNotExist), "target %s should be gone after unpublish", v.Target)
}

// step runs fn as a pod on a volume of source (may be empty) captured as
// handle, and returns once it is captured.
func (e *env) step(source, handle string, fn func(dir string)) {
	e.t.Helper()
	attrs := map[string]string{driver.AttrCapture: handle}
	if source != "" {
		attrs[driver.AttrSource] = source
	}
	v := e.mount(attrs, false)
	fn(v.Target)
	e.umount(v)
}

// read runs fn on a read-only view of handle.
func (e *env) read(handle string, fn func(dir string)) {
	e.t.Helper()
	v := e.mount(map[string]string{driver.AttrSource: handle}, true)
	fn(v.Target)
	e.umount(v)
}

func code(err error) codes.Code { return status.Code(err) }

func write(t *testing.T, root, name, data string) {
	t.Helper()
	p := filepath.Join(root, name)
	require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
	require.NoError(t, os.WriteFile(p, []byte(data), 0o644))
}

func readFile(t *testing.T, root, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, name))
	require.NoError(t, err)
	return string(b)
}

func absent(t *testing.T, root, name string) {
	t.Helper()
	_, err := os.Lstat(filepath.Join(root, name))
	require.True(t, errors.Is(err, os.ErrNotExist), "%s should not exist in %s (err %v)", name, root, err)
}

// retry calls call until it succeeds, failing t with its last error after
// a minute.
func retry(t *testing.T, what string, call func() error) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		err := call()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s: %v", what, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// eventually waits up to a minute for cond.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	retry(t, what, func() error {
		if cond() {
			return nil
		}
		return errors.New("not yet")
	})
}

// mountID is the unique ID of the mount whose root path is, or 0 when path
// is not a mount root: a view adopted across a restart keeps its ID, a
// view mounted again gets a new one.
func mountID(t *testing.T, path string) uint64 {
	t.Helper()
	id, root, err := mountid.Of(path)
	require.NoError(t, err)
	if !root {
		return 0
	}
	return id
}

// backend is the COW backend the plugin says it runs (the node API's
// GetNode).
func (e *env) backend(t *testing.T) string {
	t.Helper()
	n, err := e.p.NodeAPI.GetNode(context.Background(), &nodev1.GetNodeRequest{})
	require.NoError(t, err)
	return n.GetBackend()
}
