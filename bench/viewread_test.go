package bench

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/index"
	"github.com/concourse/cowvol/pkg/overlay"
)

// viewReadRounds is how many times BenchmarkViewRead reads each tree,
// taking turns, after a first read of each that warms the page cache.
const viewReadRounds = 5

// BenchmarkViewRead reads every file of a 1 GiB / 50,000-file cached
// volume, page cache warm, through a writable view (an overlay over it),
// through a read-only view (a bind mount of its layer) and from its layer
// dir itself, the comparator (issue 38's target for the writable view: at
// most 1.15x); and, as a step reads a volume pulled as an index once its
// blob is whole, through the layer's index (EROFS, file-backed, its blob
// written whole) and a writable view over it.
func BenchmarkViewRead(b *testing.B) {
	testfs.Need(b)
	for range b.N {
		xfs := testfs.Mount(b, testfs.XFS, 4<<30)
		state := filepath.Join(xfs, "state")
		n := newNode(b, state, "overlay")
		n.capture("", "tree", func(dir string) { genMixedTree(b, dir, treeFiles, treeBytes) })
		n.settle()
		rw := n.volume(map[string]string{driver.AttrSource: "tree"}, false)
		ro := n.volume(map[string]string{driver.AttrSource: "tree"}, true)
		n.timed(n.p.Publish, rw)
		n.timed(n.p.Publish, ro)
		ix := mountIndexOf(b, layerDir(b, state, "tree"), filepath.Join(xfs, "index"))
		trees := []struct {
			what, dir string
			before    func() // untimed, before each read
		}{
			{"the layer dir (plain directory)", layerDir(b, state, "tree"), nil},
			{"a writable view (overlay)", rw.Target, nil},
			{"a read-only view (bind mount)", ro.Target, nil},
			{"its index (EROFS, its blob whole), warm", ix.mnt, nil},
			{"a writable view over its index, warm", ix.view, nil},
			{"its index mounted afresh, its blob cached", ix.mnt, ix.remount},
			{"a writable view over it, mounted afresh", ix.view, ix.remount},
		}
		read := readEvery(b, 1)
		took := map[string][]time.Duration{}
		for _, t := range trees {
			read(t.dir) // warm
		}
		for round := range viewReadRounds {
			for i := range trees {
				t := trees[(i+round)%len(trees)]
				if t.before != nil {
					t.before()
				}
				start := time.Now()
				read(t.dir)
				took[t.what] = append(took[t.what], time.Since(start))
			}
		}
		n.timed(n.p.Unpublish, rw)
		n.timed(n.p.Unpublish, ro)
		n.p.Stop()
		plain := p50(took[trees[0].what])
		fmt.Printf("\n%-52s %12s  %s\n", "reading every file of 1 GiB / 50,000 files, warm", "p50", "vs")
		for _, t := range trees {
			d := p50(took[t.what])
			fmt.Printf("%-52s %12s  %.2fx the plain directory\n", t.what, ms(d), float64(d)/float64(plain))
		}
		b.ReportMetric(float64(p50(took[trees[1].what]))/float64(plain), "rw-view-vs-dir")
		b.ReportMetric(float64(p50(took[trees[2].what]))/float64(plain), "ro-view-vs-dir")
		b.ReportMetric(float64(p50(took[trees[4].what]))/float64(plain), "index-view-vs-dir")
		b.ReportMetric(float64(p50(took[trees[6].what]))/float64(plain), "fresh-index-view-vs-dir")
	}
}

// mountedIndex is a layer's index mounted at mnt, its blob whole, and a
// writable overlay over it at view, as a step's view of an index is made.
type mountedIndex struct {
	b                      *testing.B
	image, blob, mnt, view string
	upper, work            string
}

// mountIndexOf indexes the layer at layer in dir (on the layer's
// filesystem), writes its blob whole and mounts both; the bench's end
// unmounts them.
func mountIndexOf(b *testing.B, layer, dir string) *mountedIndex {
	b.Helper()
	ix := &mountedIndex{b: b, image: filepath.Join(dir, "image"), blob: filepath.Join(dir, "blob"), mnt: filepath.Join(dir, "mnt"),
		view: filepath.Join(dir, "view"), upper: filepath.Join(dir, "upper"), work: filepath.Join(dir, "work")}
	for _, d := range []string{ix.mnt, ix.view, ix.upper, ix.work} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	root, err := unix.Open(layer, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(root)
	image, err := os.Create(ix.image)
	if err != nil {
		b.Fatal(err)
	}
	defer image.Close()
	layout, err := index.Build(root, image, index.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer layout.Close()
	blob, err := os.Create(ix.blob)
	if err != nil {
		b.Fatal(err)
	}
	defer blob.Close()
	if _, err := io.Copy(blob, io.NewSectionReader(index.Blob{Root: root, Layout: layout}, 0, layout.Size)); err != nil {
		b.Fatal(err)
	}
	if err := overlay.MountIndex(ix.image, ix.blob, ix.mnt); err != nil {
		b.Skipf("the kernel mounts no index here: %v", err)
	}
	ix.mountView()
	b.Cleanup(ix.unmount)
	return ix
}

// mountView mounts the view in a new work dir: a volatile overlay's old
// one marks it unclean, and refuses the mount.
func (ix *mountedIndex) mountView() {
	if err := os.RemoveAll(ix.work); err != nil {
		ix.b.Fatal(err)
	}
	if err := os.Mkdir(ix.work, 0o755); err != nil {
		ix.b.Fatal(err)
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s,index=off,metacopy=off,redirect_dir=off,volatile", ix.mnt, ix.upper, ix.work)
	if err := unix.Mount("overlay", ix.view, "overlay", 0, opts); err != nil {
		ix.b.Fatal(err)
	}
}

func (ix *mountedIndex) unmount() {
	_ = unix.Unmount(ix.view, unix.MNT_DETACH)
	_ = overlay.UnmountIndex(ix.mnt)
}

// remount mounts the index and its view again: a new EROFS superblock,
// whose own page cache is empty, over a blob whose pages are cached, as
// a lazily pulled blob's are once the fill wrote them.
func (ix *mountedIndex) remount() {
	ix.unmount()
	if err := overlay.MountIndex(ix.image, ix.blob, ix.mnt); err != nil {
		ix.b.Fatal(err)
	}
	ix.mountView()
}
