package fill

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/filesum"
)

// Where a layer checks sums, no reader ever sees bytes that are not the
// file's: wrong bytes from a fetch are fetched again (the layer told, so
// that the holder is dropped) and the reader gets the right ones; a file
// no fetch brings right answers EIO, after a bounded number of tries;
// wrong bytes from a stream are fetched alone.
func TestCheckedSumsNeverShowWrongBytes(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"once": random(t, 4096), "big": random(t, 2<<20), "always": random(t, 4096), "offered": random(t, 8192)})
	src := &fetcher{src: s.src}
	var mu sync.Mutex
	wrongFetches := map[string]int{"once": 1, "big": 1, "always": 1 << 30}
	fetch := func(ctx context.Context, rel string, size int64, w io.WriterAt) error {
		if err := src.fetch(ctx, rel, size, w); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if wrongFetches[rel] > 0 {
			wrongFetches[rel]--
			_, err := w.WriteAt([]byte{s.files[rel][size/2] ^ 0x80}, size/2) // one flipped bit, as a rotten disk gives
			return err
		}
		return nil
	}
	type told struct{ rel, from string }
	var corrupt []told
	g, err := Open(filepath.Dir(s.layer), time.Minute)
	require.NoError(t, err)
	t.Cleanup(func() { _ = g.Close() })
	l, err := g.NewLayer(s.layer, fetch, nil)
	require.NoError(t, err)
	l.CheckSums(func(rel, from string, err error) {
		require.ErrorIs(t, err, filesum.ErrMismatch)
		mu.Lock()
		defer mu.Unlock()
		corrupt = append(corrupt, told{rel, from})
	})
	for place, name := range slices.Sorted(maps.Keys(s.files)) {
		f, err := os.Open(filepath.Join(s.layer, name))
		require.NoError(t, err)
		require.NoError(t, l.Add(int(f.Fd()), stubOf(t, f, Stub{Rel: name, Size: int64(len(s.files[name])), Place: place,
			Sum: sha256.Sum256(s.files[name])})))
		require.NoError(t, f.Close())
	}
	l.Seal()

	for _, name := range []string{"once", "big"} {
		got, err := os.ReadFile(filepath.Join(s.merged, name))
		require.NoError(t, err, name)
		require.True(t, bytes.Equal(s.files[name], got), "%s: the right bytes, fetched again", name)
		require.Equal(t, 2, src.count(name))
	}
	require.NoError(t, l.Offer("offered", func(w io.WriterAt) error {
		data := bytes.Clone(s.files["offered"])
		data[7] ^= 0x01
		_, err := w.WriteAt(data, 0)
		return err
	}))
	got, err := os.ReadFile(filepath.Join(s.merged, "offered"))
	require.NoError(t, err)
	require.True(t, bytes.Equal(s.files["offered"], got), "a stream's wrong bytes: the file fetched alone")
	require.Equal(t, 1, src.count("offered"))

	_, err = os.ReadFile(filepath.Join(s.merged, "always"))
	require.ErrorIs(t, err, syscall.EIO, "no fetch brings it right: EIO, never the wrong bytes")
	require.Equal(t, maxRefetches+1, src.count("always"))
	<-l.Done()
	require.ErrorIs(t, l.Err(), filesum.ErrMismatch)
	mu.Lock()
	defer mu.Unlock()
	require.Contains(t, corrupt, told{"once", FromHolder})
	require.Contains(t, corrupt, told{"big", FromHolder})
	require.Contains(t, corrupt, told{"offered", FromStream})
	sum, ok := l.Sum("big")
	require.True(t, ok)
	require.Equal(t, filesum.Sum(sha256.Sum256(s.files["big"])), sum, "the sum a stub's data was checked against")
	_, ok = l.Sum("no such stub")
	require.False(t, ok)
}
