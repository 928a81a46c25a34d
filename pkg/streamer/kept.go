package streamer

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/cespare/xxhash/v2"
	"github.com/klauspost/compress/s2"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/bufpool"
)

// kept.go: a layer's stub tree kept as streams. A pull of a layer's stubs
// asks the holder for the same stream every time, a StubTar (a lazy pull)
// or its records (StubRecords, an index pull), and making it walks the
// whole tree: at 100,000 files that walk was 2.5 s of a publish's 2.8 s,
// cold or warm (open, stat and listxattr of every entry). KeepStubs makes
// both once, off any pull's path, into a file the holder names beside the
// layer; ServeKept sends either from there. A layer does not change once
// captured, so its kept streams stay right, and they go with the layer as
// its sums do (the store's business, not this file's).
//
// The file is the StubTar s2-encoded, then its records s2-encoded (what
// pullers ask for, sent as they lie), then a footer: for each, where it
// lies and what its trailer says (its size, its entries and its digests,
// both kinds); and the Inline they were made with, which a request must
// match. The footer also holds the XXH64 of each one's s2 bytes, checked
// before a byte of it is sent: a kept stream that rotted on disk is
// dropped and the tree packed as before, and never half sent. Last come
// the footer's length, its own XXH64 and keptMagic.
//
// A puller that received a big layer's records (an index pull) keeps them
// as they came (ReceiveRecords), once its pull is checked: the same file
// with no StubTar and only the digest its pull had (its stream's, a
// swarm's or not), ended by keptMagicReceived. It serves those records
// alone: a request it cannot serve walks the layer, and the puller keeps
// the tree whole then (KeptReceived says which it holds). Before, the
// puller walked the layer it had just made to keep them: 3 s of a
// 300,000-file pull's 14 CPU-seconds.

// StubInline is which small files a pull's stub tree carries whole: those
// of at most 8 KiB, in the walk's order, 16 MiB of them at most. A file
// that small costs a node less CPU to receive whole than to make as a
// stub, mark, and fill later (about 20 us a file here, the time 8 KiB take
// on the wire), and it is there before the step starts; the budget keeps
// the publish flat in the size (16 MiB is some 40 ms of a publish here).
// What holders keep (KeepStubs) and pullers ask for.
var StubInline = Inline{Max: 8 << 10, Budget: 16 << 20}

// ErrNotKept: no kept stream serves the request (none kept, another
// Inline, or the one kept did not read whole): pack the tree instead.
var ErrNotKept = errors.New("no kept stub tree serves this request")

// keptMagic ends a kept stream's file, keptMagicReceived one of records
// a pull received (an earlier version takes it for no kept stream, and
// walks). keptMagicV1 ended those of a file with the StubTar alone, which
// is replaced.
const (
	keptMagic         = "cowvolK2"
	keptMagicReceived = "cowvolK3"
	keptMagicV1       = "cowvolK1"
)

// maxKeptFooter bounds the footer a reader takes (it is a few hundred
// bytes).
const maxKeptFooter = 4096

// keptFooter is what a kept stream's file says of it.
type keptFooter struct {
	InlineMax    int64      `json:"inlineMax"`
	InlineBudget int64      `json:"inlineBudget"`
	Tar          keptStream `json:"tar"`
	Records      keptStream `json:"records"`
	// received: the records a pull received, and no StubTar (its
	// magic says so).
	received bool
}

// keptStream is one stream of a kept file.
type keptStream struct {
	Offset    int64  `json:"offset"`    // of its s2 bytes in the file
	Body      int64  `json:"body"`      // how many
	BodyXXH64 string `json:"bodyXXH64"` // theirs
	Bytes     int64  `json:"bytes"`     // the stream's, decoded
	Entries   int64  `json:"entries"`
	XXH64     string `json:"xxh64"` // the stream's digests, as a trailer says them
	SHA256    string `json:"sha256"`
}

// KeepStubs packs layer's stub tree (StubTar, the small files inline
// carries whole) and its records (StubRecords) into a new file at path,
// replacing any there: written aside, synced, then renamed, so that path
// is whole or absent (a file left aside by a crash is named path.tmp*).
// It returns the StubTar's summary (its SHA-256). A file of the layer
// whose bytes are not its sum's fails it with ErrRotten.
func KeepStubs(ctx context.Context, layer LayerFiles, inline Inline, path string) (Summary, error) {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return Summary{}, err
	}
	defer func() {
		if f != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	layer.swarm = true // the digests returned are SHA-256s; the XXH64s counted beside
	foot := keptFooter{InlineMax: inline.Max, InlineBudget: inline.Budget}
	var sum Summary
	foot.Tar, err = keepStream(f, 0, func(raw io.Writer) (Summary, error) {
		sum, err = PackFirst(ctx, layer, nil, raw, Raw, StubTar, inline)
		return sum, err
	})
	if err != nil {
		return Summary{}, err
	}
	// The records are made of the tar just kept, read back: one walk.
	foot.Records, err = keepStream(f, foot.Tar.Body, func(raw io.Writer) (Summary, error) {
		sr, release := fromPool[*s2.Reader](&s2Readers, io.Reader(io.NewSectionReader(f, 0, foot.Tar.Body)))
		defer release()
		return toRecords(ctx, sr, raw, true)
	})
	if err != nil {
		return Summary{}, err
	}
	if err := finishKept(f, foot, keptMagic, path, true); err != nil {
		return Summary{}, err
	}
	f = nil
	return sum, nil
}

// finishKept appends foot and magic to f, a kept file written aside,
// syncs it if sync says, closes it and renames it to path.
func finishKept(f *os.File, foot keptFooter, magic, path string, sync bool) error {
	footer, err := json.Marshal(foot)
	if err != nil {
		return err
	}
	footer = binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(footer, uint32(len(footer))), xxhash.Sum64(footer))
	if _, err := f.Write(append(footer, magic...)); err != nil {
		return err
	}
	if sync {
		if err := f.Sync(); err != nil {
			return err
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// keepStream appends to f, at offset, the stream write writes (raw, and
// summarises with its SHA-256) s2-encoded, and says what it kept.
func keepStream(f *os.File, offset int64, write func(raw io.Writer) (Summary, error)) (keptStream, error) {
	body := newCounter(false)
	bw, releaseBuffer := fromPool[*bufio.Writer](&bufWriters, io.MultiWriter(f, body))
	defer releaseBuffer()
	sw, release := fromPool[*s2.Writer](&s2Writers, io.Writer(bw))
	defer release()
	xxh := newCounter(false)
	sum, err := write(io.MultiWriter(sw, xxh))
	if err == nil {
		err = sw.Close()
	}
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		return keptStream{}, err
	}
	return keptStream{Offset: offset, Body: body.n, BodyXXH64: body.summary(0).Digest, Bytes: sum.Bytes, Entries: sum.Entries,
		XXH64: xxh.summary(0).Digest, SHA256: sum.Digest}, nil
}

// ServeKept sends the stub tree kept at path (KeepStubs) as shape says
// (StubTar or StubRecords) to w, encoded with enc, if it was made with
// inline (the request's), and returns its summary with the digest a
// stream of a swarm (SHA-256) or not (XXH64) has: what packing it would.
// Its s2 bytes are checked first, and sent as they lie if enc is s2.
// ErrNotKept says nothing was sent: pack the tree instead. A kept file
// that does not read whole is removed, and said in the log; whoever
// keeps them keeps the next.
func ServeKept(path string, inline Inline, shape Shape, w io.Writer, enc Encoding, swarm bool) (Summary, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return Summary{}, ErrNotKept
	}
	if err != nil {
		klog.ErrorS(err, "Opening a layer's kept stub tree; packing it from the layer", "path", path)
		return Summary{}, ErrNotKept
	}
	defer f.Close()
	foot, err := readKept(f)
	if errors.Is(err, errKeptV1) {
		klog.V(2).InfoS("A layer's stub tree kept by an earlier version is removed; it is kept again once a pull walks the layer", "path", path)
		if err := os.Remove(path); err != nil {
			klog.ErrorS(err, "Removing a stub tree kept by an earlier version", "path", path)
		}
		return Summary{}, ErrNotKept
	}
	if err == nil && (foot.InlineMax != inline.Max || foot.InlineBudget != inline.Budget || inline.Through != "") {
		return Summary{}, ErrNotKept
	}
	kept := foot.Tar
	if shape == StubRecords {
		kept = foot.Records
	}
	digest := kept.XXH64
	if swarm {
		digest = kept.SHA256
	}
	if err == nil && digest == "" { // received records: no StubTar, one digest
		return Summary{}, ErrNotKept
	}
	buf := bufpool.Get(streamBuffer)
	defer bufpool.Put(buf)
	body := io.NewSectionReader(f, kept.Offset, kept.Body)
	if err == nil {
		err = checkKept(body, kept, buf)
	}
	if err != nil {
		klog.ErrorS(err, "A layer's kept stub tree does not read whole: it is removed, and the tree packed from the layer", "path", path)
		if rerr := os.Remove(path); rerr != nil {
			klog.ErrorS(rerr, "Removing a kept stub tree that does not read whole", "path", path)
		}
		return Summary{}, ErrNotKept
	}
	sum := Summary{Bytes: kept.Bytes, Entries: kept.Entries, Digest: digest}
	if enc == S2 {
		_, err := io.CopyBuffer(w, body, buf)
		return sum, err
	}
	sr, releaseReader := fromPool[*s2.Reader](&s2Readers, io.Reader(body))
	defer releaseReader()
	err = encodeTo(w, enc, func(raw io.Writer) error {
		n, err := io.CopyBuffer(raw, sr, buf)
		if err == nil && n != kept.Bytes {
			err = fmt.Errorf("%s: %d bytes decoded, kept as %d", path, n, kept.Bytes)
		}
		return err
	})
	return sum, err
}

// checkKept checks a kept stream's s2 bytes (body, read with buf) against
// its footer's digest of them, and leaves body at its start.
func checkKept(body *io.SectionReader, kept keptStream, buf []byte) error {
	check := newCounter(false)
	if _, err := io.CopyBuffer(check, body, buf); err != nil {
		return err
	}
	if got := check.summary(0).Digest; got != kept.BodyXXH64 {
		return fmt.Errorf("its bytes are %s, kept as %s", got, kept.BodyXXH64)
	}
	_, err := body.Seek(0, io.SeekStart)
	return err
}

// errKeptV1: a file an earlier version kept (the StubTar alone).
var errKeptV1 = errors.New("a stub tree kept by an earlier version")

// readKept reads the footer of the kept file open as f, checking that it
// says streams that fill the file up to it.
func readKept(f *os.File) (keptFooter, error) {
	var foot keptFooter
	st, err := f.Stat()
	if err != nil {
		return foot, err
	}
	tail := int64(4 + 8 + len(keptMagic))
	if st.Size() < tail {
		return foot, errors.New("too short for a kept stream")
	}
	end := make([]byte, tail)
	if _, err := f.ReadAt(end, st.Size()-tail); err != nil {
		return foot, err
	}
	switch string(end[12:]) {
	case keptMagic:
	case keptMagicReceived:
		foot.received = true
	case keptMagicV1:
		return foot, errKeptV1
	default:
		return foot, errors.New("not a kept stream")
	}
	size := int64(binary.LittleEndian.Uint32(end[:4]))
	if size > maxKeptFooter || size > st.Size()-tail {
		return foot, fmt.Errorf("a footer of %d bytes", size)
	}
	raw := make([]byte, size)
	if _, err := f.ReadAt(raw, st.Size()-tail-size); err != nil {
		return foot, err
	}
	if xxhash.Sum64(raw) != binary.LittleEndian.Uint64(end[4:12]) {
		return foot, errors.New("a footer that is not what was written")
	}
	if err := json.Unmarshal(raw, &foot); err != nil {
		return foot, err
	}
	t, r := foot.Tar, foot.Records
	if foot.received && t != (keptStream{}) {
		return foot, errors.New("received records with a StubTar")
	}
	if t.Offset != 0 || t.Body < 0 || r.Offset != t.Body || r.Body < 0 || r.Offset+r.Body != st.Size()-tail-size ||
		t.Bytes < 0 || t.Entries < 0 || r.Bytes < 0 || r.Entries < 0 {
		return foot, fmt.Errorf("a footer that says streams of %d and %d bytes at %d and %d (%d and %d bytes decoded, %d and %d entries), in a file of %d",
			t.Body, r.Body, t.Offset, r.Offset, t.Bytes, r.Bytes, t.Entries, r.Entries, st.Size())
	}
	return foot, nil
}

// encodeTo writes to w, encoded with enc, what write writes to raw.
func encodeTo(w io.Writer, enc Encoding, write func(raw io.Writer) error) error {
	bw, releaseBuffer := fromPool[*bufio.Writer](&bufWriters, w)
	defer releaseBuffer()
	ew, release, err := enc.writer(bw)
	if err != nil {
		return err
	}
	defer release()
	if err := write(ew); err != nil {
		return err
	}
	if err := ew.Close(); err != nil {
		return err
	}
	return bw.Flush()
}

// KeptReceived says whether the stub tree kept at path is records a pull
// received (ReceiveRecords), which serve those records alone.
func KeptReceived(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	foot, err := readKept(f)
	return err == nil && foot.received
}

// KeepsStubs says whether the stub tree of a layer of files regular files
// is kept: below 4,096, a holder walks the tree in well under 0.1 s, cold,
// and a kept stream would be disk spent for nothing.
func KeepsStubs(files int) bool { return files >= 4096 }

// ReceivedRecords is the records of a layer's stub tree as a pull of them
// receives them (PullLayerIndex), written aside as they arrive: the wire's
// s2 bytes as they come, which a kept file holds (nothing is encoded, or
// hashed but by XXH64). Keep keeps them once the pull is checked; a
// stream in another encoding, or one that could not be written, is not
// kept (the layer is walked for them later, as before).
type ReceivedRecords struct {
	path string
	f    *os.File
	body *counter // of the s2 bytes written
	max  int64    // of them (maxReceivedRecords)
	err  error
}

// ReceiveRecords starts receiving records to keep at path (a file written
// aside in its dir until they are kept).
func ReceiveRecords(path string) (*ReceivedRecords, error) {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return nil, err
	}
	return &ReceivedRecords{path: path, f: f, body: newCounter(false), max: maxReceivedRecords}, nil
}

// maxReceivedRecords bounds the s2 bytes of records a pull writes aside to
// keep: a stub tree of 10,000,000 files (DefaultLimits' entries) is some
// 600 MB of them. What a hostile peer sends past it (s2's padding decodes
// to nothing) is not written, and not kept.
const maxReceivedRecords = 1 << 30

// tee is the tee (see pullLayer) of a pull of stream s that also writes
// each wire chunk to k, then hands it to next (if any).
func (k *ReceivedRecords) tee(s LayerStream, next func([]byte)) func([]byte) {
	if s.Encoding != S2 || s.Shape != StubRecords {
		k.err = fmt.Errorf("a stream of %s in %s is not kept as received", s.Shape, s.Encoding)
		return next
	}
	return func(chunk []byte) {
		if k.err == nil && k.body.n+int64(len(chunk)) > k.max {
			k.err = fmt.Errorf("records past %d bytes received", k.max)
		}
		if k.err == nil {
			if _, err := k.f.Write(chunk); err != nil {
				k.err = err
			} else {
				_, _ = k.body.Write(chunk)
			}
		}
		if next != nil {
			next(chunk)
		}
	}
}

// Keep keeps the records received as the stub tree of their layer, made
// with inline, sum being what their pull checked them against (their
// size, entries and digest, a swarm's or not): written aside, then renamed
// to their path. Not synced, on a publish's path: a file a crash tore
// does not read whole, and ServeKept removes it and has the layer walked.
// Records that do not decode as such (a holder that sent a StubTar) are
// refused. The file aside is gone either way.
func (k *ReceivedRecords) Keep(inline Inline, sum Summary) error {
	defer k.Abandon()
	if k.err != nil {
		return k.err
	}
	if k.body.n > sum.Bytes+sum.Bytes/4+64<<10 { // s2 adds a few bytes a block to what does not compress
		return fmt.Errorf("%d s2 bytes received for %d bytes of records: padded", k.body.n, sum.Bytes)
	}
	head := make([]byte, len(recordsMagic))
	sr, release := fromPool[*s2.Reader](&s2Readers, io.Reader(io.NewSectionReader(k.f, 0, k.body.n)))
	_, err := io.ReadFull(sr, head)
	release()
	switch {
	case err != nil:
		return fmt.Errorf("reading the records received: %w", err)
	case string(head) != recordsMagic:
		return errors.New("received a StubTar, not records")
	}
	records := keptStream{Body: k.body.n, BodyXXH64: k.body.summary(0).Digest, Bytes: sum.Bytes, Entries: sum.Entries}
	switch algo, _, _ := strings.Cut(sum.Digest, ":"); algo {
	case "sha256":
		records.SHA256 = sum.Digest
	case "xxh64":
		records.XXH64 = sum.Digest
	default:
		return fmt.Errorf("records of digest %q", sum.Digest)
	}
	foot := keptFooter{InlineMax: inline.Max, InlineBudget: inline.Budget, Records: records}
	// Not synced: on the publish's path (above).
	if err := finishKept(k.f, foot, keptMagicReceived, k.path, false); err != nil {
		return err
	}
	k.f = nil
	return nil
}

// Abandon lets go of the records received, kept or not.
func (k *ReceivedRecords) Abandon() {
	if k == nil || k.f == nil {
		return
	}
	k.f.Close()
	if err := os.Remove(k.f.Name()); err != nil {
		klog.ErrorS(err, "Removing a stub tree's records received and not kept", "path", k.f.Name())
	}
	k.f = nil
}
