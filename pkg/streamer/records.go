package streamer

import (
	"archive/tar"
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"

	"github.com/concourse/cowvol/pkg/filesum"
)

// records.go: a stub tree as index records (StubRecords), the stream an
// index pull learns a layer's tree from. A StubTar spends 1.5 to 1.7 KB of
// tar headers and PAX text on each entry (its sum in hex, its size as a
// sparse map, its xattrs), and parsing them was most of an index publish's
// time at the puller (about 6 us an entry). A record says the same in
// binary: about 50 bytes for a file, its name sharing what it can with
// the name before it. The holder makes records of the StubTar its packer
// writes (toRecords), so that the two forms cannot say different trees,
// and keeps both beside a big layer (KeepStubs).
//
// The stream is recordsMagic, then records, each its length (uvarint)
// and its body; a length of 0 ends it. A body is:
//
//	kind (one byte: recDir, recFile, recStub, recSymlink, recLink,
//	      recWhiteout, recFifo)
//	the length of the prefix its name shares with the name before it
//	(uvarint; the root's name is "" and comes first), the rest's length
//	(uvarint) and the rest
//	but for recLink: mode bits (uvarint, at most 07777), uid and gid
//	(uvarints, at most 2^32-1), mtime in ns (varint), the xattrs' count
//	(uvarint) and each's name and value (each a uvarint length and bytes)
//	then by kind:
//	  recFile, recStub: size (uvarint), a byte saying whether a sum
//	    follows (1) or not (0), the sum (32 bytes); recFile, its data to
//	    the body's end, size bytes with any holes as zeros
//	  recSymlink, recLink: the target to the body's end (a link's, a
//	    name in the tree)
//	  recWhiteout: device major and minor (uvarints; only 0:0 is taken)
//
// A reader takes nothing but this: a body longer than what it says, a
// field past its bounds, a name that does not clean are refused, as a
// StubTar's would be (see indexer).

// recordsMagic starts a records stream. A holder that knows no records
// sends a StubTar, whose first bytes are a tar header's name: a puller
// tells them apart by these.
const recordsMagic = "cowvolR1"

// Record kinds.
const (
	recDir      = 'd'
	recFile     = 'f' // a regular file carried whole
	recStub     = 's' // a regular file's size and sum, no data
	recSymlink  = 'l'
	recLink     = 'h' // a hard link to a file before it
	recWhiteout = 'c'
	recFifo     = 'p'
)

// maxRecord bounds a record's body: a name and a link's target, xattrs as
// a PAX header bounds them, and a small file.
const maxRecord = 2*maxNameLen + maxPAXHeader + MaxInlineFile + 64

// record is one decoded record. Its name, target and xattrs are its own;
// its data is lent until the next record is read.
type record struct {
	kind         byte
	name         string
	mode         uint32
	uid, gid     uint32
	mtime        int64
	xattrs       map[string]string
	size         int64
	summed       bool
	sum          filesum.Sum
	data         []byte
	target       string
	major, minor uint64
}

// recordWriter writes a packer's StubTar entries as records to w.
type recordWriter struct {
	w       *bufio.Writer
	prev    string
	body    []byte
	data    []byte
	entries int64
}

func newRecordWriter(w *bufio.Writer) (*recordWriter, error) {
	_, err := w.WriteString(recordsMagic)
	return &recordWriter{w: w}, err
}

// entry writes the record of a StubTar's entry (a readArchive callback).
func (rw *recordWriter) entry(hdr *tar.Header, body io.Reader) error {
	name := ""
	if hdr.Name != rootName {
		var err error
		if name, err = cleanName(hdr.Name); err != nil {
			return err
		}
	}
	var kind byte
	switch hdr.Typeflag {
	case tar.TypeDir:
		kind = recDir
	case tar.TypeReg:
		kind = recStub
		if !isStub(hdr) {
			kind = recFile
		}
	case tar.TypeSymlink:
		kind = recSymlink
	case tar.TypeLink:
		kind = recLink
	case tar.TypeChar:
		kind = recWhiteout
	case tar.TypeFifo:
		kind = recFifo
	default:
		return fmt.Errorf("%s: entry type %q in a stub tree", name, hdr.Typeflag)
	}
	b := append(rw.body[:0], kind)
	shared := commonPrefix(rw.prev, name)
	b = binary.AppendUvarint(b, uint64(shared))
	b = appendBytes(b, name[shared:])
	rw.prev = name
	if kind != recLink {
		b = binary.AppendUvarint(b, uint64(hdr.Mode&0o7777))
		b = binary.AppendUvarint(b, uint64(hdr.Uid))
		b = binary.AppendUvarint(b, uint64(hdr.Gid))
		b = binary.AppendVarint(b, hdr.ModTime.UnixNano())
		var xattrs []string
		for k := range hdr.PAXRecords {
			if strings.HasPrefix(k, paxXattr) {
				xattrs = append(xattrs, k)
			}
		}
		slices.Sort(xattrs)
		b = binary.AppendUvarint(b, uint64(len(xattrs)))
		for _, k := range xattrs {
			b = appendBytes(appendBytes(b, k[len(paxXattr):]), hdr.PAXRecords[k])
		}
	}
	switch kind {
	case recFile, recStub:
		size, segments := hdr.Size, [][2]int64{{0, hdr.Size}}
		if rec, ok := hdr.PAXRecords[paxHoles]; ok {
			var err error
			if size, segments, err = parseHoles(rec, hdr.Size); err != nil {
				return err
			}
		}
		b = binary.AppendUvarint(b, uint64(size))
		if rec, ok := hdr.PAXRecords[paxSum]; ok {
			sum, err := filesum.Parse(rec)
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			b = append(append(b, 1), sum[:]...)
		} else {
			b = append(b, 0)
		}
		if kind == recFile {
			if size > MaxInlineFile {
				return fmt.Errorf("%s: %d bytes inline", name, size)
			}
			rw.data = slices.Grow(rw.data[:0], int(size))[:size]
			clear(rw.data) // holes read as zeros
			for _, s := range segments {
				if _, err := io.ReadFull(body, rw.data[s[0]:s[0]+s[1]]); err != nil {
					return fmt.Errorf("%s: %w", name, err)
				}
			}
			b = append(b, rw.data...)
		}
	case recSymlink:
		b = append(b, hdr.Linkname...)
	case recLink:
		target, err := cleanName(hdr.Linkname)
		if err != nil {
			return err
		}
		b = append(b, target...)
	case recWhiteout:
		b = binary.AppendUvarint(binary.AppendUvarint(b, uint64(hdr.Devmajor)), uint64(hdr.Devminor))
	}
	rw.body = b
	rw.entries++
	return rw.write(b)
}

func (rw *recordWriter) write(b []byte) error {
	var n [binary.MaxVarintLen64]byte
	if _, err := rw.w.Write(binary.AppendUvarint(n[:0], uint64(len(b)))); err != nil {
		return err
	}
	_, err := rw.w.Write(b)
	return err
}

// end writes the end of the records and flushes them.
func (rw *recordWriter) end() error {
	if err := rw.w.WriteByte(0); err != nil {
		return err
	}
	return rw.w.Flush()
}

func commonPrefix(a, b string) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

func appendBytes(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

// toRecords writes the StubTar a packer writes to tarStream (raw) as
// records to w (raw), counted as a stream of a swarm or not is: the
// summary a puller of the records checks.
func toRecords(ctx context.Context, tarStream io.Reader, w io.Writer, swarm bool) (Summary, error) {
	c := newCounter(swarm)
	bw, releaseBuffer := fromPool[*bufio.Writer](&bufWriters, io.MultiWriter(w, c))
	defer releaseBuffer()
	rw, err := newRecordWriter(bw)
	if err != nil {
		return Summary{}, err
	}
	own := Limits{Bytes: math.MaxInt64, Entries: math.MaxInt64} // the holder's own tar
	if _, err := readArchive(ctx, tarStream, Raw, own, rw.entry); err != nil {
		return Summary{}, err
	}
	if err := rw.end(); err != nil {
		return Summary{}, err
	}
	return c.summary(rw.entries), nil
}

// PackRecords writes layer's stub tree as records (StubRecords) to w,
// encoded with enc: the StubTar PackFirst packs (the small files inline
// says whole), made records as it is packed.
func PackRecords(ctx context.Context, layer LayerFiles, w io.Writer, enc Encoding, inline Inline) (Summary, error) {
	pr, pw := io.Pipe()
	packed := make(chan error, 1)
	go func() {
		_, err := PackFirst(ctx, layer, nil, pw, Raw, StubTar, inline)
		pw.CloseWithError(err) // nil: the records see the tar end
		packed <- err
	}()
	var sum Summary
	err := encodeTo(w, enc, func(raw io.Writer) error {
		var err error
		sum, err = toRecords(ctx, pr, raw, layer.swarm)
		return err
	})
	pr.CloseWithError(errRecordsStopped) // a packer still writing stops
	if perr := <-packed; perr != nil && !errors.Is(perr, errRecordsStopped) {
		err = perr // the packer's failure (a rotten file) is what the records saw end short
	}
	return sum, err
}

// errRecordsStopped stops a packer whose records are no longer read.
var errRecordsStopped = errors.New("the records of the stub tree stopped")

// recordReader reads records from a stream past its magic.
type recordReader struct {
	r    *bufio.Reader
	body []byte
	prev string
	rec  record
}

// errRecord is a record that does not decode.
func errRecord(format string, args ...any) error {
	return refused("a stub tree's record: %s", fmt.Sprintf(format, args...))
}

// next reads the next record; io.EOF at the records' end.
func (rr *recordReader) next() (*record, error) {
	n, err := binary.ReadUvarint(rr.r)
	switch {
	case errors.Is(err, io.EOF):
		return nil, io.ErrUnexpectedEOF
	case err != nil:
		return nil, err
	case n == 0:
		return nil, io.EOF
	case n > maxRecord:
		return nil, errRecord("%d bytes long", n)
	}
	if uint64(cap(rr.body)) < n {
		rr.body = make([]byte, n)
	}
	b := rr.body[:n]
	if _, err := io.ReadFull(rr.r, b); err != nil {
		return nil, noEOF(err)
	}
	d := decoder{b: b}
	rec := &rr.rec
	*rec = record{kind: d.byte()}
	shared := d.uvarint()
	suffix := d.bytes()
	if d.err == nil && shared > uint64(len(rr.prev)) {
		d.fail("a name sharing %d bytes of %q", shared, rr.prev)
	}
	if d.err != nil {
		return nil, d.err
	}
	rec.name = rr.prev[:shared] + string(suffix)
	rr.prev = rec.name
	if rec.kind != recLink {
		rec.mode = uint32(d.bounded(0o7777, "mode"))
		rec.uid = uint32(d.bounded(math.MaxUint32, "uid"))
		rec.gid = uint32(d.bounded(math.MaxUint32, "gid"))
		rec.mtime = d.varint()
		for i := d.bounded(maxPAXHeader, "xattrs"); i > 0 && d.err == nil; i-- {
			k, v := d.bytes(), d.bytes()
			if rec.xattrs == nil {
				rec.xattrs = map[string]string{}
			}
			rec.xattrs[string(k)] = string(v)
		}
	}
	switch rec.kind {
	case recFile, recStub:
		rec.size = int64(d.bounded(math.MaxInt64, "size"))
		switch d.byte() {
		case 0:
		case 1:
			rec.summed = true
			copy(rec.sum[:], d.take(len(rec.sum)))
		default:
			d.fail("a sum flag that is neither 0 nor 1")
		}
		if rec.kind == recFile {
			if rec.data = d.rest(); d.err == nil && int64(len(rec.data)) != rec.size {
				d.fail("%s: %d bytes of data for a size of %d", rec.name, len(rec.data), rec.size)
			}
		}
	case recSymlink, recLink:
		rec.target = string(d.rest())
	case recWhiteout:
		rec.major, rec.minor = d.uvarint(), d.uvarint()
	case recDir, recFifo:
	default:
		d.fail("kind %q", rec.kind)
	}
	if d.err == nil && len(d.b) > 0 {
		d.fail("%s: %d bytes past its end", rec.name, len(d.b))
	}
	return rec, d.err
}

func noEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// decoder reads a record's fields; its first failure sticks.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = errRecord(format, args...)
	}
}

func (d *decoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n > len(d.b) {
		d.fail("cut short")
		return nil
	}
	out := d.b[:n]
	d.b = d.b[n:]
	return out
}

func (d *decoder) byte() byte {
	if b := d.take(1); b != nil {
		return b[0]
	}
	return 0
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("a malformed number")
		return 0
	}
	d.b = d.b[n:]
	return v
}

// varint is a zig-zag uvarint, as binary.AppendVarint writes it.
func (d *decoder) varint() int64 {
	u := d.uvarint()
	return int64(u>>1) ^ -int64(u&1)
}

// bounded is a uvarint of at most limit, what says what it is.
func (d *decoder) bounded(limit uint64, what string) uint64 {
	v := d.uvarint()
	if v > limit {
		d.fail("%s %d", what, v)
	}
	return v
}

// bytes is a uvarint length and that many bytes.
func (d *decoder) bytes() []byte {
	n := d.uvarint()
	if d.err == nil && n > uint64(len(d.b)) {
		d.fail("a field of %d bytes in %d", n, len(d.b))
	}
	return d.take(int(n))
}

func (d *decoder) rest() []byte { return d.take(len(d.b)) }
