package filesum

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A landing's sum is the sum of what the file holds after its writes: from
// the writes alone while they come in order (gaps are the file's holes),
// from the file read back once one comes behind another.
func TestLanding(t *testing.T) {
	block := func(b byte, n int) []byte { return bytes.Repeat([]byte{b}, n) }
	type write struct {
		off  int64
		data []byte
	}
	for _, tc := range []struct {
		name     string
		size     int64
		writes   []write
		readBack bool // the sum needs the file read back
		wrong    bool // the sum wanted is of other bytes
	}{
		{name: "nothing written: zeros", size: 200 << 10},
		{name: "in order", size: 3 << 10, writes: []write{{0, block('a', 1<<10)}, {1 << 10, block('b', 2<<10)}}},
		{name: "holes between and after", size: 1 << 20,
			writes: []write{{4 << 10, block('a', 100)}, {300 << 10, block('b', 70<<10)}}},
		{name: "a zero-length write", size: 10, writes: []write{{0, nil}, {0, block('a', 10)}}},
		{name: "behind the last", size: 128 << 10, readBack: true,
			writes: []write{{64 << 10, block('b', 64<<10)}, {0, block('a', 64<<10)}}},
		{name: "over an earlier write", size: 10, readBack: true,
			writes: []write{{0, block('a', 10)}, {5, block('b', 5)}}},
		{name: "past the size", size: 10, readBack: true, writes: []write{{0, block('a', 20)}}},
		{name: "other bytes", size: 10, wrong: true, writes: []write{{0, block('a', 10)}}},
		{name: "other bytes, read back", size: 10, wrong: true, readBack: true,
			writes: []write{{5, block('a', 5)}, {0, block('b', 5)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := os.Create(filepath.Join(t.TempDir(), "f"))
			require.NoError(t, err)
			defer f.Close()
			require.NoError(t, f.Truncate(tc.size))
			l := NewLanding(f)
			for _, w := range tc.writes {
				n, err := l.WriteAt(w.data, w.off)
				require.NoError(t, err)
				require.Equal(t, len(w.data), n)
			}
			held, err := io.ReadAll(io.NewSectionReader(f, 0, tc.size))
			require.NoError(t, err)
			want := Sum(sha256.Sum256(held))
			if tc.wrong {
				want[0]++
			}
			back := &countingReader{r: io.NewSectionReader(f, 0, tc.size)}
			err = l.Check(tc.size, want, back)
			require.Equal(t, tc.readBack, back.n > 0, "read back")
			if tc.wrong {
				require.ErrorIs(t, err, ErrMismatch)
			} else {
				require.NoError(t, err)
			}
		})
	}
}

// A landing whose region cannot be read back fails its check where it
// needs it, and only there.
func TestLandingReadBackFails(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	require.NoError(t, err)
	defer f.Close()
	l := NewLanding(f)
	_, err = l.WriteAt([]byte("b"), 1)
	require.NoError(t, err)
	_, err = l.WriteAt([]byte("a"), 0)
	require.NoError(t, err)
	broken := errors.New("unreadable")
	require.ErrorIs(t, l.Check(2, Sum(sha256.Sum256([]byte("ab"))), &countingReader{err: broken}), broken)
}

type countingReader struct {
	r   io.Reader
	n   int
	err error
}

func (c *countingReader) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}
