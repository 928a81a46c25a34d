// Package indextest makes the indexes of layers (pkg/index) for tests and
// benchmarks: an image, and its blob whole, as a pull's fill leaves them.
// It owns that fixture and nothing else; pkg/index's own tests keep theirs
// (they could not import this package).
package indextest

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/tb"
	"github.com/concourse/cowvol/pkg/index"
)

// holeBlock is the run of zeros Whole leaves a hole: a filesystem block.
const holeBlock = 4 << 10

// Whole builds the index of the layer at layer into dir: its image at
// dir/index, and dir/blob whole, the layer's holes (runs of zeros) left
// holes. It returns their paths and the index's layout.
func Whole(t tb.TB, layer, dir string) (image, blob string, layout *index.Layout) {
	t.Helper()
	root, err := unix.Open(layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(root)
	image, blob = filepath.Join(dir, "index"), filepath.Join(dir, "blob")
	f, err := os.Create(image)
	if err != nil {
		t.Fatal(err)
	}
	layout, err = index.Build(root, f, index.Options{})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	if f, err = os.Create(blob); err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(layout.Size); err != nil {
		t.Fatal(err)
	}
	from := index.Blob{Root: root, Layout: layout}
	buf := make([]byte, 1<<20)
	for off := int64(0); off < layout.Size; off += int64(len(buf)) {
		p := buf[:min(int64(len(buf)), layout.Size-off)]
		if _, err := from.ReadAt(p, off); err != nil && !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
		for at := 0; at < len(p); at += holeBlock {
			block := p[at:min(at+holeBlock, len(p))]
			if bytes.Count(block, []byte{0}) == len(block) {
				continue // a hole stays one
			}
			if _, err := f.WriteAt(block, off+int64(at)); err != nil {
				t.Fatal(err)
			}
		}
	}
	return image, blob, layout
}
