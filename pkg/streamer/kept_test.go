package streamer

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/filesum"
)

// keptLayer is a layer of every kind of entry and some small and large
// files, with its sums.
func keptLayer(t *testing.T) LayerFiles {
	t.Helper()
	dir := filepath.Join(testfs.Mount(t, testfs.XFS, 1<<30), "layer")
	require.NoError(t, os.Mkdir(dir, 0o755))
	testfs.LayerTree(t, dir)
	for i := range 40 {
		data := bytes.Repeat([]byte{byte(i)}, 1000*i)
		require.NoError(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("f-%02d", i)), data, 0o644))
	}
	sums, err := filesum.OfTree(t.Context(), dir)
	require.NoError(t, err)
	return LayerFiles{Dir: dir, Sums: sums}
}

// keptInline is the Inline the tests keep stub trees with.
var keptInline = Inline{Max: 8 << 10, Budget: 100 << 10}

// keepLayer keeps a keptLayer's stub tree, and returns the layer and
// where its tree is kept.
func keepLayer(t *testing.T) (LayerFiles, string) {
	t.Helper()
	layer := keptLayer(t)
	path := filepath.Join(t.TempDir(), "layer.stubs")
	kept, err := KeepStubs(t.Context(), layer, keptInline, path)
	require.NoError(t, err)
	require.Positive(t, kept.Entries)
	return layer, path
}

// decoded is a stream in enc, decoded.
func decoded(t *testing.T, wire []byte, enc Encoding) []byte {
	t.Helper()
	r, release, err := enc.reader(bytes.NewReader(wire))
	require.NoError(t, err)
	defer release()
	raw, err := io.ReadAll(r)
	require.NoError(t, err)
	return raw
}

// A kept stub tree is served as the very stream a walk of its layer
// makes, in any encoding, with the summary (size, entries, digest of a
// swarm's stream or not) the walk's trailer would say.
func TestServeKeptIsTheWalksStream(t *testing.T) {
	layer, path := keepLayer(t)
	inline := keptInline
	for _, shape := range []Shape{StubTar, StubRecords} {
		for _, enc := range []Encoding{S2, Raw, Zstd, Gzip} {
			for _, swarm := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s %s swarm=%v", shape, enc, swarm), func(t *testing.T) {
					walked := layer
					walked.swarm = swarm
					var want, got bytes.Buffer
					var wantSum Summary
					var err error
					if shape == StubRecords {
						wantSum, err = PackRecords(t.Context(), walked, &want, enc, inline)
					} else {
						wantSum, err = PackFirst(t.Context(), walked, nil, &want, enc, StubTar, inline)
					}
					require.NoError(t, err)
					gotSum, err := ServeKept(path, inline, shape, &got, enc, swarm)
					require.NoError(t, err)
					require.Equal(t, wantSum, gotSum)
					require.Equal(t, decoded(t, want.Bytes(), enc), decoded(t, got.Bytes(), enc))
				})
			}
		}
	}
	matches, err := filepath.Glob(path + "*")
	require.NoError(t, err)
	require.Equal(t, []string{path}, matches, "nothing left aside")
}

// A request the kept stream does not serve, or a kept stream that does
// not read whole, sends nothing and answers ErrNotKept; one that does not
// read whole is removed, and a file no stream is kept in is left alone.
func TestServeKeptRefuses(t *testing.T) {
	_, src := keepLayer(t)
	inline := keptInline
	good, err := os.ReadFile(src)
	require.NoError(t, err)
	tail := len(keptMagic) + 8 + 4
	footerAt := len(good) - tail - int(binary.LittleEndian.Uint32(good[len(good)-tail:]))
	f, err := os.Open(src)
	require.NoError(t, err)
	foot, err := readKept(f)
	require.NoError(t, f.Close())
	require.NoError(t, err)
	recordsAt := int(foot.Records.Offset)

	flip := func(at int) func([]byte) []byte {
		return func(b []byte) []byte { b[at] ^= 0x10; return b }
	}
	tests := []struct {
		name    string
		file    func([]byte) []byte // nil: no file
		inline  Inline
		shape   Shape // StubTar where unset
		removed bool
	}{
		{name: "nothing kept", inline: inline},
		{name: "another inline", file: func(b []byte) []byte { return b }, inline: Inline{Max: inline.Max, Budget: inline.Budget + 1}},
		{name: "a byte of the tar rotted", file: flip(recordsAt / 2), inline: inline, removed: true},
		{name: "a byte of the records rotted", file: flip((recordsAt + footerAt) / 2), inline: inline, shape: StubRecords, removed: true},
		{name: "the records' first byte rotted", file: flip(recordsAt), inline: inline, shape: StubRecords, removed: true},
		{name: "kept by an earlier version", file: func(b []byte) []byte { return append(b[:len(b)-len(keptMagicV1)], keptMagicV1...) },
			inline: inline, removed: true},
		{name: "its first byte rotted", file: flip(0), inline: inline, removed: true},
		{name: "the footer rotted", file: flip(footerAt + 3), inline: inline, removed: true},
		{name: "the footer's length rotted", file: flip(len(good) - tail + 1), inline: inline, removed: true},
		{name: "the footer's digest rotted", file: flip(len(good) - tail + 5), inline: inline, removed: true},
		{name: "the magic rotted", file: flip(len(good) - 1), inline: inline, removed: true},
		{name: "cut short", file: func(b []byte) []byte { return b[:len(b)/2] }, inline: inline, removed: true},
		{name: "cut to the footer", file: func(b []byte) []byte { return b[footerAt:] }, inline: inline, removed: true},
		{name: "empty", file: func([]byte) []byte { return nil }, inline: inline, removed: true},
		{name: "grown", file: func(b []byte) []byte { return append([]byte("x"), b...) }, inline: inline, removed: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "layer.stubs")
			if tc.file != nil {
				require.NoError(t, os.WriteFile(path, tc.file(bytes.Clone(good)), 0o600))
			}
			shape := tc.shape
			if shape == PlainTar {
				shape = StubTar
			}
			var wire bytes.Buffer
			_, err := ServeKept(path, tc.inline, shape, &wire, S2, false)
			require.ErrorIs(t, err, ErrNotKept)
			require.Zero(t, wire.Len(), "nothing sent")
			_, err = os.Stat(path)
			if tc.removed || tc.file == nil {
				require.ErrorIs(t, err, os.ErrNotExist)
			} else {
				require.NoError(t, err, "a stream kept for another request stays")
			}
		})
	}
}

// A layer that rotted since its sums were taken is not kept: the kept
// stream carries its small files, and must carry what was captured.
func TestKeepStubsOfARottenLayer(t *testing.T) {
	layer := keptLayer(t)
	require.NoError(t, os.WriteFile(filepath.Join(layer.Dir, "f-03"), bytes.Repeat([]byte{4}, 3000), 0o644))
	path := filepath.Join(t.TempDir(), "layer.stubs")
	_, err := KeepStubs(t.Context(), layer, keptInline, path)
	require.ErrorIs(t, err, ErrRotten)
	matches, err := filepath.Glob(path + "*")
	require.NoError(t, err)
	require.Empty(t, matches, "nothing kept, nothing left aside")
}

// Whatever lies where a stub tree is kept, ServeKept does not crash, and
// when it answers ErrNotKept it has sent nothing: a holder then walks the
// layer instead, and the puller must get one stream, not the start of two.
func FuzzServeKept(f *testing.F) {
	// Each refused file is logged: tens of thousands of lines otherwise.
	klog.LogToStderr(false)
	klog.SetOutput(io.Discard)
	dir := filepath.Join(f.TempDir(), "layer")
	require.NoError(f, os.MkdirAll(filepath.Join(dir, "d"), 0o755))
	for i := range 20 {
		require.NoError(f, os.WriteFile(filepath.Join(dir, "d", strconv.Itoa(i)), bytes.Repeat([]byte{byte(i)}, 600*i), 0o644))
	}
	sums, err := filesum.OfTree(context.Background(), dir)
	require.NoError(f, err)
	path := filepath.Join(f.TempDir(), "layer.stubs")
	_, err = KeepStubs(context.Background(), LayerFiles{Dir: dir, Sums: sums}, keptInline, path)
	require.NoError(f, err)
	good, err := os.ReadFile(path)
	require.NoError(f, err)
	f.Add(good, false, false)
	f.Add(good, true, true)
	f.Add(good[:len(good)-1], false, true)
	f.Add(good[len(good)/2:], true, false)
	f.Fuzz(func(t *testing.T, file []byte, raw, records bool) {
		path := filepath.Join(t.TempDir(), "layer.stubs")
		require.NoError(t, os.WriteFile(path, file, 0o600))
		enc := S2
		if raw {
			enc = Raw
		}
		shape := StubTar
		if records {
			shape = StubRecords
		}
		var wire bytes.Buffer
		_, err := ServeKept(path, keptInline, shape, &wire, enc, false)
		if errors.Is(err, ErrNotKept) {
			require.Zero(t, wire.Len(), "sent something, then said nothing was kept")
		}
	})
}

// receive hands wire (a pull's stream of s) to a ReceivedRecords kept at
// path in chunks, as a pull's tee does, and keeps them as sum says.
func receive(t *testing.T, s LayerStream, wire []byte, sum Summary, path string) error {
	t.Helper()
	return receiveUpTo(t, s, wire, sum, path, maxReceivedRecords)
}

// receiveUpTo is receive with max s2 bytes written aside.
func receiveUpTo(t *testing.T, s LayerStream, wire []byte, sum Summary, path string, max int64) error {
	t.Helper()
	k, err := ReceiveRecords(path)
	require.NoError(t, err)
	k.max = max
	var teed int
	tee := k.tee(s, func(chunk []byte) { teed += len(chunk) })
	for chunk := range slices.Chunk(wire, 1000) {
		tee(chunk)
	}
	require.Equal(t, len(wire), teed, "the pull's own tee is handed every chunk")
	return k.Keep(keptInline, sum)
}

// Records a pull received are kept as they came and served as the very
// stream a walk of the layer makes, in any encoding, with the digest the
// pull checked them against; a request for what they do not hold (a
// StubTar, the other kind of digest) is not served from them, and they
// stay. The walk's file serves everything, and is not taken for them.
func TestReceivedRecordsAreServed(t *testing.T) {
	layer, walkKept := keepLayer(t)
	require.False(t, KeptReceived(walkKept))
	for _, swarm := range []bool{false, true} {
		t.Run(fmt.Sprintf("swarm=%v", swarm), func(t *testing.T) {
			walked := layer
			walked.swarm = swarm
			var wire bytes.Buffer
			sum, err := PackRecords(t.Context(), walked, &wire, S2, keptInline)
			require.NoError(t, err)
			path := filepath.Join(t.TempDir(), "layer.stubs")
			require.NoError(t, receive(t, LayerStream{Encoding: S2, Shape: StubRecords}, wire.Bytes(), sum, path))
			require.True(t, KeptReceived(path))
			for _, enc := range []Encoding{S2, Raw, Zstd} {
				var got bytes.Buffer
				gotSum, err := ServeKept(path, keptInline, StubRecords, &got, enc, swarm)
				require.NoError(t, err, enc)
				require.Equal(t, sum, gotSum, enc)
				require.Equal(t, decoded(t, wire.Bytes(), S2), decoded(t, got.Bytes(), enc), enc)
			}
			for _, req := range []struct {
				shape Shape
				swarm bool
			}{{StubTar, swarm}, {StubRecords, !swarm}} {
				var got bytes.Buffer
				_, err := ServeKept(path, keptInline, req.shape, &got, S2, req.swarm)
				require.ErrorIs(t, err, ErrNotKept, req)
				require.Zero(t, got.Len(), "nothing sent")
			}
			matches, err := filepath.Glob(path + "*")
			require.NoError(t, err)
			require.Equal(t, []string{path}, matches, "kept, nothing left aside")
		})
	}
}

// What is not records, or not s2 as they lie, or not written whole, is
// not kept, and nothing is left aside.
func TestReceivedRecordsRefused(t *testing.T) {
	layer := keptLayer(t)
	var records, tar, raw bytes.Buffer
	recordsSum, err := PackRecords(t.Context(), layer, &records, S2, keptInline)
	require.NoError(t, err)
	tarSum, err := PackFirst(t.Context(), layer, nil, &tar, S2, StubTar, keptInline)
	require.NoError(t, err)
	rawSum, err := PackRecords(t.Context(), layer, &raw, Raw, keptInline)
	require.NoError(t, err)
	require.Equal(t, decoded(t, records.Bytes(), S2), decoded(t, padded(records.Bytes(), 4, 64<<10), S2),
		"a padded stream reads as the records")
	full := t.TempDir()
	require.NoError(t, unix.Mount("tmpfs", full, "tmpfs", 0, "size=4k"))
	t.Cleanup(func() { require.NoError(t, unix.Unmount(full, 0)) })
	require.NoError(t, os.WriteFile(filepath.Join(full, "filler"), make([]byte, 4096), 0o600))

	tests := []struct {
		name    string
		s       LayerStream
		wire    []byte
		sum     Summary
		dir     string // a temp dir where unset
		max     int64  // maxReceivedRecords where unset
		wantErr string
	}{
		{name: "a StubTar", s: LayerStream{Encoding: S2, Shape: StubRecords}, wire: tar.Bytes(), sum: tarSum, wantErr: "received a StubTar"},
		{name: "a StubTar asked for", s: LayerStream{Encoding: S2, Shape: StubTar}, wire: tar.Bytes(), sum: tarSum, wantErr: "is not kept"},
		{name: "raw", s: LayerStream{Encoding: Raw, Shape: StubRecords}, wire: raw.Bytes(), sum: rawSum, wantErr: "is not kept"},
		{name: "a full disk", s: LayerStream{Encoding: S2, Shape: StubRecords}, wire: records.Bytes(), sum: recordsSum, dir: full,
			wantErr: "no space left"},
		{name: "cut short", s: LayerStream{Encoding: S2, Shape: StubRecords}, wire: records.Bytes()[:4], sum: recordsSum,
			wantErr: "reading the records received"},
		{name: "no digest", s: LayerStream{Encoding: S2, Shape: StubRecords}, wire: records.Bytes(), sum: Summary{Bytes: recordsSum.Bytes},
			wantErr: "digest"},
		// s2's padding chunks (type 0xfe) decode to nothing: the stream
		// reads as the records, but is not what they need.
		{name: "padded", s: LayerStream{Encoding: S2, Shape: StubRecords}, wire: padded(records.Bytes(), 4, 64<<10), sum: recordsSum,
			wantErr: "padded"},
		{name: "past the bound", s: LayerStream{Encoding: S2, Shape: StubRecords}, wire: padded(records.Bytes(), 2, 64<<10),
			sum: recordsSum, max: int64(records.Len()) + 64<<10, wantErr: "records past"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := tc.dir
			if dir == "" {
				dir = t.TempDir()
			}
			path := filepath.Join(dir, "layer.stubs")
			err := receiveUpTo(t, tc.s, tc.wire, tc.sum, path, cmp.Or(tc.max, maxReceivedRecords))
			require.ErrorContains(t, err, tc.wantErr)
			matches, err := filepath.Glob(path + "*")
			require.NoError(t, err)
			require.Empty(t, matches, "nothing kept, nothing left aside")
		})
	}
}

// padded is an s2 stream with n padding chunks of size bytes each after
// its own chunks.
func padded(stream []byte, n, size int) []byte {
	out := bytes.Clone(stream)
	chunk := append([]byte{0xfe, byte(size), byte(size >> 8), byte(size >> 16)}, make([]byte, size)...)
	for range n {
		out = append(out, chunk...)
	}
	return out
}
