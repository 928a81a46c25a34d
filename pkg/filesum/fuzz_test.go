package filesum

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A file of sums changed anywhere after it was kept, its trailer made to
// match or not (a file torn or rotted, or one made to look whole), is
// read or refused, never a crash; one read answers every path it holds,
// by Sum, by a Finder and by a walk, the same; and once the file changes
// under the table (the same bytes changed again in place), what is asked
// is answered right or not at all.
func FuzzReadTableFile(f *testing.F) {
	var b TableBuilder
	for _, p := range []string{"a", "a/b", "a/c", "b", "c/d/e", "c/d/f", "z"} {
		b.Add(p, Sum{p[0], byte(len(p))})
	}
	dir := f.TempDir()
	seed := filepath.Join(dir, "seed")
	require.NoError(f, b.Table().WriteFile(seed))
	raw, err := os.ReadFile(seed)
	require.NoError(f, err)
	f.Add(raw, uint16(0), byte(0), true, uint16(0), byte(0))
	f.Add(raw, uint16(len(fileHeader)+32), byte(0x7f), true, uint16(len(fileHeader)+40), byte(0xff))
	f.Fuzz(func(t *testing.T, file []byte, at uint16, to byte, whole bool, laterAt uint16, laterTo byte) {
		file = bytes.Clone(file)
		if len(file) > sha256.Size && int(at) < len(file)-sha256.Size {
			file[at] = to
			if whole { // the trailer made to match what was changed
				sum := sha256.Sum256(file[:len(file)-sha256.Size])
				copy(file[len(file)-sha256.Size:], sum[:])
			}
		}
		path := filepath.Join(t.TempDir(), "sums")
		require.NoError(t, os.WriteFile(path, file, 0o600))
		table, err := ReadFile(path)
		if err != nil {
			return
		}
		read := maps.Collect(table.All())
		require.Len(t, read, table.Len())
		finder := table.Finder()
		for p, sum := range read {
			got, ok := table.Sum(p)
			require.True(t, ok, p)
			require.Equal(t, sum, got, p)
		}
		for p := range table.All() {
			got, ok := finder.Sum(p)
			require.True(t, ok, p)
			require.Equal(t, read[p], got, p)
		}
		if int(laterAt) < len(file) {
			f, err := os.OpenFile(path, os.O_WRONLY, 0)
			require.NoError(t, err)
			_, err = f.WriteAt([]byte{laterTo}, int64(laterAt))
			require.NoError(t, f.Close())
			require.NoError(t, err)
		}
		for p := range read {
			if got, ok := table.Sum(p); ok {
				// (a sum's own bytes changed are not seen: what is
				// checked against it then fails closed)
				if got != read[p] && !sumChangedAt(file, laterAt) {
					t.Fatalf("%q: %x, read %x", p, got, read[p])
				}
			}
		}
		_ = table.Digest()
	})
}

// sumChangedAt says whether the byte at off of a file of sums lies in a
// record's sum.
func sumChangedAt(file []byte, off uint16) bool {
	pos := len(fileHeader)
	for pos+sha256.Size <= len(file)-sha256.Size {
		if int(off) < pos+sha256.Size {
			return int(off) >= pos
		}
		n, k := binary.Uvarint(file[pos+sha256.Size:])
		if k <= 0 {
			return false
		}
		pos += sha256.Size + k + int(n)
	}
	return false
}
