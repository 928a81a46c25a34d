package fill

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The bitmap the keeper reads is the one the plugin writes, across the
// words of a span, and a span is in place only if all of it is.
func TestPlacedBlocks(t *testing.T) {
	const size = 200*blobBlock + 1 // 201 blocks: four words, the last partly used
	tests := []struct {
		name        string
		set         [][2]int64 // blocks [first, end)
		first, end  int64
		wantInPlace bool
	}{
		{name: "nothing set", first: 0, end: 1},
		{name: "one block", set: [][2]int64{{5, 6}}, first: 5, end: 6, wantInPlace: true},
		{name: "the block beside it", set: [][2]int64{{5, 6}}, first: 6, end: 7},
		{name: "a span over three words", set: [][2]int64{{60, 140}}, first: 60, end: 140, wantInPlace: true},
		{name: "a span one block longer", set: [][2]int64{{60, 140}}, first: 60, end: 141},
		{name: "two spans that meet", set: [][2]int64{{0, 64}, {64, 130}}, first: 10, end: 129, wantInPlace: true},
		{name: "two spans with a gap", set: [][2]int64{{0, 63}, {64, 130}}, first: 10, end: 129},
		{name: "the last block", set: [][2]int64{{200, 201}}, first: 200, end: 201, wantInPlace: true},
		{name: "past the end", set: [][2]int64{{0, 201}}, first: 200, end: 202},
		{name: "a set past the end is cut", set: [][2]int64{{199, 400}}, first: 199, end: 201, wantInPlace: true},
		{name: "an empty span", set: [][2]int64{{0, 201}}, first: 3, end: 3},
		{name: "a negative span", set: [][2]int64{{0, 201}}, first: -1, end: 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, fd, err := newPlacedBlocks(size)
			require.NoError(t, err)
			defer p.close()
			defer unix.Close(fd)
			keeper, err := mapPlacedBlocks(fd, p.blocks, unix.PROT_READ)
			require.NoError(t, err)
			defer keeper.close()
			for _, s := range tc.set {
				p.set(s[0], s[1])
			}
			require.Equal(t, tc.wantInPlace, keeper.has(tc.first, tc.end), "as the keeper sees it")
			require.Equal(t, tc.wantInPlace, p.has(tc.first, tc.end))
		})
	}
}

// A read's bytes touch the blocks that hold any of them.
func TestBlockSpan(t *testing.T) {
	for _, tc := range []struct{ off, n, first, end int64 }{
		{0, 1, 0, 1},
		{0, blobBlock, 0, 1},
		{0, blobBlock + 1, 0, 2},
		{blobBlock - 1, 2, 0, 2},
		{3 * blobBlock, 12288, 3, 6},
	} {
		first, end := blockSpan(tc.off, tc.n)
		require.Equal(t, [2]int64{tc.first, tc.end}, [2]int64{first, end}, "%d bytes at %d", tc.n, tc.off)
	}
}

// The keeper maps no bitmap but one of the size its blob needs, sealed at
// that size, and no bitmap is made for a blob past the bound.
func TestPlacedBlocksRefused(t *testing.T) {
	_, _, err := newPlacedBlocks(0)
	require.ErrorIs(t, err, errNoPlacedBlocks)
	_, _, err = newPlacedBlocks((maxPlacedBlocks + 1) * blobBlock)
	require.ErrorIs(t, err, errNoPlacedBlocks)
	p, fd, err := newPlacedBlocks(64 * blobBlock)
	require.NoError(t, err)
	defer p.close()
	defer unix.Close(fd)
	_, err = mapPlacedBlocks(fd, 65*64, unix.PROT_READ)
	require.Error(t, err, "a bitmap smaller than its blob needs")
	unsealed, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(unsealed)
	require.NoError(t, unix.Ftruncate(unsealed, 8))
	_, err = mapPlacedBlocks(unsealed, 64, unix.PROT_READ)
	require.Error(t, err, "a bitmap whose owner could shrink it under the keeper")
	pipe := make([]int, 2)
	require.NoError(t, unix.Pipe2(pipe, unix.O_CLOEXEC))
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])
	_, err = mapPlacedBlocks(pipe[0], 64, unix.PROT_READ)
	require.Error(t, err, "not a memfd's file")
}
