package index

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/overlay"
)

// mountIndex mounts the image at index, file-backed, with blob as its
// extra device, read-only at target; skips where the kernel cannot.
func mountIndex(t *testing.T, index, blob, target string) {
	t.Helper()
	err := overlay.MountIndex(index, blob, target)
	if errors.Is(err, overlay.ErrNoIndexMounts) {
		t.Skip(err)
	}
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, unix.Unmount(target, unix.MNT_DETACH)) })
}

// layerAndMountPoint makes an XFS filesystem with an empty layer dir and a
// mount point in it.
func layerAndMountPoint(t *testing.T) (fs, layer, mnt string) {
	t.Helper()
	testfs.Need(t)
	fs = testfs.Mount(t, testfs.XFS, 2<<30)
	layer, mnt = filepath.Join(fs, "layer"), filepath.Join(fs, "mnt")
	require.NoError(t, os.Mkdir(layer, 0o755))
	require.NoError(t, os.Mkdir(mnt, 0o755))
	return fs, layer, mnt
}

// index builds the index of the layer at dir into dir's sibling files and
// fills a sparse blob from the layer as a puller would, range by range.
func index(t *testing.T, layer, work string, opt Options) (indexPath, blobPath string, l *Layout) {
	t.Helper()
	root, err := unix.Open(layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(root)
	var img bytes.Buffer
	l, err = Build(root, &img, opt)
	require.NoError(t, err)
	indexPath, blobPath = filepath.Join(work, "index"), filepath.Join(work, "blob")
	require.NoError(t, os.WriteFile(indexPath, img.Bytes(), 0o600))
	f, err := os.Create(blobPath)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(l.Size))
	blob := Blob{Root: root, Layout: l}
	buf := make([]byte, 1<<20)
	zero := make([]byte, len(buf))
	for off := int64(0); off < l.Size; off += int64(len(buf)) {
		n, err := blob.ReadAt(buf[:min(int64(len(buf)), l.Size-off)], off)
		require.NoError(t, err)
		if !bytes.Equal(buf[:n], zero[:n]) { // holes stay holes
			_, err = f.WriteAt(buf[:n], off)
			require.NoError(t, err)
		}
	}
	return indexPath, blobPath, l
}

// The index of a layer, mounted with its blob filled, is the layer: every
// kind of entry a captured layer holds (hard links, a whiteout, an opaque
// dir, xattrs, a fifo, a symlink, empty and sparse files, a tree deeper
// than PATH_MAX), with owners, modes and times.
func TestIndexIsTheLayer(t *testing.T) {
	fs, layer, mnt := layerAndMountPoint(t)
	testfs.LayerTree(t, layer)
	require.NoError(t, os.WriteFile(filepath.Join(layer, "empty"), nil, 0o600))
	require.NoError(t, os.Mkdir(filepath.Join(layer, "empty-dir"), 0o700))
	long := strings.Repeat("n", 255)
	require.NoError(t, os.WriteFile(filepath.Join(layer, long), []byte("a long name"), 0o644))
	require.NoError(t, os.Mkdir(filepath.Join(layer, "many"), 0o755))
	for i := range 700 { // a directory of more than one block of entries
		require.NoError(t, os.WriteFile(filepath.Join(layer, "many", strings.Repeat("x", i%40)+string(rune('a'+i%26))+strings.Repeat("y", i/26)), []byte{byte(i)}, 0o644))
	}
	require.NoError(t, unix.Mknod(filepath.Join(layer, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	require.NoError(t, os.WriteFile(filepath.Join(layer, "setuid"), []byte("x"), 0o755))
	require.NoError(t, unix.Chmod(filepath.Join(layer, "setuid"), 0o4755))

	indexPath, blobPath, l := index(t, layer, fs, Options{})
	mountIndex(t, indexPath, blobPath, mnt)
	want, got := testfs.Describe(t, layer), testfs.Describe(t, mnt)
	require.Contains(t, want["setuid"], "mode=104755")
	want["setuid"] = strings.Replace(want["setuid"], "mode=104755", "mode=100755", 1) // cleared, as a capture does
	before, after, found := strings.Cut(want["cap"], " xattrs=security.capability=")
	require.True(t, found)
	_, mtime, _ := strings.Cut(after, " mtime=")
	want["cap"] = before + " mtime=" + mtime // file capabilities are not kept either
	require.Equal(t, want, got)
	require.Positive(t, l.Size)
	require.Equal(t, 0, l.Find(0))
}

// With KeepSetuid the bits and capabilities stay.
func TestIndexKeepsSetuidWhenAsked(t *testing.T) {
	fs, layer, mnt := layerAndMountPoint(t)
	require.NoError(t, os.WriteFile(filepath.Join(layer, "setuid"), []byte("x"), 0o755))
	require.NoError(t, unix.Chmod(filepath.Join(layer, "setuid"), 0o4755))
	require.NoError(t, unix.Setxattr(filepath.Join(layer, "setuid"), fdtree.CapsXattr, testCaps, 0))
	indexPath, blobPath, _ := index(t, layer, fs, Options{KeepSetuid: true})
	mountIndex(t, indexPath, blobPath, mnt)
	var st unix.Stat_t
	require.NoError(t, unix.Lstat(filepath.Join(mnt, "setuid"), &st))
	require.Equal(t, uint32(unix.S_IFREG|0o4755), st.Mode)
	caps := make([]byte, 64)
	n, err := unix.Lgetxattr(filepath.Join(mnt, "setuid"), fdtree.CapsXattr, caps)
	require.NoError(t, err)
	require.Equal(t, testCaps, caps[:n])
}

// cap_net_bind_service+ep (VFS_CAP_REVISION_2).
var testCaps = []byte{0x01, 0, 0, 0x02, 0x00, 0x04, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

// The blob is each file's bytes at its extent and zeros between; reads
// across extents and past the end say so.
func TestBlobReadsTheLayer(t *testing.T) {
	layer := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(layer, "a"), []byte("first"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(layer, "b"), bytes.Repeat([]byte("b"), blockSize+1), 0o644))
	root, err := unix.Open(layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(root)
	var img bytes.Buffer
	l, err := Build(root, &img, Options{})
	require.NoError(t, err)
	require.Equal(t, []Extent{{Path: "a", Size: 5}, {Path: "b", Offset: blockSize, Size: blockSize + 1}}, l.Extents)
	require.Equal(t, int64(3*blockSize), l.Size)
	require.Equal(t, -1, l.Find(5), "padding")
	require.Equal(t, 1, l.Find(2*blockSize))

	blob := Blob{Root: root, Layout: l}
	p := make([]byte, blockSize+4)
	n, err := blob.ReadAt(p, 2)
	require.NoError(t, err)
	require.Equal(t, len(p), n)
	want := append(append([]byte("rst"), make([]byte, blockSize-5)...), []byte("bbbbbb")...)
	require.Equal(t, want, p)
	n, err = blob.ReadAt(p, l.Size-2)
	require.Equal(t, 2, n)
	require.ErrorIs(t, err, io.EOF)
	_, err = blob.ReadAt(p, -1)
	require.Error(t, err)
}

// What an index cannot say is refused as ErrUnindexable, for the caller to
// fall back: a symlink whose target does not fit in its inode's block, an
// xattr EROFS has no prefix for.
func TestUnindexable(t *testing.T) {
	tests := []struct {
		name string
		make func(t *testing.T, dir string)
	}{
		{"sparse files past what a blob addresses (16 TiB)", func(t *testing.T, dir string) {
			for _, name := range []string{"huge-1", "huge-2"} {
				f, err := os.Create(filepath.Join(dir, name))
				require.NoError(t, err)
				require.NoError(t, f.Truncate(12<<40), "ext4 and XFS make sparse files of 12 TiB")
				require.NoError(t, f.Close())
			}
		}},
		{"a symlink of 4,050 bytes", func(t *testing.T, dir string) {
			require.NoError(t, os.Symlink(strings.Repeat("a/", 2025), filepath.Join(dir, "long")))
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			tc.make(t, dir)
			root, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			require.NoError(t, err)
			defer unix.Close(root)
			_, err = Build(root, io.Discard, Options{})
			require.ErrorIs(t, err, ErrUnindexable)
		})
	}
	_, err := xattrBody(map[string]string{"system.posix_acl_access": "x"})
	require.ErrorIs(t, err, ErrUnindexable)
}

// Lookup finds each file's extent by its first name, in a tree whose
// names sort differently as whole paths than as the walk meets them
// ("a.c" before "a/b" by bytes, after it in the walk), and finds nothing
// for any other name.
func TestLayoutLookup(t *testing.T) {
	layer := t.TempDir()
	for _, f := range []string{"a/b", "a.c", "a-d", "a/b.x/y", "a/b-x", "ab", "a/ü", "z", "a/b.x/y2", " a", "dir/a/b"} {
		require.NoError(t, os.MkdirAll(filepath.Join(layer, filepath.Dir(f)), 0o755))
		if f == "a/b.x/y" {
			require.NoError(t, os.Link(filepath.Join(layer, "a/b"), filepath.Join(layer, f)))
			continue
		}
		require.NoError(t, os.WriteFile(filepath.Join(layer, f), []byte(f), 0o644))
	}
	require.NoError(t, os.WriteFile(filepath.Join(layer, "empty"), nil, 0o644))
	root, err := unix.Open(layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(root)
	layout, err := Build(root, io.Discard, Options{})
	require.NoError(t, err)
	require.Len(t, layout.Extents, 10, "every file with data, a hard link's once")
	for i, e := range layout.Extents {
		require.Equal(t, i, layout.Lookup(e.Path), e.Path)
		off, ok := layout.Offset(e.Path)
		require.True(t, ok)
		require.Equal(t, e.Offset, off)
		_, ok = layout.Sum(e.Path)
		require.False(t, ok, "Build says no sums")
	}
	for _, name := range []string{"a/b.x/y", "empty", "a", "a/", "dir", "dir/a", "b", "", "zz", "a/b/c"} {
		require.Equal(t, -1, layout.Lookup(name), "%q has no extent", name)
		_, ok := layout.Offset(name)
		require.False(t, ok, name)
	}
	layout.Extents[3].Sum = filesum.Sum{3}
	sum, ok := layout.Sum(layout.Extents[3].Path)
	require.True(t, ok)
	require.Equal(t, filesum.Sum{3}, sum, "an extent's sum, by its file's first name")
}

// A node is what a pull holds of each entry until its image is written,
// and an extent what it holds of each file until the blob is whole: a
// million of them must not grow unnoticed.
func TestNodeSize(t *testing.T) {
	require.LessOrEqual(t, unsafe.Sizeof(node{}), uintptr(112), "a node in the allocator's class of 112 bytes")
	require.LessOrEqual(t, unsafe.Sizeof(Extent{}), uintptr(64))
}
