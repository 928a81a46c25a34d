package testfs

import (
	"bytes"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/internal/tb"
)

// Tree describes a directory tree: relative path → type, mode, owner, size,
// content (or its digest), link target, xattrs, hardlink group and mtime.
// Two trees compare equal when a step would see no difference between them.
type Tree map[string]string

// Describe walks root. It reports user.* xattrs and the trusted.overlay.*
// ones overlayfs keeps in layers (whiteouts are 0/0 char devices and show
// as such). The root's own mtime is left out: it moves with any change.
func Describe(tb tb.TB, root string) Tree {
	tb.Helper()
	rootFd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		tb.Fatal(err)
	}
	defer unix.Close(rootFd)
	var st unix.Stat_t
	if err := unix.Fstat(rootFd, &st); err != nil {
		tb.Fatal(err)
	}
	out := Tree{}
	inodes := map[uint64]string{}
	describe := func(dir int, name, rel string, st *unix.Stat_t) error {
		desc := fmt.Sprintf("mode=%o uid=%d gid=%d", st.Mode, st.Uid, st.Gid)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			fd, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			f := os.NewFile(uintptr(fd), rel)
			data, err := io.ReadAll(f)
			f.Close()
			if err != nil {
				return err
			}
			desc += fmt.Sprintf(" size=%d data=%q", st.Size, digest(data))
			if st.Nlink > 1 {
				if first, ok := inodes[st.Ino]; ok {
					desc += " link-of=" + first
				} else {
					inodes[st.Ino] = rel
				}
			}
		case unix.S_IFLNK:
			target, _ := fdtree.Readlink(dir, name)
			desc += " -> " + target
		case unix.S_IFDIR:
		default:
			desc += fmt.Sprintf(" rdev=%d", st.Rdev)
		}
		if x := xattrs(fdtree.ProcPath(dir, name)); x != "" {
			desc += " xattrs=" + x
		}
		if rel != "." {
			desc += fmt.Sprintf(" mtime=%d.%09d", st.Mtim.Sec, st.Mtim.Nsec)
		}
		out[rel] = desc
		return nil
	}
	err = describe(rootFd, ".", ".", &st)
	if err == nil {
		err = fdtree.Walk(rootFd, fdtree.Visitor{Visit: func(e *fdtree.Entry) (bool, error) {
			return true, describe(e.Parent, e.Name, e.Path, &e.Stat)
		}})
	}
	if err != nil {
		tb.Fatal(err)
	}
	return out
}

func digest(b []byte) string {
	if len(b) <= 64 {
		return string(b)
	}
	h := fnv.New64a()
	h.Write(b)
	return fmt.Sprintf("%d bytes fnv %x", len(b), h.Sum64())
}

func xattrs(path string) string {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(path, buf)
	if err != nil || n == 0 {
		return ""
	}
	var parts []string
	for _, name := range bytes.Split(buf[:n-1], []byte{0}) {
		if !bytes.HasPrefix(name, []byte("user.")) && !bytes.HasPrefix(name, []byte("trusted.overlay.")) &&
			string(name) != "security.capability" {
			continue
		}
		val := make([]byte, 1024)
		m, err := unix.Lgetxattr(path, string(name), val)
		if err == nil {
			parts = append(parts, string(name)+"="+string(val[:m]))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}
