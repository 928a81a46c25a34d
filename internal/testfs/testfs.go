// Package testfs makes real filesystems for tests and benchmarks: XFS with
// reflink, btrfs and ext4 on loop devices whose images live on a private
// tmpfs, so that results do not depend on this machine's throttled root disk.
// It is test support only and never imported by the plugin.
package testfs

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/concourse/cowvol/internal/tb"
	"golang.org/x/sys/unix"
)

// Kind names a filesystem testfs can make.
type Kind string

const (
	XFS   Kind = "xfs"   // with reflink=1
	Btrfs Kind = "btrfs" // snapshots
	Ext4  Kind = "ext4"  // no reflink: overlay copy-up copies
)

var mkfs = map[Kind][]string{
	XFS:   {"mkfs.xfs", "-q", "-f", "-m", "reflink=1"},
	Btrfs: {"mkfs.btrfs", "-q", "-f"},
	Ext4:  {"mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"},
}

// Need skips tb when it cannot mount: not root, or a tool missing. Under CI
// (CI=true) it fails instead, because CI must run every test.
func Need(tb tb.TB, tools ...string) {
	tb.Helper()
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root (the test mounts filesystems)")
	}
	for _, t := range tools {
		if _, err := exec.LookPath(t); err != nil {
			missing = append(missing, t+" (apt-get install the package that ships it)")
		}
	}
	if len(missing) == 0 {
		return
	}
	msg := "needs " + strings.Join(missing, ", ")
	if os.Getenv("CI") == "true" {
		tb.Fatal(msg + "; CI must not skip it")
	}
	tb.Skip(msg)
}

// Mount makes a fresh filesystem of kind and size bytes and returns where it
// is mounted; everything is undone when tb ends.
func Mount(tb tb.TB, kind Kind, size int64) string {
	tb.Helper()
	return mustMount(tb, kind, size, false)
}

// MountAllocated is Mount on an image whose memory is all allocated
// before the filesystem is made, as a disk's blocks are all there: on a
// sparse image, whatever first writes a block also pays for the tmpfs
// page under it (a pull of 1 GiB onto a new filesystem took twice as
// long as the same pull once its blocks had been written). Benchmarks
// that compare writers use it, so that none of them pays that and the
// others not.
func MountAllocated(tb tb.TB, kind Kind, size int64) string {
	tb.Helper()
	return mustMount(tb, kind, size, true)
}

func mustMount(tb tb.TB, kind Kind, size int64, allocate bool) string {
	tb.Helper()
	mnt, err := mount(tb, kind, size, nil, "", allocate)
	if err != nil {
		tb.Fatalf("mounting %s: %v", kind, err)
	}
	return mnt
}

// MountWithProjectQuota makes a filesystem of kind (XFS or ext4) mounted
// with project quotas enforced, or skips tb where the kernel cannot (these
// machines' kernels lack CONFIG_XFS_QUOTA, and CONFIG_QUOTA with
// CONFIG_QFMT_V2 for ext4): the test runs wherever the kernel allows.
func MountWithProjectQuota(tb tb.TB, kind Kind, size int64) string {
	tb.Helper()
	var extra []string
	if kind == Ext4 {
		extra = []string{"-O", "quota,project"}
	}
	mnt, err := mount(tb, kind, size, extra, "prjquota", false)
	if err != nil {
		tb.Skipf("this kernel cannot mount %s with project quotas (%v): XFS needs CONFIG_XFS_QUOTA, ext4 CONFIG_QUOTA and CONFIG_QFMT_V2", kind, err)
	}
	return mnt
}

// EnableBtrfsQuota turns quotas (qgroups) on for the btrfs mounted at mnt,
// as an operator preparing a state dir for size limits does.
func EnableBtrfsQuota(tb tb.TB, mnt string) {
	tb.Helper()
	Need(tb, "btrfs")
	if out, err := exec.Command("btrfs", "quota", "enable", mnt).CombinedOutput(); err != nil {
		tb.Fatalf("btrfs quota enable: %v: %s", err, out)
	}
}

func mount(tb tb.TB, kind Kind, size int64, mkfsExtra []string, options string, allocate bool) (string, error) {
	tb.Helper()
	Need(tb, mkfs[kind][0], "losetup")
	base := tb.TempDir()
	backing := filepath.Join(base, "backing")
	mnt := filepath.Join(base, "mnt")
	for _, d := range []string{backing, mnt} {
		if err := os.Mkdir(d, 0o700); err != nil {
			tb.Fatal(err)
		}
	}
	if err := unix.Mount("tmpfs", backing, "tmpfs", 0, fmt.Sprintf("size=%d", size+(64<<20))); err != nil {
		tb.Fatalf("mounting tmpfs for the image: %v", err)
	}
	tb.Cleanup(func() { _ = unix.Unmount(backing, unix.MNT_DETACH) })
	img := filepath.Join(backing, "fs.img")
	f, err := os.Create(img)
	if err != nil {
		tb.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		tb.Fatal(err)
	}
	if allocate {
		if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
			tb.Fatalf("allocating the image: %v", err)
		}
	}
	f.Close()
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		tb.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	tb.Cleanup(func() { _ = exec.Command("losetup", "-d", dev).Run() })
	args := append(append(append([]string{}, mkfs[kind][1:]...), mkfsExtra...), dev)
	if out, err := exec.Command(mkfs[kind][0], args...).CombinedOutput(); err != nil {
		tb.Fatalf("%s: %v: %s", mkfs[kind][0], err, out)
	}
	if err := unix.Mount(dev, mnt, string(kind), 0, options); err != nil {
		return "", err
	}
	tb.Cleanup(func() {
		if err := unmountSettled(mnt); err != nil {
			tb.Errorf("unmounting test %s at %s: %v (a leaked mount?)", kind, mnt, err)
			_ = unix.Unmount(mnt, unix.MNT_DETACH)
		}
	})
	return mnt, nil
}

// unmountSettled unmounts mnt, trying again for a few seconds while it is
// busy: a file-backed mount (an index) detached lazily from a dir on it
// lets go of its files a moment after, not as the detach returns (seen
// under a loaded make test). A mount still busy after that is a leak.
func unmountSettled(mnt string) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := unix.Unmount(mnt, 0)
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// DeepTree makes a chain of dirs under root whose full path is longer than
// twice PATH_MAX, walking by file descriptor as a step would have to, and at
// its bottom a 64 KiB file with an xattr, a hardlink to it, a symlink and a
// dir of mode 0700 owned by 1000: DeepInodes inodes beyond the chain's
// dirs. It returns how many dirs the chain has.
func DeepTree(tb tb.TB, root string) int {
	tb.Helper()
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		tb.Fatal(err)
	}
	name := strings.Repeat("d", 200)
	depth := 2*unix.PathMax/len(name) + 1
	for range depth {
		if err := unix.Mkdirat(fd, name, 0o755); err != nil {
			tb.Fatal(err)
		}
		next, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			tb.Fatal(err)
		}
		unix.Close(fd)
		fd = next
	}
	defer unix.Close(fd)
	f, err := unix.Openat(fd, "bottom", unix.O_CREAT|unix.O_WRONLY, 0o644)
	if err != nil {
		tb.Fatal(err)
	}
	defer unix.Close(f)
	if _, err := unix.Write(f, make([]byte, 64<<10)); err != nil {
		tb.Fatal(err)
	}
	for _, err := range []error{
		unix.Fsetxattr(f, "user.deep", []byte("yes"), 0),
		unix.Linkat(fd, "bottom", fd, "bottom-link", 0),
		unix.Symlinkat("bottom", fd, "to-bottom"),
		unix.Mkdirat(fd, "private", 0o700),
		unix.Fchownat(fd, "private", 1000, 1000, unix.AT_SYMLINK_NOFOLLOW),
	} {
		if err != nil {
			tb.Fatal(err)
		}
	}
	return depth
}

// DeepInodes counts what DeepTree puts at the bottom of its chain.
const DeepInodes = 3

// OpenBelow is how many of this process's descriptors are open on files
// below dir.
func OpenBelow(tb tb.TB, dir string) int {
	tb.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Fatal(err)
	}
	n := 0
	for _, fd := range fds {
		if p, _ := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); strings.HasPrefix(p, dir+"/") {
			n++
		}
	}
	return n
}
