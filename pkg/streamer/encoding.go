package streamer

import (
	"compress/gzip"
	"fmt"
	"io"

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

func (e Encoding) writer(w io.Writer) (io.WriteCloser, error) {
	switch e {
	case Raw:
		return nopWriteCloser{w}, nil
	case Zstd:
		return zstd.NewWriter(w, zstd.WithEncoderLevel(zstd.SpeedFastest))
	case S2:
		return s2.NewWriter(w), nil
	case Gzip:
		return gzip.NewWriterLevel(w, gzip.DefaultCompression)
	}
	return nil, fmt.Errorf("encoding %q: want raw, zstd, s2 or gzip", string(e))
}

func (e Encoding) reader(r io.Reader) (io.ReadCloser, error) {
	switch e {
	case Raw:
		return io.NopCloser(r), nil
	case Zstd:
		d, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(64<<20))
		if err != nil {
			return nil, err
		}
		return d.IOReadCloser(), nil
	case S2:
		return io.NopCloser(s2.NewReader(r)), nil
	case Gzip:
		return gzip.NewReader(r)
	}
	return nil, fmt.Errorf("encoding %q: want raw, zstd, s2 or gzip", string(e))
}
