package fdtree

import (
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Extended attributes of an entry named beneath a directory descriptor,
// without following a symlink. Linux 6.13 has listxattrat and getxattrat,
// which take the descriptor; older kernels (and seccomp filters that do not
// know them) get the l*xattr calls on ProcPath, which pays a lookup through
// procfs per call: about half of a packer's xattr time.

// CapsXattr holds a file's capabilities, which the kernel drops on a write
// or a chown.
const CapsXattr = "security.capability"

// xattrPrefixes are the extended attributes that travel with a volume's
// files (in its streams and its index): the overlay's own (whiteouts,
// opaque dirs, redirects), users', and file capabilities (which a nosuid
// mount disarms). Others (SELinux labels, ACLs) belong to the node, not
// the volume.
var xattrPrefixes = []string{"trusted.overlay.", "user.", CapsXattr}

// XattrTravels says whether the extended attribute name travels with a
// volume's file.
func XattrTravels(name string) bool {
	for _, p := range xattrPrefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// Xattrs are the extended attributes that travel of name, in the
// directory open as dir (nil: none, or a filesystem without xattrs).
func Xattrs(dir int, name string) (map[string]string, error) {
	names, err := XattrNames(func(buf []byte) (int, error) { return ListXattrs(dir, name, buf) })
	if err != nil || names == nil {
		return nil, err
	}
	out := map[string]string{}
	for _, attr := range names {
		if !XattrTravels(attr) {
			continue
		}
		val, err := XattrValue(func(buf []byte) (int, error) { return GetXattr(dir, name, attr, buf) })
		if err != nil {
			return nil, err
		}
		out[attr] = string(val)
	}
	return out, nil
}

// XattrNames lists the names list reads, list being a listxattr call of
// any form (into buf, or with none the size it needs): nil for none, or
// on a filesystem without xattrs.
func XattrNames(list func(buf []byte) (int, error)) ([]string, error) {
	buf, err := readSized(list)
	if errors.Is(err, unix.ENOTSUP) {
		return nil, nil
	}
	if err != nil || len(buf) == 0 {
		return nil, err
	}
	var names []string
	for name := range strings.SplitSeq(string(buf), "\x00") {
		if name != "" {
			names = append(names, name)
		}
	}
	return names, nil
}

// XattrValue reads the value get reads, get being a getxattr call of any
// form (into buf, or with none the size it needs).
func XattrValue(get func(buf []byte) (int, error)) ([]byte, error) { return readSized(get) }

// readSized reads what read returns into a buffer of the size it first
// says (a call with no buffer), sized again where it grew meanwhile
// (ERANGE), up to readSizedTries times: a file whose attributes someone
// grows faster than they are read fails with ERANGE, never holds its
// reader. The first call costs no allocation where there is nothing, as
// for most files.
func readSized(read func(buf []byte) (int, error)) ([]byte, error) {
	for try := 1; ; try++ {
		size, err := read(nil)
		if err != nil || size == 0 {
			return nil, err
		}
		buf := make([]byte, size)
		n, err := read(buf)
		if errors.Is(err, unix.ERANGE) && try < readSizedTries {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

// readSizedTries bounds readSized's reads of what keeps growing.
const readSizedTries = 8

// noXattrAt is set once the *xattrat calls are found missing or blocked.
var noXattrAt atomic.Bool

// ListXattrs lists the names of name's extended attributes (in the
// directory open as dir) into buf, as llistxattr does: with an empty buf,
// it returns the size the list needs.
func ListXattrs(dir int, name string, buf []byte) (int, error) {
	if !noXattrAt.Load() {
		n, err := listxattrat(dir, name, buf)
		if !missing(err) {
			return n, err
		}
	}
	n, err := unix.Llistxattr(ProcPath(dir, name), buf)
	if err == nil {
		noXattrAt.Store(true)
	}
	return n, err
}

// GetXattr reads name's extended attribute attr into buf, as lgetxattr
// does: with an empty buf, it returns the size the value needs.
func GetXattr(dir int, name, attr string, buf []byte) (int, error) {
	if !noXattrAt.Load() {
		n, err := getxattrat(dir, name, attr, buf)
		if !missing(err) {
			return n, err
		}
	}
	n, err := unix.Lgetxattr(ProcPath(dir, name), attr, buf)
	if err == nil {
		noXattrAt.Store(true)
	}
	return n, err
}

// missing says whether an *xattrat call failed for want of the call itself:
// an old kernel, or a seccomp filter answering EPERM for what it does not
// know (the procfs call decides which, by succeeding).
func missing(err error) bool { return errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EPERM) }

func listxattrat(dir int, name string, buf []byte) (int, error) {
	p, err := unix.BytePtrFromString(name)
	if err != nil {
		return 0, err
	}
	var b unsafe.Pointer
	if len(buf) > 0 {
		b = unsafe.Pointer(&buf[0])
	}
	n, _, errno := unix.Syscall6(unix.SYS_LISTXATTRAT, uintptr(dir), uintptr(unsafe.Pointer(p)), unix.AT_SYMLINK_NOFOLLOW,
		uintptr(b), uintptr(len(buf)), 0)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// xattrArgs is the kernel's struct xattr_args.
type xattrArgs struct {
	value uint64
	size  uint32
	flags uint32
}

func getxattrat(dir int, name, attr string, buf []byte) (int, error) {
	p, err := unix.BytePtrFromString(name)
	if err != nil {
		return 0, err
	}
	a, err := unix.BytePtrFromString(attr)
	if err != nil {
		return 0, err
	}
	// The value's address travels inside args, where the compiler does
	// not keep it alive or in place: the kernel writes into a buffer of
	// ours on the heap, copied out after.
	var value []byte
	args := xattrArgs{size: uint32(len(buf))}
	if len(buf) > 0 {
		value = make([]byte, len(buf))
		args.value = uint64(uintptr(unsafe.Pointer(&value[0])))
	}
	n, _, errno := unix.Syscall6(unix.SYS_GETXATTRAT, uintptr(dir), uintptr(unsafe.Pointer(p)), unix.AT_SYMLINK_NOFOLLOW,
		uintptr(unsafe.Pointer(a)), uintptr(unsafe.Pointer(&args)), unsafe.Sizeof(args))
	runtime.KeepAlive(value)
	if errno != 0 {
		return 0, errno
	}
	copy(buf, value[:min(int(n), len(value))])
	return int(n), nil
}
