package localcluster

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/tb"
	"github.com/concourse/cowvol/pkg/overlay"
)

func (c *Cluster) teardown() {
	t := c.T
	if t.Failed() {
		c.dumpLogs()
		defer t.Logf("FAILED in scenario %q: its failure is logged above the processes' logs", c.Current)
	}
	c.stopAll("kubelet")
	c.stopAll("kube-proxy")
	for _, socket := range append([]string{c.Containerd}, c.runtimes...) {
		c.killShims(socket)
	}
	for _, name := range []string{"kube-scheduler", "kube-controller-manager", "containerd", "kube-apiserver", "etcd"} {
		c.stopAll(name)
	}
	// What runs in pods outlives its shim: the DaemonSet's plugin, say.
	killCgroupProcs(c.cgroupRoots...)
	// The nodes' mount namespaces go with their last process.
	c.stopAll("mountns")
	// Rounds: a shared kubelet dir (TestInstall's) holds each pod mount
	// twice, one copy hidden under the other until that goes.
	for round := 0; ; round++ {
		mounts, err := overlay.MountsUnder(c.Work)
		if err != nil {
			t.Error(err)
		}
		if len(mounts) == 0 {
			break
		}
		if round == 5 {
			t.Errorf("mounts left under %s: %v", c.Work, mounts)
			break
		}
		for _, mp := range mounts {
			if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
				t.Errorf("unmounting %s: %v", mp, err)
			}
		}
	}
	removeKubeCgroups(t, c.cgroupRoots...)
	for s, v := range c.sysctls {
		if err := os.WriteFile("/proc/sys/"+s, []byte(v), 0o644); err != nil {
			t.Errorf("restoring %s: %v", s, err)
		}
	}
	if after := linkNames(t); strings.Join(after, ",") != strings.Join(c.links, ",") {
		t.Errorf("network devices changed: %v before, %v after", c.links, after)
	}
	for _, pid := range c.pidsMentioning(c.Work) {
		t.Errorf("process %d outlived the cluster", pid)
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	if err := os.RemoveAll(c.Work); err != nil {
		t.Errorf("removing %s: %v", c.Work, err)
	}
}

// pidsMentioning lists processes whose command line contains s: every
// process of the cluster names its work dir (its data, config or socket).
func (c *Cluster) pidsMentioning(s string) []int {
	return PidsWhere(func(cmdline string) bool { return strings.Contains(cmdline, s) })
}

// PidsWhere lists the processes (but this one) whose command line, its
// arguments NUL-separated, match says.
func PidsWhere(match func(cmdline string) bool) []int {
	var pids []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && match(string(cmdline)) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// stopAll stops the process name and every node's process of that name
// (name-<node>).
func (c *Cluster) stopAll(name string) {
	for n, p := range c.Procs {
		if n == name || strings.HasPrefix(n, name+"-") {
			p.Stop(syscall.SIGTERM, 30*time.Second)
		}
	}
}

// killShims kills the containerd shims of the containerd at socket (they
// outlive it by design) by PID: they name its socket.
func (c *Cluster) killShims(socket string) {
	if socket == "" {
		return
	}
	for _, pid := range c.pidsMentioning(socket) {
		if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); strings.Contains(filepath.Base(exe), "containerd-shim") {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	time.Sleep(200 * time.Millisecond)
}

// killCgroupProcs kills every process in the cgroups of nodes' pods
// (under cgroupRoots) and waits until they are gone.
func killCgroupProcs(cgroupRoots ...string) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		var left []int
		for _, r := range cgroupRoots {
			dirs, _ := filepath.Glob("/sys/fs/cgroup/*" + r)
			for _, dir := range dirs {
				for _, pid := range CgroupPids(dir) {
					left = append(left, pid)
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		if len(left) == 0 || time.Now().After(deadline) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// CgroupPids lists the processes in a cgroup and the cgroups below it.
func CgroupPids(dir string) []int {
	var pids []int
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
			return nil
		}
		b, _ := os.ReadFile(p)
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return nil
	})
	return pids
}

// removeKubeCgroups removes the kubelet's cgroups (v1 and v2), and the
// cgroup roots of nodes (their kubepods below), deepest first.
func removeKubeCgroups(t tb.TB, cgroupRoots ...string) {
	var dirs []string
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/kubepods*")
	if v2, _ := filepath.Glob("/sys/fs/cgroup/kubepods*"); len(v2) > 0 {
		roots = append(roots, v2...)
	}
	for _, r := range cgroupRoots {
		more, _ := filepath.Glob("/sys/fs/cgroup/*" + r)
		roots = append(roots, more...)
	}
	for _, root := range roots {
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := unix.Rmdir(dirs[i]); err != nil && !os.IsNotExist(err) {
			t.Errorf("removing cgroup %s: %v", dirs[i], err)
		}
	}
}
