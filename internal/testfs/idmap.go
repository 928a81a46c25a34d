package testfs

import (
	"fmt"
	"os/exec"
	"syscall"

	"github.com/concourse/cowvol/internal/tb"
	"golang.org/x/sys/unix"
)

// Idmap tries what a container runtime does with each volume of a pod in a
// user namespace of its own (runc from 1.2): clone the mount at path
// (open_tree) and idmap the clone with the pod's mapping (mount_setattr
// MOUNT_ATTR_IDMAP). The clone is never attached, so nothing is left
// mounted. nil means the runtime would start the pod; an overlay mount
// answers EINVAL.
func Idmap(tb tb.TB, path string) error {
	tb.Helper()
	userns := newUserNamespace(tb)
	defer unix.Close(userns)
	tree, err := unix.OpenTree(unix.AT_FDCWD, path, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("open_tree %s: %w", path, err)
	}
	defer unix.Close(tree)
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns)}
	if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		return fmt.Errorf("idmapping a clone of the mount at %s: %w", path, err)
	}
	return nil
}

// newUserNamespace opens a user namespace mapping 0-65535 to host IDs from
// 100000, as a kubelet gives a pod: a process is started in it, and the
// namespace outlives it through the descriptor.
func newUserNamespace(tb tb.TB) int {
	tb.Helper()
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 100000, Size: 65536}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 100000, Size: 65536}},
	}
	if err := cmd.Start(); err != nil {
		tb.Fatalf("starting a process in a user namespace: %v", err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		tb.Fatalf("opening the user namespace: %v", err)
	}
	return fd
}
