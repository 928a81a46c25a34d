package fill

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
	"github.com/concourse/cowvol/pkg/overlay"
)

// indexed is a layer, its index mounted with a blob no byte of which is
// there yet, and the Blob that fills it.
type indexed struct {
	layer, mnt string
	layout     *index.Layout
	blob       *Blob
	mu         sync.Mutex
	fetched    map[string]int // by extent path
}

// newIndexed indexes the layer makeLayer makes (each extent with its sum, as a
// pull's index has), mounts it, and fills its blob from the layer with
// fetch (nil: the layer's bytes, zeros left as holes).
func newIndexed(t *testing.T, makeLayer func(layer string), fetch func(ix *indexed) BlobFetch) *indexed {
	t.Helper()
	testfs.Need(t)
	fs := testfs.Mount(t, testfs.XFS, 1<<30)
	if err := Supported(fs); err != nil {
		t.Skip(err)
	}
	ix := &indexed{layer: filepath.Join(fs, "layer"), mnt: filepath.Join(fs, "mnt"), fetched: map[string]int{}}
	work := filepath.Join(fs, "work")
	for _, d := range []string{ix.layer, ix.mnt, work} {
		require.NoError(t, os.Mkdir(d, 0o755))
	}
	makeLayer(ix.layer)
	sums, err := filesum.OfTree(t.Context(), ix.layer)
	require.NoError(t, err)
	root, err := unix.Open(ix.layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(root) })
	var img bytes.Buffer
	ix.layout, err = index.Build(root, &img, index.Options{})
	require.NoError(t, err)
	for i := range ix.layout.Extents {
		ix.layout.Extents[i].Sum = sums[ix.layout.Extents[i].Path]
	}
	require.NoError(t, os.WriteFile(filepath.Join(work, "index"), img.Bytes(), 0o600))
	f, err := os.Create(filepath.Join(work, "blob"))
	require.NoError(t, err)
	require.NoError(t, f.Truncate(ix.layout.Size))
	require.NoError(t, f.Close())

	from := index.Blob{Root: root, Layout: ix.layout}
	layerBytes := BlobFetch(func(_ context.Context, e index.Extent, w io.WriterAt) error {
		buf := make([]byte, 1<<20)
		for off := int64(0); off < e.Size; off += int64(len(buf)) {
			p := buf[:min(int64(len(buf)), e.Size-off)]
			if _, err := from.ReadAt(p, e.Offset+off); err != nil && !errors.Is(err, io.EOF) {
				return err
			}
			if bytes.Count(p, []byte{0}) == len(p) {
				continue // a hole stays one
			}
			if _, err := w.WriteAt(p, off); err != nil {
				return err
			}
		}
		return nil
	})
	if fetch != nil {
		layerBytes = fetch(ix)
	}
	counted := func(ctx context.Context, e index.Extent, w io.WriterAt) error {
		ix.mu.Lock()
		ix.fetched[e.Path]++
		ix.mu.Unlock()
		return layerBytes(ctx, e, w)
	}
	ix.blob, err = OpenBlob(work, "blob", ix.layout, counted)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, ix.blob.Close()) })
	err = overlay.MountIndex(filepath.Join(work, "index"), filepath.Join(work, "blob"), ix.mnt)
	if errors.Is(err, overlay.ErrNoIndexMounts) {
		t.Skip(err)
	}
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, unix.Unmount(ix.mnt, unix.MNT_DETACH)) }) // before the Blob's Close
	return ix
}

func (ix *indexed) fetches(path string) int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.fetched[path]
}

// An index mounted with an empty blob reads as its layer: each file's
// extent is fetched when a read first reaches it, once, and a file mapped
// through the mount is filled too (a stub's mapping through an overlay
// raises no event; the blob's reads by EROFS do). Once every extent is in
// place the Blob is done.
func TestBlobFillsAnIndexOnDemand(t *testing.T) {
	if name := os.Getenv("COWVOL_MAP_FILE"); name != "" {
		mapAndSum(name)
		return
	}
	ix := newIndexed(t, func(layer string) {
		testfs.LayerTree(t, layer)
		// Its sparse file of 256 MiB made smaller: reading its zeros to
		// leave them holes takes half a minute under the race detector.
		f, err := os.Create(filepath.Join(layer, "sparse"))
		require.NoError(t, err)
		_, err = f.WriteAt([]byte("tail"), 8<<20)
		require.NoError(t, err)
		require.NoError(t, f.Close())
		require.NoError(t, os.Mkdir(filepath.Join(layer, "many"), 0o755))
		for i := range 300 {
			require.NoError(t, os.WriteFile(filepath.Join(layer, "many", strings.Repeat("f", 1+i%7)+string(rune('a'+i%26))+strings.Repeat("g", i/26)),
				bytes.Repeat([]byte{byte(i)}, 1+i*37), 0o644))
		}
	}, nil)

	data, err := os.ReadFile(filepath.Join(ix.mnt, "sub/file"))
	require.NoError(t, err)
	require.Equal(t, "data", string(data))
	require.Equal(t, 1, ix.fetches("sub/file"))
	require.Zero(t, ix.fetches("big"), "a file no one read is not fetched")

	// Mapped, not read: its pages come through the blob's reads. Another
	// process maps it: a thread of this one faulting on a held page would
	// hold up the garbage collector's stop of the world, and with it the
	// goroutine that answers.
	mapper := exec.Command(os.Args[0], "-test.run", "^TestBlobFillsAnIndexOnDemand$")
	mapper.Env = append(os.Environ(), "COWVOL_MAP_FILE="+filepath.Join(ix.mnt, "big"))
	mapped, err := mapper.Output()
	require.NoError(t, err, "the mapper: %s", mapped)
	want, err := os.ReadFile(filepath.Join(ix.layer, "big"))
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("%x", sha256.Sum256(want)), strings.TrimSpace(string(mapped)), "a mapped file reads its bytes")
	require.Equal(t, 1, ix.fetches("big"))

	wantTree, got := testfs.Describe(t, ix.layer), testfs.Describe(t, ix.mnt)
	wantTree["cap"] = withoutCaps(t, wantTree["cap"])
	require.Equal(t, wantTree, got)
	select {
	case <-ix.blob.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("every extent was read, and the blob is not done")
	}
	require.NoError(t, ix.blob.Err())
	for _, e := range ix.layout.Extents {
		require.LessOrEqual(t, ix.fetches(e.Path), 1, "%s fetched again", e.Path)
	}
}

// mapAndSum prints the SHA-256 of the file name as a mapping of it reads
// it, and exits.
func mapAndSum(name string) {
	f, err := os.Open(name)
	var st os.FileInfo
	if err == nil {
		st, err = f.Stat()
	}
	var mapped []byte
	if err == nil {
		mapped, err = unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	}
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	fmt.Printf("%x\n", sha256.Sum256(mapped))
	os.Exit(0)
}

// withoutCaps is a described file without its file capabilities, which
// an index drops unless it keeps setuid bits.
func withoutCaps(t *testing.T, described string) string {
	before, after, found := strings.Cut(described, " xattrs=security.capability=")
	require.True(t, found)
	_, mtime, _ := strings.Cut(after, " mtime=")
	return before + " mtime=" + mtime
}

// A wrong byte never reaches a reader: an extent whose fetched bytes are
// not its sum is failed, and its readers get EIO, now and later, while
// other files read; a fetch that fails gives EIO, not a hang; and readers
// held when the Blob fails get EIO, as do those that come after.
func TestBlobRefusesWhatIsNotTheLayer(t *testing.T) {
	entered := make(chan struct{}, 1)
	ix := newIndexed(t, func(layer string) {
		for _, name := range []string{"good", "rotten", "lost", "held"} {
			require.NoError(t, os.WriteFile(filepath.Join(layer, name), []byte("the bytes of "+name), 0o644))
		}
	}, func(*indexed) BlobFetch {
		return func(ctx context.Context, e index.Extent, w io.WriterAt) error {
			switch e.Path {
			case "rotten":
				_, err := w.WriteAt([]byte("the bytes of rottEn"), 0)
				return err
			case "lost":
				return errors.New("the holder went")
			case "held":
				entered <- struct{}{}
				<-ctx.Done()
				return ctx.Err()
			}
			_, err := w.WriteAt([]byte("the bytes of "+e.Path), 0)
			return err
		}
	})
	for range 2 {
		_, err := os.ReadFile(filepath.Join(ix.mnt, "rotten"))
		require.ErrorIs(t, err, syscall.EIO)
	}
	require.Equal(t, 1, ix.fetches("rotten"), "a failed extent is not fetched again")
	require.ErrorIs(t, ix.blob.Err(), filesum.ErrMismatch)
	_, err := os.ReadFile(filepath.Join(ix.mnt, "lost"))
	require.ErrorIs(t, err, syscall.EIO)
	data, err := os.ReadFile(filepath.Join(ix.mnt, "good"))
	require.NoError(t, err)
	require.Equal(t, "the bytes of good", string(data))

	read := make(chan error, 1)
	go func() {
		_, err := os.ReadFile(filepath.Join(ix.mnt, "held"))
		read <- err
	}()
	<-entered
	select {
	case err := <-read:
		t.Fatalf("a reader went on before its extent was here: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	ix.blob.Fail()
	require.ErrorIs(t, <-read, syscall.EIO)
	_, err = os.ReadFile(filepath.Join(ix.mnt, "held"))
	require.ErrorIs(t, err, syscall.EIO, "a failed blob holds and fails its readers until it is closed")
	data, err = os.ReadFile(filepath.Join(ix.mnt, "good"))
	require.NoError(t, err, "what was in place before stays readable")
	require.Equal(t, "the bytes of good", string(data))
}
