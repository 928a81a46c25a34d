package testfs

import (
	"os"
	"path/filepath"
	"time"

	"github.com/concourse/cowvol/internal/tb"
	"golang.org/x/sys/unix"
)

func must(t tb.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// LayerTree fills dir with every kind of entry a captured overlay layer can
// hold, including a whiteout, an opaque dir and a tree deeper than PATH_MAX
// (DeepTree, in deep/).
func LayerTree(t tb.TB, dir string) {
	t.Helper()
	p := func(name string) string { return filepath.Join(dir, name) }
	// The root's own attributes belong to the volume too.
	must(t, os.Chown(dir, 1000, 1000))
	must(t, unix.Chmod(dir, 0o1775))
	must(t, unix.Setxattr(dir, "user.root", []byte("kept"), 0))
	must(t, os.MkdirAll(p("sub/opaque"), 0o755))
	must(t, os.WriteFile(p("sub/file"), []byte("data"), 0o640))
	must(t, os.Chown(p("sub/file"), 1000, 2000))
	must(t, unix.Chmod(p("sub"), 0o2750))
	must(t, unix.Setxattr(p("sub/opaque"), "trusted.overlay.opaque", []byte("y"), 0))
	must(t, unix.Setxattr(p("sub/file"), "user.note", []byte("kept"), 0))
	must(t, unix.Mknod(p("whiteout"), unix.S_IFCHR|0o000, 0))
	must(t, unix.Mkfifo(p("fifo"), 0o644))
	must(t, os.Symlink("sub/file", p("link")))
	// A binary with file capabilities (cap_net_bind_service+ep), owned by
	// someone else than the extractor: a chown or a write after the xattr
	// would drop it.
	must(t, os.WriteFile(p("cap"), []byte("#!/bin/true\n"), 0o755))
	must(t, os.Chown(p("cap"), 1000, 1000))
	must(t, unix.Setxattr(p("cap"), "security.capability", netBindService, 0))
	must(t, os.WriteFile(p("hard1"), []byte("linked"), 0o644))
	must(t, os.Link(p("hard1"), p("hard2")))
	big := make([]byte, 3<<20)
	for i := range big {
		big[i] = byte(i % 251)
	}
	must(t, os.WriteFile(p("big"), big, 0o600))
	f, err := os.Create(p("sparse"))
	must(t, err)
	_, err = f.WriteAt([]byte("tail"), 256<<20)
	must(t, err)
	must(t, f.Close())
	when := time.Date(2021, 5, 6, 7, 8, 9, 123456789, time.UTC)
	must(t, os.Chtimes(p("big"), when, when))
	must(t, os.Mkdir(p("deep"), 0o755))
	DeepTree(t, p("deep"))
}

// netBindService is a security.capability xattr (VFS_CAP_REVISION_2,
// effective) that grants CAP_NET_BIND_SERVICE.
var netBindService = []byte{0x01, 0, 0, 0x02, 0x00, 0x04, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
