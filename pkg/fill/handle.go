package fill

import (
	"errors"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// An XFS handle names a file by its inode and generation, as XFS's own
// handle ioctls give and take it (xfs_handle_t: the filesystem's id, then
// the fid). A fill opens a stub by its handle: XFS's open by handle is the
// interface made for hierarchical storage managers putting data back into
// files in place ("invisible I/O"). Its descriptor writes without changing
// the file's times, so the times the stub was made with stand and need no
// second futimens, and no write costs a timestamp transaction. It also
// walks no path (no component to resolve, no symlink to refuse) and cannot
// open another file than the stub (a handle whose inode was freed and
// reused has another generation: ESTALE).
type xfsHandle [24]byte

// xfsHandleReq is struct xfs_fsop_handlereq (linux/xfs_fs.h).
type xfsHandleReq struct {
	fd       uint32
	path     *byte
	oflags   uint32
	ihandle  *byte
	ihandlen uint32
	ohandle  *byte
	ohandlen *uint32
}

// The ioctls' numbers: _IOWR('X', 106 or 107, struct xfs_fsop_handlereq).
var (
	xfsIocFDToHandle   = ioWR('X', 106, unsafe.Sizeof(xfsHandleReq{}))
	xfsIocOpenByHandle = ioWR('X', 107, unsafe.Sizeof(xfsHandleReq{}))
)

func ioWR(typ byte, nr, size uintptr) uintptr {
	const read, write = 2, 1
	return (read|write)<<30 | size<<16 | uintptr(typ)<<8 | nr
}

// xfsHandleOf is the handle of the XFS file open as fd.
func xfsHandleOf(fd int) (xfsHandle, error) {
	var h xfsHandle
	n := uint32(len(h))
	req := xfsHandleReq{fd: uint32(fd), ohandle: &h[0], ohandlen: &n}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), xfsIocFDToHandle, uintptr(unsafe.Pointer(&req))); errno != 0 {
		return h, errno
	}
	if n != uint32(len(h)) {
		return h, unix.EINVAL
	}
	return h, nil
}

// errForking says a fork is under way (see openXFSHandle).
var errForking = errors.New("the process is forking")

// openXFSHandle opens the file h names, through the mount fsfd is on, with
// flags (O_RDONLY or O_WRONLY), close-on-exec. A regular file opened so
// writes leaving its times alone (the kernel sets FMODE_NOCMTIME and
// O_NOATIME on it). It needs CAP_SYS_ADMIN.
func openXFSHandle(fsfd int, h *xfsHandle, flags int) (int, error) {
	req := xfsHandleReq{oflags: uint32(flags), ihandle: &h[0], ihandlen: uint32(len(h))}
	// The ioctl's descriptor is not close-on-exec: one made while the
	// process forks would leak into the child. The fork lock keeps forks
	// out until the flag is set; where a fork holds it, the caller opens
	// by name instead of waiting: the child may be exec'ing a stub, which
	// waits for its fill (a vfork holds the lock until the exec is done).
	if !syscall.ForkLock.TryRLock() {
		return -1, errForking
	}
	defer syscall.ForkLock.RUnlock()
	fd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fsfd), xfsIocOpenByHandle, uintptr(unsafe.Pointer(&req)))
	if errno != 0 {
		return -1, errno
	}
	if _, err := unix.FcntlInt(fd, unix.F_SETFD, unix.FD_CLOEXEC); err != nil {
		unix.Close(int(fd))
		return -1, err
	}
	return int(fd), nil
}
