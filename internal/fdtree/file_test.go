package fdtree

import (
	"bytes"
	"io"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestUnnamedLeavesNoName(t *testing.T) {
	dir := t.TempDir()
	f, err := Unnamed(dir, "a scratch file")
	require.NoError(t, err)
	defer f.Close()
	_, err = f.WriteString("kept only while open")
	require.NoError(t, err)
	names, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, names, "an unnamed file must not appear in its dir")

	_, err = Unnamed(dir+"/missing", "a scratch file")
	require.ErrorContains(t, err, "a scratch file in "+dir+"/missing")
}

func TestCopyRange(t *testing.T) {
	src := bytes.Repeat([]byte("0123456789abcdef"), 70_000) // over 1 MiB
	through := func(dst *os.File, dstOff int64, src *os.File, srcOff, n int64) error {
		return CopyThrough(dst, dstOff, src, srcOff, n, make([]byte, 4096))
	}
	tests := []struct {
		name  string
		dstIn string // where the copy lands; another filesystem takes the fallback
		copy  func(dst *os.File, dstOff int64, src *os.File, srcOff, n int64) error
	}{
		{name: "same filesystem", dstIn: "", copy: CopyRange},
		{name: "across filesystems", dstIn: "/dev/shm", copy: CopyRange},
		{name: "through user space, a buffer of its own", dstIn: "", copy: through},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			dstDir := dir
			if tc.dstIn != "" {
				if _, err := os.Stat(tc.dstIn); err != nil {
					t.Skipf("no %s to copy across to: %v", tc.dstIn, err)
				}
				dstDir = tc.dstIn
			}
			in, err := Unnamed(dir, "a source")
			require.NoError(t, err)
			defer in.Close()
			_, err = in.Write(src)
			require.NoError(t, err)
			out, err := Unnamed(dstDir, "a copy")
			require.NoError(t, err)
			defer out.Close()

			const at, from, n = 4096 + 7, 13, 1 << 20
			require.NoError(t, tc.copy(out, at, in, from, n))
			got := make([]byte, n)
			_, err = out.ReadAt(got, at)
			require.NoError(t, err)
			require.Equal(t, src[from:from+n], got)

			require.ErrorIs(t, tc.copy(out, 0, in, int64(len(src))-10, 20), io.ErrUnexpectedEOF, "a source that ends early is an error")
		})
	}
}
