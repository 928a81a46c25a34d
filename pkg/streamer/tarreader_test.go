package streamer

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/testfs"
)

// entryRead is what a reader returned for one entry.
type entryRead struct {
	hdr  tar.Header
	body []byte
}

// readAll reads a tar stream's entries to its end or its first error.
func readAll(next func() (*tar.Header, error), body io.Reader) ([]entryRead, error) {
	var out []entryRead
	for {
		hdr, err := next()
		if err != nil {
			return out, err
		}
		data, err := io.ReadAll(body)
		if err != nil {
			return out, err
		}
		out = append(out, entryRead{hdr: *hdr, body: data})
	}
}

// sameEntry compares what the two readers return of an entry, but the
// format they guess and the deprecated Xattrs.
func sameEntry(t testing.TB, want, got entryRead) {
	t.Helper()
	w, g := want.hdr, got.hdr
	w.Format, g.Format, w.Xattrs, g.Xattrs = 0, 0, nil, nil
	require.True(t, w.ModTime.Equal(g.ModTime), "mtime %v, want %v", g.ModTime, w.ModTime)
	w.ModTime, g.ModTime = time.Time{}, time.Time{}
	require.Equal(t, w, g)
	require.Equal(t, want.body, got.body)
}

// A packer's stream reads the same through tarReader as through
// archive/tar: every kind of entry a layer holds, and files as stubs.
func TestTarReaderReadsWhatAPackerWrites(t *testing.T) {
	root := testfs.Mount(t, testfs.XFS, 1<<30)
	src := filepath.Join(root, "src")
	require.NoError(t, os.Mkdir(src, 0o755))
	testfs.LayerTree(t, src)
	deep := filepath.Join(src, strings.Repeat("d", 120), strings.Repeat("e", 120))
	require.NoError(t, os.MkdirAll(deep, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(deep, "café"), []byte("x"), 0o644))
	for _, shape := range []Shape{SparseTar, StubTar, PlainTar} {
		var wire bytes.Buffer
		_, err := Pack(context.Background(), src, &wire, Raw, shape)
		require.NoError(t, err)
		theirs := tar.NewReader(bytes.NewReader(wire.Bytes()))
		want, err := readAll(theirs.Next, theirs)
		require.ErrorIs(t, err, io.EOF)
		ours := newTarReader(bytes.NewReader(wire.Bytes()))
		got, err := readAll(ours.Next, ours)
		require.ErrorIs(t, err, io.EOF)
		require.Len(t, got, len(want))
		for i := range want {
			sameEntry(t, want[i], got[i])
		}
	}
}

// What a packer never writes is refused, not read otherwise than
// archive/tar would read it.
func TestTarReaderRefusesWhatAPackerDoesNotWrite(t *testing.T) {
	gnu := func(h tar.Header) tar.Header { h.Format = tar.FormatGNU; return h }
	tests := []struct {
		name    string
		stream  func() []byte
		wantErr string
	}{
		{name: "a GNU long name", stream: func() []byte {
			return craft(t, entry{hdr: gnu(tar.Header{Name: strings.Repeat("n", 200), Typeflag: tar.TypeReg})})
		}, wantErr: "not ustar"},
		{name: "a base-256 owner", stream: func() []byte {
			return craft(t, entry{hdr: gnu(tar.Header{Name: "f", Typeflag: tar.TypeReg, Uid: 1 << 30})})
		}, wantErr: "not ustar"},
		{name: "a global header", stream: func() []byte {
			var b bytes.Buffer
			tw := tar.NewWriter(&b)
			require.NoError(t, tw.WriteHeader(&tar.Header{Typeflag: tar.TypeXGlobalHeader, PAXRecords: map[string]string{"comment": "hi"}}))
			require.NoError(t, tw.Close())
			return b.Bytes()
		}, wantErr: "type 'g'"},
		{name: "a record no packer writes", stream: func() []byte {
			return craft(t, entry{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, PAXRecords: map[string]string{"comment": "hi"}}})
		}, wantErr: `PAX record "comment"`},
		{name: "a user name", stream: func() []byte {
			return craft(t, entry{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, Uname: strings.Repeat("u", 40)}})
		}, wantErr: `PAX record "uname"`},
		{name: "two extended headers in a row", stream: func() []byte {
			one := craft(t, entry{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, ModTime: time.Unix(1, 5), Format: tar.FormatPAX}})
			return append(append([]byte{}, one[:2*tarBlock]...), one...)
		}, wantErr: "two extended headers"},
		{name: "a bad checksum", stream: func() []byte {
			b := craft(t, file("f", "x"))
			b[0] = 'g'
			return b
		}, wantErr: "bad checksum"},
		{name: "zeros, then a header", stream: func() []byte {
			return append(make([]byte, tarBlock), craft(t, file("f", "x"))...)
		}, wantErr: "a block of zeros before a header"},
		{name: "cut short in a body", stream: func() []byte {
			return craft(t, file("f", strings.Repeat("x", 1000)))[:tarBlock+100]
		}, wantErr: "unexpected EOF"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newTarReader(bytes.NewReader(tt.stream()))
			_, err := readAll(r.Next, r)
			require.ErrorContains(t, err, tt.wantErr)
			require.False(t, errors.Is(err, io.EOF) && tt.wantErr != "unexpected EOF")
		})
	}
}

// On any stream, tarReader either refuses or returns what archive/tar
// returns, entry for entry and byte for byte.
func FuzzTarReader(f *testing.F) {
	f.Add(craft(f, file("a", "hello"), entry{hdr: tar.Header{Name: "d/", Typeflag: tar.TypeDir}}))
	f.Add(craft(f, entry{hdr: tar.Header{Name: strings.Repeat("long/", 40) + "f", Typeflag: tar.TypeReg, ModTime: time.Unix(5, 7), Format: tar.FormatPAX,
		PAXRecords: map[string]string{paxXattr + "user.k": "v", paxHoles: "10 0:2"}}, body: "ab"},
		entry{hdr: tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "ça"}}))
	f.Add(craft(f, entry{hdr: tar.Header{Name: "w", Typeflag: tar.TypeChar, Uid: 1 << 22}}))
	// Odd streams a packer does not write but archive/tar reads: each
	// seed runs in every go test, both readers compared.
	for _, seed := range oddStreams(f) {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, stream []byte) {
		// Mutations that break a header's checksum only reach the
		// checksum test.
		fixChecksums(stream)
		theirs := tar.NewReader(bytes.NewReader(stream))
		want, wantErr := readAll(theirs.Next, theirs)
		ours := newTarReader(bytes.NewReader(stream))
		got, gotErr := readAll(ours.Next, ours)
		require.LessOrEqual(t, len(got), len(want), "ours read entries archive/tar refused")
		for i := range got {
			sameEntry(t, want[i], got[i])
		}
		if errors.Is(gotErr, io.EOF) {
			require.ErrorIs(t, wantErr, io.EOF, "ours saw the end where archive/tar did not")
			require.Len(t, got, len(want))
		}
	})
}

// fixChecksums sets the checksum of each block that looks like a header.
func fixChecksums(stream []byte) {
	for i := 0; i+tarBlock <= len(stream); i += tarBlock {
		blk := (*[tarBlock]byte)(stream[i:])
		if string(blk[tarMagic[0]:][:6]) == "ustar\x00" {
			copy(blk[tarChksum[0]:][:tarChksum[1]], "        ")
			putOctal(blk[tarChksum[0]:][:7], blockSum(blk))
		}
	}
}

// Archives with what archive/tar takes that a packer does not write, but
// tarReader takes too, read the same through both.
func TestTarReaderReadsOddStreamsAsArchiveTarDoes(t *testing.T) {
	for i, stream := range oddStreams(t) {
		fixChecksums(stream)
		theirs := tar.NewReader(bytes.NewReader(stream))
		want, err := readAll(theirs.Next, theirs)
		require.ErrorIs(t, err, io.EOF, "stream %d", i)
		ours := newTarReader(bytes.NewReader(stream))
		got, err := readAll(ours.Next, ours)
		require.ErrorIs(t, err, io.EOF, "stream %d", i)
		require.Len(t, got, len(want))
		for j := range want {
			sameEntry(t, want[j], got[j])
		}
	}
}

// oddStreams are archives with what archive/tar takes and a packer never
// writes: numbers padded with spaces or cut by a NUL, a ustar prefix,
// records that are empty, repeated, or say more than their fields, a size
// on a symlink. Checksums are set by FuzzTarReader.
func oddStreams(t testing.TB) [][]byte {
	ustar := func(h tar.Header, body string) []byte {
		var b bytes.Buffer
		w := newTarWriter(&b)
		h.Format, h.Size = tar.FormatPAX, int64(len(body))
		require.NoError(t, w.WriteHeader(&h))
		_, err := w.Write([]byte(body))
		require.NoError(t, err)
		require.NoError(t, w.Close())
		return b.Bytes()
	}
	// pax puts an extended header of records (key, value, ...) before
	// stream.
	pax := func(kv []string, stream []byte) []byte {
		var records []byte
		for i := 0; i < len(kv); i += 2 {
			records = appendPAXRecord(records, kv[i], kv[i+1])
		}
		var blk [tarBlock]byte
		blk[tarTypeflag] = tar.TypeXHeader
		copy(blk[:], "PaxHeaders.0/f")
		putOctal(blk[tarSize[0]:][:tarSize[1]], int64(len(records)))
		copy(blk[tarMagic[0]:], "ustar\x0000")
		data := make([]byte, len(records)+(-len(records)&(tarBlock-1)))
		copy(data, records)
		return append(append(blk[:], data...), stream...)
	}
	patch := func(stream []byte, at int, with string) []byte {
		copy(stream[at:], with)
		return stream
	}
	f := tar.Header{Name: "f", Typeflag: tar.TypeReg, Mode: 0o644, ModTime: time.Unix(1_700_000_000, 0)}
	return [][]byte{
		patch(ustar(f, "abc"), tarMode[0], "  644 \x00 "),
		patch(ustar(f, "abc"), tarUID[0], "12\x0034 "),
		patch(ustar(f, "abc"), tarPrefix[0], "some/dir"),
		patch(ustar(f, "abc"), tarSize[0], "00000000003"),
		patch(ustar(tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "t", ModTime: time.Unix(5, 0)}, ""), tarSize[0], "00000000017"),
		pax([]string{"path", "g/h"}, ustar(f, "abc")),
		pax([]string{"path", ""}, ustar(f, "abc")),
		pax([]string{"path", "one", "path", "two"}, ustar(f, "abc")),
		pax([]string{"mtime", "123.4567890123"}, ustar(f, "abc")),
		pax([]string{"mtime", "-1.5"}, ustar(f, "abc")),
		pax([]string{"size", "5"}, ustar(f, "abcde")),
		pax([]string{"uid", "99999999999"}, ustar(f, "abc")),
		pax([]string{paxXattr + "user.k", "a\x00b=c"}, ustar(f, "abc")),
		pax([]string{paxHoles, "10 0:2 8:1"}, ustar(f, "abc")),
	}
}
