package overlay

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Limiter caps what a step may write into its own tree (an overlay upper
// dir, or a whole tree the backend built), so that a step cannot fill the
// node: a write past the limit fails with EDQUOT inside the step, and no
// other volume is touched. Two mechanisms do it: btrfs qgroups on the
// step's subvolume, and project quotas (XFS, ext4) on its dirs.
type Limiter interface {
	// Mechanism names how limits are enforced, for logs.
	Mechanism() string
	// Claim charges what is made under dirs (empty) from now on to quota
	// id.
	Claim(id uint32, dirs ...string) error
	// Limit claims dirs and lets what id holds grow by bytes from now.
	Limit(id uint32, bytes int64, dirs ...string) error
	// Used is what id holds: bytes, and inodes (-1 if the mechanism does
	// not count them). dir is one of its dirs.
	Used(id uint32, dir string) (bytes, inodes int64, err error)
	// Release drops id's limit once its step is over (captured data keeps
	// no limit).
	Release(id uint32) error
}

// ProbeLimits finds how size limits can be enforced for kind's step volumes
// under dir, trying each mechanism for real (a write past a small limit must
// fail). The error says why none works.
func ProbeLimits(dir string, kind Kind) (Limiter, error) {
	var lim Limiter
	switch {
	case isBtrfs(dir) && kind != KindBtrfs:
		return nil, fmt.Errorf("the %s backend on btrfs cannot enforce them: use the btrfs backend", kind)
	case isBtrfs(dir):
		lim = btrfsLimiter{}
	default:
		lim = projectLimiter{root: dir}
	}
	scratch, err := os.MkdirTemp(dir, ".probe-limits-")
	if err != nil {
		return nil, err
	}
	defer RemoveTree(scratch)
	tree := filepath.Join(scratch, "tree")
	if kind == KindBtrfs {
		err = createSubvolume(tree)
	} else {
		err = os.Mkdir(tree, 0o700)
	}
	if err != nil {
		return nil, err
	}
	const probeID = quotaProbeID
	if err := lim.Limit(probeID, 64<<10, tree); err != nil {
		return nil, fmt.Errorf("%s: %w", lim.Mechanism(), err)
	}
	defer lim.Release(probeID)
	werr := os.WriteFile(filepath.Join(tree, "fill"), make([]byte, 4<<20), 0o600)
	if werr == nil {
		if f, err := os.Open(filepath.Join(tree, "fill")); err == nil {
			werr = f.Sync()
			f.Close()
		}
	}
	if !errors.Is(werr, unix.EDQUOT) && !errors.Is(werr, unix.ENOSPC) {
		return nil, fmt.Errorf("%s: a write past a 64 KiB limit was not refused (%v): quotas are accounted but not enforced", lim.Mechanism(), werr)
	}
	return lim, nil
}

// quotaProbeID is the quota ID start-up probes use: never a step's.
const quotaProbeID = 0x636effff

// btrfsLimiter limits the exclusive bytes of the step's subvolume with its
// qgroup. Quotas must be enabled on the filesystem (btrfs quota enable).
type btrfsLimiter struct{}

func (btrfsLimiter) Mechanism() string { return "btrfs qgroups" }

// Claim is free on btrfs: a subvolume's qgroup counts what is written in it.
func (btrfsLimiter) Claim(uint32, ...string) error { return nil }

func (l btrfsLimiter) Limit(_ uint32, bytes int64, dirs ...string) error {
	for _, d := range dirs {
		if !isSubvolume(d) {
			return fmt.Errorf("%s is not a btrfs subvolume: only subvolumes can be limited", d)
		}
		// Counts settle at a transaction commit: commit, so that what a
		// tree already holds (a copied chain) is not counted as room.
		if err := SyncFS(d); err != nil {
			return err
		}
		used, _, err := l.Used(0, d)
		if err != nil {
			return err
		}
		if err := qgroupLimit(d, uint64(used+bytes)); err != nil {
			return err
		}
	}
	return nil
}

func (btrfsLimiter) Used(_ uint32, dir string) (int64, int64, error) {
	q, err := qgroupDir(dir)
	if err != nil {
		return 0, 0, err
	}
	raw, err := os.ReadFile(filepath.Join(q, "exclusive"))
	if errors.Is(err, os.ErrNotExist) {
		return 0, 0, fmt.Errorf("no qgroup for %s: are quotas enabled (btrfs quota enable)?", dir)
	}
	if err != nil {
		return 0, 0, err
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
	return n, -1, err
}

// Release is free on btrfs: the qgroup goes with its subvolume, and a
// captured subvolume is never written again.
func (btrfsLimiter) Release(uint32) error { return nil }

// projectLimiter limits a project quota ID that the step's dirs carry and
// pass on to everything made under them (PROJINHERIT). The filesystem must
// be mounted with project quotas enforced (XFS prjquota; ext4 with the
// project feature and prjquota).
type projectLimiter struct {
	root string // a dir of the filesystem, to name it to quotactl
}

func (projectLimiter) Mechanism() string { return "project quotas" }

// fsxattr is struct fsxattr of linux/fs.h.
type fsxattr struct {
	xflags, extsize, nextents, projid, cowextsize uint32
	pad                                           [8]byte
}

const (
	fsIocGetXattr        = 0x801c581f // _IOR('X', 31, struct fsxattr)
	fsIocSetXattr        = 0x401c5820 // _IOW('X', 32, struct fsxattr)
	fsXflagProjInherit   = 0x200
	qGetQuota            = 0x800007
	qSetQuota            = 0x800008
	prjQuota             = 2
	qifBlimits           = 1
	quotaBlockSize       = 1024 // QIF_DQBLKSIZE
	projectQuotaCommands = 8    // SUBCMDSHIFT
)

// dqblk is struct if_dqblk of linux/quota.h.
type dqblk struct {
	bhardlimit, bsoftlimit, curspace  uint64
	ihardlimit, isoftlimit, curinodes uint64
	btime, itime                      uint64
	valid                             uint32
	_                                 uint32
}

func (projectLimiter) Claim(id uint32, dirs ...string) error {
	for _, d := range dirs {
		f, err := os.Open(d)
		if err != nil {
			return err
		}
		var x fsxattr
		err = ioctlPtr(int(f.Fd()), fsIocGetXattr, unsafe.Pointer(&x))
		if err == nil {
			x.projid, x.xflags = id, x.xflags|fsXflagProjInherit
			err = ioctlPtr(int(f.Fd()), fsIocSetXattr, unsafe.Pointer(&x))
		}
		f.Close()
		if err != nil {
			return fmt.Errorf("giving %s project ID %d: %w", d, id, err)
		}
	}
	return nil
}

func (l projectLimiter) Limit(id uint32, bytes int64, dirs ...string) error {
	if len(dirs) == 0 {
		return errors.New("no dir to limit")
	}
	if err := l.Claim(id, dirs...); err != nil {
		return err
	}
	q, err := quotactl(dirs[0], qGetQuota, id, dqblk{})
	if err != nil {
		return err
	}
	limit := (q.curspace + uint64(bytes) + quotaBlockSize - 1) / quotaBlockSize
	_, err = quotactl(dirs[0], qSetQuota, id, dqblk{bhardlimit: limit, valid: qifBlimits})
	return err
}

func (projectLimiter) Used(id uint32, dir string) (int64, int64, error) {
	q, err := quotactl(dir, qGetQuota, id, dqblk{})
	if err != nil {
		return 0, 0, err
	}
	return int64(q.curspace), int64(q.curinodes), nil
}

func (l projectLimiter) Release(id uint32) error {
	_, err := quotactl(l.root, qSetQuota, id, dqblk{valid: qifBlimits})
	return err
}

// quotactl runs a project-quota command through quotactl_fd (Linux 5.14):
// any file of the filesystem names it, no block device needed.
func quotactl(dir string, cmd int, id uint32, in dqblk) (dqblk, error) {
	f, err := os.Open(dir)
	if err != nil {
		return in, err
	}
	defer f.Close()
	qcmd := uintptr(cmd<<projectQuotaCommands | prjQuota)
	_, _, errno := unix.Syscall6(unix.SYS_QUOTACTL_FD, f.Fd(), qcmd, uintptr(id), uintptr(unsafe.Pointer(&in)), 0, 0)
	if errno != 0 {
		return in, fmt.Errorf("project quota of %d on %s: %w", id, dir, errno)
	}
	return in, nil
}
