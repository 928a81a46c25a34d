package walkorder

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A walk meets a directory's entries right after it, before a name it
// starts: "/" sorts before every other byte.
func TestCompare(t *testing.T) {
	walked := []string{"", "a", "a/b", "a/b/c", "a/c", "a.c", "a0", "b", "ba"}
	require.True(t, slices.IsSortedFunc(walked, Compare[string, string]))
	for i, a := range walked {
		for j, b := range walked {
			require.Equal(t, -Compare(b, a), Compare(a, []byte(b)), "%q %q", a, b)
			require.Equal(t, i == j, Compare(a, b) == 0)
		}
	}
}

// A List's paths are kept each as what it does not share with the one
// before, every Restart-th whole, in chunks of chunkSize: any path is read
// back, and found, across restarts and chunks, and nothing else is.
func TestList(t *testing.T) {
	var l List
	require.Equal(t, -1, l.Lookup("a"), "an empty list")
	r := l.From(0)
	require.False(t, r.Next())
	var paths []string
	for i := range 3000 { // in the walk's order, sharing a few bytes each: over 3 MB, in chunks of 1 MiB
		paths = append(paths, fmt.Sprintf("%04d/%s", i, strings.Repeat("x", 1000+i%7)))
		l.Add(paths[i])
	}
	paths = append(paths, strings.Repeat("z", 2*chunkSize)) // a path longer than a chunk
	l.Add(paths[len(paths)-1])
	require.Greater(t, len(l.chunks), 3)
	require.Equal(t, len(paths), l.Len())
	for i, path := range paths {
		require.Equal(t, path, l.Path(i))
		require.Equal(t, i, l.Lookup(path))
	}
	for r, i := l.From(0), 0; r.Next(); i++ {
		require.Equal(t, paths[i], string(r.Path()))
		require.Equal(t, i, r.Index())
	}
	absent := []string{"", "a", "0000", "0000/", paths[5] + "x", paths[5][:len(paths[5])-1], "2999/y", "zz"}
	for _, p := range absent {
		require.Equal(t, -1, l.Lookup(p), p)
	}

	// A Finder finds what Lookup does, asked in order, out of it, after
	// a path that is not there, and past the end.
	f := l.Finder()
	asked := []string{paths[0], paths[1], paths[2], paths[40], paths[41], absent[4], paths[42], paths[7], paths[8], paths[len(paths)-1], paths[len(paths)-2], paths[len(paths)-1], absent[7], paths[3]}
	asked = append(asked, absent...)
	for _, p := range asked {
		require.Equal(t, l.Lookup(p), f.Find(p), "%.10q", p)
	}
}
