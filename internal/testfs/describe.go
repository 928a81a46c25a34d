package testfs

import (
	"bytes"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Tree describes a directory tree: relative path → type, mode, owner, size,
// content (or its digest), link target, xattrs, hardlink group and mtime.
// Two trees compare equal when a step would see no difference between them.
type Tree map[string]string

// Describe walks root. It reports user.* xattrs and the trusted.overlay.*
// ones overlayfs keeps in layers (whiteouts are 0/0 char devices and show
// as such). The root's own mtime is left out: it moves with any change.
func Describe(tb testing.TB, root string) Tree {
	tb.Helper()
	out := Tree{}
	inodes := map[uint64]string{}
	err := filepath.Walk(root, func(path string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err != nil {
			return err
		}
		desc := fmt.Sprintf("mode=%o uid=%d gid=%d", st.Mode, st.Uid, st.Gid)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			data, err := os.ReadFile(path)
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
			target, _ := os.Readlink(path)
			desc += " -> " + target
		case unix.S_IFDIR:
		default:
			desc += fmt.Sprintf(" rdev=%d", st.Rdev)
		}
		if x := xattrs(path); x != "" {
			desc += " xattrs=" + x
		}
		if rel != "." {
			desc += fmt.Sprintf(" mtime=%d.%09d", st.Mtim.Sec, st.Mtim.Nsec)
		}
		out[rel] = desc
		return nil
	})
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
		if !bytes.HasPrefix(name, []byte("user.")) && !bytes.HasPrefix(name, []byte("trusted.overlay.")) {
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
