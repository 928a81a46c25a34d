package streamer

import (
	"archive/tar"
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// writeBoth writes the same entries with archive/tar's Writer and with
// tarWriter: what each wrote, and the first error each met.
func writeBoth(t testing.TB, hdrs []tar.Header, bodies []string) (want, got []byte, wantErr, gotErr error) {
	t.Helper()
	var a, b bytes.Buffer
	ours := newTarWriter(&b)
	theirs := tar.NewWriter(&a)
	for i := range hdrs {
		h := hdrs[i]
		if wantErr == nil {
			if wantErr = theirs.WriteHeader(&h); wantErr == nil && bodies[i] != "" {
				_, wantErr = theirs.Write([]byte(bodies[i]))
			}
		}
		h = hdrs[i]
		if gotErr == nil {
			if gotErr = ours.WriteHeader(&h); gotErr == nil && bodies[i] != "" {
				_, gotErr = ours.Write([]byte(bodies[i]))
			}
		}
	}
	if wantErr == nil {
		wantErr = theirs.Close()
	}
	if gotErr == nil {
		gotErr = ours.Close()
	}
	return a.Bytes(), b.Bytes(), wantErr, gotErr
}

// The stream's writer writes what archive/tar writes, byte for byte, for
// every kind of header a packer makes, and refuses what archive/tar
// refuses.
func TestTarWriterWritesWhatArchiveTarWrites(t *testing.T) {
	sec := time.Unix(1_700_000_000, 0)
	nsec := time.Unix(1_700_000_000, 123_456_000)
	long := strings.Repeat("d/", 60) + "file"
	tests := []struct {
		name    string
		hdr     tar.Header
		body    string
		wantErr bool
		// headerOnly: compare the headers alone (a body too big to write)
		headerOnly bool
	}{
		{name: "a file, whole seconds (ustar)", hdr: tar.Header{Name: "a.txt", Typeflag: tar.TypeReg, Mode: 0o644, Uid: 1000, Gid: 1000, Size: 5, ModTime: sec}, body: "hello"},
		{name: "a file, nanoseconds (PAX mtime)", hdr: tar.Header{Name: "a.txt", Typeflag: tar.TypeReg, Mode: 0o755, Size: 3, ModTime: nsec}, body: "abc"},
		{name: "a file of 512 bytes", hdr: tar.Header{Name: "b", Typeflag: tar.TypeReg, Mode: 0o600, Size: 512, ModTime: nsec}, body: strings.Repeat("x", 512)},
		{name: "an empty file", hdr: tar.Header{Name: "e", Typeflag: tar.TypeReg, Mode: 0o600, ModTime: sec}},
		{name: "a dir", hdr: tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o1777, ModTime: nsec}},
		{name: "the root", hdr: tar.Header{Name: "./", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: sec}},
		{name: "a symlink", hdr: tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "../target", Mode: 0o777, ModTime: nsec}},
		{name: "a long symlink target", hdr: tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: strings.Repeat("t", 300), ModTime: sec}},
		{name: "a hardlink", hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "a.txt", Mode: 0o644, Size: 0, ModTime: nsec}},
		{name: "a whiteout", hdr: tar.Header{Name: "gone", Typeflag: tar.TypeChar, Mode: 0, ModTime: nsec}},
		{name: "a fifo", hdr: tar.Header{Name: "p", Typeflag: tar.TypeFifo, Mode: 0o600, ModTime: sec}},
		{name: "a long name ustar splits", hdr: tar.Header{Name: long, Typeflag: tar.TypeReg, Mode: 0o644, Size: 1, ModTime: sec}, body: "z"},
		{name: "a long name, nanoseconds", hdr: tar.Header{Name: long, Typeflag: tar.TypeReg, Mode: 0o644, Size: 1, ModTime: nsec}, body: "z"},
		{name: "a long name ustar cannot split", hdr: tar.Header{Name: strings.Repeat("n", 150), Typeflag: tar.TypeReg, ModTime: sec}},
		{name: "a long dir name", hdr: tar.Header{Name: strings.Repeat("n", 99) + "/" + strings.Repeat("m", 120) + "/", Typeflag: tar.TypeDir, ModTime: sec}},
		{name: "a name cut at a slash", hdr: tar.Header{Name: strings.Repeat("n", 99) + "/" + strings.Repeat("m", 300), Typeflag: tar.TypeReg, ModTime: nsec}},
		{name: "a name past PATH_MAX", hdr: tar.Header{Name: strings.Repeat("deep/", 900) + "f", Typeflag: tar.TypeReg, ModTime: nsec}},
		{name: "a UTF-8 name", hdr: tar.Header{Name: "café/naïve.txt", Typeflag: tar.TypeReg, Mode: 0o644, Size: 2, ModTime: sec}, body: "ok"},
		{name: "a name of invalid UTF-8", hdr: tar.Header{Name: "bad\xff\xfename", Typeflag: tar.TypeReg, ModTime: sec}},
		{name: "a UTF-8 link", hdr: tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "ça", ModTime: sec}},
		{name: "a large owner", hdr: tar.Header{Name: "o", Typeflag: tar.TypeReg, Uid: 1 << 30, Gid: 3_000_000, ModTime: sec}},
		{name: "a file past 8 GiB", hdr: tar.Header{Name: "big", Typeflag: tar.TypeReg, Size: 9 << 30, ModTime: sec}, headerOnly: true},
		{name: "a time before 1970", hdr: tar.Header{Name: "old", Typeflag: tar.TypeReg, ModTime: time.Unix(-1, 250_000_000)}},
		{name: "a time far ahead", hdr: tar.Header{Name: "new", Typeflag: tar.TypeReg, ModTime: time.Unix(1<<34, 0)}},
		{name: "the epoch", hdr: tar.Header{Name: "zero", Typeflag: tar.TypeReg, ModTime: time.Unix(0, 0)}},
		{name: "no time", hdr: tar.Header{Name: "none", Typeflag: tar.TypeReg}},
		{name: "set-ID bits", hdr: tar.Header{Name: "s", Typeflag: tar.TypeReg, Mode: 0o6755, ModTime: sec}},
		{name: "xattrs and holes", hdr: tar.Header{Name: "x", Typeflag: tar.TypeReg, Size: 4, ModTime: sec, PAXRecords: map[string]string{
			paxXattr + "user.a": "1", paxXattr + "trusted.overlay.opaque": "y", paxXattr + "security.capability": "\x00\x00\x00\x02\x00\x20",
			paxHoles: "1048576 0:2 1048574:2"}}, body: "abcd"},
		{name: "a long record", hdr: tar.Header{Name: "r", Typeflag: tar.TypeReg, ModTime: sec, PAXRecords: map[string]string{paxXattr + "user.big": strings.Repeat("v", 5000)}}},
		{name: "records of every length around a power of ten", hdr: tar.Header{Name: "p", Typeflag: tar.TypeReg, ModTime: sec, PAXRecords: map[string]string{
			paxXattr + "user.a": strings.Repeat("v", 78), paxXattr + "user.b": strings.Repeat("v", 79), paxXattr + "user.c": strings.Repeat("v", 80),
			paxXattr + "user.d": strings.Repeat("v", 977), paxXattr + "user.e": strings.Repeat("v", 978)}}},
		{name: "an xattr named with =", hdr: tar.Header{Name: "q", Typeflag: tar.TypeReg, ModTime: sec, PAXRecords: map[string]string{paxXattr + "user.a=b": "v"}}, wantErr: true},
		{name: "a NUL in a name", hdr: tar.Header{Name: "a\x00b", Typeflag: tar.TypeReg, ModTime: sec}, wantErr: true},
		{name: "a file named as a dir", hdr: tar.Header{Name: "f/", Typeflag: tar.TypeReg, ModTime: sec}, wantErr: true},
		{name: "a negative size", hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, Size: -1, ModTime: sec}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.hdr.Format = tar.FormatPAX
			if tt.headerOnly {
				var a, b bytes.Buffer
				h := tt.hdr
				require.NoError(t, tar.NewWriter(&a).WriteHeader(&h))
				h = tt.hdr
				require.NoError(t, newTarWriter(&b).WriteHeader(&h))
				require.Equal(t, a.Bytes(), b.Bytes())
				return
			}
			want, got, wantErr, gotErr := writeBoth(t, []tar.Header{tt.hdr, {Name: "next", Typeflag: tar.TypeReg, Size: 1, ModTime: sec, Format: tar.FormatPAX}},
				[]string{tt.body, "n"})
			if tt.wantErr {
				require.Error(t, wantErr, "archive/tar writes it: the case is wrong")
				require.Error(t, gotErr)
				return
			}
			require.NoError(t, wantErr)
			require.NoError(t, gotErr)
			require.Equal(t, want, got)
		})
	}
}

// A body longer or shorter than its header says is refused, as
// archive/tar refuses it; a header it does not write is refused, not
// written otherwise.
func TestTarWriterRefusesWhatItCannotWrite(t *testing.T) {
	w := newTarWriter(&bytes.Buffer{})
	require.NoError(t, w.WriteHeader(&tar.Header{Name: "f", Typeflag: tar.TypeReg, Size: 2, Format: tar.FormatPAX}))
	n, err := w.Write([]byte("abc"))
	require.ErrorIs(t, err, tar.ErrWriteTooLong)
	require.Equal(t, 2, n)

	w = newTarWriter(&bytes.Buffer{})
	require.NoError(t, w.WriteHeader(&tar.Header{Name: "f", Typeflag: tar.TypeReg, Size: 2, Format: tar.FormatPAX}))
	require.ErrorContains(t, w.WriteHeader(&tar.Header{Name: "g", Typeflag: tar.TypeReg, Format: tar.FormatPAX}), "missed writing 2 bytes")

	for _, h := range []tar.Header{
		{Name: "u", Typeflag: tar.TypeReg, Uname: "root", Format: tar.FormatPAX},
		{Name: "d", Typeflag: tar.TypeBlock, Devmajor: 8, Format: tar.FormatPAX},
		{Name: "a", Typeflag: tar.TypeReg, AccessTime: time.Now(), Format: tar.FormatPAX},
		{Name: "g", Typeflag: tar.TypeReg},
		{Name: "p", Typeflag: tar.TypeReg, PAXRecords: map[string]string{"mtime": "1"}, Format: tar.FormatPAX},
		{Name: "x", Typeflag: tar.TypeXHeader, Format: tar.FormatPAX},
	} {
		require.ErrorIs(t, newTarWriter(&bytes.Buffer{}).WriteHeader(&h), errTarField, h.Name)
	}
}

// Random headers of the kinds a packer makes: both writers write the same
// bytes, or both refuse.
func FuzzTarWriter(f *testing.F) {
	f.Add("a/b.txt", "", byte(tar.TypeReg), int64(0o644), 1000, 1000, int64(5), int64(1_700_000_000), int64(123), "user.k", "v")
	f.Add(strings.Repeat("x/", 80), "t", byte(tar.TypeSymlink), int64(0o777), 0, 0, int64(0), int64(-5), int64(0), "", "")
	f.Fuzz(func(t *testing.T, name, link string, flag byte, mode int64, uid, gid int, size, secs, nsecs int64, xk, xv string) {
		switch flag {
		case tar.TypeReg, tar.TypeDir, tar.TypeSymlink, tar.TypeLink, tar.TypeChar, tar.TypeFifo:
		default:
			return
		}
		size = min(max(size, -1), 4096)
		body := ""
		if flag == tar.TypeReg && size > 0 {
			body = strings.Repeat("b", int(size))
		}
		h := tar.Header{Name: name, Linkname: link, Typeflag: flag, Mode: mode & 0o7777, Uid: uid & 0x7fffffff, Gid: gid & 0x7fffffff,
			Size: size, ModTime: time.Unix(secs%(1<<40), nsecs%1e9), Format: tar.FormatPAX}
		if xk != "" {
			h.PAXRecords = map[string]string{paxXattr + xk: xv}
		}
		want, got, wantErr, gotErr := writeBoth(t, []tar.Header{h}, []string{body})
		require.Equal(t, wantErr != nil, gotErr != nil, "archive/tar: %v; ours: %v", wantErr, gotErr)
		if wantErr == nil {
			require.Equal(t, want, got)
		}
	})
}
