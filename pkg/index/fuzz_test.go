package index

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"path"
	"testing"

	erofs "github.com/erofs/go-erofs"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// fuzzTree makes a tree from data: each step takes a kind, a directory
// made so far, a name and what the kind needs (a size, a target, the file
// a hard link names, an xattr).
func fuzzTree(data []byte) *node {
	top := &node{st: attrs{Mode: unix.S_IFDIR | 0o755}, extent: -1}
	dirs, files := []*node{top}, []*node{}
	next := func() byte {
		if len(data) == 0 {
			return 0
		}
		b := data[0]
		data = data[1:]
		return b
	}
	for len(data) > 0 {
		kind, parent := next()%6, dirs[int(next())%len(dirs)]
		name := make([]byte, 1+int(next())%64)
		const chars = "abcXYZ019._-~ é\xff" // and bytes of no character
		for i := range name {
			name[i] = chars[int(next())%len(chars)]
		}
		if string(name) == "." || string(name) == ".." || bytes.ContainsAny(name, "\x00/") {
			continue
		}
		taken := false
		for _, d := range parent.entries() {
			taken = taken || d.name == string(name)
		}
		if taken {
			continue
		}
		n := &node{extent: -1, st: attrs{Uid: uint32(next()) << 10, Gid: uint32(next()), Mode: 0o640 | uint32(next()&0o7)}}
		n.st.MtimSec, n.st.MtimNsec = int64(next())<<24, uint32(next())<<20
		if next()%3 == 0 {
			n.rare = &rare{xattrs: map[string]string{"user.k" + string(name[:1]): string(name), "trusted.overlay.opaque": "y"}}
		}
		switch kind {
		case 0:
			n.st.Mode |= unix.S_IFDIR
			dirs = append(dirs, n)
		case 1:
			n.st.Mode |= unix.S_IFREG
			n.st.Size = int64(next()) << (next() % 24)
			files = append(files, n)
		case 2:
			n.st.Mode |= unix.S_IFLNK
			n.rare = &rare{xattrs: n.xattrs(), data: bytes.Repeat(name, 1+int(next())%8)}
		case 3:
			if len(files) == 0 {
				continue
			}
			n = files[int(next())%len(files)]
		case 4:
			n.st.Mode |= unix.S_IFIFO
		case 5:
			n.st.Mode |= unix.S_IFCHR
			n.st.Rdev = unix.Mkdev(uint32(next()), uint32(next())<<4)
		}
		parent.add(string(name), n)
	}
	return top
}

// fuzzSeed is the input fuzzTree makes n entries of every kind from: in
// the root, then in the directories made on the way.
func fuzzSeed(n int) []byte {
	var out []byte
	for i := range n {
		kind := byte(i % 6)
		if i < n/2 {
			kind = 1 // files first, for hard links to name
		}
		name := []byte{byte(i), byte(i >> 2), byte(i >> 4), byte(i >> 6), byte(i >> 8)} // 5 bytes of chars
		out = append(out, kind, byte(i%7), byte(len(name)-1))
		out = append(out, name...)
		out = append(out, byte(i), byte(i*3), byte(i), byte(i*7), byte(i*11), byte(i))
		switch kind {
		case 1:
			out = append(out, byte(i), byte(i))
		case 2, 3:
			out = append(out, byte(i))
		case 5:
			out = append(out, byte(i), byte(i))
		}
	}
	return out
}

// zeros is a blob of size zero bytes.
type zeros int64

func (z zeros) ReadAt(p []byte, off int64) (int, error) {
	n := max(0, min(int64(len(p)), int64(z)-off))
	clear(p[:n])
	if n < int64(len(p)) {
		return int(n), io.EOF
	}
	return int(n), nil
}

// What the index writes, an independent reader (go-erofs) reads back:
// every name, kind, mode, owner, time, xattr, device, symlink target,
// hard link and extent of any tree.
func FuzzImage(f *testing.F) {
	f.Add(fuzzSeed(600)) // a directory of several blocks, and every kind
	f.Add(fuzzSeed(20))
	f.Fuzz(func(t *testing.T, data []byte) {
		top := fuzzTree(data)
		layout, err := seal(top, 0) // (no count: the extents grow)
		require.NoError(t, err)
		for i, e := range layout.Extents {
			require.Equal(t, i, layout.Lookup(e.Path), "the extents lie in path order: %q", e.Path)
		}
		var img bytes.Buffer
		if err := write(&img, top, layout); errors.Is(err, ErrUnindexable) {
			return
		} else {
			require.NoError(t, err)
		}
		fsys, err := erofs.Open(bytes.NewReader(img.Bytes()), erofs.WithExtraDevices(zeros(layout.Size)))
		require.NoError(t, err)
		lstat := fsys.(interface {
			Lstat(string) (fs.FileInfo, error)
			ReadLink(string) (string, error)
		})
		inos := map[*node]int64{}
		var check func(d *node, dir string)
		check = func(d *node, dir string) {
			listed, err := fs.ReadDir(fsys, dir)
			require.NoError(t, err, dir)
			var names []string
			for _, e := range listed {
				names = append(names, e.Name())
			}
			var want []string
			for _, c := range d.entries() {
				if c.name != "." && c.name != ".." {
					want = append(want, c.name)
				}
			}
			require.Equal(t, want, names, dir)
			for _, c := range d.entries() {
				if c.name == "." || c.name == ".." {
					continue
				}
				p := path.Join(dir, c.name)
				fi, err := lstat.Lstat(p)
				require.NoError(t, err, p)
				st := fi.Sys().(*erofs.Stat)
				n := c.n
				require.Equal(t, n.st.Uid, st.UID, p)
				require.Equal(t, n.st.Gid, st.GID, p)
				require.Equal(t, uint64(n.st.MtimSec), st.Mtime, p)
				require.Equal(t, n.st.MtimNsec, st.MtimeNs, p)
				require.Equal(t, fs.FileMode(n.st.Mode&0o777), fi.Mode().Perm(), p)
				require.Equal(t, int(n.nlink), st.Nlink, p)
				if len(n.xattrs()) > 0 {
					require.Equal(t, n.xattrs(), st.Xattrs, p)
				}
				if ino, ok := inos[n]; ok {
					require.Equal(t, ino, st.Ino, "%s: a hard link is one inode", p)
				}
				inos[n] = st.Ino
				switch n.st.Mode & unix.S_IFMT {
				case unix.S_IFDIR:
					require.True(t, fi.IsDir(), p)
					check(n, p)
				case unix.S_IFREG:
					require.True(t, fi.Mode().IsRegular(), p)
					require.Equal(t, n.st.Size, fi.Size(), p)
					if n.st.Size > 0 {
						ranges := fi.(interface{ DataRange() []erofs.DataRange }).DataRange()
						require.NotEmpty(t, ranges, p)
						require.Equal(t, layout.Extents[n.extent].Offset, ranges[0].Offset, p)
						require.Equal(t, uint16(blobDeviceID), ranges[0].Device, p)
					}
				case unix.S_IFLNK:
					target, err := lstat.ReadLink(p)
					require.NoError(t, err, p)
					require.Equal(t, string(n.data()), target, p)
				case unix.S_IFCHR:
					require.Equal(t, uint32(unix.Major(n.st.Rdev)), unix.Major(uint64(st.Rdev)), p)
					require.Equal(t, uint32(unix.Minor(n.st.Rdev)), unix.Minor(uint64(st.Rdev)), p)
				case unix.S_IFIFO:
					require.Equal(t, fs.ModeNamedPipe, fi.Mode().Type(), p)
				}
			}
		}
		check(top, ".")
	})
}
