package test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
)

// suiteFlattenDepth is low enough for the suite's deepest chain to cross it.
const suiteFlattenDepth = 12

// backendCases are the backend and filesystem pairs every behaviour is
// checked on. "" is the root disk (ext4 here).
var backendCases = []struct {
	name    string
	backend string
	fs      testfs.Kind
}{
	{"overlay-rootdisk", "overlay", ""},
	{"overlay-xfs", "overlay", testfs.XFS},
	{"reflink-xfs", "reflink", testfs.XFS},
	{"btrfs", "btrfs", testfs.Btrfs},
	{"copy-rootdisk", "copy", ""},
}

// TestBackends runs the same behavioural suite on every backend, each
// through its own real plugin process.
func TestBackends(t *testing.T) {
	testfs.Need(t)
	for _, bc := range backendCases {
		t.Run(bc.name, func(t *testing.T) {
			stateDir := t.TempDir()
			if bc.fs != "" {
				stateDir = testfs.Mount(t, bc.fs, 1<<30)
			}
			e := newEnv(t, plugintest.Config{StateDir: stateDir, Backend: bc.backend, FlattenDepth: suiteFlattenDepth})
			require.Equal(t, bc.backend, e.backend(t))
			t.Run("isolation", e.testIsolation)
			t.Run("deletions-and-renames", e.testDeletionsAndRenames)
			t.Run("chains", func(t *testing.T) { e.testChains(t, bc.backend) })
			t.Run("read-only", e.testReadOnly)
			t.Run("metadata", e.testMetadata)
			t.Run("empty-volume", e.testEmptyVolume)
			t.Run("privileged-files", e.testPrivilegedFiles)
		})
	}
}

// testPrivilegedFiles: runc does not pass a volume's nosuid and nodev into
// the container, so what a step captures loses its setuid and setgid bits
// and its device nodes, on every backend, from an empty volume and over a
// source (where overlay's own whiteouts, devices 0:0, must survive).
func (e *env) testPrivilegedFiles(t *testing.T) {
	e = e.sub(t)
	plant := func(dir, suffix string) {
		write(t, dir, "suid"+suffix, "#!/bin/sh")
		require.NoError(t, unix.Chmod(filepath.Join(dir, "suid"+suffix), 0o4755))
		require.NoError(t, unix.Mknod(filepath.Join(dir, "null"+suffix), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	}
	modes := func(dir string, names ...string) []string {
		var out []string
		for _, n := range names {
			var st unix.Stat_t
			if err := unix.Lstat(filepath.Join(dir, n), &st); err != nil {
				out = append(out, n+" absent")
				continue
			}
			out = append(out, fmt.Sprintf("%s %o", n, st.Mode))
		}
		return out
	}
	e.step("", "priv-0", func(dir string) {
		plant(dir, "-0")
		write(t, dir, "plain", "x")
		write(t, dir, "gone", "x")
	})
	e.step("priv-0", "priv-1", func(dir string) {
		plant(dir, "-1")
		require.NoError(t, unix.Chmod(filepath.Join(dir, "plain"), 0o2755)) // a copy-up gains setgid
		require.NoError(t, os.Remove(filepath.Join(dir, "gone")))
	})
	e.read("priv-1", func(dir string) {
		require.Equal(t, []string{"suid-0 100755", "suid-1 100755", "plain 100755", "null-0 absent", "null-1 absent", "gone absent"},
			modes(dir, "suid-0", "suid-1", "plain", "null-0", "null-1", "gone"))
	})
}

// sub makes an env for a subtest sharing the plugin.
func (e *env) sub(t *testing.T) *env { return &env{t: t, p: e.p, metrics: e.metrics} }

func (e *env) testIsolation(t *testing.T) {
	e = e.sub(t)
	e.step("", "iso-base", func(dir string) {
		write(t, dir, "a.txt", "A")
		write(t, dir, "b.txt", "B")
		write(t, dir, "dir/c.txt", "C")
	})
	var before testfs.Tree
	e.read("iso-base", func(dir string) { before = testfs.Describe(t, dir) })

	v1 := e.mount(map[string]string{"source": "iso-base"}, false)
	v2 := e.mount(map[string]string{"source": "iso-base"}, false)
	require.Equal(t, before, testfs.Describe(t, v1.Target), "a fresh view shows the source exactly")
	write(t, v1.Target, "a.txt", "A1")
	require.NoError(t, os.Remove(filepath.Join(v1.Target, "b.txt")))
	write(t, v1.Target, "dir/d.txt", "D")
	write(t, v2.Target, "e.txt", "E")

	require.Equal(t, "A", readFile(t, v2.Target, "a.txt"), "a view never sees another view's writes")
	require.Equal(t, "B", readFile(t, v2.Target, "b.txt"))
	absent(t, v2.Target, "dir/d.txt")
	absent(t, v1.Target, "e.txt")
	e.umount(v1)
	e.umount(v2)
	e.read("iso-base", func(dir string) {
		require.Equal(t, before, testfs.Describe(t, dir), "the source is unchanged by its views")
	})
}

// renameDir renames like mv: overlay with redirect_dir off answers EXDEV for
// a directory from a lower layer, and mv then copies.
func renameDir(t *testing.T, from, to string) {
	t.Helper()
	err := os.Rename(from, to)
	if errors.Is(err, syscall.EXDEV) {
		require.NoError(t, os.CopyFS(to, os.DirFS(from)))
		err = os.RemoveAll(from)
	}
	require.NoError(t, err)
}

func (e *env) testDeletionsAndRenames(t *testing.T) {
	e = e.sub(t)
	e.step("", "del-0", func(dir string) {
		for _, f := range []string{"keep.txt", "gone.txt", "ren.txt", "olddir/y", "opaque/1", "opaque/2", "deep/a/b/c"} {
			write(t, dir, f, "v0 "+f)
		}
	})
	var r0 testfs.Tree
	e.read("del-0", func(dir string) { r0 = testfs.Describe(t, dir) })
	e.step("del-0", "del-1", func(dir string) {
		require.NoError(t, os.Remove(filepath.Join(dir, "gone.txt")))
		require.NoError(t, os.Rename(filepath.Join(dir, "ren.txt"), filepath.Join(dir, "renamed.txt")))
		renameDir(t, filepath.Join(dir, "olddir"), filepath.Join(dir, "newdir"))
		require.NoError(t, os.RemoveAll(filepath.Join(dir, "opaque")))
		write(t, dir, "opaque/3", "v1 3")
		require.NoError(t, os.RemoveAll(filepath.Join(dir, "deep/a")))
	})
	check := func(dir string) {
		require.Equal(t, "v0 keep.txt", readFile(t, dir, "keep.txt"))
		absent(t, dir, "gone.txt")
		absent(t, dir, "ren.txt")
		require.Equal(t, "v0 ren.txt", readFile(t, dir, "renamed.txt"))
		absent(t, dir, "olddir")
		require.Equal(t, "v0 olddir/y", readFile(t, dir, "newdir/y"))
		entries, err := os.ReadDir(filepath.Join(dir, "opaque"))
		require.NoError(t, err)
		require.Len(t, entries, 1, "a dir deleted and made again hides what was below it")
		require.Equal(t, "v1 3", readFile(t, dir, "opaque/3"))
		absent(t, dir, "deep/a")
	}
	e.read("del-1", check)
	// One more link: deletions stay deleted in views further down a chain.
	e.step("del-1", "del-2", func(dir string) {
		check(dir)
		write(t, dir, "more.txt", "v2")
	})
	e.read("del-2", check)
	e.read("del-0", func(dir string) { require.Equal(t, r0, testfs.Describe(t, dir), "the chain's root is unchanged") })
}

func (e *env) testChains(t *testing.T, backend string) {
	for _, depth := range []int{1, 2, 10, suiteFlattenDepth + 4} {
		t.Run(strconv.Itoa(depth), func(t *testing.T) {
			e := e.sub(t)
			prefix := fmt.Sprintf("chain%d-", depth)
			prev := ""
			var deep testfs.Tree // a tree past PATH_MAX, made in the first layer
			for i := 1; i <= depth; i++ {
				handle := prefix + strconv.Itoa(i)
				e.step(prev, handle, func(dir string) {
					if i == 1 {
						require.NoError(t, os.Mkdir(filepath.Join(dir, "deep"), 0o755))
						testfs.DeepTree(t, filepath.Join(dir, "deep"))
						deep = testfs.Describe(t, filepath.Join(dir, "deep"))
					}
					write(t, dir, "layer", strconv.Itoa(i))
					write(t, dir, fmt.Sprintf("f/%d", i), "kept")
					if i > 1 {
						require.NoError(t, os.Remove(filepath.Join(dir, fmt.Sprintf("g%d", i-1))))
					}
					write(t, dir, fmt.Sprintf("g%d", i), "only the last")
				})
				prev = handle
			}
			check := func(dir string) {
				require.Equal(t, strconv.Itoa(depth), readFile(t, dir, "layer"))
				entries, err := os.ReadDir(filepath.Join(dir, "f"))
				require.NoError(t, err)
				require.Len(t, entries, depth)
				for i := 1; i < depth; i++ {
					absent(t, dir, fmt.Sprintf("g%d", i))
				}
				require.Equal(t, "only the last", readFile(t, dir, fmt.Sprintf("g%d", depth)))
				require.Equal(t, deep, testfs.Describe(t, filepath.Join(dir, "deep")), "the deep tree, through every layer")
			}
			// Right after the last capture, while a flatten may be running.
			e.read(prev, check)
			if backend == "overlay" && depth > suiteFlattenDepth {
				// The first volume past the limit becomes a root layer, so
				// the chains of its descendants start again from it.
				first := prefix + strconv.Itoa(suiteFlattenDepth+1)
				layers := filepath.Join(e.p.StateDir, "volumes", "ci", first)
				eventually(t, "the deep chain to be flattened", func() bool {
					entries, _ := os.ReadDir(layers)
					entries = slices.DeleteFunc(entries, func(e os.DirEntry) bool { return !e.IsDir() }) // a layer's file sums beside it
					return len(entries) == 1 && strings.HasPrefix(entries[0].Name(), "f")
				})
				e.read(prev, check)
				// A child of the flattened volume stacks on the flat layer.
				e.step(prev, prefix+"child", func(dir string) {
					check(dir)
					write(t, dir, "child", "yes")
				})
				e.read(prefix+"child", func(dir string) {
					check(dir)
					require.Equal(t, "yes", readFile(t, dir, "child"))
				})
			}
		})
	}
}

func (e *env) testReadOnly(t *testing.T) {
	e = e.sub(t)
	e.step("", "ro-base", func(dir string) { write(t, dir, "a", "A") })
	for _, src := range []string{"ro-base", ""} {
		attrs := map[string]string{}
		if src != "" {
			attrs["source"] = src
		}
		v := e.mount(attrs, true)
		err := os.WriteFile(filepath.Join(v.Target, "new"), []byte("x"), 0o644)
		require.ErrorIs(t, err, syscall.EROFS, "a read-only volume refuses writes (source %q)", src)
		e.umount(v)
	}
	// Read-only over a chain (an overlay without upper, on every backend
	// whose layers form chains).
	e.step("ro-base", "ro-child", func(dir string) { write(t, dir, "b", "B") })
	e.read("ro-child", func(dir string) {
		require.Equal(t, "A", readFile(t, dir, "a"))
		require.Equal(t, "B", readFile(t, dir, "b"))
		require.ErrorIs(t, os.Remove(filepath.Join(dir, "a")), syscall.EROFS)
	})
}

func (e *env) testMetadata(t *testing.T) {
	e = e.sub(t)
	when := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	var made testfs.Tree
	e.step("", "meta", func(dir string) {
		p := func(name string) string { return filepath.Join(dir, name) }
		write(t, dir, "owned", "owned by 1234:5678")
		require.NoError(t, os.Chown(p("owned"), 1234, 5678))
		require.NoError(t, os.Chmod(p("owned"), 0o640))
		require.NoError(t, os.Mkdir(p("setgid"), 0o755))
		require.NoError(t, os.Chown(p("setgid"), 42, 43))
		require.NoError(t, unix.Chmod(p("setgid"), 0o2775))
		require.NoError(t, os.Mkdir(p("sticky"), 0o755))
		require.NoError(t, unix.Chmod(p("sticky"), 0o1777))
		write(t, dir, "exec", "#!/bin/sh\n")
		require.NoError(t, os.Chmod(p("exec"), 0o755))
		require.NoError(t, os.Symlink("owned", p("rel-link")))
		require.NoError(t, os.Symlink("/nowhere/at/all", p("dangling-link")))
		write(t, dir, "hard-a", "shared inode")
		require.NoError(t, os.Link(p("hard-a"), p("hard-b")))
		require.NoError(t, unix.Setxattr(p("owned"), "user.origin", []byte("cowvol"), 0))
		require.NoError(t, unix.Setxattr(p("setgid"), "user.dir", []byte("yes"), 0))
		require.NoError(t, unix.Mkfifo(p("fifo"), 0o600))
		write(t, dir, "empty", "")
		f, err := os.Create(p("sparse"))
		require.NoError(t, err)
		_, err = f.WriteAt([]byte("end"), 64<<20)
		require.NoError(t, err)
		require.NoError(t, f.Close())
		require.NoError(t, os.Chtimes(p("owned"), when, when))
		made = testfs.Describe(t, dir)
	})
	e.read("meta", func(dir string) {
		require.Equal(t, made, testfs.Describe(t, dir), "a captured volume keeps modes, owners, links, xattrs and times")
		var st unix.Stat_t
		require.NoError(t, unix.Stat(filepath.Join(dir, "sparse"), &st))
		require.Less(t, st.Blocks*512, int64(1<<20), "a sparse file stays sparse")
	})
	// A writable view shows the same, and a change of owner or mode in it
	// is captured without touching the source.
	e.step("meta", "meta-2", func(dir string) {
		require.Equal(t, made, testfs.Describe(t, dir))
		require.NoError(t, os.Chown(filepath.Join(dir, "exec"), 7, 8))
		require.NoError(t, os.Chmod(filepath.Join(dir, "owned"), 0o600))
	})
	e.read("meta-2", func(dir string) {
		var st unix.Stat_t
		require.NoError(t, unix.Stat(filepath.Join(dir, "exec"), &st))
		require.Equal(t, [2]uint32{7, 8}, [2]uint32{st.Uid, st.Gid})
		require.NoError(t, unix.Stat(filepath.Join(dir, "owned"), &st))
		require.Equal(t, uint32(0o600), st.Mode&0o7777)
	})
	e.read("meta", func(dir string) { require.Equal(t, made, testfs.Describe(t, dir)) })
}

func (e *env) testEmptyVolume(t *testing.T) {
	e = e.sub(t)
	v := e.mount(nil, false)
	var st unix.Stat_t
	require.NoError(t, unix.Stat(v.Target, &st))
	require.Equal(t, uint32(0o777), st.Mode&0o7777, "an empty volume is writable by any user, like an emptyDir")
	write(t, v.Target, "scratch", "gone after unpublish")
	e.umount(v)
	// A scratch volume leaves nothing behind once the janitor has run.
	eventually(t, "the trash to be emptied", func() bool {
		entries, _ := os.ReadDir(filepath.Join(e.p.StateDir, "trash"))
		return len(entries) == 0
	})
}
