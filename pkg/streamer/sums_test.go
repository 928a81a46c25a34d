package streamer

import (
	"bytes"
	"context"
	"maps"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/filesum"
)

// A layer's stream carries each regular file's sum; a summed extraction
// checks every file that came with its data before it ends, hands each stub
// its sum, and refuses a file with no sum: one changed byte (a relay's, or
// the holder's disk's) fails the layer, whatever the stream's own digest.
func TestSummedLayers(t *testing.T) {
	src := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(src, "d"), 0o755))
	files := map[string][]byte{
		"small":   []byte("carried whole in a stub tree"),
		"d/big":   bytes.Repeat([]byte("0123456789abcdef"), 64<<10),
		"d/empty": nil,
	}
	for name, data := range files {
		require.NoError(t, os.WriteFile(filepath.Join(src, name), data, 0o644))
	}
	require.NoError(t, os.Link(filepath.Join(src, "small"), filepath.Join(src, "d/small-again")))
	sums, err := filesum.OfTree(t.Context(), src)
	require.NoError(t, err)
	sumOf := maps.Collect(sums.All())
	layer := LayerFiles{Dir: src, Sums: sums}
	summed := DefaultLimits
	summed.Summed = true
	inline := Inline{Max: 4096, Budget: 4096}

	pack := func(shape Shape, l LayerFiles) []byte {
		var wire bytes.Buffer
		_, err := PackFirst(context.Background(), l, nil, &wire, Raw, shape, inline)
		require.NoError(t, err)
		return wire.Bytes()
	}
	unpack := func(wire []byte) error {
		_, err := Unpack(context.Background(), bytes.NewReader(wire), Raw, t.TempDir(), summed)
		return err
	}
	whole := pack(SparseTar, layer)
	sum, err := Unpack(context.Background(), bytes.NewReader(whole), Raw, t.TempDir(), summed)
	require.NoError(t, err)
	require.Equal(t, sums.Digest(), sum.Files, "the digest of the table the stream carried, the hardlink's name with its file's sum")
	require.Nil(t, sum.Table, "a table only where asked")
	tabled := summed
	tabled.Tabled = true
	sum, err = Unpack(context.Background(), bytes.NewReader(whole), Raw, t.TempDir(), tabled)
	require.NoError(t, err)
	require.Equal(t, sumOf, maps.Collect(sum.Table.All()), "the table itself, where asked")

	var mu sync.Mutex
	got := map[string]filesum.Sum{}
	sum, err = UnpackStubs(context.Background(), bytes.NewReader(pack(StubTar, layer)), Raw, t.TempDir(), summed, inline, func(s Stub) error {
		mu.Lock()
		defer mu.Unlock()
		got[s.Name] = s.Sum
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, sums.Digest(), sum.Files, "the stub tree's table")
	require.Equal(t, map[string]filesum.Sum{"d/big": sumOf["d/big"]}, got, "the stub's sum")
	require.Nil(t, sum.Table)
	sum, err = UnpackStubs(context.Background(), bytes.NewReader(pack(StubTar, layer)), Raw, t.TempDir(), tabled, inline, func(Stub) error { return nil })
	require.NoError(t, err)
	require.Nil(t, sum.Table, "no table of stubs, which do not hold their sums' bytes yet")

	flipped := bytes.Clone(whole)
	i := bytes.Index(flipped, []byte("0123456789abcdef"))
	flipped[i+3] ^= 0x01
	err = unpack(flipped)
	require.ErrorIs(t, err, ErrCorrupt)
	require.ErrorIs(t, err, filesum.ErrMismatch)
	require.Contains(t, err.Error(), "d/big")

	smallFlipped := pack(StubTar, layer)
	i = bytes.Index(smallFlipped, files["small"])
	smallFlipped[i] ^= 0x01
	_, err = UnpackStubs(context.Background(), bytes.NewReader(smallFlipped), Raw, t.TempDir(), summed, inline, func(Stub) error { return nil })
	require.ErrorIs(t, err, filesum.ErrMismatch, "a small file carried whole in the stub tree")

	require.ErrorIs(t, unpack(pack(SparseTar, LayerFiles{Dir: src})), ErrRefused, "a layer's stream without sums")

	// The holder's own disk: a byte changed since the sums were taken is
	// found as it is sent, in every shape that carries data.
	rotten := bytes.Clone(files["d/big"])
	rotten[1000] ^= 0x20
	require.NoError(t, os.WriteFile(filepath.Join(src, "d/big"), rotten, 0o644))
	for _, shape := range []Shape{SparseTar, DataTar} {
		_, err := PackFirst(context.Background(), layer, nil, &bytes.Buffer{}, Raw, shape, Inline{})
		require.ErrorIs(t, err, ErrRotten, "shape %d", shape)
	}
	_, err = PackFirst(context.Background(), layer, nil, &bytes.Buffer{}, Raw, StubTar, inline)
	require.NoError(t, err, "a stub tree reads no big file's data")
	_, err = PackFirst(context.Background(), LayerFiles{Dir: src, Sums: filesum.TableOf(map[string]filesum.Sum{"small": sumOf["small"]})}, nil, &bytes.Buffer{}, Raw, SparseTar, Inline{})
	require.ErrorContains(t, err, "has no sum", "sums that are not the layer's")
}
