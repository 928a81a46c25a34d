package streamer

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/internal/testfs"
)

// A layer with every kind of entry travels in each encoding and lands
// identical: modes, owners, times, xattrs (the overlay's opaque mark too),
// the whiteout, the fifo, the hardlink, and the sparse file stays sparse.
// Both ends agree on the size and digest of what crossed.
func TestRoundTripKeepsALayer(t *testing.T) {
	root := testfs.Mount(t, testfs.XFS, 1<<30)
	src := filepath.Join(root, "src")
	require.NoError(t, os.Mkdir(src, 0o755))
	testfs.LayerTree(t, src)
	want := testfs.Describe(t, src)
	keepAll := DefaultLimits // --allow-setuid's: the tree's file capabilities too (see TestUnpackClearsSetuid)
	keepAll.KeepSetuid = true
	for _, enc := range []Encoding{Raw, Zstd, S2, Gzip} {
		t.Run(string(enc), func(t *testing.T) {
			var wire bytes.Buffer
			sent, err := Pack(context.Background(), src, &wire, enc, SparseTar)
			require.NoError(t, err)
			require.Less(t, sent.Bytes, int64(8<<20), "the 256 MiB hole did not cross as zeros")
			dst := filepath.Join(root, "dst-"+string(enc))
			require.NoError(t, os.Mkdir(dst, 0o755))
			got, err := Unpack(context.Background(), &wire, enc, dst, keepAll)
			require.NoError(t, err)
			require.Equal(t, sent, got)
			require.Equal(t, want, testfs.Describe(t, dst))
			var st unix.Stat_t
			require.NoError(t, unix.Stat(filepath.Join(dst, "sparse"), &st))
			require.Less(t, st.Blocks*512, int64(1<<20), "the sparse file's holes stay holes")
		})
	}
	// A plugin limited to one CPU (Go sizes GOMAXPROCS by the cgroup's
	// CPU limit) extracts with no makers: the extractor makes each file
	// itself. This once dereferenced the makers it had not started.
	t.Run("one CPU", func(t *testing.T) {
		defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
		var wire bytes.Buffer
		sent, err := Pack(context.Background(), src, &wire, S2, SparseTar)
		require.NoError(t, err)
		dst := filepath.Join(root, "dst-one-cpu")
		require.NoError(t, os.Mkdir(dst, 0o755))
		got, err := Unpack(context.Background(), &wire, S2, dst, keepAll)
		require.NoError(t, err)
		require.Equal(t, sent, got)
		require.Equal(t, want, testfs.Describe(t, dst))
	})
}

// Without holes the stream is a plain tar any reader takes: the sparse
// file is its zeros.
func TestPackWithoutHolesIsAPlainTar(t *testing.T) {
	src := t.TempDir()
	f, err := os.Create(filepath.Join(src, "sparse"))
	require.NoError(t, err)
	_, err = f.WriteAt([]byte("tail"), 8<<20)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	var wire bytes.Buffer
	_, err = Pack(context.Background(), src, &wire, Raw, PlainTar)
	require.NoError(t, err)
	tr := tar.NewReader(&wire)
	hdr, err := tr.Next()
	require.NoError(t, err)
	require.Equal(t, "./", hdr.Name, "the root comes first, as GNU tar writes it")
	hdr, err = tr.Next()
	require.NoError(t, err)
	require.Equal(t, "sparse", hdr.Name)
	require.Equal(t, int64(8<<20+4), hdr.Size)
	require.NotContains(t, hdr.PAXRecords, paxHoles)
}

func TestPackRefusesDeviceNodes(t *testing.T) {
	src := t.TempDir()
	require.NoError(t, unix.Mknod(filepath.Join(src, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	_, err := Pack(context.Background(), src, &bytes.Buffer{}, Raw, SparseTar)
	require.ErrorContains(t, err, "null is a device node (1:3)")
}

// entry is one header (and body) of a crafted archive.
type entry struct {
	hdr  tar.Header
	body string
}

func craft(t testing.TB, entries ...entry) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		require.NoError(t, tw.WriteHeader(&h))
		if e.body != "" {
			_, err := tw.Write([]byte(e.body))
			require.NoError(t, err)
		}
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}

func file(name, body string) entry {
	return entry{hdr: tar.Header{Name: name, Typeflag: tar.TypeReg}, body: body}
}

// Every way out of the directory a crafted archive can try is refused, and
// nothing lands outside it (nor is anything outside read, written or
// linked).
func TestUnpackRefusesAttacks(t *testing.T) {
	tests := []struct {
		name    string
		entries []entry
		limits  Limits
		wantErr string
	}{
		{name: "dot-dot", entries: []entry{file("../escaped", "x")}, wantErr: "archive refused"},
		{name: "dot-dot inside", entries: []entry{file("a/../../escaped", "x")}, wantErr: "archive refused"},
		{name: "absolute", entries: []entry{file("/tmp/escaped", "x")}, wantErr: "archive refused"},
		{name: "empty name", entries: []entry{file("", "x")}, wantErr: "archive refused"},
		{name: "through a symlink to outside", entries: []entry{
			{hdr: tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "OUTSIDE"}},
			file("link/escaped", "x"),
		}, wantErr: "a symlink"},
		{name: "through a symlink to inside", entries: []entry{
			{hdr: tar.Header{Name: "d", Typeflag: tar.TypeDir}},
			{hdr: tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "d"}},
			file("link/f", "x"),
		}, wantErr: "a symlink"},
		{name: "hardlink outside", entries: []entry{
			{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "../secret"}},
		}, wantErr: "archive refused"},
		{name: "hardlink through a symlink", entries: []entry{
			{hdr: tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "OUTSIDE"}},
			{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "link/secret"}},
		}, wantErr: "a symlink"},
		{name: "hardlink to a symlink", entries: []entry{
			{hdr: tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "OUTSIDE/secret"}},
			{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "link"}},
		}, wantErr: "not a file extracted before it"},
		{name: "hardlink to nothing yet", entries: []entry{
			{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "later"}},
			file("later", "x"),
		}, wantErr: "not a file extracted before it"},
		{name: "a device node", entries: []entry{
			{hdr: tar.Header{Name: "null", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 3}},
		}, wantErr: "device node 1:3"},
		{name: "a block device", entries: []entry{
			{hdr: tar.Header{Name: "sda", Typeflag: tar.TypeBlock, Devmajor: 8}},
		}, wantErr: "entry type"},
		{name: "an xattr that does not travel", entries: []entry{
			{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, Format: tar.FormatPAX,
				PAXRecords: map[string]string{paxXattr + "security.selinux": "system_u:object_r:shadow_t:s0"}}},
		}, wantErr: `xattr "security.selinux"`},
		{name: "an xattr that does not travel, on the root", entries: []entry{
			{hdr: tar.Header{Name: "./", Typeflag: tar.TypeDir, Format: tar.FormatPAX,
				PAXRecords: map[string]string{paxXattr + "security.selinux": "system_u:object_r:shadow_t:s0"}}},
		}, wantErr: `xattr "security.selinux"`},
		{name: "an upload's whiteout", entries: []entry{
			{hdr: tar.Header{Name: "wh", Typeflag: tar.TypeChar}},
		}, limits: Limits{Bytes: 1 << 20, Entries: 10, Strict: true}, wantErr: "a whiteout"},
		{name: "an upload's overlay xattr", entries: []entry{
			{hdr: tar.Header{Name: "d/", Typeflag: tar.TypeDir, Format: tar.FormatPAX,
				PAXRecords: map[string]string{paxXattr + "trusted.overlay.redirect": "/etc"}}},
		}, limits: Limits{Bytes: 1 << 20, Entries: 10, Strict: true}, wantErr: `xattr "trusted.overlay.redirect"`},
		{name: "a sparse map past the file's end", entries: []entry{
			{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, Format: tar.FormatPAX,
				PAXRecords: map[string]string{paxHoles: "10 8:4"}}, body: "abcd"},
		}, wantErr: "sparse map segment"},
		{name: "a sparse map with overlapping segments", entries: []entry{
			{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, Format: tar.FormatPAX,
				PAXRecords: map[string]string{paxHoles: "100 0:4 2:4"}}, body: "abcdefgh"},
		}, wantErr: "sparse map segment"},
		{name: "a sparse map that is not the body", entries: []entry{
			{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, Format: tar.FormatPAX,
				PAXRecords: map[string]string{paxHoles: "1099511627776 0:1"}}, body: "abcd"},
		}, wantErr: "sparse map holds 1 bytes"},
		{name: "a root entry after others", entries: []entry{file("f", "1"),
			{hdr: tar.Header{Name: "./", Typeflag: tar.TypeDir, Mode: 0o777}}}, wantErr: "root entry"},
		{name: "a root that is not a dir", entries: []entry{file(".", "x")}, wantErr: "archive refused"},
		{name: "a name twice", entries: []entry{file("f", "1"), file("f", "2")}, wantErr: "file exists"},
		{name: "too many entries", entries: []entry{file("a", "1"), file("b", "2"), file("c", "3")},
			limits: Limits{Bytes: 1 << 20, Entries: 2}, wantErr: "more than 2 entries"},
		{name: "too many bytes", entries: []entry{file("big", string(make([]byte, 64<<10)))},
			limits: Limits{Bytes: 16 << 10, Entries: 10}, wantErr: "size limit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			outside, dir := filepath.Join(base, "outside"), filepath.Join(base, "dir")
			require.NoError(t, os.Mkdir(outside, 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(outside, "secret"), []byte("secret"), 0o600))
			require.NoError(t, os.Mkdir(dir, 0o755))
			for i := range tc.entries {
				if tc.entries[i].hdr.Linkname == "OUTSIDE" {
					tc.entries[i].hdr.Linkname = outside
				} else if rest, ok := bytes.CutPrefix([]byte(tc.entries[i].hdr.Linkname), []byte("OUTSIDE/")); ok {
					tc.entries[i].hdr.Linkname = filepath.Join(outside, string(rest))
				}
			}
			lim := tc.limits
			if lim == (Limits{}) {
				lim = DefaultLimits
			}
			_, err := Unpack(context.Background(), bytes.NewReader(craft(t, tc.entries...)), Raw, dir, lim)
			require.ErrorContains(t, err, tc.wantErr)
			names, err := os.ReadDir(outside)
			require.NoError(t, err)
			require.Len(t, names, 1, "nothing lands outside")
			secret, err := os.ReadFile(filepath.Join(outside, "secret"))
			require.NoError(t, err)
			require.Equal(t, "secret", string(secret))
			var st unix.Stat_t
			require.NoError(t, unix.Stat(filepath.Join(outside, "secret"), &st))
			require.Equal(t, uint64(1), uint64(st.Nlink), "nothing outside is linked")
			_, err = os.Stat(filepath.Join(base, "escaped"))
			require.True(t, os.IsNotExist(err))
		})
	}
}

// A stream with a byte changed in transit either fails to decode or
// carries another digest, or the change reached nothing the receiver
// decodes: a few bits of a deflate stream (gzip) are such, as about one
// file's mtime in 300 places the flipped byte among them.
func TestCorruptionIsDetected(t *testing.T) {
	src := t.TempDir()
	content := bytes.Repeat([]byte("cowvol "), 10_000)
	require.NoError(t, os.WriteFile(filepath.Join(src, "f"), content, 0o644))
	for _, enc := range []Encoding{Raw, Zstd, S2, Gzip} {
		t.Run(string(enc), func(t *testing.T) {
			var wire bytes.Buffer
			sent, err := Pack(context.Background(), src, &wire, enc, SparseTar)
			require.NoError(t, err)
			raw := wire.Bytes()
			raw[len(raw)/2] ^= 0x40
			dst := t.TempDir()
			got, err := Unpack(context.Background(), bytes.NewReader(raw), enc, dst, DefaultLimits)
			if err == nil && sent.Digest == got.Digest {
				landed, err := os.ReadFile(filepath.Join(dst, "f"))
				require.NoError(t, err)
				require.Equal(t, content, landed, "a change the digest missed changed the file")
			}
		})
	}
}

// The extractor takes any bytes without panicking and without making
// anything outside its directory.
func FuzzUnpack(f *testing.F) {
	f.Add(craft(f, file("a", "x")))
	f.Add(craft(f, entry{hdr: tar.Header{Name: "d", Typeflag: tar.TypeDir}}, file("d/f", "y"),
		entry{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "d/f"}}))
	f.Add(craft(f, entry{hdr: tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "/"}}, file("l/etc/x", "z")))
	f.Add(craft(f, file("../x", "x")))
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		dir := filepath.Join(base, "dir")
		require.NoError(t, os.Mkdir(dir, 0o755))
		_, _ = Unpack(context.Background(), bytes.NewReader(data), Raw, dir, Limits{Bytes: 1 << 20, Entries: 1000})
		names, err := os.ReadDir(base)
		require.NoError(t, err)
		require.Len(t, names, 1, "only dir in %s", base)
	})
}

// A pulled or uploaded setuid binary arrives without its setuid and setgid
// bits, and a binary with file capabilities without them, as a capture
// would leave them, unless the node keeps them (--allow-setuid): runtimes
// do not pass a volume's nosuid into the container.
func TestUnpackClearsSetuid(t *testing.T) {
	capSetuid := "\x01\x00\x00\x02\x80\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00" // v2, effective, CAP_SETUID
	archive := craft(t,
		entry{hdr: tar.Header{Name: "suid", Typeflag: tar.TypeReg, Mode: 0o4755}, body: "x"},
		entry{hdr: tar.Header{Name: "sgid", Typeflag: tar.TypeReg, Mode: 0o2711}, body: "x"},
		entry{hdr: tar.Header{Name: "capped", Typeflag: tar.TypeReg, Mode: 0o755, Format: tar.FormatPAX,
			PAXRecords: map[string]string{paxXattr + fdtree.CapsXattr: capSetuid}}, body: "x"},
		entry{hdr: tar.Header{Name: "dir", Typeflag: tar.TypeDir, Mode: 0o2775}})
	for _, keep := range []bool{false, true} {
		dst := t.TempDir()
		lim := DefaultLimits
		lim.KeepSetuid = keep
		_, err := Unpack(context.Background(), bytes.NewReader(archive), Raw, dst, lim)
		require.NoError(t, err)
		want := map[string]uint32{"suid": 0o755, "sgid": 0o711, "capped": 0o755, "dir": 0o2775}
		if keep {
			want["suid"], want["sgid"] = 0o4755, 0o2711
		}
		for name, mode := range want {
			var st unix.Stat_t
			require.NoError(t, unix.Lstat(filepath.Join(dst, name), &st))
			require.Equal(t, mode, st.Mode&0o7777, "%s (keep %v)", name, keep)
		}
		buf := make([]byte, 64)
		n, err := unix.Lgetxattr(filepath.Join(dst, "capped"), fdtree.CapsXattr, buf)
		if keep {
			require.NoError(t, err)
			require.Equal(t, capSetuid, string(buf[:n]))
		} else {
			require.ErrorIs(t, err, unix.ENODATA, "no file capabilities unless kept")
		}
	}
}

// A file is made with its permission bits, so that most need no chmod
// after; what the making gave it instead (a umask's cut, the group of a
// set-group-ID dir) is still changed to what the archive says.
func TestUnpackGivesFilesTheirOwnersAndModes(t *testing.T) {
	archive := craft(t,
		entry{hdr: tar.Header{Name: "sgid", Typeflag: tar.TypeDir, Mode: 0o2775, Gid: 50}},
		entry{hdr: tar.Header{Name: "sgid/root", Typeflag: tar.TypeReg, Mode: 0o644}, body: "x"},
		entry{hdr: tar.Header{Name: "sgid/group", Typeflag: tar.TypeReg, Mode: 0o664, Gid: 50}, body: "x"},
		entry{hdr: tar.Header{Name: "open", Typeflag: tar.TypeReg, Mode: 0o666, Uid: 1000, Gid: 1000}, body: "x"},
		entry{hdr: tar.Header{Name: "private", Typeflag: tar.TypeReg, Mode: 0o400}, body: "x"})
	defer unix.Umask(unix.Umask(0o077)) // no test here runs in parallel
	dst := t.TempDir()
	_, err := Unpack(context.Background(), bytes.NewReader(archive), Raw, dst, DefaultLimits)
	require.NoError(t, err)
	for name, want := range map[string]struct{ uid, gid, mode uint32 }{
		"sgid/root":  {0, 0, 0o644},
		"sgid/group": {0, 50, 0o664},
		"open":       {1000, 1000, 0o666},
		"private":    {0, 0, 0o400},
	} {
		var st unix.Stat_t
		require.NoError(t, unix.Lstat(filepath.Join(dst, name), &st))
		require.Equal(t, want, struct{ uid, gid, mode uint32 }{st.Uid, st.Gid, st.Mode & 0o7777}, name)
	}
}

// PackFiles sends the named regular files whole and nothing else, reached
// beneath the root with no symlink followed; Files hands them back with
// their holes.
func TestPackFilesAndFiles(t *testing.T) {
	src := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(src, "d"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(src, "d", "a"), []byte("alpha"), 0o644))
	sparse, err := os.Create(filepath.Join(src, "d", "sparse"))
	require.NoError(t, err)
	_, err = sparse.WriteAt([]byte("end"), 1<<20)
	require.NoError(t, err)
	require.NoError(t, sparse.Close())
	require.NoError(t, os.WriteFile(filepath.Join(src, "skipped"), []byte("not asked for"), 0o644))
	require.NoError(t, os.Symlink("d", filepath.Join(src, "link")))

	var wire bytes.Buffer
	sent, err := PackFiles(context.Background(), LayerFiles{Dir: src}, []string{"d/sparse", "d/a"}, &wire, S2, SparseTar)
	require.NoError(t, err)
	got := map[string][]byte{}
	sum, err := Files(context.Background(), &wire, S2, DefaultLimits, func(name string, size int64, write func(w io.WriterAt) error) error {
		f := &bufferAt{b: make([]byte, size)}
		got[name] = f.b
		return write(f)
	})
	require.NoError(t, err)
	require.Equal(t, sent, sum, "the digest covers what was sent")
	require.Equal(t, []byte("alpha"), got["d/a"])
	require.Len(t, got["d/sparse"], 1<<20+3)
	require.Equal(t, []byte("end"), got["d/sparse"][1<<20:])
	require.NotContains(t, got, "skipped")

	for name, want := range map[string]error{"link/a": ErrNoPath, "d": ErrWrongKind, "nope": ErrNoPath, "link": ErrWrongKind} {
		_, err := PackFiles(context.Background(), LayerFiles{Dir: src}, []string{name}, io.Discard, Raw, SparseTar)
		require.ErrorIs(t, err, want, name)
		_, err = openInLayer(src, name) // ReadLayerFile's: the same answers
		require.ErrorIs(t, err, want, name)
	}
	f, err := openInLayer(src, "d/a")
	require.NoError(t, err)
	require.NoError(t, f.Close())
}

// PackFirst sends the files first at the start, in that order, then the
// rest of the tree without them; a name that is not a regular file is
// skipped, and another name of a file sent first follows as a link to it.
// Files reads it back.
func TestPackFirst(t *testing.T) {
	src := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(src, "d"), 0o755))
	for _, name := range []string{"a", "b", "d/c"} {
		require.NoError(t, os.WriteFile(filepath.Join(src, name), []byte(name), 0o644))
	}
	require.NoError(t, os.Link(filepath.Join(src, "a"), filepath.Join(src, "d", "a-too")))
	require.NoError(t, os.Symlink("d", filepath.Join(src, "link")))

	var wire bytes.Buffer
	_, err := PackFirst(context.Background(), LayerFiles{Dir: src}, []string{"d/c", "nope", "link/c", "d", "a", "d/c"}, &wire, Raw, SparseTar, Inline{})
	require.NoError(t, err)
	var names []string
	links := map[string]string{}
	for _, hdr := range tarHeaders(t, &wire) {
		names = append(names, hdr.Name)
		if hdr.Typeflag == tar.TypeLink {
			links[hdr.Name] = hdr.Linkname
		}
	}
	require.Equal(t, []string{"./", "d/c", "a"}, names[:3])
	require.ElementsMatch(t, []string{"d/", "b", "d/a-too", "link"}, names[3:], "the rest, each once")
	require.Equal(t, map[string]string{"d/a-too": "a"}, links)

	var again bytes.Buffer
	sent, err := PackFirst(context.Background(), LayerFiles{Dir: src}, []string{"a", "d/c"}, &again, S2, SparseTar, Inline{})
	require.NoError(t, err)
	got := map[string]string{}
	sum, err := Files(context.Background(), &again, S2, DefaultLimits, func(name string, size int64, write func(w io.WriterAt) error) error {
		f := &bufferAt{b: make([]byte, size)}
		defer func() { got[name] = string(f.b) }()
		return write(f)
	})
	require.NoError(t, err)
	require.Equal(t, sent, sum)
	require.Equal(t, map[string]string{"a": "a", "d/c": "d/c", "b": "b"}, got, "each file's data once, its other name a link")
}

// A DataTar carries the regular files with data and nothing else of the
// tree, each under the first name the stream meets, with its name, size
// and holes alone: no dirs, links, empty files, owners, modes, times or
// xattrs. Files reads the same data from it as from a SparseTar, and the
// digest and entry count agree with what was sent.
func TestDataTarCarriesOnlyTheFilesData(t *testing.T) {
	src := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(src, "d"), 0o755))
	for _, name := range []string{"a", "d/c"} {
		require.NoError(t, os.WriteFile(filepath.Join(src, name), []byte(name), 0o640))
	}
	require.NoError(t, unix.Setxattr(filepath.Join(src, "a"), "user.note", []byte("x"), 0))
	require.NoError(t, os.Chtimes(filepath.Join(src, "a"), time.Now(), time.Date(2020, 1, 2, 3, 4, 5, 6, time.UTC)))
	require.NoError(t, os.WriteFile(filepath.Join(src, "empty"), nil, 0o644))
	require.NoError(t, os.Link(filepath.Join(src, "a"), filepath.Join(src, "d", "a-too")))
	require.NoError(t, os.Symlink("d", filepath.Join(src, "link")))
	require.NoError(t, unix.Mkfifo(filepath.Join(src, "fifo"), 0o644))
	sparse, err := os.Create(filepath.Join(src, "d", "sparse"))
	require.NoError(t, err)
	_, err = sparse.WriteAt([]byte("end"), 1<<20)
	require.NoError(t, err)
	require.NoError(t, sparse.Close())

	files := func(wire io.Reader) (Summary, map[string]string) {
		got := map[string]string{}
		sum, err := Files(context.Background(), wire, S2, DefaultLimits, func(name string, size int64, write func(w io.WriterAt) error) error {
			f := &bufferAt{b: make([]byte, size)}
			defer func() { got[name] = string(f.b) }()
			return write(f)
		})
		require.NoError(t, err)
		return sum, got
	}
	var sparseTar, dataTar bytes.Buffer
	_, err = PackFirst(context.Background(), LayerFiles{Dir: src}, []string{"d/c"}, &sparseTar, S2, SparseTar, Inline{})
	require.NoError(t, err)
	_, want := files(&sparseTar)
	sent, err := PackFirst(context.Background(), LayerFiles{Dir: src}, []string{"d/c"}, &dataTar, S2, DataTar, Inline{})
	require.NoError(t, err)
	raw := bytes.Clone(dataTar.Bytes())
	sum, got := files(&dataTar)
	require.Equal(t, sent, sum)
	require.Equal(t, want, got)
	require.Len(t, got, 3)

	dr, release, err := S2.reader(bytes.NewReader(raw))
	require.NoError(t, err)
	defer release()
	var names []string
	for _, hdr := range tarHeaders(t, dr) {
		names = append(names, hdr.Name)
		require.Equal(t, byte(tar.TypeReg), hdr.Typeflag, hdr.Name)
		require.Zero(t, hdr.Mode, hdr.Name)
		require.Zero(t, hdr.ModTime.Unix(), hdr.Name)
		for k := range hdr.PAXRecords {
			require.Equal(t, paxHoles, k, hdr.Name)
		}
	}
	require.Equal(t, []string{"d/c", "a", "d/sparse"}, names, "the files with data, each once, the first first")
	require.EqualValues(t, len(names), sent.Entries)

	var named bytes.Buffer
	sent, err = PackFiles(context.Background(), LayerFiles{Dir: src}, []string{"empty", "d/a-too"}, &named, S2, DataTar)
	require.NoError(t, err)
	require.EqualValues(t, 1, sent.Entries, "the empty file has no entry")
	sum, got = files(&named)
	require.Equal(t, sent, sum)
	require.Equal(t, map[string]string{"d/a-too": "a"}, got)
}

// tarHeaders reads a plain tar stream to its end with archive/tar and
// returns its headers, in order.
func tarHeaders(t *testing.T, r io.Reader) []*tar.Header {
	t.Helper()
	var hdrs []*tar.Header
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return hdrs
		}
		require.NoError(t, err)
		hdrs = append(hdrs, hdr)
	}
}

type bufferAt struct{ b []byte }

func (b *bufferAt) WriteAt(p []byte, off int64) (int, error) { return copy(b.b[off:], p), nil }

// UnpackStubs hands each stub with a size to its func as it is made, once,
// open, with its attributes already set: not a hardlink's second name, not
// an empty file; with its place among the regular files of the stream,
// which is the order a stream of the tree's data brings them in. An error
// from the func ends the extraction with it.
func TestUnpackStubsHandsOverEachStub(t *testing.T) {
	root := testfs.Mount(t, testfs.XFS, 1<<30)
	src := filepath.Join(root, "src")
	require.NoError(t, os.MkdirAll(filepath.Join(src, "d"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(src, "d", "a"), []byte("aaaa"), 0o640))
	require.NoError(t, os.WriteFile(filepath.Join(src, "b"), make([]byte, 1<<20), 0o644))
	// VFS_CAP_REVISION_2, effective, CAP_NET_BIND_SERVICE.
	require.NoError(t, unix.Setxattr(filepath.Join(src, "b"), fdtree.CapsXattr, []byte{0x01, 0, 0, 0x02, 0x00, 0x04, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 0))
	require.NoError(t, os.WriteFile(filepath.Join(src, "empty"), nil, 0o644))
	require.NoError(t, os.Link(filepath.Join(src, "d", "a"), filepath.Join(src, "a-too")))
	mtime := time.Date(2020, 1, 2, 3, 4, 5, 6, time.UTC)
	require.NoError(t, os.Chtimes(filepath.Join(src, "d", "a"), mtime, mtime))
	var wire bytes.Buffer
	_, err := Pack(context.Background(), src, &wire, Raw, StubTar)
	require.NoError(t, err)

	dst := filepath.Join(root, "dst")
	require.NoError(t, os.Mkdir(dst, 0o755))
	var mu sync.Mutex
	got, places, caps := map[string]int64{}, map[string]int{}, map[string]bool{}
	keepCaps := DefaultLimits // --allow-setuid's: file capabilities are set, and their fills put them back
	keepCaps.KeepSetuid = true
	_, err = UnpackStubs(context.Background(), bytes.NewReader(wire.Bytes()), Raw, dst, keepCaps, Inline{}, func(s Stub) error {
		fd, name, size := s.FD, s.Name, s.Size
		var st unix.Stat_t
		require.NoError(t, unix.Fstat(fd, &st))
		require.Equal(t, size, st.Size, name)
		require.Equal(t, [2]uint64{uint64(st.Dev), st.Ino}, [2]uint64{s.Dev, s.Ino}, "the stub's identity, %s", name)
		require.Equal(t, st.Mtim, s.Mtime, "its times as set, %s", name)
		require.Equal(t, st.Atim, s.Mtime, "its times as set, %s", name)
		if name == "d/a" || name == "a-too" {
			require.Equal(t, mtime.UnixNano(), st.Mtim.Nano(), "its times are set before")
			require.Equal(t, uint32(0o640), st.Mode&0o7777)
		}
		mu.Lock()
		defer mu.Unlock()
		_, again := got[name]
		require.False(t, again, name)
		got[name], places[name], caps[name] = size, s.Place, s.Caps
		return nil
	})
	require.NoError(t, err)
	require.Len(t, got, 2, "a, once under one of its names, and b: %v", got)
	require.Equal(t, int64(1<<20), got["b"])
	require.Equal(t, map[string]int{"a-too": 0, "b": 1}, places, "a-too, b, then empty and d/a's link, in the walk's order")
	require.Equal(t, map[string]bool{"a-too": false, "b": true}, caps, "which carry file capabilities")

	var data bytes.Buffer
	_, err = Pack(context.Background(), src, &data, Raw, SparseTar)
	require.NoError(t, err)
	var brought []string
	_, err = Files(context.Background(), &data, Raw, DefaultLimits, func(name string, _ int64, _ func(io.WriterAt) error) error {
		if _, ok := places[name]; ok {
			brought = append(brought, name)
		}
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, []string{"a-too", "b"}, brought, "the data stream brings them in their places' order")

	// Without --allow-setuid no stub has file capabilities, nor any to
	// put back.
	noCaps := filepath.Join(root, "dst-no-caps")
	require.NoError(t, os.Mkdir(noCaps, 0o755))
	_, err = UnpackStubs(context.Background(), bytes.NewReader(wire.Bytes()), Raw, noCaps, DefaultLimits, Inline{}, func(s Stub) error {
		require.False(t, s.Caps, s.Name)
		return nil
	})
	require.NoError(t, err)
	_, err = unix.Lgetxattr(filepath.Join(noCaps, "b"), fdtree.CapsXattr, nil)
	require.ErrorIs(t, err, unix.ENODATA)

	boom := errors.New("boom")
	dst2 := filepath.Join(root, "dst2")
	require.NoError(t, os.Mkdir(dst2, 0o755))
	_, err = UnpackStubs(context.Background(), bytes.NewReader(wire.Bytes()), Raw, dst2, DefaultLimits, Inline{},
		func(Stub) error { return boom })
	require.ErrorIs(t, err, boom)
}

// A stub tree carries the small files Inline asks for whole, in the walk's
// order, until one would take it over its budget: none after that one, so
// that they are all the small files up to the last one carried. Those are
// made complete and are not stubs, and the summary names the last; a
// stream of the rest of the data leaves them out and brings every other
// file. A stub tree that carries more than was asked for is refused.
func TestStubTreeCarriesSmallFilesWhole(t *testing.T) {
	root := testfs.Mount(t, testfs.XFS, 1<<30)
	src := filepath.Join(root, "src")
	require.NoError(t, os.MkdirAll(filepath.Join(src, "b"), 0o755))
	sizes := map[string]int{
		"a":   10,   // carried: 3,190 left
		"b/c": 3000, // carried: 190 left
		"b/d": 9000, // over Max: a stub, and the next may still be carried
		"b/e": 200,  // over what is left: a stub, and none after it is carried
		"f":   5000, // over Max: a stub
		"g":   20,   // would fit, but comes after b/e: a stub
	}
	data := map[string][]byte{}
	for name, size := range sizes {
		data[name] = bytes.Repeat([]byte(name[len(name)-1:]), size)
		require.NoError(t, os.WriteFile(filepath.Join(src, name), data[name], 0o644))
	}
	inline := Inline{Max: 4096, Budget: 3200}
	var wire bytes.Buffer
	_, err := PackFirst(context.Background(), LayerFiles{Dir: src}, nil, &wire, Raw, StubTar, inline)
	require.NoError(t, err)

	dst := filepath.Join(root, "dst")
	require.NoError(t, os.Mkdir(dst, 0o755))
	var mu sync.Mutex
	var stubs []string
	sum, err := UnpackStubs(context.Background(), bytes.NewReader(wire.Bytes()), Raw, dst, DefaultLimits, inline, func(s Stub) error {
		mu.Lock()
		defer mu.Unlock()
		stubs = append(stubs, s.Name)
		return nil
	})
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"b/d", "b/e", "f", "g"}, stubs)
	require.Equal(t, "b/c", sum.Inlined)
	for name := range sizes {
		got, err := os.ReadFile(filepath.Join(dst, name))
		require.NoError(t, err)
		require.Len(t, got, sizes[name], name)
		if slices.Contains(stubs, name) {
			require.Equal(t, make([]byte, sizes[name]), got, "%s is a stub: holes", name)
		} else {
			require.Equal(t, data[name], got, "%s came whole", name)
		}
	}

	var rest bytes.Buffer
	_, err = PackFirst(context.Background(), LayerFiles{Dir: src}, nil, &rest, Raw, SparseTar, Inline{Max: inline.Max, Through: sum.Inlined})
	require.NoError(t, err)
	var brought []string
	_, err = Files(context.Background(), &rest, Raw, DefaultLimits, func(name string, _ int64, _ func(io.WriterAt) error) error {
		brought = append(brought, name)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, []string{"b/d", "b/e", "f", "g"}, brought, "the rest of the data, in the walk's order")

	dst2 := filepath.Join(root, "dst2")
	require.NoError(t, os.Mkdir(dst2, 0o755))
	_, err = UnpackStubs(context.Background(), bytes.NewReader(wire.Bytes()), Raw, dst2, DefaultLimits, Inline{Max: 4096, Budget: 100},
		func(Stub) error { return nil })
	require.ErrorIs(t, err, ErrRefused, "more data inline than asked for")
}

// walkCompare orders paths as a walk meets them: by component, a dir
// before its contents, whatever the bytes after a shared prefix.
func TestWalkCompare(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want int
	}{
		{"a", "a", 0},
		{"a", "b", -1},
		{"a/z", "b", -1},
		{"a", "a/b", -1},
		{"a/b", "a", 1},
		{"a/b", "a.b", -1}, // byte order would put "a.b" first ('.' < '/')
		{"a.b", "a/b", 1},
		{"d1/f9", "d1/g", -1},
		{"d10/a", "d9/a", -1},
	} {
		require.Equal(t, tc.want, walkCompare(tc.a, tc.b), "%s vs %s", tc.a, tc.b)
	}
}

// fdWatcher is a stream's destination that notes the most files below dir
// the packer held open at any write, and fails from the failAt'th write on
// (0: never).
type fdWatcher struct {
	t       *testing.T
	dir     string
	most    int
	writes  int
	failAt  int
	written int64
}

func (w *fdWatcher) Write(p []byte) (int, error) {
	w.writes++
	if w.failAt > 0 && w.writes >= w.failAt {
		return 0, errors.New("the peer went away")
	}
	w.most = max(w.most, testfs.OpenBelow(w.t, w.dir))
	w.written += int64(len(p))
	return len(p), nil
}

// The packer asks for the data of the files it is about to send while it
// sends those before (a tree read file after file would wait for the disk
// once each), holding at most aheadFiles of them open and aheadBytes of
// their data; a stream that fails lets go of all of them.
func TestPackReadsAhead(t *testing.T) {
	for _, tc := range []struct {
		name        string
		files       int
		size        int
		failAt      int
		wantMost    int
		wantAtLeast int
	}{
		{name: "many small files: bounded by files", files: 400, size: 4 << 10, wantAtLeast: aheadFiles / 2, wantMost: aheadFiles + 1},
		{name: "large files: bounded by bytes", files: 24, size: 1 << 20, wantAtLeast: 2, wantMost: aheadBytes/(1<<20) + 1},
		{name: "the stream fails", files: 400, size: 4 << 10, failAt: 3, wantAtLeast: 2, wantMost: aheadFiles + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := t.TempDir()
			data := bytes.Repeat([]byte{'x'}, tc.size)
			for i := range tc.files {
				require.NoError(t, os.WriteFile(filepath.Join(src, fmt.Sprintf("f%04d", i)), data, 0o644))
			}
			w := &fdWatcher{t: t, dir: src, failAt: tc.failAt}
			_, err := Pack(context.Background(), src, w, Raw, SparseTar)
			if tc.failAt > 0 {
				require.Error(t, err)
			} else {
				require.NoError(t, err)
				require.Greater(t, w.written, int64(tc.files*tc.size))
			}
			require.GreaterOrEqual(t, w.most, tc.wantAtLeast, "files open ahead of the one being sent")
			require.LessOrEqual(t, w.most, tc.wantMost)
			require.Zero(t, testfs.OpenBelow(t, src), "descriptors left open")
		})
	}
}

// An entry's name is relative and clean, or refused: a dir's one trailing
// slash is the only slack taken.
func TestCleanName(t *testing.T) {
	for _, tc := range []struct{ name, want string }{
		{"a", "a"}, {"a/b", "a/b"}, {"a/b/", "a/b"}, {".a", ".a"}, {"a..b/..c", "a..b/..c"}, {"...", "..."},
		{"", ""}, {".", ""}, {"./", ""}, {"/", ""}, {"/a", ""}, {"a//b", ""}, {"a//", ""}, {"a/./b", ""}, {"a/.", ""},
		{"a/..", ""}, {"../a", ""}, {"a/../b", ""}, {"a\x00b", ""}, {string(make([]byte, maxNameLen+1)), ""},
	} {
		got, err := cleanName(tc.name)
		if tc.want == "" {
			require.ErrorIs(t, err, ErrRefused, "%q", tc.name)
			continue
		}
		require.NoError(t, err, "%q", tc.name)
		require.Equal(t, tc.want, got)
	}
}
