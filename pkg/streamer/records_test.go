package streamer

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	erofs "github.com/erofs/go-erofs"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/filesum"
)

// rec is a record as a test crafts it, nothing checked: what a hostile
// holder could send.
type rec struct {
	kind         byte
	name         string
	shared       int // of the name before it: the test says what it shares
	mode         uint64
	uid, gid     uint64
	xattrs       [][2]string
	size         uint64
	sumFlag      byte
	sum          filesum.Sum
	data         string
	target       string
	major, minor uint64
	extra        string // past the body's end
	cut          int    // bytes cut off the body's end
}

func (r rec) body() []byte {
	b := append([]byte{r.kind}, binary.AppendUvarint(nil, uint64(r.shared))...)
	b = appendBytes(b, r.name[min(r.shared, len(r.name)):])
	if r.kind != recLink {
		b = binary.AppendUvarint(b, r.mode)
		b = binary.AppendUvarint(b, r.uid)
		b = binary.AppendUvarint(b, r.gid)
		b = binary.AppendVarint(b, 1e18)
		b = binary.AppendUvarint(b, uint64(len(r.xattrs)))
		for _, x := range r.xattrs {
			b = appendBytes(appendBytes(b, x[0]), x[1])
		}
	}
	switch r.kind {
	case recFile, recStub:
		b = append(binary.AppendUvarint(b, r.size), r.sumFlag)
		if r.sumFlag == 1 {
			b = append(b, r.sum[:]...)
		}
		b = append(b, r.data...)
	case recSymlink, recLink:
		b = append(b, r.target...)
	case recWhiteout:
		b = binary.AppendUvarint(binary.AppendUvarint(b, r.major), r.minor)
	}
	return append(b, r.extra...)[:max(len(b)+len(r.extra)-r.cut, 0)]
}

// records frames recs as a stream, its end marked if end.
func records(end bool, recs ...rec) []byte {
	out := []byte(recordsMagic)
	for _, r := range recs {
		b := r.body()
		out = append(binary.AppendUvarint(out, uint64(len(b))), b...)
	}
	if end {
		out = append(out, 0)
	}
	return out
}

// Records are learnt only as a holder's toRecords writes them: each
// field within its bounds, each body exactly what it says, and every
// check a StubTar's entries have (TestIndexStubsRefuses) theirs too.
func TestIndexRecordsRefuses(t *testing.T) {
	root := rec{kind: recDir, mode: 0o755}
	dir := func(name string) rec { return rec{kind: recDir, name: name, mode: 0o755} }
	stub := func(name string, size uint64) rec { return rec{kind: recStub, name: name, mode: 0o644, size: size} }
	sum, err := filesum.Of(strings.NewReader("whole"))
	require.NoError(t, err)
	whole := func(name, data string, s filesum.Sum) rec {
		return rec{kind: recFile, name: name, mode: 0o644, size: uint64(len(data)), data: data, sumFlag: 1, sum: s}
	}
	lengthOnly := func(n uint64) []byte {
		return binary.AppendUvarint(records(false, root), n)
	}
	tests := []struct {
		name    string
		stream  []byte
		summed  bool
		inline  Inline
		entries int64
		wantErr string
	}{
		{name: "no root first", stream: records(true, stub("f", 1)), wantErr: "is not its root"},
		{name: "a root that is a file", stream: records(true, stub("", 1)), wantErr: "is not its root"},
		{name: "a second root", stream: records(true, root, root), wantErr: "entry name"},
		{name: "nothing", stream: records(true), wantErr: "an empty stub tree"},
		{name: "dot-dot", stream: records(true, root, stub("../escaped", 1)), wantErr: "entry name"},
		{name: "absolute", stream: records(true, root, stub("/etc/passwd", 1)), wantErr: "entry name"},
		{name: "a name not clean", stream: records(true, root, dir("d"), stub("d//f", 1)), wantErr: "entry name"},
		{name: "a dot in a name", stream: records(true, root, dir("d"), stub("d/./f", 1)), wantErr: "entry name"},
		{name: "a name sharing more than the last had", stream: records(true, root, dir("d"), rec{kind: recStub, name: "dd/f", shared: 2}),
			wantErr: "sharing 2 bytes"},
		{name: "a parent not sent", stream: records(true, root, stub("d/f", 1)), wantErr: "its directory was not added"},
		{name: "a name twice", stream: records(true, root, stub("f", 1), dir("f")), wantErr: "added twice"},
		{name: "a file twice", stream: records(true, root, dir("d"), stub("d/f", 1), stub("d/g", 1), stub("d/f", 2)), wantErr: `"d/f" after "d/g": not in a walk's order`},
		{name: "a directory twice", stream: records(true, root, dir("d"), dir("d")), wantErr: `"d": added twice`},
		{name: "a hard link over a name", stream: records(true, root, stub("f", 1), stub("g", 1), rec{kind: recLink, name: "g", target: "f"}),
			wantErr: `"g": added twice`},
		{name: "a hard link to a directory", stream: records(true, root, dir("d"), rec{kind: recLink, name: "h", target: "d"}),
			wantErr: "not a regular file added before it"},
		{name: "a hard link to nothing yet", stream: records(true, root, rec{kind: recLink, name: "h", target: "later"}, stub("later", 1)),
			wantErr: "not a regular file added before it"},
		{name: "a hard link outside", stream: records(true, root, rec{kind: recLink, name: "h", target: "../secret"}), wantErr: "hardlink to"},
		{name: "a hard link not clean", stream: records(true, root, stub("f", 1), rec{kind: recLink, name: "h", target: "./f"}),
			wantErr: "hardlink to"},
		{name: "a device node", stream: records(true, root, rec{kind: recWhiteout, name: "null", major: 1, minor: 3}), wantErr: "device node 1:3"},
		{name: "a kind of no record", stream: records(true, root, rec{kind: 'b', name: "sda"}), wantErr: "kind 'b'"},
		{name: "an xattr that does not travel", stream: records(true, root,
			rec{kind: recStub, name: "f", xattrs: [][2]string{{"security.selinux", "system_u:object_r:shadow_t:s0"}}}), wantErr: `xattr "security.selinux"`},
		{name: "a mode past its bits", stream: records(true, root, rec{kind: recStub, name: "f", mode: 0o170644}), wantErr: "mode"},
		{name: "an owner past 32 bits", stream: records(true, root, rec{kind: recStub, name: "f", uid: math.MaxUint32 + 1}), wantErr: "uid"},
		{name: "a size past int64", stream: records(true, root, stub("f", math.MaxUint64)), wantErr: "size"},
		{name: "a sum flag of neither", stream: records(true, root, rec{kind: recStub, name: "f", sumFlag: 2}), wantErr: "sum flag"},
		{name: "a sum cut short", stream: records(true, root, rec{kind: recStub, name: "f", sumFlag: 1, cut: 10}), wantErr: "cut short"},
		{name: "a name's length past the body", stream: records(true, root, rec{kind: recDir, name: "dir", cut: 16}), wantErr: "a field of"},
		{name: "bytes past a record's end", stream: records(true, root, rec{kind: recDir, name: "d", extra: "x"}), wantErr: "past its end"},
		{name: "data not its size", stream: records(true, root, rec{kind: recFile, name: "f", size: 9, data: "whole", sumFlag: 1, sum: sum}),
			inline: Inline{Max: 100, Budget: 100}, wantErr: "5 bytes of data for a size of 9"},
		{name: "data not asked for", stream: records(true, root, whole("f", "whole", sum)), wantErr: "asked for files of at most 0"},
		{name: "more data than asked for", stream: records(true, root, whole("f", "whole", sum)), inline: Inline{Max: 4, Budget: 100},
			wantErr: "asked for files of at most 4"},
		{name: "a record too long", stream: lengthOnly(maxRecord + 1), wantErr: "bytes long"},
		{name: "a file with no sum", stream: records(true, root, stub("f", 1)), summed: true, wantErr: "no sum"},
		{name: "a small file that is not its sum", stream: records(true, root, whole("f", "whoLe", sum)), summed: true,
			inline: Inline{Max: 100, Budget: 100}, wantErr: "corrupt"},
		{name: "more entries than the limit", stream: records(true, root, dir("a"), dir("b")), entries: 2, wantErr: "more than 2 entries"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			lim := DefaultLimits
			lim.Summed = tc.summed
			if tc.entries > 0 {
				lim.Entries = tc.entries
			}
			_, _, err := IndexStubs(context.Background(), bytes.NewReader(tc.stream), Raw, lim, tc.inline, tempImage(t), nil)
			require.ErrorContains(t, err, tc.wantErr)
			if tc.wantErr == "corrupt" {
				require.ErrorIs(t, err, ErrCorrupt)
			} else {
				require.ErrorIs(t, err, ErrRefused)
			}
		})
	}

	cut := records(true, root, dir("d"))
	for n := len(recordsMagic); n < len(cut); n++ {
		_, _, err := IndexStubs(context.Background(), bytes.NewReader(cut[:n]), Raw, DefaultLimits, Inline{}, tempImage(t), nil)
		require.Error(t, err, "records cut to %d of %d bytes", n, len(cut))
	}
	lim := DefaultLimits
	lim.Summed = true
	l, got, err := IndexStubs(context.Background(), bytes.NewReader(records(true, root, whole("f", "whole", sum))), Raw, lim,
		Inline{Max: 100, Budget: 100}, tempImage(t), nil)
	require.NoError(t, err, "a small file that is its sum")
	require.Equal(t, "f", got.Inlined)
	require.Equal(t, map[int][]byte{0: []byte("whole")}, inlineBytes(t, l))
}

// A layer whose file rotted since its sums were taken is not made
// records of: the packer's ErrRotten is what PackRecords says, not the
// records' end short of it.
func TestPackRecordsOfARottenLayer(t *testing.T) {
	layer := keptLayer(t)
	require.NoError(t, os.WriteFile(filepath.Join(layer.Dir, "f-03"), bytes.Repeat([]byte{4}, 3000), 0o644))
	_, err := PackRecords(t.Context(), layer, io.Discard, S2, keptInline)
	require.ErrorIs(t, err, ErrRotten)
}

// Whatever records a holder sends, learning them does not crash, and a
// tree learnt is an image an independent reader (go-erofs) walks whole.
func FuzzIndexRecords(f *testing.F) {
	sum, err := filesum.Of(strings.NewReader("whole"))
	require.NoError(f, err)
	f.Add(records(true, rec{kind: recDir, mode: 0o755}, rec{kind: recDir, name: "d", mode: 0o700, xattrs: [][2]string{{"user.a", "b"}}},
		rec{kind: recFile, name: "d/f", shared: 1, mode: 0o644, size: 5, data: "whole", sumFlag: 1, sum: sum},
		rec{kind: recLink, name: "d/h", shared: 2, target: "d/f"}, rec{kind: recSymlink, name: "s", target: "d/f"},
		rec{kind: recWhiteout, name: "w"}, rec{kind: recFifo, name: "p"}, rec{kind: recStub, name: "q", size: 1 << 40, sumFlag: 1}))
	f.Fuzz(func(t *testing.T, stream []byte) {
		if !bytes.HasPrefix(stream, []byte(recordsMagic)) {
			stream = append([]byte(recordsMagic), stream...)
		}
		lim := DefaultLimits
		lim.Summed = true
		image := tempImage(t)
		layout, _, err := IndexStubs(context.Background(), bytes.NewReader(stream), Raw, lim, Inline{Max: 100, Budget: 1000}, image, nil)
		if err != nil {
			return
		}
		fsys, err := erofs.Open(image, erofs.WithExtraDevices(io.NewSectionReader(zeroReader{}, 0, layout.Size)))
		require.NoError(t, err)
		require.NoError(t, fs.WalkDir(fsys, ".", func(string, fs.DirEntry, error) error { return err }))
	})
}
