package streamer

import (
	"bytes"
	"context"
	"encoding/binary"
	"math/bits"
	"os"
	"path/filepath"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"
)

// XXH64's lane round is invertible in its input, so a relay can edit a
// stream and restore every lane with one chosen 32-byte stripe: the same
// bytes, entries and XXH64 digest. A swarm's streams are digested with
// SHA-256, which this edit does not get past; a stream between a holder
// and its puller keeps XXH64 (mutual TLS, and every file's bytes checked
// against its sum).
func TestASwarmsDigestCannotBeForged(t *testing.T) {
	src := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(src, "f"), bytes.Repeat([]byte("the layer's data"), 8<<10), 0o644))
	var wire bytes.Buffer
	_, err := PackFirst(context.Background(), LayerFiles{Dir: src}, nil, &wire, Raw, SparseTar, Inline{})
	require.NoError(t, err)
	stream := wire.Bytes()

	forged := bytes.Clone(stream)
	at := (bytes.Index(forged, []byte("the layer's data")) + 63) &^ 31 // a stripe of f's data
	forged[at] ^= 0xff
	restoreLanes(stream, forged, at/32)
	require.NotEqual(t, stream, forged)
	require.Equal(t, xxhash.Sum64(stream), xxhash.Sum64(forged), "the edit keeps XXH64")

	digest := func(b []byte, swarm bool) Summary {
		c := newCounter(swarm)
		_, _ = c.Write(b)
		return c.summary(1)
	}
	require.Equal(t, digest(stream, false), digest(forged, false), "a holder's stream's digest does not tell them apart")
	require.NotEqual(t, digest(stream, true), digest(forged, true), "a swarm's does")
	require.Contains(t, digest(stream, true).Digest, "sha256:")
}

const (
	xxPrime1 uint64 = 11400714785074694791
	xxPrime2 uint64 = 14029467366897019727
)

// restoreLanes overwrites stripe k+1 of forged, which differs from
// original in stripe k, so that XXH64's four lanes after it are original's.
func restoreLanes(original, forged []byte, k int) {
	lanes := func(b []byte, stripes int) [4]uint64 {
		p1, p2 := xxPrime1, xxPrime2 // variables: the sums wrap, as the hash's do
		v := [4]uint64{p1 + p2, p2, 0, -p1}
		for s := range stripes {
			for i := range v {
				v[i] = bits.RotateLeft64(v[i]+binary.LittleEndian.Uint64(b[32*s+8*i:])*xxPrime2, 31) * xxPrime1
			}
		}
		return v
	}
	before, want := lanes(forged, k+1), lanes(original, k+2)
	inv := func(p uint64) uint64 {
		x := p
		for range 6 {
			x *= 2 - p*x
		}
		return x
	}
	for i := range 4 {
		in := (bits.RotateLeft64(want[i]*inv(xxPrime1), -31) - before[i]) * inv(xxPrime2)
		binary.LittleEndian.PutUint64(forged[32*(k+1)+8*i:], in)
	}
}
