package test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/overlay"
)

// Squatting and poisoning: namespace evil captures a handle first (shared
// with everyone), then ci captures the same handle. ci's capture is its own,
// ci's source resolves to ci's data, and only a pod that names evil's
// namespace gets evil's data.
func TestSquattingIsHarmless(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	e.captureIn("evil", "res-7f3a", map[string]string{driver.AttrScope: "cluster"})
	e.captureIn("ci", "res-7f3a", nil)
	tests := []struct {
		name     string
		ns       string
		attrs    map[string]string
		wantCode codes.Code
		want     string
	}{
		{"ci's source is ci's", "ci", map[string]string{"source": "res-7f3a"}, codes.OK, "ci/res-7f3a"},
		{"evil's, named, is evil's", "ci", map[string]string{"source": "res-7f3a", "sourceNamespace": "evil"}, codes.OK, "evil/res-7f3a"},
		{"evil cannot name ci's private volume", "evil", map[string]string{"source": "res-7f3a", "sourceNamespace": "ci"}, codes.NotFound, ""},
		{"evil's own source is evil's", "evil", map[string]string{"source": "res-7f3a"}, codes.OK, "evil/res-7f3a"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v := e.volumeIn(tc.ns, tc.attrs, true)
			err := e.publish(v)
			require.Equal(t, tc.wantCode, code(err), "err: %v", err)
			if err != nil {
				require.NotContains(t, status.Convert(err).Message(), "evil")
				return
			}
			require.Equal(t, tc.want, readFile(t, v.Target, "file"))
			e.umount(v)
		})
	}
	// Capturing a handle another namespace holds is a capture of one's own.
	require.NoError(t, e.publish(e.volumeIn("other", map[string]string{"capture": "res-7f3a"}, false)))
}

// Targets are the kubelet's and nothing else: no symlink on the way is
// followed, and cowvol never mounts over data or a mount, never unmounts a
// mount it did not make, and never deletes what it did not make.
func TestTargetPaths(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	victim := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(victim, "precious"), []byte("x"), 0o644))
	mounted := func(p string) bool { return mountID(t, p) != 0 }
	tests := []struct {
		name     string
		setup    func(t *testing.T, v kubeletsim.InlineVolume)
		wantCode codes.Code
	}{
		{"the volume dir is a symlink", func(t *testing.T, v kubeletsim.InlineVolume) {
			dir := filepath.Dir(v.Target)
			require.NoError(t, os.Remove(dir))
			require.NoError(t, os.Symlink(victim, dir))
		}, codes.FailedPrecondition},
		{"the pod dir is a symlink", func(t *testing.T, v kubeletsim.InlineVolume) {
			pod := filepath.Dir(filepath.Dir(filepath.Dir(filepath.Dir(v.Target))))
			require.NoError(t, os.RemoveAll(pod))
			require.NoError(t, os.Symlink(victim, pod))
		}, codes.FailedPrecondition},
		{"the target is a symlink", func(t *testing.T, v kubeletsim.InlineVolume) {
			require.NoError(t, os.Symlink(victim, v.Target))
		}, codes.FailedPrecondition},
		{"the target is not empty", func(t *testing.T, v kubeletsim.InlineVolume) {
			write(t, v.Target, "data", "someone's")
		}, codes.FailedPrecondition},
		{"the target is a file", func(t *testing.T, v kubeletsim.InlineVolume) {
			require.NoError(t, os.WriteFile(v.Target, []byte("x"), 0o644))
		}, codes.FailedPrecondition},
		{"the target is someone's mount", func(t *testing.T, v kubeletsim.InlineVolume) {
			require.NoError(t, os.Mkdir(v.Target, 0o755))
			require.NoError(t, unix.Mount("tmpfs", v.Target, "tmpfs", 0, "size=1m"))
			t.Cleanup(func() { _ = unix.Unmount(v.Target, unix.MNT_DETACH) })
		}, codes.FailedPrecondition},
		{"the volume's dir is missing", func(t *testing.T, v kubeletsim.InlineVolume) {
			require.NoError(t, os.Remove(filepath.Dir(v.Target)))
		}, codes.FailedPrecondition},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v := e.volume(map[string]string{"capture": fmt.Sprintf("t-%d", e.n)}, false)
			tc.setup(t, v)
			require.Equal(t, tc.wantCode, code(e.publish(v)))
			require.False(t, mounted(victim), "nothing is mounted where a symlink points")
			_, err := os.Stat(filepath.Join(victim, "precious"))
			require.NoError(t, err)
			// The kubelet unpublishes after a failed publish: nothing of
			// anyone else's is unmounted or deleted.
			err = e.unpublish(v)
			if tc.name == "the target is someone's mount" {
				require.Equal(t, codes.FailedPrecondition, code(err), "a mount cowvol did not make is never unmounted")
				require.True(t, mounted(v.Target))
			} else {
				require.NoError(t, err)
			}
			entries, err := os.ReadDir(victim)
			require.NoError(t, err)
			require.Len(t, entries, 1, "nothing was made or deleted where a symlink points")
		})
	}

	t.Run("unpublish of an unknown volume leaves a file at the target", func(t *testing.T) {
		v := e.volume(nil, false)
		require.NoError(t, os.WriteFile(v.Target, []byte("not cowvol's"), 0o644))
		require.NoError(t, e.unpublish(v))
		require.Equal(t, "not cowvol's", readFile(t, filepath.Dir(v.Target), "mount"))
	})
	t.Run("a second unpublish never unmounts a foreign mount", func(t *testing.T) {
		v := e.mount(nil, false)
		e.umount(v)
		require.NoError(t, os.Mkdir(v.Target, 0o755))
		require.NoError(t, unix.Mount("tmpfs", v.Target, "tmpfs", 0, "size=1m"))
		defer unix.Unmount(v.Target, unix.MNT_DETACH)
		require.Equal(t, codes.FailedPrecondition, code(e.unpublish(v)))
		require.True(t, mounted(v.Target))
	})
	t.Run("a mount swapped in under a published volume is not unmounted", func(t *testing.T) {
		v := e.mount(nil, false)
		require.NoError(t, unix.Unmount(v.Target, 0))
		require.NoError(t, unix.Mount("tmpfs", v.Target, "tmpfs", 0, "size=1m"))
		require.Equal(t, codes.FailedPrecondition, code(e.unpublish(v)))
		require.Equal(t, codes.FailedPrecondition, code(e.publish(v)), "nor used as the volume")
		require.True(t, mounted(v.Target))
		// Once its owner takes it away, the kubelet's retry finishes.
		require.NoError(t, unix.Unmount(v.Target, 0))
		e.umount(v)
	})
	e.noLeaks(t)
}

// Mounts are nodev and nosuid, and a capture drops device nodes (runtimes
// do not pass nodev into the container): a device node in a volume gives a
// step nothing. --allow-setuid keeps device nodes, which nodev still stops
// here, and drops nosuid.
func TestMountsAreNodevNosuid(t *testing.T) {
	testfs.Need(t)
	for _, allow := range []bool{false, true} {
		t.Run(fmt.Sprintf("allow-setuid=%v", allow), func(t *testing.T) {
			var args []string
			if allow {
				args = []string{"--allow-setuid"}
			}
			e := newEnv(t, plugintest.Config{Backend: "overlay", Args: args})
			e.step("", "devs", func(dir string) {
				require.NoError(t, unix.Mknod(filepath.Join(dir, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
			})
			for _, attrs := range []map[string]string{nil, {"source": "devs"}} {
				v := e.mount(attrs, false)
				opts := mountOptions(t, v.Target)
				require.Contains(t, opts, "nodev")
				if allow {
					require.NotContains(t, opts, "nosuid")
				} else {
					require.Contains(t, opts, "nosuid")
				}
				if attrs != nil {
					_, err := os.OpenFile(filepath.Join(v.Target, "null"), os.O_WRONLY, 0)
					if allow {
						require.ErrorIs(t, err, os.ErrPermission, "a device node kept in a volume does not open")
					} else {
						require.ErrorIs(t, err, os.ErrNotExist, "the capture dropped the device node")
					}
				}
				e.umount(v)
			}
		})
	}
}

func mountOptions(t *testing.T, mnt string) []string {
	t.Helper()
	infos, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	for _, line := range strings.Split(string(infos), "\n") {
		if f := strings.Fields(line); len(f) > 5 && f[4] == mnt {
			return strings.Split(f[5], ",")
		}
	}
	t.Fatalf("%s is not mounted", mnt)
	return nil
}

// sizeLimit on btrfs with quotas: a write past the limit fails inside the
// step with EDQUOT, other volumes are untouched, the volume still captures,
// and stats report the limit as the volume's size.
func TestSizeLimits(t *testing.T) {
	state := testfs.Mount(t, testfs.Btrfs, 1<<30)
	testfs.EnableBtrfsQuota(t, state)
	e := newEnv(t, plugintest.Config{StateDir: state, Backend: "btrfs"})
	require.Contains(t, scrape(t, e), `size_limits="btrfs qgroups"`)
	e.step("", "lim-src", func(dir string) { write(t, dir, "base", "data") })

	limited := e.mount(map[string]string{"source": "lim-src", "capture": "lim-out", "sizeLimit": "8Mi"}, false)
	free := e.mount(map[string]string{"source": "lim-src"}, false)
	err := os.WriteFile(filepath.Join(limited.Target, "big"), make([]byte, 16<<20), 0o644)
	require.ErrorIs(t, err, syscall.EDQUOT, "a write past the limit fails in the step")
	require.NoError(t, os.WriteFile(filepath.Join(free.Target, "big"), make([]byte, 16<<20), 0o644), "other volumes are untouched")
	require.NoError(t, os.Remove(filepath.Join(limited.Target, "big")))
	require.NoError(t, overlay.SyncFS(limited.Target))
	write(t, limited.Target, "small", "fits")

	resp, err := e.p.Node.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: limited.VolumeID, VolumePath: limited.Target})
	require.NoError(t, err)
	require.Equal(t, int64(8<<20), resp.Usage[0].Total, "the limit is the volume's size")
	require.LessOrEqual(t, resp.Usage[0].Available, int64(8<<20))

	e.umount(limited)
	e.umount(free)
	e.read("lim-out", func(dir string) {
		require.Equal(t, "fits", readFile(t, dir, "small"), "a volume that hit its limit still captures")
		require.Equal(t, "data", readFile(t, dir, "base"))
	})
	_, err = e.p.Node.NodePublishVolume(context.Background(), e.volume(map[string]string{"sizeLimit": "lots"}, false).PublishRequest())
	require.Equal(t, codes.InvalidArgument, code(err))
	e.noLeaks(t)
}

// A node default needs limits the state dir can enforce: refused at start.
func TestDefaultSizeLimitNeedsEnforcement(t *testing.T) {
	testfs.Need(t)
	sock := "unix://" + filepath.Join(t.TempDir(), "csi.sock")
	out, err := exec.Command(plugintest.Binary(t), "--endpoint="+sock, "--state-dir="+t.TempDir(), "--kubelet-dir="+t.TempDir(),
		"--cow-backend=overlay", "--default-size-limit=1Gi").CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "--default-size-limit needs size limits")
}

// scrape reads the plugin's metrics.
func scrape(t *testing.T, e *env) string {
	t.Helper()
	resp, err := http.Get("http://" + e.metrics + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(body)
}

// A view that cannot be settled at start-up (its mount went away while the
// plugin was down, and something else now sits in its target dir) is
// quarantined: the plugin starts and serves everything else, and settles
// the view once it can.
func TestPoisonedViewDoesNotBrickTheNode(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	e.step("", "p-src", func(dir string) { write(t, dir, "f", "x") })
	v := e.volume(map[string]string{"source": "p-src", "capture": "p-out"}, false)
	require.NoError(t, e.publish(v))
	write(t, v.Target, "g", "the step's")
	e.p.Kill()
	require.NoError(t, overlay.NewSysMounter().Unmount(v.Target))
	write(t, v.Target, "stray", "not cowvol's") // cowvol never mounts over it

	e.p.Restart()
	require.Contains(t, scrape(t, e), "cowvol_quarantined_step_volumes 1")
	e.step("p-src", "p-other", func(dir string) { require.Equal(t, "x", readFile(t, dir, "f")) })

	require.NoError(t, os.Remove(filepath.Join(v.Target, "stray")))
	eventually(t, "the quarantined view to be settled", func() bool {
		return strings.Contains(scrape(t, e), "cowvol_quarantined_step_volumes 0")
	})
	require.True(t, e.p.Running(), "the plugin settled the view and serves on")
	require.Equal(t, "the step's", readFile(t, v.Target, "g"), "mounted again as the step left it")
	retry(t, "publish", func() error { return e.publish(v) })
	e.umount(v)
	e.read("p-out", func(dir string) {
		require.Equal(t, "x", readFile(t, dir, "f"))
		require.Equal(t, "the step's", readFile(t, dir, "g"))
	})
	e.noLeaks(t)
}

// Trees deeper than PATH_MAX are captured, measured and removed.
func TestDeepTrees(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	var depth int
	e.step("", "deep", func(dir string) { depth = testfs.DeepTree(t, dir) })
	eventually(t, "the deep volume to be measured", func() bool {
		for _, line := range strings.Split(scrape(t, e), "\n") {
			var n float64
			if _, err := fmt.Sscanf(line, "cowvol_cached_bytes %g", &n); err == nil {
				return n >= 64<<10
			}
		}
		return false
	})
	e.read("deep", func(dir string) {
		_, inodes, err := overlay.Usage(dir)
		require.NoError(t, err)
		require.Equal(t, int64(1+depth+testfs.DeepInodes), inodes, "every dir and the file came through")
	})
	scratch := e.mount(map[string]string{"source": "deep"}, false)
	require.NoError(t, os.Mkdir(filepath.Join(scratch.Target, "more"), 0o755))
	testfs.DeepTree(t, filepath.Join(scratch.Target, "more"))
	e.umount(scratch)
	eventually(t, "the scratch volume's deep tree to be removed", func() bool {
		entries, err := os.ReadDir(filepath.Join(e.p.StateDir, "trash"))
		return err == nil && len(entries) == 0
	})
	e.noLeaks(t)
}
