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
	fs, layer, mnt, work string
	layout               *index.Layout
	blob                 *Blob
	// layerBytes writes an extent's bytes from the layer, zeros left as
	// holes.
	layerBytes BlobFetch
	mu         sync.Mutex
	fetched    map[string]int      // by extent path
	corrupted  map[string][]string // by extent path: where wrong bytes came from
}

// corrupt is ix's Blob's CorruptFunc.
func (ix *indexed) corrupt(path, from string, _ error) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.corrupted[path] = append(ix.corrupted[path], from)
}

func (ix *indexed) corruptions(path string) []string {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.corrupted[path]
}

// newIndexed indexes the layer makeLayer makes, fills its blob from the
// layer with fetch (nil: the layer's bytes), in a group of its own, and
// mounts it.
func newIndexed(t *testing.T, makeLayer func(layer string), fetch func(ix *indexed) BlobFetch) *indexed {
	t.Helper()
	return newIndexedStalling(t, time.Minute, makeLayer, fetch)
}

// newIndexedStalling is newIndexed in a group that fails a fetch that
// writes nothing for stall.
func newIndexedStalling(t *testing.T, stall time.Duration, makeLayer func(layer string), fetch func(ix *indexed) BlobFetch) *indexed {
	t.Helper()
	ix := buildIndexed(t, makeLayer)
	g, err := Open(ix.fs, stall)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, g.Close()) }) // after the Blob's Close
	ix.hold(t, g, fetch)
	ix.mount(t)
	return ix
}

// buildIndexed indexes the layer makeLayer makes (each extent with its
// sum, as a pull's index has) into an image and an empty blob beside it,
// on an XFS of its own.
func buildIndexed(t *testing.T, makeLayer func(layer string)) *indexed {
	t.Helper()
	testfs.Need(t)
	fs := testfs.Mount(t, testfs.XFS, 1<<30)
	if err := Supported(fs); err != nil {
		t.Skip(err)
	}
	ix := &indexed{fs: fs, layer: filepath.Join(fs, "layer"), mnt: filepath.Join(fs, "mnt"), work: filepath.Join(fs, "work"),
		fetched: map[string]int{}, corrupted: map[string][]string{}}
	for _, d := range []string{ix.layer, ix.mnt, ix.work} {
		require.NoError(t, os.Mkdir(d, 0o755))
	}
	makeLayer(ix.layer)
	sums, err := filesum.OfTree(t.Context(), ix.layer)
	require.NoError(t, err)
	root, err := unix.Open(ix.layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(root) })
	img, err := os.Create(filepath.Join(ix.work, "index"))
	require.NoError(t, err)
	ix.layout, err = index.Build(root, img, index.Options{Sums: sums})
	require.NoError(t, errors.Join(err, img.Close()))
	t.Cleanup(func() { require.NoError(t, ix.layout.Close()) }) // before the filesystem goes
	f, err := os.Create(filepath.Join(ix.work, "blob"))
	require.NoError(t, err)
	require.NoError(t, f.Truncate(ix.layout.Size))
	require.NoError(t, f.Close())

	from := index.Blob{Root: root, Layout: ix.layout}
	ix.layerBytes = func(_ context.Context, e index.Extent, w io.WriterAt) error {
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
	}
	return ix
}

// hold has g hold the readers of ix's blob, which fetch fills (nil: the
// layer's bytes), each fetch counted.
func (ix *indexed) hold(t *testing.T, g *Group, fetch func(ix *indexed) BlobFetch) {
	t.Helper()
	fetchBytes := ix.layerBytes
	if fetch != nil {
		fetchBytes = fetch(ix)
	}
	counted := func(ctx context.Context, e index.Extent, w io.WriterAt) error {
		ix.mu.Lock()
		ix.fetched[e.Path]++
		ix.mu.Unlock()
		return fetchBytes(ctx, e, w)
	}
	var err error
	ix.blob, err = g.OpenBlob(filepath.Join(ix.work, "blob"), ix.layout, counted, ix.corrupt)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, ix.blob.Close()) })
}

// mount mounts ix's index, to be unmounted before its Blob is closed.
func (ix *indexed) mount(t *testing.T) {
	t.Helper()
	err := overlay.MountIndex(filepath.Join(ix.work, "index"), filepath.Join(ix.work, "blob"), ix.mnt)
	if errors.Is(err, overlay.ErrNoIndexMounts) {
		t.Skip(err)
	}
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, unix.Unmount(ix.mnt, unix.MNT_DETACH)) })
}

func (ix *indexed) fetches(path string) int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.fetched[path]
}

// An index mounted with an empty blob reads as its layer: each file's
// extent is fetched when a read first reaches it, once, and a file mapped
// through the mount is filled too (a stub's mapping through an overlay
// raises no event; the blob's reads by EROFS do). The files readers reach
// are noted in order once asked. Once every extent is in place the Blob
// is done.
func TestBlobFillsAnIndexOnDemand(t *testing.T) {
	if name := os.Getenv("COWVOL_MAP_FILE"); name != "" {
		mapAndSum(name)
		return
	}
	ix := newIndexed(t, func(layer string) {
		layerTree(t, layer)
		require.NoError(t, os.Mkdir(filepath.Join(layer, "many"), 0o755))
		for i := range 300 {
			require.NoError(t, os.WriteFile(filepath.Join(layer, "many", strings.Repeat("f", 1+i%7)+string(rune('a'+i%26))+strings.Repeat("g", i/26)),
				bytes.Repeat([]byte{byte(i)}, 1+i*37), 0o644))
		}
	}, nil)

	require.False(t, ix.blob.Recording())
	ix.blob.RecordReaches()
	data, err := os.ReadFile(filepath.Join(ix.mnt, "sub/file"))
	require.NoError(t, err)
	require.Equal(t, "data", string(data))
	require.Equal(t, 1, ix.fetches("sub/file"))
	require.Equal(t, "sub/file", ix.blob.Reached()[0], "the first file a reader reached, first")
	require.Zero(t, ix.fetches("big"), "a file no one read is not fetched")

	// Mapped, not read: its pages come through the blob's reads.
	want, err := os.ReadFile(filepath.Join(ix.layer, "big"))
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("%x", sha256.Sum256(want)), mappedSum(t, "TestBlobFillsAnIndexOnDemand", filepath.Join(ix.mnt, "big")),
		"a mapped file reads its bytes")
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
	for i := range ix.layout.Len() {
		e := ix.layout.Extent(i)
		require.LessOrEqual(t, ix.fetches(e.Path), 1, "%s fetched again", e.Path)
	}
}

// mappedSum is the SHA-256 of the file at path as a mapping of it reads
// it in another process: the test named test, run again, which calls
// mapAndSum. A thread of this process faulting on a page of a file it
// answers for would hold up the garbage collector's stop of the world,
// and with it the goroutine that answers.
func mappedSum(t *testing.T, test, path string) string {
	t.Helper()
	mapper := exec.Command(os.Args[0], "-test.run", "^"+test+"$")
	mapper.Env = append(os.Environ(), "COWVOL_MAP_FILE="+path)
	out, err := mapper.Output()
	require.NoError(t, err, "the mapper: %s", out)
	return strings.TrimSpace(string(out))
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

// layerTree is testfs.LayerTree with its sparse file of 256 MiB made
// smaller: reading its zeros through an index to leave them holes takes
// half a minute under the race detector.
func layerTree(t *testing.T, layer string) {
	testfs.LayerTree(t, layer)
	f, err := os.Create(filepath.Join(layer, "sparse"))
	require.NoError(t, err)
	_, err = f.WriteAt([]byte("tail"), 8<<20)
	require.NoError(t, err)
	require.NoError(t, f.Close())
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
// not its sum, fetched again a few times, is failed, and with it the Blob
// (done): the volume cannot be whole. Its readers get EIO, and so at once
// do the readers held for other extents (their fetches are stopped: a
// hung holder holds nobody for its --pull-wait) and every later reader of
// an extent not in place (with no fetch); what was in place reads on.
func TestBlobRefusesWhatIsNotTheLayer(t *testing.T) {
	entered := make(chan struct{}, 1)
	stopped := make(chan struct{})
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
			case "held":
				entered <- struct{}{}
				<-ctx.Done()
				close(stopped)
				return ctx.Err()
			}
			_, err := w.WriteAt([]byte("the bytes of "+e.Path), 0)
			return err
		}
	})
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

	for range 2 {
		_, err := os.ReadFile(filepath.Join(ix.mnt, "rotten"))
		require.ErrorIs(t, err, syscall.EIO)
	}
	require.Equal(t, blobFetchTries, ix.fetches("rotten"), "wrong bytes are fetched again, a few times; a failed extent never again")
	require.Equal(t, []string{FromHolder, FromHolder, FromHolder}, ix.corruptions("rotten"), "each time told")
	require.ErrorIs(t, ix.blob.Err(), filesum.ErrMismatch)
	select {
	case <-ix.blob.Done():
	default:
		t.Fatal("a blob with a failed extent is not done")
	}
	select {
	case err := <-read:
		require.ErrorIs(t, err, syscall.EIO, "a reader held for another extent is let go with the blob")
	case <-time.After(30 * time.Second):
		t.Fatal("a reader is held for an extent of a blob that failed")
	}
	<-stopped // its fetch too
	_, err = os.ReadFile(filepath.Join(ix.mnt, "lost"))
	require.ErrorIs(t, err, syscall.EIO)
	require.Zero(t, ix.fetches("lost"), "a failed blob fetches nothing more")
	data, err = os.ReadFile(filepath.Join(ix.mnt, "good"))
	require.NoError(t, err, "what was in place before stays readable")
	require.Equal(t, "the bytes of good", string(data))
}

// A holder that hangs holds no reader for long: a fetch that writes
// nothing for the group's stall (part-way, or before its first byte, as
// a dial that is never answered) fails, and its reader gets EIO.
func TestBlobFetchThatStallsFails(t *testing.T) {
	for _, sent := range []int{0, 4} {
		t.Run(fmt.Sprintf("sent=%d", sent), func(t *testing.T) {
			ix := newIndexedStalling(t, 300*time.Millisecond, func(layer string) {
				require.NoError(t, os.WriteFile(filepath.Join(layer, "hung"), []byte("the bytes of hung"), 0o644))
			}, func(*indexed) BlobFetch {
				return func(ctx context.Context, e index.Extent, w io.WriterAt) error {
					if _, err := w.WriteAt([]byte("the bytes of hung")[:sent], 0); err != nil {
						return err
					}
					<-ctx.Done()
					return ctx.Err()
				}
			})
			read := make(chan error, 1)
			go func() {
				_, err := os.ReadFile(filepath.Join(ix.mnt, "hung"))
				read <- err
			}()
			select {
			case err := <-read:
				require.ErrorIs(t, err, syscall.EIO)
			case <-time.After(30 * time.Second):
				t.Fatal("a reader is held by a fetch that writes nothing")
			}
			require.ErrorContains(t, ix.blob.Err(), "no data for 300ms")
		})
	}
}

// Readers held when the Blob is failed get EIO, as do those that come
// after, until it is closed, while what was in place reads on.
func TestBlobFailedLetsGoOfItsReaders(t *testing.T) {
	entered := make(chan struct{}, 1)
	ix := newIndexed(t, func(layer string) {
		for _, name := range []string{"good", "held", "later"} {
			require.NoError(t, os.WriteFile(filepath.Join(layer, name), []byte("the bytes of "+name), 0o644))
		}
	}, func(*indexed) BlobFetch {
		return func(ctx context.Context, e index.Extent, w io.WriterAt) error {
			if e.Path == "held" {
				entered <- struct{}{}
				<-ctx.Done()
				return ctx.Err()
			}
			_, err := w.WriteAt([]byte("the bytes of "+e.Path), 0)
			return err
		}
	})
	_, err := os.ReadFile(filepath.Join(ix.mnt, "good"))
	require.NoError(t, err)
	read := make(chan error, 1)
	go func() {
		_, err := os.ReadFile(filepath.Join(ix.mnt, "held"))
		read <- err
	}()
	<-entered
	ix.blob.Fail()
	require.ErrorIs(t, <-read, syscall.EIO)
	require.ErrorIs(t, ix.blob.Err(), errBlobFailed)
	for _, name := range []string{"held", "later"} {
		_, err = os.ReadFile(filepath.Join(ix.mnt, name))
		require.ErrorIs(t, err, syscall.EIO, "a failed blob holds and fails its readers until it is closed: %s", name)
	}
	require.Zero(t, ix.fetches("later"))
	data, err := os.ReadFile(filepath.Join(ix.mnt, "good"))
	require.NoError(t, err, "what was in place before stays readable")
	require.Equal(t, "the bytes of good", string(data))
}

// A stream of the whole layer fills the extents no reader asked for: an
// extent offered is written and checked, one in place or being filled is
// not written again, and one whose offered bytes are not its sum is
// fetched instead; a prefetch brings the rest. A reader of a file
// offered or prefetched reads with no fetch.
func TestBlobTakesExtentsFromAStream(t *testing.T) {
	ix := newIndexed(t, func(layer string) {
		for _, name := range []string{"a", "b", "c"} {
			require.NoError(t, os.WriteFile(filepath.Join(layer, name), []byte("the bytes of "+name), 0o644))
		}
	}, nil)
	offer := func(path, data string) (written bool, err error) {
		err = ix.blob.Offer(path, func(w io.WriterAt) error {
			written = true
			_, err := w.WriteAt([]byte(data), 0)
			return err
		})
		return written, err
	}
	written, err := offer("a", "the bytes of a")
	require.NoError(t, err)
	require.True(t, written)
	written, err = offer("a", "the bytes of a")
	require.NoError(t, err)
	require.False(t, written, "an extent in place is not written again")
	written, err = offer("b", "the bytes of B")
	require.NoError(t, err, "a wrong offer is fetched instead")
	require.True(t, written)
	require.Equal(t, 1, ix.fetches("b"))
	require.Equal(t, []string{FromStream}, ix.corruptions("b"), "told")
	written, err = offer("nowhere", "x")
	require.NoError(t, err)
	require.False(t, written, "a path with no extent")
	_, err = offer("a", strings.Repeat("x", 100))
	require.NoError(t, err, "(in place: not written)")

	ix.blob.Prefetch(2)
	select {
	case <-ix.blob.Done():
	default:
		t.Fatal("every extent is in place, and the blob is not done")
	}
	require.Equal(t, 1, ix.fetches("c"), "not offered: prefetched")
	for _, name := range []string{"a", "b", "c"} {
		data, err := os.ReadFile(filepath.Join(ix.mnt, name))
		require.NoError(t, err)
		require.Equal(t, "the bytes of "+name, string(data))
	}
	require.Zero(t, ix.fetches("a"), "offered, not fetched")
	require.Equal(t, 1, ix.fetches("c"), "read with no fetch")
	require.NoError(t, ix.blob.Err())
	ix.blob.Fail()
	_, err = offer("c", "the bytes of c")
	require.Error(t, err, "a failed blob takes nothing")
}

// A blob's readers outlive the plugin that held them: its group is the
// node's, which the fill keeper keeps, so a reader held when the plugin is
// SIGKILLed stays held (the kernel would let it read the blob's holes
// were the group closed), and the next plugin answers it EIO if the blob's
// layer is one left unfinished, as it does the later readers, until it
// holds the blob again and fills it.
func TestABlobsReadersOutliveTheirPlugin(t *testing.T) {
	if root := os.Getenv("COWVOL_BLOB_ROOT"); root != "" {
		holdBlobAndWait(root, os.Getenv("COWVOL_BLOB_KEEPER"), os.Getenv("COWVOL_BLOB_LAYER"), os.Getenv("COWVOL_BLOB"), "")
		return
	}
	ix := buildIndexed(t, func(layer string) {
		require.NoError(t, os.WriteFile(filepath.Join(layer, "f"), []byte("the bytes of f"), 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(layer, "g"), []byte("the bytes of g"), 0o644))
	})
	sock := serveKeeper(t, time.Minute)

	plugin := startBlobHolder(t, ix, sock, "TestABlobsReadersOutliveTheirPlugin", "COWVOL_BLOB_ROOT")
	ix.mount(t)
	read := readsOf(ix.mnt, func(name string) []byte { return []byte("the bytes of " + name) })
	held := read("f")
	held2 := read("f")
	require.NoError(t, plugin.Process.Kill())
	_ = plugin.Wait()
	select {
	case err := <-held:
		t.Fatalf("a reader went on when its plugin died: %v", err)
	case <-time.After(500 * time.Millisecond):
	}

	g, err := OpenKept(ix.fs, time.Minute, Kept{Socket: sock, Unfinished: func() []string { return []string{ix.work} }})
	require.NoError(t, err)
	defer func() { require.NoError(t, g.Close()) }()
	for _, r := range []<-chan error{held, held2, read("g")} {
		select {
		case err := <-r:
			require.ErrorIs(t, err, syscall.EIO, "a blob left unfinished gives EIO, never its holes")
		case <-time.After(10 * time.Second):
			t.Fatal("the next plugin left a reader of a blob left unfinished held")
		}
	}
	ix.hold(t, g, nil)
	require.NoError(t, <-read("f"), "held again, the blob is filled")
	require.Equal(t, 1, ix.fetches("f"))
}

// startBlobHolder runs this test binary's test as the plugin that holds
// ix's blob in the group kept by the keeper at sock (holdBlobAndWait,
// which the test runs when rootEnv is set), and returns once it holds it;
// it is killed when the test ends, if it is not before.
func startBlobHolder(t *testing.T, ix *indexed, sock, test, rootEnv string) *exec.Cmd {
	t.Helper()
	plugin := exec.Command(os.Args[0], "-test.run", "^"+test+"$")
	plugin.Env = append(os.Environ(), rootEnv+"="+ix.fs, "COWVOL_BLOB_KEEPER="+sock, "COWVOL_BLOB_LAYER="+ix.layer,
		"COWVOL_BLOB="+filepath.Join(ix.work, "blob"))
	out, err := plugin.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, plugin.Start())
	t.Cleanup(func() {
		_ = plugin.Process.Kill()
		_ = plugin.Wait()
	})
	line := make([]byte, 8)
	_, err = io.ReadFull(out, line)
	require.NoError(t, err, "the plugin never held the blob")
	require.Equal(t, "holding\n", string(line))
	return plugin
}

// readsOf starts a read of a file under mnt, whose result comes on the
// channel: an error unless it read want(name).
func readsOf(mnt string, want func(name string) []byte) func(name string) <-chan error {
	return func(name string) <-chan error {
		done := make(chan error, 1)
		go func() {
			data, err := os.ReadFile(filepath.Join(mnt, name))
			if err == nil && !bytes.Equal(data, want(name)) {
				err = fmt.Errorf("%s read %d bytes not its own", name, len(data))
			}
			done <- err
		}()
		return done
	}
}

// serveKeeper serves a fill keeper with grace in this process until the
// test ends, and returns its socket once it listens.
func serveKeeper(t *testing.T, grace time.Duration) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "keeper.sock")
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- ServeKeeper(ctx, sock, grace) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-served)
	})
	require.Eventually(t, func() bool { return testfs.Listening(sock) }, 10*time.Second, 5*time.Millisecond, "the keeper to listen")
	return sock
}

// holdBlobAndWait is the plugin of TestABlobsReadersOutliveTheirPlugin: it
// holds the readers of the blob of the index of layer, in the group kept
// by the keeper at socket, with a fetch that never ends, and waits to be
// killed. Unless missing is "", every extent but that file's is put in
// place (from layer) first.
func holdBlobAndWait(root, socket, layer, blob, missing string) {
	fail := func(err error) {
		fmt.Println(err)
		os.Exit(3)
	}
	g, err := OpenKept(root, time.Hour, Kept{Socket: socket})
	if err != nil {
		fail(err)
	}
	dir, err := unix.Open(layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		fail(err)
	}
	image, err := os.CreateTemp(filepath.Dir(blob), "image-")
	if err != nil {
		fail(err)
	}
	layout, err := index.Build(dir, image, index.Options{})
	if err != nil {
		fail(err)
	}
	b, err := g.OpenBlob(blob, layout, func(ctx context.Context, _ index.Extent, _ io.WriterAt) error {
		<-ctx.Done()
		return ctx.Err()
	}, nil)
	if err != nil {
		fail(err)
	}
	for i := range layout.Len() {
		if e := layout.Extent(i); missing != "" && e.Path != missing {
			err := b.Offer(e.Path, func(w io.WriterAt) error {
				p := make([]byte, e.Size)
				if _, err := (index.Blob{Root: dir, Layout: layout}).ReadAt(p, e.Offset); err != nil {
					return err
				}
				_, err := w.WriteAt(p, 0)
				return err
			})
			if err != nil {
				fail(err)
			}
		}
	}
	g.Settle() // (the keeper has taken every message before it)
	fmt.Println("holding")
	select {}
}

// Through the fill keeper, a read of an index's blob whose blocks are all
// in place is answered by the keeper itself: it goes on while the plugin
// is stopped (SIGSTOP), where a read of a block not in place waits for the
// plugin. Which blocks are in place is the plugin's to say: the next
// plugin answers EIO to the readers of a blob left unfinished, those of
// blocks in place too.
func TestTheKeeperAnswersReadsOfBlocksInPlace(t *testing.T) {
	if root := os.Getenv("COWVOL_PLACED_ROOT"); root != "" {
		holdBlobAndWait(root, os.Getenv("COWVOL_BLOB_KEEPER"), os.Getenv("COWVOL_BLOB_LAYER"), os.Getenv("COWVOL_BLOB"), "missing")
		return
	}
	ix := buildIndexed(t, func(layer string) {
		for _, name := range []string{"a", "b", "c", "missing"} {
			// Over a block each, so that a read spans blocks and words of
			// the bitmap differ by file.
			data := bytes.Repeat([]byte("the bytes of "+name+" "), 1000)
			require.NoError(t, os.WriteFile(filepath.Join(layer, name), data, 0o644))
		}
	})
	sock := serveKeeper(t, time.Minute)
	plugin := startBlobHolder(t, ix, sock, "TestTheKeeperAnswersReadsOfBlocksInPlace", "COWVOL_PLACED_ROOT")
	ix.mount(t)
	read := readsOf(ix.mnt, func(name string) []byte { return bytes.Repeat([]byte("the bytes of "+name+" "), 1000) })
	require.NoError(t, plugin.Process.Signal(syscall.SIGSTOP))
	for _, name := range []string{"a", "b"} {
		select {
		case err := <-read(name):
			require.NoError(t, err, "bytes in place read whole, while the plugin is stopped")
		case <-time.After(10 * time.Second):
			t.Fatalf("a read of %s, in place, waited for the stopped plugin", name)
		}
	}
	held := read("missing")
	select {
	case err := <-held:
		t.Fatalf("a read of what is not in place went on without the plugin: %v", err)
	case <-time.After(500 * time.Millisecond):
	}

	require.NoError(t, plugin.Process.Kill())
	_ = plugin.Wait()
	g, err := OpenKept(ix.fs, time.Minute, Kept{Socket: sock, Unfinished: func() []string { return []string{ix.work} }})
	require.NoError(t, err)
	defer func() { require.NoError(t, g.Close()) }()
	inPlace := read("c") // (not read yet: no page of it in the index's cache)
	for _, r := range []<-chan error{held, inPlace} {
		select {
		case err := <-r:
			require.ErrorIs(t, err, syscall.EIO, "a blob left unfinished gives EIO, never its holes")
		case <-time.After(10 * time.Second):
			t.Fatal("the next plugin left a reader of a blob left unfinished held")
		}
	}
}

// A blob whose reads are recorded (RecordReaches) has every read come to
// the plugin, the keeper's answers included: what is in place is noted as
// what is not.
func TestRecordedReadsOfABlobPassTheKeeper(t *testing.T) {
	ix := buildIndexed(t, func(layer string) {
		for _, name := range []string{"a", "b"} {
			require.NoError(t, os.WriteFile(filepath.Join(layer, name), bytes.Repeat([]byte(name), 9000), 0o644))
		}
	})
	sock := serveKeeper(t, time.Minute)
	g, err := OpenKept(ix.fs, time.Minute, Kept{Socket: sock})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, g.Close()) })
	require.True(t, g.keeper.Load().answersPlaced)
	ix.hold(t, g, nil)
	require.True(t, ix.blob.shared.Load(), "the keeper is told which blocks are in place")
	require.NoError(t, ix.blob.Offer("a", func(w io.WriterAt) error {
		return ix.layerBytes(context.Background(), ix.layout.Extent(ix.layout.Lookup("a")), w)
	}))
	ix.blob.RecordReaches()
	require.False(t, ix.blob.shared.Load())
	g.Settle() // (every message to the keeper before it is taken)
	ix.mount(t)
	for _, name := range []string{"a", "b"} {
		data, err := os.ReadFile(filepath.Join(ix.mnt, name))
		require.NoError(t, err)
		require.Equal(t, bytes.Repeat([]byte(name), 9000), data)
	}
	require.Equal(t, []string{"a", "b"}, ix.blob.Reached(), "the read of a, in place, was seen")
}

// The bytes an index's Entries carried (a stream's small files) are
// written into the blob behind its mark, not before OpenBlob returns: a
// reader that reaches one first waits for it, none is fetched, and the
// rest is fetched as ever. A write that fails (a full disk) fails the
// blob: the readers of what is not in place get EIO, never the blob's
// holes.
func TestBlobWritesCarriedBytesBehindItsReaders(t *testing.T) {
	const carried = 3000
	small := func(i int) []byte { return []byte(strings.Repeat(fmt.Sprintf("small file %d;", i), 1+i%7)) }
	big := random(t, 1<<20)
	for _, tc := range []struct {
		name     string
		diskFull bool
	}{{"written", false}, {"disk full", true}} {
		t.Run(tc.name, func(t *testing.T) {
			testfs.Need(t)
			fs := testfs.Mount(t, testfs.XFS, 512<<20)
			if err := Supported(fs); err != nil {
				t.Skip(err)
			}
			work, mnt := filepath.Join(fs, "work"), filepath.Join(fs, "mnt")
			require.NoError(t, os.Mkdir(work, 0o755))
			require.NoError(t, os.Mkdir(mnt, 0o755))
			img, err := os.Create(filepath.Join(work, "index"))
			require.NoError(t, err)
			w, err := index.NewWriter(img, index.Options{}, index.Entry{Stat: unix.Stat_t{Mode: unix.S_IFDIR | 0o755}})
			require.NoError(t, err)
			file := func(name string, data []byte, carried bool) index.Entry {
				e := index.Entry{Name: name, Stat: unix.Stat_t{Mode: unix.S_IFREG | 0o644, Size: int64(len(data))}, Sum: filesum.Sum(sha256.Sum256(data))}
				if carried {
					e.Data = data
				}
				return e
			}
			require.NoError(t, w.Add(file("big", big, false)))
			for i := range carried {
				require.NoError(t, w.Add(file(fmt.Sprintf("f%04d", i), small(i), true)))
			}
			layout, err := w.Close()
			require.NoError(t, errors.Join(err, img.Close()))
			t.Cleanup(func() { require.NoError(t, layout.Close()) })
			blobPath := filepath.Join(work, "blob")
			f, err := os.Create(blobPath)
			require.NoError(t, err)
			require.NoError(t, errors.Join(f.Truncate(layout.Size), f.Close()))
			if tc.diskFull {
				var st unix.Statfs_t
				require.NoError(t, unix.Statfs(fs, &st))
				filler, err := os.Create(filepath.Join(fs, "filler"))
				require.NoError(t, err)
				defer filler.Close()
				require.NoError(t, unix.Fallocate(int(filler.Fd()), 0, 0, int64(st.Bavail)*st.Bsize-(1<<20)))
			}

			g, err := Open(fs, time.Minute)
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, g.Close()) })
			var mu sync.Mutex
			fetched := map[string]int{}
			blob, err := g.OpenBlob(blobPath, layout, func(_ context.Context, e index.Extent, w io.WriterAt) error {
				mu.Lock()
				fetched[e.Path]++
				mu.Unlock()
				_, err := w.WriteAt(big, 0)
				return err
			}, nil)
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, blob.Close()) })
			err = overlay.MountIndex(filepath.Join(work, "index"), blobPath, mnt)
			if errors.Is(err, overlay.ErrNoIndexMounts) {
				t.Skip(err)
			}
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, unix.Unmount(mnt, unix.MNT_DETACH)) })

			last := fmt.Sprintf("f%04d", carried-1)
			if tc.diskFull {
				_, err := os.ReadFile(filepath.Join(mnt, last))
				require.ErrorIs(t, err, syscall.EIO, "not in place: never the blob's hole")
				<-blob.Done()
				require.ErrorIs(t, blob.Err(), syscall.ENOSPC)
				return
			}
			for i := carried - 1; i >= 0; i-- { // the last written first, which a reader may reach before it is
				data, err := os.ReadFile(filepath.Join(mnt, fmt.Sprintf("f%04d", i)))
				require.NoError(t, err)
				require.Equal(t, small(i), data)
			}
			data, err := os.ReadFile(filepath.Join(mnt, "big"))
			require.NoError(t, err)
			require.Equal(t, big, data)
			<-blob.Done()
			require.NoError(t, blob.Err())
			mu.Lock()
			defer mu.Unlock()
			require.Equal(t, map[string]int{"big": 1}, fetched, "the carried bytes are written, not fetched")
		})
	}
}

// A pod with a user namespace of its own (hostUsers: false) has its volumes
// idmapped by its runtime, which cannot idmap an overlay mount, so an
// overlay node makes its views with the reflink backend: a read-only view
// of an index is a bind of the index's mount, which the runtime idmaps, and
// a writable one a tree of its own copied through the mount (nothing clones
// out of EROFS). The engine makes them once the index is whole (such a
// view needs its whole chain); made over one still filling, as here, each
// extent is fetched once as the copy or the reader reaches it. Both hold
// the layer's tree, and the runtime can idmap both.
func TestIdmappedViewsOfAFillingIndex(t *testing.T) {
	for _, readOnly := range []bool{true, false} {
		t.Run(fmt.Sprintf("read-only=%t", readOnly), func(t *testing.T) {
			ix := newIndexed(t, func(layer string) { layerTree(t, layer) }, nil)
			b, err := overlay.New(overlay.KindReflink, overlay.NewSysMounter(), nil)
			require.NoError(t, err)
			s := overlay.Spec{Dir: filepath.Join(ix.fs, "view"), Target: filepath.Join(ix.fs, "target"), Lowers: []string{ix.mnt},
				Attrs: overlay.Attrs{ReadOnly: readOnly}, Idmapped: true}
			require.NoError(t, os.Mkdir(s.Target, 0o755))
			require.NoError(t, b.Prepare(t.Context(), s))
			t.Cleanup(func() { require.NoError(t, overlay.Unmount(overlay.NewSysMounter(), s)) }) // before the index's
			require.NoError(t, testfs.Idmap(t, s.Target), "the runtime can idmap the view")

			want := testfs.Describe(t, ix.layer)
			want["cap"] = withoutCaps(t, want["cap"])
			require.Equal(t, want, testfs.Describe(t, s.Target))
			for i := range ix.layout.Len() {
				e := ix.layout.Extent(i)
				require.LessOrEqual(t, ix.fetches(e.Path), 1, "%s fetched again", e.Path)
			}
			if !readOnly {
				require.NoError(t, os.WriteFile(filepath.Join(s.Target, "new"), []byte("written"), 0o644))
				_, err := os.Lstat(filepath.Join(ix.mnt, "new"))
				require.ErrorIs(t, err, os.ErrNotExist, "a write lands in the view's own tree")
			}
		})
	}
}
