package fill

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
)

// stubbed is a layer of stubs on XFS, the source files they stand for, and
// an overlay mount over the stubs, as a step's view of a lazy input.
type stubbed struct {
	src, layer, merged string
	files              map[string][]byte
}

// newStubbed makes files (name → data; mode 0755 where the name starts
// with "x-") in a source dir, and stubs of them.
func newStubbed(t *testing.T, files map[string][]byte) *stubbed {
	t.Helper()
	return newStubbedOn(t, testfs.XFS, files)
}

// newStubbedOn is newStubbed on a filesystem of kind.
func newStubbedOn(t *testing.T, kind testfs.Kind, files map[string][]byte) *stubbed {
	t.Helper()
	testfs.Need(t, "mkfs."+string(kind))
	mnt := testfs.Mount(t, kind, 512<<20)
	s := &stubbed{src: filepath.Join(mnt, "src"), layer: filepath.Join(mnt, "layer"), merged: filepath.Join(mnt, "merged"), files: files}
	for _, d := range []string{s.src, s.layer, s.merged, filepath.Join(mnt, "upper"), filepath.Join(mnt, "work")} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	for name, data := range files {
		mode := os.FileMode(0o644)
		if strings.HasPrefix(name, "x-") {
			mode = 0o755
		}
		require.NoError(t, os.WriteFile(filepath.Join(s.src, name), data, mode))
		f, err := os.OpenFile(filepath.Join(s.layer, name), os.O_CREATE|os.O_WRONLY, mode)
		require.NoError(t, err)
		require.NoError(t, f.Truncate(int64(len(data))))
		require.NoError(t, f.Close())
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s/upper,workdir=%s/work", s.layer, mnt, mnt)
	require.NoError(t, unix.Mount("overlay", s.merged, "overlay", 0, opts))
	t.Cleanup(func() { _ = unix.Unmount(s.merged, unix.MNT_DETACH) })
	return s
}

// fetcher serves the source files, counting fetches by file; gate, if
// set, is waited on before each.
type fetcher struct {
	src     string
	mu      sync.Mutex
	fetched []string
	gate    chan struct{}
	fail    error
}

func (f *fetcher) fetch(ctx context.Context, rel string, size int64, w io.WriterAt) error {
	f.mu.Lock()
	f.fetched = append(f.fetched, rel)
	f.mu.Unlock()
	if f.gate != nil {
		select {
		case <-f.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if f.fail != nil {
		return f.fail
	}
	data, err := os.ReadFile(filepath.Join(f.src, rel))
	if err != nil {
		return err
	}
	if int64(len(data)) != size {
		return fmt.Errorf("size %d, want %d", len(data), size)
	}
	_, err = w.WriteAt(data, 0)
	return err
}

// all is every fetch so far, in order.
func (f *fetcher) all() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.fetched)
}

func (f *fetcher) count(rel string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, r := range f.fetched {
		if r == rel {
			n++
		}
	}
	return n
}

// hold opens a group over s's filesystem and adds every stub to a layer.
func hold(t *testing.T, s *stubbed, fetch FetchFunc, stall time.Duration) (*Group, *Layer) {
	return holdWith(t, s, fetch, nil, stall)
}

// holdWith is hold with a read-ahead.
func holdWith(t *testing.T, s *stubbed, fetch FetchFunc, many FetchManyFunc, stall time.Duration) (*Group, *Layer) {
	t.Helper()
	g, err := Open(filepath.Dir(s.layer), stall)
	require.NoError(t, err)
	t.Cleanup(func() { _ = g.Close() })
	l, err := g.NewLayer(s.layer, fetch, many)
	require.NoError(t, err)
	for place, name := range slices.Sorted(maps.Keys(s.files)) {
		f, err := os.Open(filepath.Join(s.layer, name))
		require.NoError(t, err)
		require.NoError(t, l.Add(int(f.Fd()), stubOf(t, f, Stub{Rel: name, Size: int64(len(s.files[name])), Place: place})))
		require.NoError(t, f.Close())
	}
	l.Seal()
	return g, l
}

// stubOf is s with the identity and times of the stub open as f, as its
// maker would give them.
func stubOf(t *testing.T, f *os.File, s Stub) Stub {
	t.Helper()
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(int(f.Fd()), &st))
	s.Dev, s.Ino, s.Times = st.Dev, st.Ino, [2]unix.Timespec{st.Atim, st.Mtim}
	return s
}

func random(t *testing.T, n int) []byte {
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return b
}

func TestSupported(t *testing.T) {
	testfs.Need(t, "mkfs.xfs")
	require.NoError(t, Supported(testfs.Mount(t, testfs.XFS, 300<<20)))
	tmp := t.TempDir()
	require.NoError(t, unix.Mount("tmpfs", tmp, "tmpfs", 0, ""))
	t.Cleanup(func() { _ = unix.Unmount(tmp, unix.MNT_DETACH) })
	err := Supported(tmp)
	require.Error(t, err, "tmpfs allows no pre-content events")
	require.Contains(t, err.Error(), "allows no pre-content events")
}

// Readers through an overlay see the source's bytes, each file fetched
// once however many read it at once, and a filled file is not fetched again.
func TestReadersWaitForTheirFile(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"big": random(t, 8<<20), "small": []byte("hello\n"), "untouched": random(t, 1<<20)})
	src := &fetcher{src: s.src, gate: make(chan struct{})}
	_, l := hold(t, s, src.fetch, time.Minute)
	before, err := os.Stat(filepath.Join(s.layer, "big"))
	require.NoError(t, err)
	stubTime := before.ModTime()
	time.Sleep(20 * time.Millisecond) // a fill's writes would show a later time

	var wg sync.WaitGroup
	got := make([][]byte, 4)
	for i := range got {
		wg.Go(func() {
			var err error
			got[i], err = os.ReadFile(filepath.Join(s.merged, "big"))
			require.NoError(t, err)
		})
	}
	require.Eventually(t, func() bool { return src.count("big") == 1 }, 10*time.Second, 5*time.Millisecond)
	time.Sleep(50 * time.Millisecond) // the readers are held, not reading zeros
	for i := range got {
		require.Nil(t, got[i], "a reader went on before its file was filled")
	}
	close(src.gate)
	wg.Wait()
	for i := range got {
		require.True(t, bytes.Equal(s.files["big"], got[i]), "reader %d read other bytes", i)
	}
	require.Equal(t, 1, src.count("big"), "concurrent readers share one fetch")

	small, err := os.ReadFile(filepath.Join(s.merged, "small"))
	require.NoError(t, err)
	require.Equal(t, "hello\n", string(small))
	_, err = os.ReadFile(filepath.Join(s.merged, "big"))
	require.NoError(t, err)
	require.Equal(t, 1, src.count("big"), "a filled file is read straight through")
	stub, err := os.Stat(filepath.Join(s.layer, "big"))
	require.NoError(t, err)
	require.Equal(t, stubTime, stub.ModTime(), "filling keeps the stub's mtime, not the time of the fill")
	require.Zero(t, src.count("untouched"), "nothing is fetched that no one read")
	select {
	case <-l.Done():
		t.Fatal("the layer is done with a file still a stub")
	default:
	}
}

// A fill on XFS opens the stub by its handle, whose writes change none of
// its times: the mtime stands without being put back, and the ctime is
// the stub's (a tool that caches stats, as git's index does, sees no
// change). Elsewhere a fill puts the times back after its writes.
func TestAFillOnXFSKeepsTheStubsTimes(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"small": []byte("hello\n"), "big": random(t, 4<<20)})
	g, l := hold(t, s, (&fetcher{src: s.src}).fetch, time.Minute)
	require.True(t, g.byHandle.Load(), "fills of stubs on XFS open them by handle")
	stat := func(name string) unix.Stat_t {
		var st unix.Stat_t
		require.NoError(t, unix.Stat(filepath.Join(s.layer, name), &st))
		return st
	}
	before := map[string]unix.Stat_t{"small": stat("small"), "big": stat("big")}
	time.Sleep(20 * time.Millisecond) // a write's times would be later
	for _, name := range []string{"small", "big"} {
		require.NoError(t, l.Offer(name, func(w io.WriterAt) error { _, err := w.WriteAt(s.files[name], 0); return err }))
	}
	g.putting.Wait()
	for _, name := range []string{"small", "big"} {
		got, err := os.ReadFile(filepath.Join(s.merged, name))
		require.NoError(t, err)
		require.True(t, bytes.Equal(s.files[name], got), "%s is filled", name)
		after := stat(name)
		require.Equal(t, before[name].Mtim, after.Mtim, "%s's mtime", name)
		require.Equal(t, before[name].Ctim, after.Ctim, "%s's ctime", name)
	}
}

// A fill writes into the stub it marked and nothing else: a file put in a
// stub's place keeps its bytes, whether fills open stubs by handle or by
// name.
func TestAFillWritesOnlyIntoItsStub(t *testing.T) {
	for _, tc := range []struct {
		name     string
		byHandle bool
	}{{"by handle", true}, {"by name", false}} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStubbed(t, map[string][]byte{"a": random(t, 4096)})
			g, l := hold(t, s, (&fetcher{src: s.src}).fetch, time.Minute)
			g.byHandle.Store(tc.byHandle)
			stub := filepath.Join(s.layer, "a")
			require.NoError(t, os.Remove(stub))
			require.NoError(t, os.WriteFile(stub, []byte("not the stub"), 0o644))
			_ = l.Offer("a", func(w io.WriterAt) error { _, err := w.WriteAt(s.files["a"], 0); return err })
			g.putting.Wait()
			got, err := os.ReadFile(stub)
			require.NoError(t, err)
			require.Equal(t, "not the stub", string(got))
		})
	}
}

// A fill puts back the file capabilities of a stub that may carry them,
// which the write of its data drops; a stub said to carry none is not
// looked at (the kernel drops what it had, as for any write).
func TestFillPutsCapabilitiesBack(t *testing.T) {
	// VFS_CAP_REVISION_2, effective, CAP_NET_BIND_SERVICE.
	netBindService := []byte{0x01, 0, 0, 0x02, 0x00, 0x04, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	for _, tc := range []struct {
		name     string
		caps     bool
		wantCaps []byte
	}{
		{name: "may carry capabilities", caps: true, wantCaps: netBindService},
		{name: "said to carry none", caps: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStubbed(t, map[string][]byte{"x-bind": random(t, 4096)})
			stub := filepath.Join(s.layer, "x-bind")
			require.NoError(t, unix.Setxattr(stub, "security.capability", netBindService, 0))
			src := &fetcher{src: s.src}
			g, err := Open(filepath.Dir(s.layer), time.Minute)
			require.NoError(t, err)
			t.Cleanup(func() { _ = g.Close() })
			l, err := g.NewLayer(s.layer, src.fetch, nil)
			require.NoError(t, err)
			f, err := os.Open(stub)
			require.NoError(t, err)
			require.NoError(t, l.Add(int(f.Fd()), stubOf(t, f, Stub{Rel: "x-bind", Size: 4096, Caps: tc.caps})))
			require.NoError(t, f.Close())
			l.Seal()

			got, err := os.ReadFile(filepath.Join(s.merged, "x-bind"))
			require.NoError(t, err)
			require.Equal(t, s.files["x-bind"], got)
			buf := make([]byte, 64)
			n, err := unix.Getxattr(stub, "security.capability", buf)
			if tc.wantCaps == nil {
				require.ErrorIs(t, err, unix.ENODATA)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.wantCaps, buf[:n])
		})
	}
}

// A program run from a stub, and a file mapped through the overlay (which
// raises no event of its own), read the real bytes: files are filled when
// they are opened.
func TestExecAndMmapThroughAnOverlay(t *testing.T) {
	if name := os.Getenv("COWVOL_MAP_FILE"); name != "" {
		mapAndSum(name)
		return
	}
	truePath, err := exec.LookPath("true")
	require.NoError(t, err)
	prog, err := os.ReadFile(truePath)
	require.NoError(t, err)
	s := newStubbed(t, map[string][]byte{"x-true": prog, "mapped": random(t, 3<<20)})
	src := &fetcher{src: s.src}
	hold(t, s, src.fetch, time.Minute)

	out, err := exec.Command(filepath.Join(s.merged, "x-true")).CombinedOutput()
	require.NoError(t, err, "running a program from a lazy input: %s", out)
	require.Equal(t, 1, src.count("x-true"))

	// Mapped in another process (a run with -race hung when this one
	// mapped it).
	require.Equal(t, fmt.Sprintf("%x", sha256.Sum256(s.files["mapped"])), mappedSum(t, "TestExecAndMmapThroughAnOverlay", filepath.Join(s.merged, "mapped")),
		"a mapping of a lazy file reads its data")
}

// A file that cannot be fetched answers EIO, now and on later opens, and
// fails the layer.
func TestAFailedFetchAnswersEIO(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"a": random(t, 4096), "b": random(t, 4096)})
	src := &fetcher{src: s.src, fail: errors.New("no holder has it")}
	_, l := hold(t, s, src.fetch, time.Minute)

	for range 2 {
		_, err := os.ReadFile(filepath.Join(s.merged, "a"))
		require.ErrorIs(t, err, syscall.EIO)
	}
	<-l.Done()
	require.ErrorContains(t, l.Err(), "no holder has it")
	_, err := os.ReadFile(filepath.Join(s.merged, "b"))
	require.ErrorIs(t, err, syscall.EIO, "a failed layer never serves holes")
}

// A holder that stops sending fails the reader after the stall time, and a
// failed layer answers its held readers at once.
func TestStalledAndFailedLayersReleaseReaders(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"a": random(t, 4096), "b": random(t, 4096)})
	src := &fetcher{src: s.src, gate: make(chan struct{})} // never opened
	_, l := hold(t, s, src.fetch, 300*time.Millisecond)
	start := time.Now()
	_, err := os.ReadFile(filepath.Join(s.merged, "a"))
	require.ErrorIs(t, err, syscall.EIO)
	require.Less(t, time.Since(start), 10*time.Second)
	require.ErrorContains(t, l.Err(), "no data for")

	s2 := newStubbed(t, map[string][]byte{"a": random(t, 4096)})
	src2 := &fetcher{src: s2.src, gate: make(chan struct{})}
	_, l2 := hold(t, s2, src2.fetch, time.Hour)
	done := make(chan error, 1)
	go func() { _, err := os.ReadFile(filepath.Join(s2.merged, "a")); done <- err }()
	require.Eventually(t, func() bool { return src2.count("a") == 1 }, 10*time.Second, 5*time.Millisecond)
	l2.Fail(errors.New("the pull was cancelled"))
	select {
	case err := <-done:
		require.ErrorIs(t, err, syscall.EIO)
	case <-time.After(10 * time.Second):
		t.Fatal("a failed layer left its reader held")
	}
}

// Prefetch fills everything, the recorded order first; then the layer is
// done and its files are read with no fetch.
func TestPrefetchFillsInOrder(t *testing.T) {
	files := map[string][]byte{}
	for i := range 20 {
		files[fmt.Sprintf("f%02d", i)] = random(t, 64<<10)
	}
	s := newStubbed(t, files)
	src := &fetcher{src: s.src}
	_, l := hold(t, s, src.fetch, time.Minute)
	l.Prefetch([]string{"f17", "f03", "f11"}, 1)
	select {
	case <-l.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("prefetch did not finish")
	}
	require.NoError(t, l.Err())
	require.Equal(t, []string{"f17", "f03", "f11"}, src.all()[:3])
	require.Len(t, src.all(), 20)
	for name, data := range files {
		got, err := os.ReadFile(filepath.Join(s.merged, name))
		require.NoError(t, err)
		require.True(t, bytes.Equal(data, got), name)
	}
	require.Len(t, src.all(), 20, "a filled layer is read with no fetch")
}

// A reader held by a plugin that is SIGKILLed is never held for ever: the
// kernel lets it go on when the group's process dies. It then reads the
// stub's holes (this kernel answers FAN_ALLOW for a dead group), which is
// why a restarted plugin fails every layer that was filling, and a step
// over one captures nothing ready.
func TestAKilledHolderReleasesItsReaders(t *testing.T) {
	if os.Getenv("COWVOL_FILL_CHILD") != "" {
		g, err := Open(os.Getenv("COWVOL_FILL_ROOT"), time.Hour)
		if err != nil {
			os.Exit(3)
		}
		l, err := g.NewLayer(filepath.Dir(os.Getenv("COWVOL_FILL_STUB")),
			func(ctx context.Context, _ string, _ int64, _ io.WriterAt) error { <-ctx.Done(); return ctx.Err() }, nil)
		if err != nil {
			os.Exit(5)
		}
		f, _ := os.Open(os.Getenv("COWVOL_FILL_STUB"))
		if err := l.Add(int(f.Fd()), stubOf(t, f, Stub{Rel: "a", Size: 4096})); err != nil {
			os.Exit(4)
		}
		fmt.Println("holding")
		select {}
	}
	s := newStubbed(t, map[string][]byte{"a": random(t, 4096)})
	child := exec.Command(os.Args[0], "-test.run", "^TestAKilledHolderReleasesItsReaders$")
	child.Env = append(os.Environ(), "COWVOL_FILL_CHILD=1", "COWVOL_FILL_ROOT="+filepath.Dir(s.layer),
		"COWVOL_FILL_STUB="+filepath.Join(s.layer, "a"))
	out, err := child.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, child.Start())
	buf := make([]byte, 7)
	_, err = io.ReadFull(out, buf)
	require.NoError(t, err, "the child never held the stub")

	var reads atomic.Int32
	done := make(chan error, 1)
	go func() {
		_, err := os.ReadFile(filepath.Join(s.merged, "a"))
		reads.Add(1)
		done <- err
	}()
	time.Sleep(200 * time.Millisecond)
	require.Zero(t, reads.Load(), "the reader is held")
	require.NoError(t, child.Process.Kill())
	_ = child.Wait()
	select {
	case err := <-done:
		t.Logf("after its holder was killed the reader went on (error: %v)", err)
	case <-time.After(10 * time.Second):
		t.Fatal("a reader stayed held after its holder died")
	}
}

// While a reader is held for a fetch of its own, the stream of its layer
// waits: it would take the link and the CPUs from the fetch the step is
// waiting for. Once the fetch is done, the stream goes on. Another layer's
// stream (another namespace's input, say) does not wait: a reader must not
// be able to stall fills that are not its own.
func TestReadersGoFirst(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"wanted": random(t, 8192), "streamed": random(t, 8192)})
	src := &fetcher{src: s.src, gate: make(chan struct{})}
	g, l := hold(t, s, src.fetch, time.Minute)
	otherData := random(t, 8192)
	other := otherLayer(t, g, filepath.Join(filepath.Dir(s.layer), "other"), "x", int64(len(otherData)))

	read := make(chan error, 1)
	go func() {
		_, err := os.ReadFile(filepath.Join(s.merged, "wanted"))
		read <- err
	}()
	require.Eventually(t, func() bool { return src.count("wanted") == 1 }, 10*time.Second, time.Millisecond, "the reader's fetch started")

	otherOffered := make(chan error, 1)
	go func() {
		otherOffered <- other.Offer("x", func(w io.WriterAt) error { _, err := w.WriteAt(otherData, 0); return err })
	}()
	select {
	case err := <-otherOffered:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("another layer's stream waited for this layer's reader")
	}
	var written atomic.Bool
	offered := make(chan error, 1)
	go func() {
		offered <- l.Offer("streamed", func(w io.WriterAt) error {
			written.Store(true)
			_, err := w.WriteAt(s.files["streamed"], 0)
			return err
		})
	}()
	time.Sleep(200 * time.Millisecond)
	require.False(t, written.Load(), "the stream went on while a reader waited for its own fetch")

	close(src.gate)
	require.NoError(t, <-read)
	require.NoError(t, <-offered)
	require.True(t, written.Load(), "the stream goes on once the reader's fetch is done")
	<-l.Done()
	require.NoError(t, l.Err())
	<-other.Done()
	require.NoError(t, other.Err())
}

// While a stream of the layer runs, a reader of a file the stream is about
// to bring waits for it, with no fetch of its own; a file far ahead of the
// stream is fetched; a file the stream does not bring in streamWaitMax
// (a stalled stream) is fetched; and a reader still waiting when the
// stream ends is fetched for then.
func TestReadersWaitForTheStream(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"next": random(t, 8192), "soon": random(t, 8192), "stalled": random(t, 8192),
		"big": random(t, streamNext+(1<<20)), "far": random(t, 8192)})
	src := &fetcher{src: s.src}
	_, l := hold(t, s, src.fetch, time.Minute)
	l.Streaming([]string{"next", "soon", "stalled", "big", "far"}) // the order the stream brings them in

	read := func(name string) chan error {
		done := make(chan error, 1)
		go func() {
			got, err := os.ReadFile(filepath.Join(s.merged, name))
			if err == nil && !bytes.Equal(got, s.files[name]) {
				err = fmt.Errorf("%s read other bytes than its source's", name)
			}
			done <- err
		}()
		return done
	}
	offer := func(name string) {
		require.NoError(t, l.Offer(name, func(w io.WriterAt) error { _, err := w.WriteAt(s.files[name], 0); return err }))
	}
	waits := func(name string, done chan error, d time.Duration) {
		t.Helper()
		select {
		case err := <-done:
			t.Fatalf("the reader of %s, which the stream brings next, went on before it did: %v", name, err)
		case <-time.After(d):
		}
		require.Zero(t, src.count(name), "%s, which the stream brings next, is not fetched on its own", name)
	}

	next := read("next")
	waits("next", next, streamWaitMax/2)
	offer("next")
	require.NoError(t, <-next)

	require.NoError(t, <-read("far"), "a file far ahead of the stream is fetched")
	require.Equal(t, 1, src.count("far"))

	stalled := read("stalled")
	waits("stalled", stalled, streamWaitMax/2)
	require.NoError(t, <-stalled, "fetched once the stream did not bring it in time")
	require.Equal(t, 1, src.count("stalled"))

	soon := read("soon")
	waits("soon", soon, streamWaitMax/4)
	l.StreamEnded() // broke off before it brought soon
	require.NoError(t, <-soon)
	require.Equal(t, 1, src.count("soon"), "a reader stranded by the stream's end is fetched for")

	require.NoError(t, <-read("big"), "with no stream, a reader fetches")
	require.Equal(t, 1, src.count("big"))
	require.Zero(t, src.count("next"))
	<-l.Done()
	require.NoError(t, l.Err())
}

// otherLayer adds a second layer to g: one stub, rel, of size bytes, in
// dir (on g's filesystem), which nothing fetches.
func otherLayer(t *testing.T, g *Group, dir, rel string, size int64) *Layer {
	t.Helper()
	require.NoError(t, os.MkdirAll(dir, 0o755))
	f, err := os.Create(filepath.Join(dir, rel))
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(size))
	l, err := g.NewLayer(dir, func(context.Context, string, int64, io.WriterAt) error {
		return errors.New("not fetched: offered")
	}, nil)
	require.NoError(t, err)
	require.NoError(t, l.Add(int(f.Fd()), stubOf(t, f, Stub{Rel: rel, Size: size})))
	l.Seal()
	return l
}

// A stream of the layer offers its files: those not filled are filled from
// it, those filled are skipped, and a file whose offer breaks off is
// fetched alone.
func TestOffersFillWhatNoOneAskedFor(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"read": random(t, 8192), "offered": random(t, 8192), "broken": random(t, 8192)})
	src := &fetcher{src: s.src}
	_, l := hold(t, s, src.fetch, time.Minute)
	_, err := os.ReadFile(filepath.Join(s.merged, "read"))
	require.NoError(t, err)

	offer := func(name string, fail bool) (called bool) {
		require.NoError(t, l.Offer(name, func(w io.WriterAt) error {
			called = true
			if fail {
				_, _ = w.WriteAt([]byte("partial"), 0)
				return errors.New("the stream broke")
			}
			_, err := w.WriteAt(s.files[name], 0)
			return err
		}))
		return called
	}
	require.False(t, offer("read", false), "a filled file is not written again")
	require.True(t, offer("offered", false))
	require.Zero(t, src.count("offered"), "an offered file needs no fetch")
	require.True(t, offer("broken", true))
	require.Equal(t, 1, src.count("broken"), "a broken offer falls back to a fetch")
	require.False(t, offer("nope", false), "a name that is no stub is ignored")
	<-l.Done()
	require.NoError(t, l.Err())
	for name, data := range s.files {
		got, err := os.ReadFile(filepath.Join(s.merged, name))
		require.NoError(t, err)
		require.True(t, bytes.Equal(data, got), name)
	}
}

// fetchMany serves the source files asked for, in one call, counting
// calls; it stops after stopAfter files if that is set.
func (f *fetcher) fetchMany(calls *atomic.Int32, stopAfter int) FetchManyFunc {
	return func(ctx context.Context, rels []string, each func(rel string, write func(w io.WriterAt) error) error) error {
		calls.Add(1)
		for i, rel := range rels {
			if stopAfter > 0 && i == stopAfter {
				return errors.New("the holder went away")
			}
			data, err := os.ReadFile(filepath.Join(f.src, rel))
			if err != nil {
				return err
			}
			if err := each(rel, func(w io.WriterAt) error { _, err := w.WriteAt(data, 0); return err }); err != nil {
				return err
			}
		}
		return nil
	}
}

// A reader of one file of a dir brings the next ones with it in one
// request. Read in order, the read-ahead's window grows and a few requests
// bring the dir; read here and there, it shrinks and fetches little more
// than what is read; cut short, what it did not bring comes file by file.
// Every byte is right.
func TestReadAhead(t *testing.T) {
	files := map[string][]byte{}
	for i := range 64 {
		files[fmt.Sprintf("f%02d", i)] = random(t, 4096)
	}
	readAll := func(t *testing.T, s *stubbed, order []*file, every int) {
		for i, f := range order {
			if i%every != 0 {
				continue
			}
			got, err := os.ReadFile(filepath.Join(s.merged, f.rel))
			require.NoError(t, err)
			require.True(t, bytes.Equal(files[f.rel], got), f.rel)
		}
	}

	t.Run("in order", func(t *testing.T) {
		s := newStubbed(t, files)
		src := &fetcher{src: s.src}
		var calls atomic.Int32
		_, l := holdWith(t, s, src.fetch, src.fetchMany(&calls, 0), time.Minute)
		readAll(t, s, l.dirs["."], 1)
		require.LessOrEqual(t, calls.Load(), int32(5), "the window grew: a few requests brought 64 files")
		require.Empty(t, src.all(), "no file needed a fetch of its own")
		<-l.Done()
	})
	t.Run("here and there", func(t *testing.T) {
		s := newStubbed(t, files)
		src := &fetcher{src: s.src}
		var calls atomic.Int32
		var brought atomic.Int32
		many := src.fetchMany(&calls, 0)
		_, l := holdWith(t, s, src.fetch, func(ctx context.Context, rels []string, each func(string, func(io.WriterAt) error) error) error {
			brought.Add(int32(len(rels)))
			return many(ctx, rels, each)
		}, time.Minute)
		readAll(t, s, l.dirs["."], 8)
		require.Equal(t, int32(8), calls.Load(), "each of the 8 reads missed")
		require.Less(t, brought.Load(), int32(24), "the window shrank: %d files brought for 8 read", brought.Load())
	})
	t.Run("cut short", func(t *testing.T) {
		s := newStubbed(t, files)
		src := &fetcher{src: s.src}
		var calls atomic.Int32
		_, l := holdWith(t, s, src.fetch, src.fetchMany(&calls, 2), time.Minute)
		readAll(t, s, l.dirs["."], 1)
		<-l.Done()
		require.NoError(t, l.Err())
		require.NotEmpty(t, src.all(), "what the cut read-aheads did not bring came file by file")
	})
}

// A disk that fills up while a file is being filled answers its reader
// EIO and fails the layer; the stub never serves part of its data.
func TestDiskFullWhileFilling(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"big": random(t, 64<<20)})
	src := &fetcher{src: s.src}
	_, l := hold(t, s, src.fetch, time.Minute)
	var st unix.Statfs_t
	require.NoError(t, unix.Statfs(s.layer, &st))
	filler, err := os.Create(filepath.Join(filepath.Dir(s.layer), "filler"))
	require.NoError(t, err)
	defer filler.Close()
	require.NoError(t, unix.Fallocate(int(filler.Fd()), 0, 0, int64(st.Bavail)*st.Bsize-(8<<20)))

	for range 2 {
		_, err = os.ReadFile(filepath.Join(s.merged, "big"))
		require.ErrorIs(t, err, syscall.EIO)
	}
	<-l.Done()
	require.ErrorIs(t, l.Err(), syscall.ENOSPC)
}

// Reached is the order readers first opened files in, where the layer
// records it: a file filled before its first reader counts once that
// reader comes (who is not held: the filled file's pre-content mark went,
// and the layer's watcher notes the open), and one never read does not
// count. Where the layer does not record, nothing watches a filled file,
// so its readers go straight through, unseen. On each filesystem that
// allows pre-content events: the watcher knows files by the handles its
// events carry.
func TestReachedIsTheReadersOrder(t *testing.T) {
	for _, kind := range []testfs.Kind{testfs.XFS, testfs.Ext4, testfs.Btrfs} {
		for _, tc := range []struct {
			name                 string
			recording            bool
			wantBefore, wantLast []string
			watchMark            uint64 // the watcher's mark on the dir of a file filled before its reader
		}{
			{"recording", true, []string{"f5", "f2"}, []string{"f5", "f2", "f0"}, unix.FAN_OPEN | unix.FAN_EVENT_ON_CHILD},
			{"not recording", false, []string{"f5"}, []string{"f5"}, 0},
		} {
			t.Run(string(kind)+"/"+tc.name, func(t *testing.T) {
				files := map[string][]byte{}
				for i := range 8 {
					files[fmt.Sprintf("f%d", i)] = random(t, 4096)
				}
				s := newStubbedOn(t, kind, files)
				src := &fetcher{src: s.src}
				g, l := hold(t, s, src.fetch, time.Minute)
				if tc.recording {
					l.RecordReaches()
				}
				read := func(name string) {
					got, err := os.ReadFile(filepath.Join(s.merged, name))
					require.NoError(t, err)
					require.True(t, bytes.Equal(files[name], got), name)
				}
				offer := func(name string) {
					require.NoError(t, l.Offer(name, func(w io.WriterAt) error { _, err := w.WriteAt(files[name], 0); return err }))
				}
				read("f5") // its own fill
				offer("f2")
				offer("f7")
				g.putting.Wait() // an offer's write runs behind it: f2 is filled before its reader comes
				for _, name := range []string{"f2", "f7"} {
					require.Zero(t, markOf(t, g.fd, filepath.Join(s.layer, name)), "%s's pre-content mark went with its fill", name)
				}
				require.Equal(t, tc.watchMark, markOf(t, watcherFD(t, l), s.layer))
				read("f2")
				read("f5") // again
				require.Equal(t, tc.wantBefore, l.Reached(), "f7 was filled, never read")

				l.Prefetch(nil, 2)
				<-l.Done()
				require.NoError(t, l.Err())
				read("f0")
				require.Equal(t, tc.wantLast, l.Reached())
				require.Len(t, src.all(), 6, "offered files need no fetch")

				l.Release()
				l.watch.mu.Lock()
				require.Equal(t, -1, l.watch.fd, "its group closed, and its marks with it")
				l.watch.mu.Unlock()
			})
		}
	}
}

// Streaming names what the holder is to stream first: the recorded
// order's stubs, unless they are the first stubs by place already (the
// stream brings them first anyway).
func TestStreamingAsksForTheOrderFirst(t *testing.T) {
	files := map[string][]byte{}
	for i := range 8 {
		files[fmt.Sprintf("f%d", i)] = random(t, 512)
	}
	files["empty"] = nil // no stub: nothing to fill
	s := newStubbed(t, files)
	_, l := hold(t, s, (&fetcher{src: s.src}).fetch, time.Minute)
	for _, tc := range []struct {
		name  string
		order []string
		want  []string
	}{
		{"none", nil, nil},
		{"the first by place", []string{"f0", "f1", "f2"}, nil},
		{"all by place", []string{"f0", "f1", "f2", "f3", "f4", "f5", "f6", "f7"}, nil},
		{"names not stubs left out", []string{"nope", "f0", "empty", "f1"}, nil},
		{"another order", []string{"f1", "f0"}, []string{"f1", "f0"}},
		{"a gap", []string{"f0", "f2"}, []string{"f0", "f2"}},
		{"from the middle", []string{"f5", "f6", "f7"}, []string{"f5", "f6", "f7"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, l.Streaming(tc.order)) // what it asks for depends on the order alone
		})
	}
}

// A filled file's first reader is seen by whichever of its names (hard
// links) it opens, and recorded by the name it was added under.
func TestReachedThroughAHardLink(t *testing.T) {
	files := map[string][]byte{"a": random(t, 4096), "b": random(t, 4096)}
	s := newStubbed(t, files)
	require.NoError(t, unix.Unmount(s.merged, 0)) // the overlay sees the link once it is made
	require.NoError(t, os.Link(filepath.Join(s.layer, "a"), filepath.Join(s.layer, "z-link")))
	mnt := filepath.Dir(s.layer)
	require.NoError(t, unix.Mount("overlay", s.merged, "overlay", 0,
		fmt.Sprintf("lowerdir=%s,upperdir=%s/upper,workdir=%s/work", s.layer, mnt, mnt)))
	link, err := os.Open(filepath.Join(s.layer, "z-link")) // before it is marked: an open after would fill it
	require.NoError(t, err)
	defer link.Close()
	g, l := hold(t, s, (&fetcher{src: s.src}).fetch, time.Minute)
	require.NoError(t, l.Add(int(link.Fd()), stubOf(t, link, Stub{Rel: "z-link", Size: 4096, Place: 2})))
	l.RecordReaches()
	require.NoError(t, l.Offer("a", func(w io.WriterAt) error { _, err := w.WriteAt(files["a"], 0); return err }))
	g.putting.Wait()

	got, err := os.ReadFile(filepath.Join(s.merged, "z-link"))
	require.NoError(t, err)
	require.Equal(t, files["a"], got)
	require.Equal(t, []string{"a"}, l.Reached())
}

// A reader held for its file after another's open of a watched file
// returned reaches its file second, though the two are seen by two groups:
// the held one's event waits for the watcher's queue to be read.
func TestReachedKeepsOrderAcrossWatchedAndHeld(t *testing.T) {
	files := map[string][]byte{"a": random(t, 4096), "b": random(t, 4096)}
	s := newStubbed(t, files)
	g, l := hold(t, s, (&fetcher{src: s.src}).fetch, time.Minute)
	l.RecordReaches()
	require.NoError(t, l.Offer("a", func(w io.WriterAt) error { _, err := w.WriteAt(files["a"], 0); return err }))
	g.putting.Wait()

	l.watch.mu.Lock() // the watcher reads no event
	_, err := os.ReadFile(filepath.Join(s.merged, "a"))
	require.NoError(t, err)
	readB := make(chan error, 1)
	go func() {
		_, err := os.ReadFile(filepath.Join(s.merged, "b"))
		readB <- err
	}()
	time.Sleep(50 * time.Millisecond) // b's event is read, and waits
	l.watch.mu.Unlock()
	require.NoError(t, <-readB)
	require.Equal(t, []string{"a", "b"}, l.Reached())
}

// markOf is the event mask the mark of the fanotify group fd on the file
// at path has (0: none), as the kernel lists the group's marks. A stat
// raises no event.
func markOf(t *testing.T, fd int, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	require.NoError(t, unix.Stat(path, &st))
	info, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", fd))
	require.NoError(t, err)
	for _, line := range strings.Split(string(info), "\n") {
		var ino, sdev, mflags, mask uint64
		if n, _ := fmt.Sscanf(line, "fanotify ino:%x sdev:%x mflags:%x mask:%x", &ino, &sdev, &mflags, &mask); n == 4 && ino == st.Ino {
			return mask
		}
	}
	return 0
}

// watcherFD is the descriptor of l's watcher.
func watcherFD(t *testing.T, l *Layer) int {
	t.Helper()
	l.watch.mu.Lock()
	defer l.watch.mu.Unlock()
	require.GreaterOrEqual(t, l.watch.fd, 0)
	return l.watch.fd
}

// A watched file's reader pins no mount: its event carries a handle, not
// a descriptor open on the path the reader used, so the step's volume
// unmounts while the event is still queued. (A read-only step volume of one
// layer is a bind of the layer, so that path is the step's own mount.)
func TestWatchedReadersPinNoMount(t *testing.T) {
	files := map[string][]byte{}
	for i := range 50 {
		files[fmt.Sprintf("f%02d", i)] = random(t, 512)
	}
	s := newStubbed(t, files)
	g, l := hold(t, s, (&fetcher{src: s.src}).fetch, time.Minute)
	l.RecordReaches()
	for name, data := range files {
		require.NoError(t, l.Offer(name, func(w io.WriterAt) error { _, err := w.WriteAt(data, 0); return err }))
	}
	g.putting.Wait() // all filled and watched
	bind := filepath.Join(filepath.Dir(s.layer), "bind")
	require.NoError(t, os.MkdirAll(bind, 0o755))
	require.NoError(t, unix.Mount(s.layer, bind, "", unix.MS_BIND, ""))
	t.Cleanup(func() { _ = unix.Unmount(bind, unix.MNT_DETACH) })

	l.watch.mu.Lock() // the watcher reads no event
	for name := range files {
		_, err := os.ReadFile(filepath.Join(bind, name))
		require.NoError(t, err)
	}
	require.NoError(t, unix.Unmount(bind, 0), "a queued event holds the mount")
	l.watch.mu.Unlock()
	require.Len(t, l.Reached(), len(files))
}

// Settle returns once every answer under way is complete, its event's
// descriptor (opened on the reader's path: through the overlay) closed.
func TestSettleWaitsForAnswersUnderWay(t *testing.T) {
	s := newStubbed(t, map[string][]byte{"a": random(t, 64<<10), "b": random(t, 64<<10)})
	src := &fetcher{src: s.src}
	g, _ := hold(t, s, src.fetch, time.Minute)
	for _, name := range []string{"a", "b"} {
		data, err := os.ReadFile(filepath.Join(s.merged, name))
		require.NoError(t, err)
		require.Equal(t, s.files[name], data)
	}
	g.Settle()
	require.Zero(t, testfs.OpenBelow(t, s.merged), "a descriptor still holds the step's mount")

	g.answering.RLock() // an answer under way
	settled := make(chan struct{})
	go func() { g.Settle(); close(settled) }()
	select {
	case <-settled:
		t.Fatal("Settle returned while an answer was under way")
	case <-time.After(50 * time.Millisecond):
	}
	g.answering.RUnlock()
	<-settled
}
