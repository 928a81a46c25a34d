// Package streamer moves cached volumes between nodes. This part owns the
// wire format: a tar stream that keeps what an overlay layer needs
// (whiteouts as 0/0 character devices, trusted.overlay.* and other
// xattrs, hardlinks, owners, modes, times, holes), an encoding per link,
// a digest and a size over the tar bytes, and an extractor that lets
// nothing in a crafted archive land outside its directory. It reads and
// writes trees it is given; it never touches the node's cache metadata.
//
// The format's rooms: archive.go what every stream shares (the xattrs and
// PAX records that travel, holes, digests, limits); shapes.go the shapes a
// stream takes (a whole tree, a stub tree with small files inline, the
// data alone); pack.go the packer that walks a tree into a stream;
// unpack.go the extractor; tarwriter.go and tarreader.go the tar headers;
// peer.go and data.go the gRPC wire; swarm.go a holder's swarms (the
// pullers of one layer chained, each relaying to the next) and spool.go a
// member's copy of the stream it relays.
package streamer

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
)

const paxXattr = "SCHILY.xattr."

// Summary is what a stream carried: the tar bytes (before encoding), their
// digest, and how many entries.
type Summary struct {
	Bytes   int64
	Entries int64
	Digest  string // "xxh64:<hex>", or "sha256:<hex>" for a swarm's stream
	// Files is, for a summed extraction (Limits.Summed), the digest of
	// the table of the layer's files the stream carried, as the sums it
	// said (filesum.Table.Digest): what the node that captured the layer
	// vouches for.
	Files filesum.Sum
	// Inlined is, for UnpackStubs, the last file the stub tree carried
	// whole (see Inline.Through); empty: none.
	Inlined string
	// Table is, for an extraction Limits.Tabled, the sums of the files
	// it made: the table filesum.OfTree would compute of its tree.
	Table *filesum.Table
}

// counter hashes and counts the tar bytes as they pass. Between a holder
// and its puller the digest guards against corruption between the
// sender's reads and the receiver's writes (a proxy, a bad NIC, a bug),
// under mutual TLS, and every file's bytes are checked against its sum
// anyway: XXH64, at memory speed. A swarm's streams are SHA-256: a member
// trusts the member before it (a relay, another peer than the holder)
// only as far as the holder's digest of the same stream, and an XXH64 lane
// is invertible, so a relay could edit the stream and restore it.
type counter struct {
	h      hash.Hash
	sha256 bool
	n      int64
}

// newCounter counts with XXH64, or SHA-256 where a relay may be in the
// chain (swarm).
func newCounter(swarm bool) *counter {
	if swarm {
		return &counter{h: sha256.New(), sha256: true}
	}
	return &counter{h: xxhash.New()}
}

func (c *counter) Write(p []byte) (int, error) {
	_, _ = c.h.Write(p)
	c.n += int64(len(p))
	return len(p), nil
}

func (c *counter) summary(entries int64) Summary {
	algo := "xxh64"
	if c.sha256 {
		algo = "sha256"
	}
	return Summary{Bytes: c.n, Entries: entries, Digest: algo + ":" + hex.EncodeToString(c.h.Sum(nil))}
}

// paxHoles is cowvol's own PAX record for a sparse file: its size and the
// data segments ("size offset:length ..."), the body carrying only those.
// Go's archive/tar writes no sparse format, and a hole of gigabytes
// should not cross the wire as zeros. Only cowvol reads it: Pack leaves it
// out (holes travel as zeros) when the tar is for anyone else.
const paxHoles = "COWVOL.holes"

// paxSum is the record of a regular file's SHA-256 (filesum.Sum, in hex)
// in a layer's stream: the sum of its bytes when the layer was captured,
// which the puller checks every byte of against.
const paxSum = "COWVOL.sha256"

// maxSegments bounds a sparse file's segment list (a PAX record stays well
// under the 1 MiB readers accept); a file more fragmented than that
// travels with its zeros.
const maxSegments = 20_000

// dataSegments are where a sparse file holds data (SEEK_DATA, SEEK_HOLE),
// or nil to send it whole: too fragmented, or the filesystem cannot say.
func dataSegments(f fdtree.File, size int64) ([][2]int64, error) {
	fd := int(f)
	var out [][2]int64
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole from here
		}
		if err != nil {
			return nil, nil //nolint:nilerr // no SEEK_DATA: send it whole
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return nil, nil //nolint:nilerr
		}
		hole = min(hole, size)
		if out = append(out, [2]int64{data, hole - data}); len(out) > maxSegments {
			return nil, nil
		}
		off = hole
	}
	return out, nil
}

func formatHoles(size int64, segments [][2]int64) (string, int64) {
	var b strings.Builder
	b.WriteString(strconv.FormatInt(size, 10))
	var data int64
	for _, s := range segments {
		fmt.Fprintf(&b, " %d:%d", s[0], s[1])
		data += s[1]
	}
	return b.String(), data
}

// parseHoles reads a paxHoles record, checking that its segments are in
// order, apart, within the file, and add up to the body's size.
func parseHoles(rec string, body int64) (int64, [][2]int64, error) {
	fields := strings.Fields(rec)
	if len(fields) == 0 || len(fields) > maxSegments+1 {
		return 0, nil, refused("sparse map %q", rec)
	}
	size, err := strconv.ParseInt(fields[0], 10, 64)
	if err != nil || size < 0 {
		return 0, nil, refused("sparse map size %q", fields[0])
	}
	var segments [][2]int64
	var end, data int64
	for _, f := range fields[1:] {
		o, l, ok := strings.Cut(f, ":")
		off, err1 := strconv.ParseInt(o, 10, 64)
		n, err2 := strconv.ParseInt(l, 10, 64)
		if !ok || err1 != nil || err2 != nil || off < end || n < 0 || off > size || n > size-off {
			return 0, nil, refused("sparse map segment %q", f)
		}
		segments = append(segments, [2]int64{off, n})
		end, data = off+n, data+n
	}
	if data != body {
		return 0, nil, refused("sparse map holds %d bytes, the entry %d", data, body)
	}
	return size, segments, nil
}

// Limits bound what an extraction accepts.
type Limits struct {
	// Bytes bounds the tar stream (after decoding); Entries, its entries.
	Bytes, Entries int64
	// Strict refuses what only cowvol's own layers carry, whiteouts and
	// trusted.* xattrs: an archive from outside the cluster (an upload)
	// must not steer the overlay the volume is mounted with. It takes
	// any tar a tool writes; a stream that is not Strict, only what a
	// packer writes (see tarReader).
	Strict bool
	// KeepSetuid keeps regular files' setuid and setgid bits and file
	// capabilities (--allow-setuid). Otherwise the bits are cleared and
	// the capabilities not set, as a capture clears both: runtimes do not
	// pass a volume's nosuid into the container.
	KeepSetuid bool
	// Swarmed: the stream is a swarm's, whose digest is SHA-256 (see
	// counter).
	Swarmed bool
	// Summed: the stream is a layer a peer sent, every regular file of
	// which carries its sum (paxSum). A file that came with its data is
	// checked against it before the extraction ends, a stub hands it on
	// (Stub.Sum), and a file without one is refused: no byte a peer sent
	// is kept unchecked.
	Summed bool
	// Tabled: a Summed extraction also says the sums it checked the
	// files against, by path (Summary.Table): the table of the layer it
	// made, which then need not be read back to be known. (A list of the
	// layer's files, held until the extraction ends: asked for only where
	// the table is kept.)
	Tabled bool
}

// DefaultLimits are generous for CI volumes and fatal to a decompression
// bomb.
var DefaultLimits = Limits{Bytes: 1 << 40, Entries: 10_000_000}

// ErrRefused marks an archive that tried something no volume needs: an
// entry outside the directory, a device node, a link that escapes, a limit
// passed.
var ErrRefused = errors.New("archive refused")

func refused(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrRefused, fmt.Sprintf(format, args...))
}
