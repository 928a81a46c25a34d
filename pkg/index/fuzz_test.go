package index

import (
	"bytes"
	"cmp"
	"errors"
	"io"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	erofs "github.com/erofs/go-erofs"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// fnode is an entry of a tree FuzzImage indexes: a hard link is a node
// named twice.
type fnode struct {
	st     attrs
	xattrs map[string]string
	target string
	kids   map[string]*fnode // a directory's
}

// fuzzTree makes a tree from data: each step takes a kind, a directory
// made so far, a name and what the kind needs (a size, a target, the file
// a hard link names, an xattr).
func fuzzTree(data []byte) *fnode {
	top := &fnode{st: attrs{Mode: unix.S_IFDIR | 0o755}, kids: map[string]*fnode{}}
	dirs, files := []*fnode{top}, []*fnode{}
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
		if string(name) == "." || string(name) == ".." || bytes.ContainsAny(name, "\x00/") || parent.kids[string(name)] != nil {
			continue
		}
		n := &fnode{st: attrs{Uid: uint32(next()) << 10, Gid: uint32(next()), Mode: 0o640 | uint32(next()&0o7)}}
		n.st.MtimSec, n.st.MtimNsec = int64(next())<<24, uint32(next())<<20
		if next()%3 == 0 {
			n.xattrs = map[string]string{"user.k" + string(name[:1]): string(name), "trusted.overlay.opaque": "y"}
		}
		switch kind {
		case 0:
			n.st.Mode |= unix.S_IFDIR
			n.kids = map[string]*fnode{}
			dirs = append(dirs, n)
		case 1:
			n.st.Mode |= unix.S_IFREG
			n.st.Size = int64(next()) << (next() % 24)
			files = append(files, n)
		case 2:
			n.st.Mode |= unix.S_IFLNK
			n.target = string(bytes.Repeat(name, 1+int(next())%8))
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
		parent.kids[string(name)] = n
	}
	return top
}

// names are a directory's names in byte order, as a walk meets them.
func (n *fnode) names() []string {
	names := slices.Collect(maps.Keys(n.kids))
	slices.Sort(names)
	return names
}

// writeFuzzTree indexes the tree below top as a walk meets it, and says
// each node's first name and how many names it has.
func writeFuzzTree(t testing.TB, image *os.File, top *fnode) (*Layout, map[*fnode]string, map[*fnode]int, error) {
	entry := func(name string, n *fnode) Entry {
		e := Entry{Name: name, Xattrs: n.xattrs, Target: n.target}
		e.Stat.Mode, e.Stat.Uid, e.Stat.Gid, e.Stat.Size, e.Stat.Rdev = n.st.Mode, n.st.Uid, n.st.Gid, n.st.Size, n.st.Rdev
		e.Stat.Mtim = unix.Timespec{Sec: n.st.MtimSec, Nsec: int64(n.st.MtimNsec)}
		return e
	}
	w, err := NewWriter(image, Options{}, entry("", top))
	require.NoError(t, err)
	first, names := map[*fnode]string{}, map[*fnode]int{}
	var visit func(d *fnode, dir string) error
	visit = func(d *fnode, dir string) error {
		for _, name := range d.names() {
			n, p := d.kids[name], dir+name
			names[n]++
			if f, ok := first[n]; ok {
				if err := w.Link(p, f); err != nil {
					return err
				}
				continue
			}
			first[n] = p
			if err := w.Add(entry(p, n)); err != nil {
				return err
			}
			if n.kids != nil {
				if err := visit(n, p+"/"); err != nil {
					return err
				}
			}
		}
		return nil
	}
	err = visit(top, "")
	layout, cerr := w.Close()
	return layout, first, names, cmp.Or(err, cerr)
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
		image, err := os.Create(filepath.Join(t.TempDir(), "image"))
		require.NoError(t, err)
		defer image.Close()
		layout, first, names, err := writeFuzzTree(t, image, top)
		if errors.Is(err, ErrUnindexable) {
			return
		}
		require.NoError(t, err)
		for i := range layout.Len() {
			require.Equal(t, i, layout.Lookup(layout.Extent(i).Path), "the extents lie in path order: %q", layout.Extent(i).Path)
		}
		requireLayoutReadBack(t, image, layout)
		fsys, err := erofs.Open(image, erofs.WithExtraDevices(zeros(layout.Size)))
		require.NoError(t, err)
		lstat := fsys.(interface {
			Lstat(string) (fs.FileInfo, error)
			ReadLink(string) (string, error)
		})
		inos := map[*fnode]int64{}
		var check func(d *fnode, dir string)
		check = func(d *fnode, dir string) {
			listed, err := fs.ReadDir(fsys, dir)
			require.NoError(t, err, dir)
			var got []string
			for _, e := range listed {
				got = append(got, e.Name())
			}
			want := d.names()
			if len(want) == 0 {
				want = nil
			}
			require.Equal(t, want, got, dir)
			for _, name := range want {
				p, n := path.Join(dir, name), d.kids[name]
				fi, err := lstat.Lstat(p)
				require.NoError(t, err, p)
				st := fi.Sys().(*erofs.Stat)
				require.Equal(t, n.st.Uid, st.UID, p)
				require.Equal(t, n.st.Gid, st.GID, p)
				require.Equal(t, uint64(n.st.MtimSec), st.Mtime, p)
				require.Equal(t, n.st.MtimNsec, st.MtimeNs, p)
				require.Equal(t, fs.FileMode(n.st.Mode&0o777), fi.Mode().Perm(), p)
				nlink := names[n]
				if n.kids != nil {
					nlink = 2
					for _, k := range n.kids {
						if k.kids != nil {
							nlink++
						}
					}
				}
				require.Equal(t, nlink, st.Nlink, p)
				if len(n.xattrs) > 0 {
					require.Equal(t, n.xattrs, st.Xattrs, p)
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
						off, ok := layout.Offset(strings.TrimPrefix(first[n], "./"))
						require.True(t, ok, p)
						require.Equal(t, off, ranges[0].Offset, p)
						require.Equal(t, uint16(blobDeviceID), ranges[0].Device, p)
					}
				case unix.S_IFLNK:
					target, err := lstat.ReadLink(p)
					require.NoError(t, err, p)
					require.Equal(t, n.target, target, p)
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

// FuzzReadLayout: an image torn or changed anywhere is read back as a
// layout or refused, never a crash or a hang.
func FuzzReadLayout(f *testing.F) {
	image, err := os.Create(filepath.Join(f.TempDir(), "image"))
	require.NoError(f, err)
	defer image.Close()
	_, _, _, err = writeFuzzTree(f, image, fuzzTree(fuzzSeed(200)))
	require.NoError(f, err)
	whole, err := os.ReadFile(image.Name())
	require.NoError(f, err)
	f.Add(uint32(superblockOffset+14), []byte{0xff})
	f.Add(uint32(blockSize+8), []byte{0, 0})
	f.Add(uint32(len(whole)-100), []byte{1, 2, 3, 4, 5, 6, 7, 8})
	f.Add(uint32(len(whole)/2), []byte{})
	f.Fuzz(func(t *testing.T, at uint32, with []byte) {
		torn := slices.Clone(whole)
		if len(with) == 0 {
			torn = torn[:int(at)%len(torn)] // cut short
		} else {
			copy(torn[int(at)%len(torn):], with)
		}
		changed, err := os.Create(filepath.Join(t.TempDir(), "image"))
		require.NoError(t, err)
		defer changed.Close()
		_, err = changed.Write(torn)
		require.NoError(t, err)
		if l, err := ReadLayout(changed); err == nil {
			for i := range l.Len() {
				e := l.Extent(i)
				require.LessOrEqual(t, e.Offset+e.Size, l.Size)
			}
		}
	})
}
