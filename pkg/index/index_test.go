package index

import (
	"bytes"
	"context"
	"errors"
	"fmt"
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
	indexPath, blobPath = filepath.Join(work, "index"), filepath.Join(work, "blob")
	img, err := os.Create(indexPath)
	require.NoError(t, err)
	defer img.Close()
	l, err = Build(root, img, opt)
	require.NoError(t, err)
	requireLayoutReadBack(t, img, l)
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

// An image written on a filesystem that shares extents (XFS) is in the
// page cache whole as Build returns: the step's first lookups through
// its mount read inodes from memory, not from disk a page at a time, as
// they did when the inodes were appended by copy_file_range (a reflink
// of the writer's spill file, whose pages the image does not share).
func TestIndexImageIsInThePageCache(t *testing.T) {
	fs, layer, _ := layerAndMountPoint(t)
	for d := range 10 {
		dir := filepath.Join(layer, fmt.Sprintf("d%d", d))
		require.NoError(t, os.Mkdir(dir, 0o755))
		for i := range 500 { // 5,000 inodes: over a hundred blocks of them
			require.NoError(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", i)), []byte("x"), 0o644))
		}
	}
	root, err := unix.Open(layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(root)
	img, err := os.Create(filepath.Join(fs, "image"))
	require.NoError(t, err)
	defer img.Close()
	l, err := Build(root, img, Options{})
	require.NoError(t, err)
	defer l.Close()
	st, err := img.Stat()
	require.NoError(t, err)
	require.Greater(t, st.Size(), int64(100*blockSize))
	mem, err := unix.Mmap(int(img.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	defer unix.Munmap(mem)
	resident := make([]byte, (len(mem)+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(unsafe.Pointer(&resident[0]))); errno != 0 {
		t.Fatal(errno)
	}
	missing := 0
	for _, r := range resident {
		missing += int(r&1 ^ 1)
	}
	require.Zero(t, missing, "pages of the %d-page image not in the page cache", len(resident))
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
	l, err := Build(root, tempImage(t), Options{})
	require.NoError(t, err)
	require.Equal(t, 2, l.Len())
	require.Equal(t, []Extent{{Path: "a", Size: 5}, {Path: "b", Offset: blockSize, Size: blockSize + 1}}, []Extent{l.Extent(0), l.Extent(1)})
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
			_, err = Build(root, tempImage(t), Options{})
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
	layout, err := Build(root, tempImage(t), Options{Sums: filesum.TableOf(map[string]filesum.Sum{"a.c": {3}, "empty": {4}})})
	require.NoError(t, err)
	require.Equal(t, 10, layout.Len(), "every file with data, a hard link's once")
	for i := range layout.Len() {
		e := layout.Extent(i)
		require.Equal(t, i, layout.Lookup(e.Path), e.Path)
		off, ok := layout.Offset(e.Path)
		require.True(t, ok)
		require.Equal(t, e.Offset, off)
		sum, ok := layout.Sum(e.Path)
		require.Equal(t, e.Path == "a.c", ok, "Build says the sums it is given: %s", e.Path)
		byExtent, err := layout.SumOf(i)
		require.NoError(t, err)
		require.Equal(t, byExtent, sum)
	}
	for _, name := range []string{"a/b.x/y", "empty", "a", "a/", "dir", "dir/a", "b", "", "zz", "a/b/c"} {
		require.Equal(t, -1, layout.Lookup(name), "%q has no extent", name)
		_, ok := layout.Offset(name)
		require.False(t, ok, name)
	}
	sum, ok := layout.Sum("a.c")
	require.True(t, ok)
	require.Equal(t, filesum.Sum{3}, sum, "an extent's sum, by its file's first name")
	_, ok = layout.Sum("empty")
	require.False(t, ok, "a file of no bytes has no extent")
}

// A span is what a pull holds of each file until the blob is whole, its
// path apart: a million of them must not grow unnoticed.
func TestSpanSize(t *testing.T) {
	require.LessOrEqual(t, unsafe.Sizeof(span{}), uintptr(48))
}

// tempImage is an empty file for an image.
func tempImage(t *testing.T) *os.File {
	f, err := os.Create(filepath.Join(t.TempDir(), "image"))
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	return f
}

// A hard link whose file's directory the walk has left is found in the
// image (a binary search of that directory's blocks, then of a block's
// names): links to the first, a middle and the last name of a directory
// of several blocks, and to a file two directories down, mount as one
// inode with its link count.
func TestLinksIntoDirectoriesLeft(t *testing.T) {
	fs, layer, mnt := layerAndMountPoint(t)
	require.NoError(t, os.MkdirAll(filepath.Join(layer, "a", "deep", "er"), 0o755))
	var names []string
	for i := range 900 { // 900 names of 12 to 40 bytes: several blocks
		name := fmt.Sprintf("%03d-%s", i, strings.Repeat("n", i%29))
		names = append(names, name)
		require.NoError(t, os.WriteFile(filepath.Join(layer, "a", name), []byte(name), 0o644))
	}
	require.NoError(t, os.WriteFile(filepath.Join(layer, "a", "deep", "er", "f"), []byte("deep"), 0o644))
	require.NoError(t, os.Mkdir(filepath.Join(layer, "b"), 0o755))
	targets := []string{"a/" + names[0], "a/" + names[450], "a/" + names[899], "a/deep/er/f"}
	for i, target := range targets {
		require.NoError(t, os.Link(filepath.Join(layer, target), filepath.Join(layer, "b", fmt.Sprint(i))))
		require.NoError(t, os.Link(filepath.Join(layer, target), filepath.Join(layer, "b", fmt.Sprint(i, "-again"))))
	}
	indexPath, blobPath, _ := index(t, layer, fs, Options{})
	mountIndex(t, indexPath, blobPath, mnt)
	require.Equal(t, testfs.Describe(t, layer), testfs.Describe(t, mnt))
	for i, target := range targets {
		var want, got, again unix.Stat_t
		require.NoError(t, unix.Lstat(filepath.Join(mnt, target), &want))
		require.NoError(t, unix.Lstat(filepath.Join(mnt, "b", fmt.Sprint(i)), &got))
		require.NoError(t, unix.Lstat(filepath.Join(mnt, "b", fmt.Sprint(i, "-again")), &again))
		require.Equal(t, want.Ino, got.Ino, target)
		require.Equal(t, want.Ino, again.Ino, target)
		require.Equal(t, uint64(3), got.Nlink, target)
	}
}

// A layout keeps 8 bytes an extent and its sums in a file: each extent's
// offset and size come back exact whatever its size against the block
// (one byte, a block, a block and one), padding holds no extent, the
// sums come back by extent from the first that has one, and once the
// layout lets go of its sums they fail to read rather than read as none
// (a fill would then leave bytes unchecked).
func TestLayoutExtentsAndSums(t *testing.T) {
	sizes := []int64{1, blockSize, blockSize + 1, 3*blockSize - 1, 7}
	sums := []filesum.Sum{{}, {1}, {}, {3}, {4}}
	w, err := NewWriter(tempImage(t), Options{}, Entry{Stat: unix.Stat_t{Mode: unix.S_IFDIR | 0o755}})
	require.NoError(t, err)
	for i, size := range sizes {
		require.NoError(t, w.Add(Entry{Name: fmt.Sprintf("f%d", i), Stat: unix.Stat_t{Mode: unix.S_IFREG | 0o644, Size: size}, Sum: sums[i]}))
	}
	layout, err := w.Close()
	require.NoError(t, err)
	_, err = w.Close()
	require.Error(t, err, "a writer closes once")

	var at, data int64
	require.Equal(t, len(sizes), layout.Len())
	for i, size := range sizes {
		e := layout.Extent(i)
		require.Equal(t, Extent{Path: fmt.Sprintf("f%d", i), Offset: at, Size: size}, e)
		require.Equal(t, i, layout.Find(at))
		require.Equal(t, i, layout.Find(at+size-1))
		if size%blockSize != 0 {
			require.Equal(t, -1, layout.Find(at+size), "padding")
		}
		first, end := layout.Touching(at, size)
		require.Equal(t, [2]int{i, i + 1}, [2]int{first, end})
		sum, err := layout.SumOf(i)
		require.NoError(t, err)
		require.Equal(t, sums[i], sum)
		at += roundUp(size, blockSize)
		data += size
	}
	require.Equal(t, at, layout.Size)
	require.Equal(t, data, layout.Data())
	first, end := layout.Touching(0, layout.Size)
	require.Equal(t, [2]int{0, len(sizes)}, [2]int{first, end})

	require.NoError(t, layout.Close())
	_, err = layout.SumOf(3)
	require.Error(t, err, "a sum let go of is not read as none")
	sum, err := layout.SumOf(0)
	require.NoError(t, err, "an extent before the first sum has none")
	require.Equal(t, filesum.Sum{}, sum)
	_, ok := layout.Sum("f1")
	require.False(t, ok)
	off, ok := layout.Offset("f4")
	require.True(t, ok, "a layout's extents outlive its sums")
	require.Equal(t, layout.Extent(4).Offset, off)
}

// A layout with no sums and no inline bytes makes no file of them:
// nothing holds its filesystem.
func TestLayoutWithoutSums(t *testing.T) {
	image := tempImage(t)
	w, err := NewWriter(image, Options{}, Entry{Stat: unix.Stat_t{Mode: unix.S_IFDIR | 0o755}})
	require.NoError(t, err)
	require.NoError(t, w.Add(Entry{Name: "f", Stat: unix.Stat_t{Mode: unix.S_IFREG | 0o644, Size: 3}}))
	layout, err := w.Close()
	require.NoError(t, err)
	require.False(t, layout.sums.started())
	require.False(t, layout.inline.started())
	sum, err := layout.SumOf(0)
	require.NoError(t, err)
	require.Equal(t, filesum.Sum{}, sum)
}

// A layout whose sums or inline bytes cannot be kept fails the writer's
// Close: an index whose extents would go unchecked, or unwritten, is not
// one a fill may use.
func TestLayoutAsideNotKeptFailsTheIndex(t *testing.T) {
	tests := []struct {
		name    string
		file    Entry
		wantErr string
	}{
		{name: "sums", file: Entry{Name: "f", Stat: unix.Stat_t{Mode: unix.S_IFREG | 0o644, Size: 3}, Sum: filesum.Sum{1}}, wantErr: "file sums"},
		{name: "inline bytes", file: Entry{Name: "f", Stat: unix.Stat_t{Mode: unix.S_IFREG | 0o644, Size: 3}, Data: []byte("abc")}, wantErr: "inline bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			image, err := os.Create(filepath.Join(dir, "image"))
			require.NoError(t, err)
			defer image.Close()
			w, err := NewWriter(image, Options{}, Entry{Stat: unix.Stat_t{Mode: unix.S_IFDIR | 0o755}})
			require.NoError(t, err)
			require.NoError(t, os.Remove(image.Name()))
			require.NoError(t, os.Remove(dir)) // where the file would be made
			require.NoError(t, w.Add(tc.file))
			_, err = w.Close()
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

// The bytes Entries carried (a stream's small files) are written into the
// blob at their extents, told in extent order, once: not the others', and
// none after the layout let go of them.
func TestLayoutWriteInline(t *testing.T) {
	files := []struct {
		size int64
		data []byte
	}{{size: 5, data: []byte("small")}, {size: 3}, {size: blockSize + 2, data: bytes.Repeat([]byte{7}, blockSize+2)}}
	layoutOf := func() *Layout {
		w, err := NewWriter(tempImage(t), Options{}, Entry{Stat: unix.Stat_t{Mode: unix.S_IFDIR | 0o755}})
		require.NoError(t, err)
		for i, f := range files {
			require.NoError(t, w.Add(Entry{Name: fmt.Sprintf("f%d", i), Stat: unix.Stat_t{Mode: unix.S_IFREG | 0o644, Size: f.size}, Data: f.data}))
		}
		layout, err := w.Close()
		require.NoError(t, err)
		return layout
	}
	layout := layoutOf()
	blob := make(blobBytes, layout.Size)
	var written []int
	require.NoError(t, layout.WriteInline(blob, func(i int) { written = append(written, i) }))
	require.Equal(t, []int{0, 2}, written)
	want := make(blobBytes, layout.Size)
	for _, i := range written {
		copy(want[layout.Extent(i).Offset:], files[i].data)
	}
	require.Equal(t, want, blob)
	require.NoError(t, layout.WriteInline(blob, func(i int) { t.Errorf("extent %d written twice", i) }))
	require.NoError(t, layout.Close())

	layout = layoutOf()
	require.NoError(t, layout.Close())
	require.NoError(t, layout.WriteInline(blob, func(i int) { t.Errorf("extent %d written after Close", i) }))

	// Taken, they are the writer's, and Write stops once its context is
	// done: a blob that failed is not written on.
	layout = layoutOf()
	inline := layout.TakeInline()
	require.NoError(t, layout.WriteInline(blob, func(i int) { t.Errorf("extent %d written after it was taken", i) }))
	require.NoError(t, layout.Close())
	require.Equal(t, []uint32{0, 2}, inline.Extents(), "the layout's Close lets go of the rest, not of what was taken")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, inline.Write(ctx, blob, func(i int) { t.Errorf("extent %d written after its context ended", i) }), context.Canceled)
	require.Empty(t, inline.Extents(), "let go of once written")
	require.NoError(t, inline.Close())
}

// blobBytes is a blob in memory.
type blobBytes []byte

func (b blobBytes) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(b)) {
		return 0, io.ErrShortWrite
	}
	return copy(b[off:], p), nil
}

// requireLayoutReadBack checks that ReadLayout reads back from image the
// layout its Writer made: the same extents, at the same first names.
func requireLayoutReadBack(t testing.TB, image *os.File, want *Layout) {
	t.Helper()
	got, err := ReadLayout(image)
	require.NoError(t, err)
	require.Equal(t, want.Size, got.Size)
	require.Equal(t, want.Len(), got.Len())
	for i := range want.Len() {
		require.Equal(t, want.Extent(i), got.Extent(i))
	}
	require.Equal(t, want.Data(), got.Data())
}

// ReadLayout refuses what is not an image this package laid out.
func TestReadLayoutRefuses(t *testing.T) {
	tests := []struct {
		name  string
		image []byte
	}{
		{name: "empty", image: nil},
		{name: "no superblock", image: make([]byte, 2*blockSize)},
		{name: "one block of garbage", image: bytes.Repeat([]byte{0xa5}, blockSize)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := tempImage(t)
			_, err := f.Write(tc.image)
			require.NoError(t, err)
			_, err = ReadLayout(f)
			require.ErrorIs(t, err, ErrNotLaidOut)
		})
	}
}
