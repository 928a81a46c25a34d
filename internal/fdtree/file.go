package fdtree

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// Unnamed opens a new file in dir that no name reaches (O_TMPFILE): it
// goes with its last descriptor, and a crash leaves nothing behind. For
// what a process writes and reads back but never keeps (a spool, an
// index's inodes before they are appended, a listing's runs).
func Unnamed(dir, what string) (*os.File, error) {
	fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("%s in %s: %w", what, dir, err)
	}
	return os.NewFile(uintptr(fd), what), nil
}

// CopyThrough copies n bytes at srcOff of src to dstOff of dst through
// buf (nil: a buffer of io.CopyBuffer's), in user space: dst's pages are
// written through the page cache and share no extent with src's. A source
// that ends before n bytes is io.ErrUnexpectedEOF.
func CopyThrough(dst *os.File, dstOff int64, src *os.File, srcOff, n int64, buf []byte) error {
	copied, err := io.CopyBuffer(io.NewOffsetWriter(dst, dstOff), io.NewSectionReader(src, srcOff, n), buf)
	if err == nil && copied < n {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// CopyRange copies n bytes at srcOff of src to dstOff of dst, in the
// kernel where it can, and through user space where copy_file_range
// refuses (across filesystem types). A source that ends before n bytes is
// io.ErrUnexpectedEOF either way.
func CopyRange(dst *os.File, dstOff int64, src *os.File, srcOff, n int64) error {
	for n > 0 {
		in, out := srcOff, dstOff
		w, err := unix.CopyFileRange(int(src.Fd()), &in, int(dst.Fd()), &out, int(n), 0)
		switch {
		case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EOPNOTSUPP):
			return CopyThrough(dst, dstOff, src, srcOff, n, nil)
		case err != nil:
			return err
		case w == 0:
			return io.ErrUnexpectedEOF
		}
		srcOff += int64(w)
		dstOff += int64(w)
		n -= int64(w)
	}
	return nil
}
