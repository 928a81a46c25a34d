package filesum

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/internal/walkorder"
)

// A tree's table names each regular file's sum by its path, follows no
// symlink, and is kept and read back whole; a torn or rotted file of sums
// reads as none.
func TestTable(t *testing.T) {
	root := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(root, "d/e"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(root, "a"), []byte("alpha"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(root, "d/e/b"), []byte("beta"), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(root, "d/empty"), nil, 0o644))
	require.NoError(t, os.Symlink("/etc/passwd", filepath.Join(root, "link")))
	table, err := OfTree(t.Context(), root)
	require.NoError(t, err)
	require.Equal(t, 3, table.Len())
	want, err := Of(strings.NewReader("beta"))
	require.NoError(t, err)
	got, ok := table.Sum("d/e/b")
	require.True(t, ok)
	require.Equal(t, want, got)
	require.NoError(t, Check(strings.NewReader("beta"), got))
	require.ErrorIs(t, Check(strings.NewReader("betA"), got), ErrMismatch)
	for _, absent := range []string{"d/empty/", "d/e", "link", "b", ""} {
		_, ok := table.Sum(absent)
		require.False(t, ok, absent)
	}
	parsed, err := Parse(want.String())
	require.NoError(t, err)
	require.Equal(t, want, parsed)
	for _, bad := range []string{"", "xyz", strings.Repeat("g", 64), strings.Repeat("0", 63)} {
		_, err := Parse(bad)
		require.Error(t, err, "%q", bad)
	}

	kept := filepath.Join(t.TempDir(), "sums")
	require.NoError(t, table.WriteFile(kept))
	back, err := ReadFile(kept)
	require.NoError(t, err)
	require.Equal(t, maps.Collect(table.All()), maps.Collect(back.All()))
	raw, err := os.ReadFile(kept)
	require.NoError(t, err)
	for name, broken := range map[string][]byte{
		"torn":    raw[:len(raw)-7],
		"rotted":  bytes.Replace(raw, []byte("d/e/b"), []byte("d/e/c"), 1),
		"no head": raw[5:],
	} {
		require.NoError(t, os.WriteFile(kept, broken, 0o600))
		_, err := ReadFile(kept)
		require.ErrorIs(t, err, ErrBadFile, name)
	}
}

// A table made knowing some sums takes them instead of reading the files
// (a sum known wrong shows it was not read), under every name of a file
// known by one, and reads the rest: knowing the right sums, it is the
// table read whole.
func TestTableKnowing(t *testing.T) {
	root := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(root, "d"), 0o755))
	for name, data := range map[string]string{"a": "alpha", "d/b": "beta", "d/empty": "", "z": "zeta"} {
		require.NoError(t, os.WriteFile(filepath.Join(root, name), []byte(data), 0o644))
	}
	for _, link := range []string{"d/link", "y"} { // d/link walked first of the three names
		require.NoError(t, os.Link(filepath.Join(root, "z"), filepath.Join(root, link)))
	}
	read, err := OfTree(t.Context(), root)
	require.NoError(t, err)
	require.Equal(t, 6, read.Len())
	sums := maps.Collect(read.All())
	require.Equal(t, sums["z"], sums["y"])

	var asked []string
	knowing := func(known map[string]Sum) func(string) (Sum, bool) {
		return func(p string) (Sum, bool) {
			asked = append(asked, p)
			s, ok := known[p]
			return s, ok
		}
	}
	same, err := OfTreeKnowing(t.Context(), root, knowing(map[string]Sum{"a": sums["a"], "y": sums["y"]}))
	require.NoError(t, err)
	require.Equal(t, sums, maps.Collect(same.All()))
	require.NotContains(t, asked, "d/empty", "a file of no bytes is summed without asking")

	wrong := Sum{1}
	asked = nil
	taken, err := OfTreeKnowing(t.Context(), root, knowing(map[string]Sum{"a": wrong, "d/link": wrong}))
	require.NoError(t, err)
	takenSums := maps.Collect(taken.All())
	require.Equal(t, wrong, takenSums["a"])
	require.Equal(t, sums["d/b"], takenSums["d/b"])
	for _, name := range []string{"d/link", "y", "z"} {
		require.Equal(t, wrong, takenSums[name], "%s: a name of the file known as d/link", name)
	}
	require.NotContains(t, asked, "y", "the file was known by the name walked first")
}

// A table written as its tree is walked is the table OfTreeKnowing makes,
// kept as WriteFile keeps it, and only where its digest is the one asked
// for: else nothing is left beside where it would be.
func TestWriteTreeFile(t *testing.T) {
	root := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(root, "d"), 0o755))
	for name, data := range map[string]string{"a": "alpha", "d/b": "beta", "d/empty": "", "z": "zeta"} {
		require.NoError(t, os.WriteFile(filepath.Join(root, name), []byte(data), 0o644))
	}
	require.NoError(t, os.Link(filepath.Join(root, "z"), filepath.Join(root, "d/link")))
	known := func(p string) (Sum, bool) { return Sum{9}, p == "a" } // taken, not read
	want, err := OfTreeKnowing(t.Context(), root, known)
	require.NoError(t, err)
	require.Equal(t, Sum{9}, maps.Collect(want.All())["a"])

	dir := t.TempDir()
	path := filepath.Join(dir, "layer.sums")
	require.NoError(t, WriteTreeFile(t.Context(), root, known, path, want.Digest()))
	got, err := ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, maps.Collect(want.All()), maps.Collect(got.All()))

	other := filepath.Join(dir, "other.sums")
	err = WriteTreeFile(t.Context(), root, nil, other, want.Digest())
	require.ErrorIs(t, err, ErrMismatch, "read, a is not the sum known")
	left, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, left, 1, "only the table kept: %v", left)

	// With nothing known, every file is read: OfTree's table, kept in
	// the walk's order (read back, its sums left in the file).
	read, err := OfTree(t.Context(), root)
	require.NoError(t, err)
	require.NoError(t, KeepTreeFile(t.Context(), root, other))
	got, err = ReadFile(other)
	require.NoError(t, err)
	require.NotNil(t, got.kept)
	require.Equal(t, maps.Collect(read.All()), maps.Collect(got.All()))
	require.Equal(t, read.Digest(), got.Digest())

	inTheWay := filepath.Join(dir, "in-the-way.sums")
	require.NoError(t, os.MkdirAll(filepath.Join(inTheWay, "x"), 0o755))
	require.Error(t, KeepTreeFile(t.Context(), root, inTheWay))
	require.ErrorIs(t, KeepTreeFile(t.Context(), filepath.Join(root, "gone"), filepath.Join(dir, "gone.sums")), fs.ErrNotExist)
	left, err = os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, left, 3, "the two tables and what was in the way, nothing half written: %v", left)
}

// Of sums a file in full, read in pieces, through a buffer it does not
// make anew for each file: summing a tree reads one file after another
// (io.Copy's buffer, made for every *os.File, was 32 KiB a file).
func TestOfReusesItsBuffer(t *testing.T) {
	if raceDetector {
		t.Skip("under the race detector a sync.Pool drops a quarter of what is put back, so a buffer is made for many files; make test's plain run has this test")
	}
	data := make([]byte, 3*sumBuffer+5)
	for i := range data {
		data[i] = byte(i * 7)
	}
	path := filepath.Join(t.TempDir(), "f")
	require.NoError(t, os.WriteFile(path, data, 0o644))
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	want := Sum(sha256.Sum256(data))

	const files = 200
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range files {
		_, err := f.Seek(0, io.SeekStart)
		require.NoError(t, err)
		got, err := Of(f)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	runtime.ReadMemStats(&after)
	perFile := (after.TotalAlloc - before.TotalAlloc) / files
	t.Logf("%d bytes allocated a file", perFile)
	require.Less(t, perFile, uint64(4<<10), "no buffer made for each file")
}

// What a layer's sums cost: a tree of 20,000 files, 1 GiB in all, on
// tmpfs (the page cache, as a layer a step just wrote is), read and summed
// once. The figure is the bytes summed a second, against reading them
// alone in the same run.
func BenchmarkOfTree(b *testing.B) {
	root := b.TempDir()
	if dir := os.Getenv("COWVOL_BENCH_TMPFS"); dir != "" {
		root = dir
	}
	const files, size = 20_000, 1 << 30
	buf := make([]byte, size/files)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	for i := range files {
		d := filepath.Join(root, fmt.Sprintf("d%03d", i/200))
		require.NoError(b, os.MkdirAll(d, 0o755))
		require.NoError(b, os.WriteFile(filepath.Join(d, fmt.Sprintf("f%05d", i)), buf, 0o644))
	}
	b.SetBytes(int64(files * len(buf)))
	b.ResetTimer()
	for range b.N {
		if _, err := OfTree(context.Background(), root); err != nil {
			b.Fatal(err)
		}
	}
}

// A table's digest is the same however its files are listed, and changes
// with any file's path or sum; a hardlink takes its target's sum; a layer's
// digest changes with its base.
func TestDigest(t *testing.T) {
	sum := func(s string) Sum {
		got, err := Of(strings.NewReader(s))
		require.NoError(t, err)
		return got
	}
	table := TableOf(map[string]Sum{"a": sum("alpha"), "d/b": sum("beta"), "d/c": sum("beta"), "e": sum("")})
	want := table.Digest()

	forward, backward := &Listing{}, &Listing{}
	forward.File("a", sum("alpha"))
	forward.File("d/b", sum("beta"))
	forward.Link("d/c", "d/b")
	forward.File("e", sum(""))
	backward.File("e", sum(""))
	backward.Link("d/c", "d/b")
	backward.File("d/b", sum("beta"))
	backward.File("a", sum("alpha"))
	for _, l := range []*Listing{forward, backward} {
		got, err := l.Digest()
		require.NoError(t, err)
		require.Equal(t, want, got)
		again, err := l.Digest()
		require.NoError(t, err)
		require.Equal(t, want, again, "a listing digested (sorted in place) says the same again")
	}

	for name, other := range map[string]map[string]Sum{
		"a file less":    {"a": sum("alpha"), "d/b": sum("beta"), "d/c": sum("beta")},
		"a file more":    {"a": sum("alpha"), "d/b": sum("beta"), "d/c": sum("beta"), "e": sum(""), "f": sum("")},
		"a file renamed": {"a": sum("alpha"), "d/b": sum("beta"), "d/x": sum("beta"), "e": sum("")},
		"a byte changed": {"a": sum("alphA"), "d/b": sum("beta"), "d/c": sum("beta"), "e": sum("")},
		"sums swapped":   {"a": sum("beta"), "d/b": sum("alpha"), "d/c": sum("beta"), "e": sum("")},
	} {
		require.NotEqual(t, want, TableOf(other).Digest(), name)
	}

	dangling := &Listing{}
	dangling.File("a", sum("alpha"))
	dangling.Link("b", "nowhere")
	_, err := dangling.Digest()
	require.Error(t, err)

	empty, err := (&Listing{}).Digest()
	require.NoError(t, err)
	require.Equal(t, (*Table)(nil).Digest(), empty)
	require.Equal(t, TableOf(nil).Digest(), empty)
	require.NotEqual(t, LayerDigest("", want), LayerDigest("ns/base", want))
	require.NotEqual(t, LayerDigest("ns/base", want), LayerDigest("ns/base", empty))
}

// A table of many files is hashed in its sorted order, though its runs
// are sorted apart and merged: the same digest as one sort's, whatever
// order the files came in, in runs of any length.
func TestDigestOfMany(t *testing.T) {
	table := map[string]Sum{}
	for i := range 3*listingRun + 40 {
		table[fmt.Sprintf("d-%d/f-%d", i%97, i)] = Sum{byte(i), byte(i >> 8)}
	}
	records := make([]record, 0, len(table))
	for p, sum := range table {
		records = append(records, recordOf(p, sum))
	}
	slices.SortFunc(records, func(a, b record) int { return bytes.Compare(a[:], b[:]) })
	h := sha256.New()
	h.Write([]byte("cowvol file table v1\n"))
	for _, r := range records {
		h.Write(r[:])
	}
	var want Sum
	h.Sum(want[:0])
	require.Equal(t, want, TableOf(table).Digest())
	slices.Reverse(records)
	runs := []run{}
	for _, part := range [][]record{records[:7], records[7:7], records[7:100_000], records[100_000:]} {
		sortRecords(part)
		r := memRun(part)
		runs = append(runs, &r)
	}
	require.Equal(t, want, digestRuns(runs), "runs of any length")
	listing := &Listing{}
	for p, sum := range table {
		listing.File(p, sum)
	}
	require.Greater(t, len(listing.files), 2, "a listing of runs")
	got, err := listing.Digest()
	require.NoError(t, err)
	require.Equal(t, want, got)

	// A Lister lists on a goroutine of its own: what it was given, once
	// closed (twice is once).
	listed := &Listing{}
	lister := listed.Lister()
	for p, sum := range table {
		lister.File(p, sum)
	}
	lister.Close()
	lister.Close()
	got, err = listed.Digest()
	require.NoError(t, err)
	require.Equal(t, want, got)

	// A link finds its target in whichever run holds it.
	for i := range 3 {
		target := fmt.Sprintf("d-%d/f-%d", i*13_001%97, i*13_001)
		table[fmt.Sprintf("links/%d", i)] = table[target]
		listing.Link(fmt.Sprintf("links/%d", i), target)
	}
	got, err = listing.Digest()
	require.NoError(t, err)
	require.Equal(t, TableOf(table).Digest(), got)
}

// A listing that spills keeps one run in memory, whatever it lists, and
// says the digest one that keeps them all says, links and all (their
// targets in spilled runs and in the one kept), again when asked again;
// a spill that fails fails the digest.
func TestListingSpilled(t *testing.T) {
	table := map[string]Sum{}
	spilled := &Listing{}
	spill, err := os.Create(filepath.Join(t.TempDir(), "spill"))
	require.NoError(t, err)
	defer spill.Close()
	spilled.Spill(spill)
	lister := spilled.Lister()
	for i := range 3*listingRun + 40 {
		p := fmt.Sprintf("d-%d/f-%d", i%97, i)
		table[p] = Sum{byte(i), byte(i >> 8), 1}
		lister.File(p, table[p])
	}
	lister.Close()
	for i, target := range []string{"d-0/f-0", fmt.Sprintf("d-%d/f-%d", 2*listingRun%97, 2*listingRun), fmt.Sprintf("d-%d/f-%d", (3*listingRun+39)%97, 3*listingRun+39)} {
		table[fmt.Sprintf("links/%d", i)] = table[target]
		spilled.Link(fmt.Sprintf("links/%d", i), target)
	}
	inMemory := 0
	for _, run := range spilled.files {
		if run != nil {
			inMemory++
		}
	}
	require.Equal(t, 1, inMemory, "one run in memory: the last, not full")
	require.Len(t, spilled.files, 4)
	for range 2 {
		got, err := spilled.Digest()
		require.NoError(t, err)
		require.Equal(t, TableOf(table).Digest(), got)
	}
	spilled.Link("dangling", "nowhere")
	_, err = spilled.Digest()
	require.Error(t, err, "a link to a file not listed")

	failed := &Listing{}
	closed, err := os.Create(filepath.Join(t.TempDir(), "closed"))
	require.NoError(t, err)
	require.NoError(t, closed.Close())
	failed.Spill(closed)
	for i := range listingRun {
		failed.File(fmt.Sprint(i), Sum{})
	}
	_, err = failed.Digest()
	require.ErrorIs(t, err, os.ErrClosed)
}

// Records sort as bytes.Compare sorts them, those whose first eight bytes
// are one key too, whatever order they come in.
func TestSortRecords(t *testing.T) {
	var records []record
	for i := range 1000 {
		var r record
		binary.BigEndian.PutUint64(r[:], uint64(i%7)) // keys shared by many
		r[8], r[63] = byte(i*31), byte(i)
		records = append(records, r)
	}
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(records), func(i, j int) { records[i], records[j] = records[j], records[i] })
	want := slices.Clone(records)
	slices.SortFunc(want, func(a, b record) int { return bytes.Compare(a[:], b[:]) })
	sortRecords(records)
	require.Equal(t, want, records)
}

// A table is made of files in any order: those that come in a walk's
// order are kept as they come, and once one does not, all are sorted;
// a path added twice has the sum added last; a hardlink takes its
// target's sum, added before it or after, and one to nothing is not in
// it. However made, it is found by path, walked in the walk's order, and
// kept and read back the same.
func TestTableBuilder(t *testing.T) {
	tests := []struct {
		name string
		adds []tableFile
		want map[string]Sum
	}{
		{name: "none", want: map[string]Sum{}},
		{name: "in a walk's order", adds: []tableFile{{path: "a", sum: Sum{1}}, {path: "a/b", sum: Sum{2}}, {path: "a.c", sum: Sum{3}}},
			want: map[string]Sum{"a": {1}, "a/b": {2}, "a.c": {3}}},
		{name: "in no order", adds: []tableFile{{path: "a.c", sum: Sum{3}}, {path: "a/b", sum: Sum{2}}, {path: "a", sum: Sum{1}}},
			want: map[string]Sum{"a": {1}, "a/b": {2}, "a.c": {3}}},
		{name: "a path twice", adds: []tableFile{{path: "a", sum: Sum{1}}, {path: "b", sum: Sum{2}}, {path: "a", sum: Sum{9}}},
			want: map[string]Sum{"a": {9}, "b": {2}}},
		{name: "the same path at once again", adds: []tableFile{{path: "a", sum: Sum{1}}, {path: "a", sum: Sum{9}}},
			want: map[string]Sum{"a": {9}}},
		{name: "links", adds: []tableFile{{path: "d/l1", target: "z"}, {path: "z", sum: Sum{5}}, {path: "l2", target: "z"}, {path: "dangling", target: "nowhere"}},
			want: map[string]Sum{"d/l1": {5}, "l2": {5}, "z": {5}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var b TableBuilder
			for _, a := range tc.adds {
				if a.target != "" {
					b.Link(a.path, a.target)
				} else {
					b.Add(a.path, a.sum)
				}
			}
			table := b.Table()
			require.Equal(t, tc.want, maps.Collect(table.All()))
			require.Equal(t, len(tc.want), table.Len())
			var walked []string
			for p, sum := range table.All() {
				walked = append(walked, p)
				got, ok := table.Sum(p)
				require.True(t, ok, p)
				require.Equal(t, sum, got, p)
			}
			require.True(t, slices.IsSortedFunc(walked, walkorder.Compare[string, string]), "%q", walked)
			_, ok := table.Sum("nowhere")
			require.False(t, ok)
			require.Equal(t, 0, b.Table().Len(), "a builder is emptied by its table")

			kept := filepath.Join(t.TempDir(), "sums")
			require.NoError(t, table.WriteFile(kept))
			back, err := ReadFile(kept)
			require.NoError(t, err)
			require.Equal(t, tc.want, maps.Collect(back.All()))
			require.Equal(t, table.Digest(), back.Digest())
		})
	}
}

// A table written as its files come keeps what a builder of the same
// files makes, its hard links given their targets' sums from the file.
func TestTableWriter(t *testing.T) {
	tests := []struct {
		name    string
		adds    []tableFile
		want    map[string]Sum
		wantErr string
	}{
		{name: "none", want: map[string]Sum{}},
		{name: "in a walk's order", adds: []tableFile{{path: "a", sum: Sum{1}}, {path: "a/b", sum: Sum{2}}, {path: "a.c", sum: Sum{3}}},
			want: map[string]Sum{"a": {1}, "a/b": {2}, "a.c": {3}}},
		{name: "links", adds: []tableFile{{path: "a", sum: emptySum}, {path: "b/f", sum: Sum{5}}, {path: "b/l1", target: "b/f"},
			{path: "c", sum: Sum{6}}, {path: "d/a", target: "a"}, {path: "e", target: "b/f"}},
			want: map[string]Sum{"a": emptySum, "b/f": {5}, "b/l1": {5}, "c": {6}, "d/a": emptySum, "e": {5}}},
		{name: "a link to a link", adds: []tableFile{{path: "a", sum: Sum{1}}, {path: "b", target: "a"}, {path: "c", target: "b"}}, wantErr: "a hard link to"},
		{name: "a link before its target", adds: []tableFile{{path: "a", target: "b"}, {path: "b", sum: Sum{1}}}, wantErr: "a hard link to"},
		{name: "a link to nothing", adds: []tableFile{{path: "a", sum: Sum{1}}, {path: "b", target: "nowhere"}}, wantErr: "a hard link to"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			kept := filepath.Join(dir, "sums")
			w, err := CreateTableFile(kept)
			require.NoError(t, err)
			var b TableBuilder
			for _, a := range tc.adds {
				if a.target != "" {
					w.Link(a.path, a.target)
					b.Link(a.path, a.target)
				} else {
					w.File(a.path, a.sum)
					b.Add(a.path, a.sum)
				}
			}
			err = w.Keep()
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				entries, err := os.ReadDir(dir)
				require.NoError(t, err)
				require.Empty(t, entries, "a table not kept leaves nothing")
				return
			}
			require.NoError(t, err)
			w.Abandon() // (kept: nothing to do)
			back, err := ReadFile(kept)
			require.NoError(t, err)
			require.Equal(t, tc.want, maps.Collect(back.All()))
			require.Equal(t, b.Table().Digest(), back.Digest())
			if len(tc.want) > 0 {
				require.NotNil(t, back.kept, "kept in the walk's order, its sums read from the file")
			}
			entries, err := os.ReadDir(dir)
			require.NoError(t, err)
			require.Len(t, entries, 1, "only the table")
		})
	}
	t.Run("abandoned", func(t *testing.T) {
		dir := t.TempDir()
		w, err := CreateTableFile(filepath.Join(dir, "sums"))
		require.NoError(t, err)
		w.File("a", Sum{1})
		w.Abandon()
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		require.Empty(t, entries)
	})
}

// A file of sums written in no order (as tables kept before they were
// kept in a walk's order were) reads back whole.
func TestReadFileInNoOrder(t *testing.T) {
	want := map[string]Sum{}
	var body bytes.Buffer
	body.Write(fileHeader)
	for i := range 1000 {
		p := fmt.Sprintf("d%d/f%d", (i*7919)%13, (i*104729)%1000)
		sum := Sum{byte(i), byte(i >> 8)}
		want[p] = sum
		body.Write(sum[:])
		body.Write(binary.AppendUvarint(nil, uint64(len(p))))
		body.WriteString(p)
	}
	whole := sha256.Sum256(body.Bytes())
	body.Write(whole[:])
	kept := filepath.Join(t.TempDir(), "sums")
	require.NoError(t, os.WriteFile(kept, body.Bytes(), 0o600))
	got, err := ReadFile(kept)
	require.NoError(t, err)
	require.Equal(t, want, maps.Collect(got.All()))
	for p, sum := range want {
		s, ok := got.Sum(p)
		require.True(t, ok, p)
		require.Equal(t, sum, s, p)
	}
}

// A table of many files made in memory (a walk's, a stream's) is what its
// sums and a few bytes of each path take, not a map's 127 bytes a file.
func TestTableSize(t *testing.T) {
	const files = 200_000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var b TableBuilder
	for i := range files {
		b.Add(fmt.Sprintf("d%04d/f%06d", i/1000, i), Sum{byte(i)})
	}
	table := b.Table()
	runtime.GC()
	runtime.ReadMemStats(&after)
	perFile := float64(after.HeapAlloc-before.HeapAlloc) / files
	t.Logf("%.1f bytes a file", perFile)
	require.Less(t, perFile, 44.0)
	require.Equal(t, files, table.Len())
}

// A table read from its file in the walk's order leaves its sums there,
// about 5 bytes a file in memory: each is read as asked for, by Sum and
// by a Finder asked in order or not, and by a walk of the table (its
// digest's runs spilled beside the file). Once the file is no longer what
// was read (a path changed in place, a length rotted, the file cut short,
// another file in its place, none), a sum that cannot be read is none,
// and the zero Sum to a walk: the table's digest is no longer the one
// read, and a check fails closed.
func TestTableReadFromItsFile(t *testing.T) {
	const files = 100_000
	var b TableBuilder
	want := map[string]Sum{}
	for i := range files {
		p := fmt.Sprintf("d%03d/f%06d", i/1000, i)
		sum := Sum{byte(i), byte(i >> 8), byte(i >> 16), 7}
		want[p] = sum
		b.Add(p, sum)
	}
	kept := filepath.Join(t.TempDir(), "sums")
	require.NoError(t, b.Table().WriteFile(kept))

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	table, err := ReadFile(kept)
	require.NoError(t, err)
	runtime.GC()
	runtime.ReadMemStats(&after)
	perFile := float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / files
	t.Logf("%.1f bytes a file", perFile)
	require.Less(t, perFile, 8.0, "the sums left in the file")
	require.NotNil(t, table.kept)

	require.Equal(t, want, maps.Collect(table.All()))
	digest := table.Digest()
	require.Equal(t, TableOf(want).Digest(), digest)
	spilled, err := table.spilledDigest() // (what Digest took: its runs beside the file)
	require.NoError(t, err)
	require.Equal(t, digest, spilled)
	inOrder, asked := table.Finder(), table.Finder()
	for i := range files {
		p := fmt.Sprintf("d%03d/f%06d", i/1000, i)
		sum, ok := inOrder.Sum(p)
		require.True(t, ok, p)
		require.Equal(t, want[p], sum, p)
		if i%997 == 0 {
			q := fmt.Sprintf("d%03d/f%06d", (i*7919%files)/1000, i*7919%files)
			sum, ok := asked.Sum(q)
			require.True(t, ok, q)
			require.Equal(t, want[q], sum, q)
			sum, ok = table.Sum(q)
			require.True(t, ok, q)
			require.Equal(t, want[q], sum, q)
		}
	}
	_, ok := inOrder.Sum("d000/f")
	require.False(t, ok)

	// A path changed in place, where the table's walk and a lookup read it.
	raw, err := os.ReadFile(kept)
	require.NoError(t, err)
	at := bytes.Index(raw, []byte("d050/f050000"))
	require.Positive(t, at)
	f, err := os.OpenFile(kept, os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteAt([]byte("X"), int64(at))
	require.NoError(t, err)
	_, ok = table.Sum("d050/f050000")
	require.False(t, ok, "a path that is not there any more")
	_, ok = table.Finder().Sum("d050/f050000")
	require.False(t, ok)
	require.Equal(t, Sum{}, maps.Collect(table.All())["d050/f050000"], "the zero Sum, to a walk")
	require.NotEqual(t, digest, table.Digest())
	require.NoError(t, Check(strings.NewReader(""), emptySum))
	require.ErrorIs(t, Check(strings.NewReader(""), Sum{}), ErrMismatch, "no bytes have the zero Sum")

	// A path's length changed in place into a terabyte's: not read, not
	// allocated.
	lengthAt := bytes.Index(raw, []byte("d060/f060000")) - 1
	require.Equal(t, byte(12), raw[lengthAt], "a path's length, in one byte before it")
	_, err = f.WriteAt(binary.AppendUvarint(nil, 1<<40), int64(lengthAt))
	require.NoError(t, err)
	_, ok = table.Sum("d060/f060000")
	require.False(t, ok)

	// The file cut short.
	require.NoError(t, f.Truncate(int64(at)))
	require.NoError(t, f.Close())
	_, ok = table.Sum("d099/f099999")
	require.False(t, ok)
	sum, ok := table.Sum("d000/f000001")
	require.True(t, ok, "what is still there reads")
	require.Equal(t, want["d000/f000001"], sum)

	// Another file in its place, the same bytes: not the file read. Then
	// none.
	require.NoError(t, os.WriteFile(kept+".new", raw, 0o600))
	require.NoError(t, os.Rename(kept+".new", kept))
	_, ok = table.Sum("d000/f000001")
	require.False(t, ok, "a file renamed over it")
	require.NoError(t, os.Remove(kept))
	_, ok = table.Finder().Sum("d000/f000001")
	require.False(t, ok, "the file gone")
}

// tableFile is a file a test adds to a table: a hard link to target where
// that is set.
type tableFile struct {
	path, target string
	sum          Sum
}
