package streamer

import (
	"bufio"
	"compress/gzip"
	"fmt"
	"io"
	"sync"

	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/zstd"
)

// Encoding is how the tar bytes travel on a link.
type Encoding string

const (
	// Raw: the tar bytes as they are (fast links, or data that does not
	// compress).
	Raw Encoding = "raw"
	// Zstd: a good ratio at hundreds of MB/s.
	Zstd Encoding = "zstd"
	// S2: a lower ratio at GB/s.
	S2 Encoding = "s2"
	// Gzip: what Concourse speaks; slow, for compatibility only.
	Gzip Encoding = "gzip"
)

// ParseEncoding checks an encoding's name.
func ParseEncoding(s string) (Encoding, error) {
	switch e := Encoding(s); e {
	case Raw, Zstd, S2, Gzip:
		return e, nil
	}
	return "", fmt.Errorf("encoding %q: want raw, zstd, s2 or gzip", s)
}

// ParseDataEncoding checks the encoding a volume read or upload names:
// raw unless it names one.
func ParseDataEncoding(s string) (Encoding, error) {
	if s == "" {
		return Raw, nil
	}
	return ParseEncoding(s)
}

type nopWriteCloser struct{ io.Writer }

func (nopWriteCloser) Close() error { return nil }

// An s2 writer or reader holds buffers of a MiB or more, and a lazy pull's
// read-ahead asks a holder for a few files at a time, thousands of times:
// making new ones for each request cost the holder more CPU than reading
// the files did. They are pooled, as are the streams' bufio buffers. Reset
// drops a stream's state; none of them ever hands on more than it was
// given in its current stream, so what an earlier stream left in their
// buffers stays there.
var (
	s2Writers  = sync.Pool{New: func() any { return s2.NewWriter(nil) }}
	s2Readers  = sync.Pool{New: func() any { return s2.NewReader(nil) }}
	bufWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, streamBuffer) }}
	bufReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, streamBuffer) }}
)

// fromPool takes a coder or buffer from p and points it at target, and
// returns it with its release, which points it at nothing (it keeps no
// stream alive) and gives it back.
func fromPool[T interface{ Reset(A) }, A any](p *sync.Pool, target A) (T, func()) {
	v := p.Get().(T)
	v.Reset(target)
	return v, func() {
		var none A
		v.Reset(none)
		p.Put(v)
	}
}

// writer is e's encoder writing to w, and release, which stops it and
// gives back what it holds. Call release once the stream is done with,
// closed or not: an s2 writer runs a goroutine until it is stopped.
func (e Encoding) writer(w io.Writer) (io.WriteCloser, func(), error) {
	switch e {
	case Raw:
		return nopWriteCloser{w}, func() {}, nil
	case Zstd:
		zw, err := zstd.NewWriter(w, zstd.WithEncoderLevel(zstd.SpeedFastest))
		return zw, func() {}, err
	case S2:
		sw, release := fromPool[*s2.Writer](&s2Writers, w)
		return sw, release, nil
	case Gzip:
		gw, err := gzip.NewWriterLevel(w, gzip.DefaultCompression)
		return gw, func() {}, err
	}
	return nil, nil, fmt.Errorf("encoding %q: want raw, zstd, s2 or gzip", string(e))
}

// reader is e's decoder reading from r, and release, which gives back
// what it holds once the stream is done with.
func (e Encoding) reader(r io.Reader) (io.Reader, func(), error) {
	switch e {
	case Raw:
		return r, func() {}, nil
	case Zstd:
		d, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(64<<20))
		if err != nil {
			return nil, nil, err
		}
		return d, d.Close, nil
	case S2:
		sr, release := fromPool[*s2.Reader](&s2Readers, r)
		return sr, release, nil
	case Gzip:
		gr, err := gzip.NewReader(r)
		if err != nil {
			return nil, nil, err
		}
		return gr, func() { _ = gr.Close() }, nil
	}
	return nil, nil, fmt.Errorf("encoding %q: want raw, zstd, s2 or gzip", string(e))
}
