package streamer

import (
	"archive/tar"
	"bytes"
	"context"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
)

// The index a puller learns from a layer's stub tree is, byte for byte,
// the index its holder builds from the layer on disk: the same image and
// the same blob, so that the puller mounts an image it made itself and
// fetches the holder's ranges. Each extent carries its file's sum, and
// the small files the stream carried whole, their bytes; the table
// written as the stream comes is the holder's.
func TestIndexStubsIsTheLayersIndex(t *testing.T) {
	testfs.Need(t)
	fs := testfs.Mount(t, testfs.XFS, 1<<30)
	layer := filepath.Join(fs, "layer")
	require.NoError(t, os.Mkdir(layer, 0o755))
	testfs.LayerTree(t, layer)
	require.NoError(t, os.MkdirAll(filepath.Join(layer, "a/b"), 0o750))
	require.NoError(t, os.WriteFile(filepath.Join(layer, "a/b/small"), []byte("small and whole"), 0o644))
	require.NoError(t, os.Link(filepath.Join(layer, "a/b/small"), filepath.Join(layer, "a/again")))
	require.NoError(t, os.WriteFile(filepath.Join(layer, "setuid"), []byte("x"), 0o755))
	require.NoError(t, unix.Chmod(filepath.Join(layer, "setuid"), 0o4755))
	require.NoError(t, os.WriteFile(filepath.Join(layer, "empty"), nil, 0o600))
	sums, err := filesum.OfTree(t.Context(), layer)
	require.NoError(t, err)

	var tarInlined string
	for _, form := range []struct {
		shape      Shape
		keepSetuid bool
	}{{StubTar, false}, {StubTar, true}, {StubRecords, false}, {StubRecords, true}} {
		keepSetuid := form.keepSetuid
		var stubs bytes.Buffer
		inline := Inline{Max: 64, Budget: 1 << 20}
		if form.shape == StubRecords {
			_, err = PackRecords(t.Context(), LayerFiles{Dir: layer, Sums: sums}, &stubs, Raw, inline)
		} else {
			_, err = PackFirst(t.Context(), LayerFiles{Dir: layer, Sums: sums}, nil, &stubs, Raw, StubTar, inline)
		}
		require.NoError(t, err)
		lim := DefaultLimits
		lim.Summed, lim.KeepSetuid = true, keepSetuid
		wire := stubs.Bytes()
		fromStream, fromDisk := tempImage(t), tempImage(t)
		keptSums := filepath.Join(t.TempDir(), "sums")
		table, err := filesum.CreateTableFile(keptSums)
		require.NoError(t, err)
		got, sum, err := IndexStubs(t.Context(), bytes.NewReader(wire), Raw, lim, inline, fromStream, table)
		require.NoError(t, err)
		require.Equal(t, sums.Digest(), sum.Files, "the stub tree's table")
		require.NoError(t, table.Keep())
		kept, err := filesum.ReadFile(keptSums)
		require.NoError(t, err)
		require.Equal(t, maps.Collect(sums.All()), maps.Collect(kept.All()), "the table written as the %s came", form.shape)
		require.Equal(t, sums.Digest(), kept.Digest())

		root, err := unix.Open(layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		require.NoError(t, err)
		want, err := index.Build(root, fromDisk, index.Options{KeepSetuid: keepSetuid})
		unix.Close(root)
		require.NoError(t, err)
		require.Equal(t, fileBytes(t, fromDisk), fileBytes(t, fromStream), "the image from the %s is the holder's (KeepSetuid %v)", form.shape, keepSetuid)
		require.Equal(t, want.Size, got.Size)
		require.Equal(t, want.Len(), got.Len())
		inlined := inlineBytes(t, got)
		require.Empty(t, inlineBytes(t, got), "the inline bytes are written once")
		for i := range got.Len() {
			e := got.Extent(i)
			require.Equal(t, want.Extent(i).Path, e.Path)
			require.Equal(t, want.Extent(i).Offset, e.Offset)
			require.Equal(t, want.Extent(i).Size, e.Size)
			sum, err := got.SumOf(i)
			require.NoError(t, err)
			wantSum, _ := sums.Sum(e.Path)
			require.Equal(t, wantSum, sum, e.Path)
			if data, ok := inlined[i]; ok {
				want, err := os.ReadFile(filepath.Join(layer, e.Path))
				require.NoError(t, err)
				require.Equal(t, want, data, e.Path)
			}
			require.Equal(t, e.Size <= inline.Max, inlined[i] != nil, "%s: the small files come whole, no other", e.Path)
		}
		require.NotEmpty(t, inlined)
		if form.shape == StubRecords {
			require.Equal(t, recordsMagic, string(wire[:len(recordsMagic)]))
			require.Equal(t, tarInlined, sum.Inlined, "the last file carried whole, as the tar says")
			continue
		}
		unpacked, err := UnpackStubs(t.Context(), bytes.NewReader(wire), Raw, t.TempDir(), lim, inline, func(Stub) error { return nil })
		require.NoError(t, err)
		require.Equal(t, unpacked.Inlined, sum.Inlined, "the last file carried whole")
		tarInlined = sum.Inlined
	}
}

// A stub tree is learnt only as a packer writes it: anything an
// extraction would refuse, or that would make the index another tree
// than the holder's, is refused, and a small file whose bytes are not its
// sum is corrupt.
func TestIndexStubsRefuses(t *testing.T) {
	root := entry{hdr: tar.Header{Name: rootName, Typeflag: tar.TypeDir, Mode: 0o755}}
	dir := func(name string) entry {
		return entry{hdr: tar.Header{Name: name + "/", Typeflag: tar.TypeDir, Mode: 0o755}}
	}
	stub := func(name string, size string) entry {
		return entry{hdr: tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Format: tar.FormatPAX,
			PAXRecords: map[string]string{paxHoles: size}}}
	}
	sum, err := filesum.Of(strings.NewReader("whole"))
	require.NoError(t, err)
	summed := func(e entry, s string) entry {
		e.hdr.Format = tar.FormatPAX
		e.hdr.PAXRecords = map[string]string{paxSum: s}
		return e
	}
	tests := []struct {
		name    string
		entries []entry
		summed  bool
		inline  Inline
		wantErr string
	}{
		{name: "no root first", entries: []entry{file("f", "x")}, wantErr: "is not its root"},
		{name: "a second root", entries: []entry{root, root}, wantErr: "not the first"},
		{name: "nothing", wantErr: "an empty stub tree"},
		{name: "dot-dot", entries: []entry{root, stub("../escaped", "1")}, wantErr: "entry name"},
		{name: "absolute", entries: []entry{root, stub("/etc/passwd", "1")}, wantErr: "entry name"},
		{name: "a parent not sent", entries: []entry{root, stub("d/f", "1")}, wantErr: "its directory was not added"},
		{name: "a parent that is a file", entries: []entry{root, stub("f", "1"), stub("f/g", "1")}, wantErr: "its directory was not added"},
		{name: "through a symlink", entries: []entry{root,
			{hdr: tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "/etc"}}, stub("link/passwd", "1")}, wantErr: "its directory was not added"},
		{name: "a name twice", entries: []entry{root, stub("f", "1"), dir("f")}, wantErr: "added twice"},
		{name: "out of a walk's order", entries: []entry{root, stub("b", "1"), stub("a", "1")}, wantErr: "not in a walk's order"},
		{name: "back in a dir left", entries: []entry{root, dir("d"), stub("d/f", "1"), stub("e", "1"), stub("d/g", "1")},
			wantErr: "not in a walk's order"},
		{name: "a dir's entries before it", entries: []entry{root, stub("d/f", "1"), dir("d")}, wantErr: "its directory was not added"},
		{name: "a name too long", entries: []entry{root, stub(strings.Repeat("n", 256), "1")}, wantErr: "entry name"},
		{name: "a hard link to nothing yet", entries: []entry{root,
			{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "later"}}, stub("later", "1")}, wantErr: "not a regular file added before it"},
		{name: "a hard link to a dir", entries: []entry{root, dir("d"),
			{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "d"}}}, wantErr: "not a regular file added before it"},
		{name: "a hard link outside", entries: []entry{root,
			{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "../secret"}}}, wantErr: "hardlink to"},
		{name: "a device node", entries: []entry{root,
			{hdr: tar.Header{Name: "null", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 3}}}, wantErr: "device node 1:3"},
		{name: "a block device", entries: []entry{root,
			{hdr: tar.Header{Name: "sda", Typeflag: tar.TypeBlock, Devmajor: 8}}}, wantErr: "entry type"},
		{name: "an xattr that does not travel", entries: []entry{root,
			{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, Format: tar.FormatPAX,
				PAXRecords: map[string]string{paxXattr + "security.selinux": "system_u:object_r:shadow_t:s0"}}}}, wantErr: `xattr "security.selinux"`},
		{name: "an owner of no one", entries: []entry{root,
			{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, Uid: -1}}}, wantErr: "owner -1:0"},
		{name: "data not asked for", entries: []entry{root, file("f", "whole")}, wantErr: "asked for files of at most 0"},
		{name: "more data than asked for", entries: []entry{root, file("f", "whole")}, inline: Inline{Max: 4, Budget: 100},
			wantErr: "asked for files of at most 4"},
		{name: "a small file whose sparse map says a terabyte", entries: []entry{root, {hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg,
			Format: tar.FormatPAX, PAXRecords: map[string]string{paxHoles: "1099511627776 0:5"}}, body: "whole"}},
			inline: Inline{Max: 100, Budget: 100}, wantErr: "1099511627776 bytes of data in a stub tree"},
		{name: "a sparse map that is not the body", entries: []entry{root, stub("f", "100 0:4")}, wantErr: "sparse map holds 4 bytes"},
		{name: "a file with no sum", entries: []entry{root, stub("f", "1")}, summed: true, wantErr: "no sum"},
		{name: "a small file that is not its sum", entries: []entry{root, summed(file("f", "whoLe"), sum.String())}, summed: true,
			inline: Inline{Max: 100, Budget: 100}, wantErr: "corrupt"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			lim := DefaultLimits
			lim.Summed = tc.summed
			_, _, err := IndexStubs(context.Background(), bytes.NewReader(craft(t, tc.entries...)), Raw, lim, tc.inline, tempImage(t), nil)
			require.ErrorContains(t, err, tc.wantErr)
			if tc.wantErr == "corrupt" {
				require.ErrorIs(t, err, ErrCorrupt)
			} else {
				require.ErrorIs(t, err, ErrRefused)
			}
		})
	}
	lim := DefaultLimits
	lim.Summed = true
	l, _, err := IndexStubs(context.Background(), bytes.NewReader(craft(t, root, summed(file("f", "whole"), sum.String()))), Raw, lim,
		Inline{Max: 100, Budget: 100}, tempImage(t), nil)
	require.NoError(t, err, "a small file that is its sum")
	require.Equal(t, map[int][]byte{0: []byte("whole")}, inlineBytes(t, l))
	lim.Strict = true
	_, _, err = IndexStubs(context.Background(), bytes.NewReader(craft(t, root)), Raw, lim, Inline{}, tempImage(t), nil)
	require.ErrorContains(t, err, "never strict", "an upload is extracted, not indexed")
}

// tempImage is an empty file for an index's image.
func tempImage(t testing.TB) *os.File {
	f, err := os.Create(filepath.Join(t.TempDir(), "image"))
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	return f
}

// inlineBytes is what l's WriteInline writes into a blob, by extent.
func inlineBytes(t *testing.T, l *index.Layout) map[int][]byte {
	blob := &bufferAt{b: make([]byte, l.Size)}
	got := map[int][]byte{}
	require.NoError(t, l.WriteInline(blob, func(i int) {
		e := l.Extent(i)
		got[i] = blob.b[e.Offset : e.Offset+e.Size]
	}))
	return got
}

// fileBytes is what f holds.
func fileBytes(t *testing.T, f *os.File) []byte {
	b, err := os.ReadFile(f.Name())
	require.NoError(t, err)
	return b
}

// zeroReader reads zeros.
type zeroReader struct{}

func (zeroReader) ReadAt(p []byte, _ int64) (int, error) {
	clear(p)
	return len(p), nil
}
