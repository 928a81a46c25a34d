package overlay

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/mountid"
	"github.com/concourse/cowvol/internal/testfs"
)

func TestCopyTreeIsFaithful(t *testing.T) {
	for _, fs := range []testfs.Kind{testfs.Ext4, testfs.XFS, testfs.Btrfs} {
		t.Run(string(fs), func(t *testing.T) {
			root := testfs.Mount(t, fs, 1<<30)
			src, dst := filepath.Join(root, "src"), filepath.Join(root, "dst")
			require.NoError(t, os.Mkdir(src, 0o711))
			testfs.LayerTree(t, src)
			for _, reflink := range []bool{true, false} {
				out := fmt.Sprintf("%s-%v", dst, reflink)
				stats, err := copyTree(context.Background(), src, out, reflink, nil)
				require.NoError(t, err)
				require.Equal(t, testfs.Describe(t, src), testfs.Describe(t, out))
				require.Equal(t, int64(2), stats.Links, "hard2, and deep/.../bottom-link")
				var st unix.Stat_t
				require.NoError(t, unix.Stat(filepath.Join(out, "sparse"), &st))
				require.Less(t, st.Blocks*512, int64(1<<20), "holes stay holes")
				if reflink && fs != testfs.Ext4 {
					require.Equal(t, int64(6), stats.Cloned, "every non-empty file (sub/file, cap, hard1, big, sparse, deep/.../bottom) is cloned")
					require.Zero(t, stats.Copied)
				} else {
					require.Zero(t, stats.Cloned)
				}
			}
		})
	}
}

func TestCopyTreeStopsWhenCancelled(t *testing.T) {
	src := t.TempDir()
	for i := range 10 {
		require.NoError(t, os.WriteFile(filepath.Join(src, fmt.Sprint(i)), nil, 0o644))
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := copyTree(ctx, src, filepath.Join(t.TempDir(), "dst"), false, nil)
	require.ErrorIs(t, err, context.Canceled)
}

// A chain deeper than mount(2)'s one-page option string can carry mounts
// through fsopen with one lowerdir+ per layer, and merges as overlay should.
func TestDeepChainMountsAndMerges(t *testing.T) {
	testfs.Need(t)
	root := filepath.Join(t.TempDir(), strings.Repeat("long-path-segment-", 3))
	const depth = 200
	var lowers []string
	for i := depth - 1; i >= 0; i-- { // top first
		l := filepath.Join(root, fmt.Sprintf("layer-%03d", i))
		require.NoError(t, os.MkdirAll(l, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(l, fmt.Sprintf("f%03d", i)), []byte("x"), 0o644))
		lowers = append(lowers, l)
	}
	require.Greater(t, len(strings.Join(lowers, ":")), os.Getpagesize())
	// The top layer deletes f000 with a whiteout.
	require.NoError(t, unix.Mknod(filepath.Join(lowers[0], "f000"), unix.S_IFCHR, 0))
	m := NewSysMounter()
	mnt := filepath.Join(t.TempDir(), "mnt")
	dst := filepath.Join(t.TempDir(), "flat")
	stats, err := CopyLayers(context.Background(), m, lowers, mnt, dst, true)
	require.NoError(t, err)
	entries, err := os.ReadDir(dst)
	require.NoError(t, err)
	require.Len(t, entries, depth-1, "every layer's file but the whited-out one")
	require.Equal(t, int64(depth-1), stats.Files)
	mounts, err := MountsUnder(filepath.Dir(mnt))
	require.NoError(t, err)
	require.Empty(t, mounts, "the merge mount is gone")
}

// Flattening on XFS clones from the real layer files, not through overlay,
// deep in a tree past PATH_MAX too.
func TestCopyLayersClonesFromLayers(t *testing.T) {
	root := testfs.Mount(t, testfs.XFS, 512<<20)
	lower, upper := filepath.Join(root, "lower"), filepath.Join(root, "upper")
	require.NoError(t, os.MkdirAll(filepath.Join(lower, "deep"), 0o755))
	require.NoError(t, os.MkdirAll(upper, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(lower, "a"), make([]byte, 1<<20), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(upper, "b"), make([]byte, 1<<20), 0o644))
	testfs.DeepTree(t, filepath.Join(lower, "deep"))
	flat := filepath.Join(root, "flat")
	stats, err := CopyLayers(context.Background(), NewSysMounter(), []string{upper, lower}, filepath.Join(root, "mnt"), flat, true)
	require.NoError(t, err)
	require.Equal(t, int64(3), stats.Cloned, "a, b and the deep tree's bottom")
	require.Zero(t, stats.Copied)
	deep := func(tree testfs.Tree) testfs.Tree {
		out := testfs.Tree{}
		for p, d := range tree {
			if strings.HasPrefix(p, "deep") {
				out[p] = d
			}
		}
		return out
	}
	require.Equal(t, deep(testfs.Describe(t, lower)), deep(testfs.Describe(t, flat)))
}

func TestRemoveTree(t *testing.T) {
	testfs.Need(t)
	t.Run("refuses a mount inside", func(t *testing.T) {
		dir := t.TempDir()
		inner := filepath.Join(dir, "a", "mnt")
		require.NoError(t, os.MkdirAll(inner, 0o755))
		src := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(src, "precious"), []byte("x"), 0o644))
		m := NewSysMounter()
		require.NoError(t, m.Bind(src, inner, Attrs{}))
		defer m.Unmount(inner)
		require.ErrorContains(t, RemoveTree(filepath.Join(dir, "a")), "is mounted")
		_, err := os.Stat(filepath.Join(src, "precious"))
		require.NoError(t, err)
	})
	t.Run("missing path is done", func(t *testing.T) {
		require.NoError(t, RemoveTree(filepath.Join(t.TempDir(), "nope")))
	})
	t.Run("btrfs subvolumes, nested too", func(t *testing.T) {
		root := testfs.Mount(t, testfs.Btrfs, 256<<20)
		outer := filepath.Join(root, "outer")
		require.NoError(t, createSubvolume(outer))
		require.NoError(t, os.WriteFile(filepath.Join(outer, "f"), []byte("x"), 0o644))
		require.NoError(t, createSubvolume(filepath.Join(outer, "inner")))
		snap := filepath.Join(root, "snap")
		require.NoError(t, snapshot(outer, snap))
		require.True(t, isSubvolume(snap))
		require.NoError(t, RemoveTree(outer))
		require.NoError(t, RemoveTree(snap))
		entries, err := os.ReadDir(root)
		require.NoError(t, err)
		require.Empty(t, entries)
	})
}

func TestProbe(t *testing.T) {
	m := NewSysMounter()
	tests := []struct {
		fs      testfs.Kind
		want    Kind
		reflink bool
	}{
		{testfs.Ext4, KindOverlay, false},
		{testfs.XFS, KindOverlay, true},
		{testfs.Btrfs, KindBtrfs, true},
	}
	for _, tc := range tests {
		t.Run(string(tc.fs), func(t *testing.T) {
			dir := testfs.Mount(t, tc.fs, 512<<20)
			got, err := Probe(dir, m)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			if tc.reflink {
				require.NoError(t, Supports(KindReflink, dir, m))
			} else {
				require.Error(t, Supports(KindReflink, dir, m))
			}
			entries, err := os.ReadDir(dir)
			require.NoError(t, err)
			for _, e := range entries {
				require.False(t, strings.HasPrefix(e.Name(), ".probe-"), "probing leaves nothing")
			}
		})
	}
}

func TestCommitIsIdempotent(t *testing.T) {
	dir := t.TempDir()
	b, err := New(KindCopy, NewSysMounter(), nil)
	require.NoError(t, err)
	s := Spec{Dir: filepath.Join(dir, "view")}
	content, _ := b.Content(s)
	require.NoError(t, os.MkdirAll(content, 0o755))
	layer := filepath.Join(dir, "layers", "h", "l1")
	diff, err := Commit(b, s, layer)
	require.NoError(t, err)
	require.False(t, diff)
	_, err = Commit(b, s, layer)
	require.NoError(t, err, "a second commit after a crash finds it done")
	_, err = Commit(b, Spec{Dir: filepath.Join(dir, "nothing")}, filepath.Join(dir, "layers", "x", "l1"))
	require.Error(t, err, "nothing to commit and nothing committed is an error")
}

// Trees deeper than PATH_MAX are measured and removed: both walk by file
// descriptor.
func TestDeepTreeUsageAndRemoval(t *testing.T) {
	root := filepath.Join(t.TempDir(), "deep")
	require.NoError(t, os.Mkdir(root, 0o755))
	depth := testfs.DeepTree(t, root)
	bytes, inodes, err := Usage(root)
	require.NoError(t, err)
	require.Equal(t, int64(1+depth+testfs.DeepInodes), inodes, "the root, every dir and what is at the bottom")
	require.GreaterOrEqual(t, bytes, int64(64<<10))
	require.NoError(t, RemoveTree(root))
	_, err = os.Lstat(root)
	require.ErrorIs(t, err, os.ErrNotExist)
}

// Every mount is nodev, and nosuid unless setuid is allowed; a symlink at
// the target is never followed.
func TestMountAttrs(t *testing.T) {
	testfs.Need(t)
	m := NewSysMounter()
	src, lower, upper, work := t.TempDir(), t.TempDir(), t.TempDir(), t.TempDir()
	dir := t.TempDir()
	opts := func(mnt string) string {
		infos, err := os.ReadFile("/proc/self/mountinfo")
		require.NoError(t, err)
		for _, line := range strings.Split(string(infos), "\n") {
			if f := strings.Fields(line); len(f) > 5 && f[4] == mnt {
				return f[5]
			}
		}
		t.Fatalf("%s is not mounted", mnt)
		return ""
	}
	tests := []struct {
		name  string
		mount func(target string) error
		want  []string
		not   []string
	}{
		{"bind", func(tg string) error { return m.Bind(src, tg, Attrs{}) }, []string{"nodev", "nosuid", "rw"}, nil},
		{"bind read-only", func(tg string) error { return m.Bind(src, tg, Attrs{ReadOnly: true}) }, []string{"nodev", "nosuid", "ro"}, nil},
		{"bind setuid", func(tg string) error { return m.Bind(src, tg, Attrs{AllowSetuid: true}) }, []string{"nodev"}, []string{"nosuid"}},
		{"overlay", func(tg string) error { return m.Overlay(tg, []string{lower}, upper, work, Attrs{}) }, []string{"nodev", "nosuid", "rw"}, nil},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			target := filepath.Join(dir, fmt.Sprint(i))
			require.NoError(t, os.Mkdir(target, 0o755))
			require.NoError(t, tc.mount(target))
			got := strings.Split(opts(target), ",")
			for _, w := range tc.want {
				require.Contains(t, got, w)
			}
			for _, n := range tc.not {
				require.NotContains(t, got, n)
			}
			_, root, err := mountid.Of(target)
			require.NoError(t, err)
			require.True(t, root)
			require.NoError(t, m.Unmount(target))
		})
	}
	t.Run("symlink target", func(t *testing.T) {
		link := filepath.Join(dir, "link")
		victim := t.TempDir()
		require.NoError(t, os.Symlink(victim, link))
		require.Error(t, m.Bind(src, link, Attrs{}), "move_mount must not follow the symlink")
		_, root, err := mountid.Of(victim)
		require.NoError(t, err)
		require.False(t, root, "nothing was mounted where the symlink points")
		require.NoError(t, m.Unmount(link), "unmounting a symlink is a no-op, never a follow")
	})
}

// btrfs qgroups cap what a subvolume's writer adds; other subvolumes are
// untouched. Quotas off: the probe says why.
func TestBtrfsLimits(t *testing.T) {
	root := testfs.Mount(t, testfs.Btrfs, 512<<20)
	_, err := ProbeLimits(root, KindBtrfs)
	require.ErrorContains(t, err, "btrfs qgroups")
	testfs.EnableBtrfsQuota(t, root)
	lim, err := ProbeLimits(root, KindBtrfs)
	require.NoError(t, err)
	_, err = ProbeLimits(root, KindOverlay)
	require.ErrorContains(t, err, "use the btrfs backend")

	limited, free := filepath.Join(root, "limited"), filepath.Join(root, "free")
	require.NoError(t, createSubvolume(limited))
	require.NoError(t, createSubvolume(free))
	require.NoError(t, lim.Limit(1, 8<<20, limited))
	err = os.WriteFile(filepath.Join(limited, "big"), make([]byte, 16<<20), 0o644)
	require.ErrorIs(t, err, unix.EDQUOT)
	require.NoError(t, os.WriteFile(filepath.Join(free, "big"), make([]byte, 16<<20), 0o644), "another subvolume is not limited")
	require.NoError(t, SyncFS(limited))
	used, _, err := lim.Used(1, limited)
	require.NoError(t, err)
	require.InDelta(t, 8<<20, used, 1<<20)
}

// Project quotas need kernel support these machines lack: the probe must
// say so, and where the kernel has them the limit must hold.
func TestProjectQuotaLimits(t *testing.T) {
	for _, fs := range []testfs.Kind{testfs.XFS, testfs.Ext4} {
		t.Run(string(fs), func(t *testing.T) {
			root := testfs.MountWithProjectQuota(t, fs, 512<<20)
			lim, err := ProbeLimits(root, KindOverlay)
			require.NoError(t, err)
			dir := filepath.Join(root, "upper")
			require.NoError(t, os.Mkdir(dir, 0o777))
			require.NoError(t, lim.Limit(7, 4<<20, dir))
			err = os.WriteFile(filepath.Join(dir, "big"), make([]byte, 8<<20), 0o644)
			require.ErrorIs(t, err, unix.EDQUOT)
			used, inodes, err := lim.Used(7, dir)
			require.NoError(t, err)
			require.InDelta(t, 4<<20, used, 1<<20)
			require.Equal(t, int64(2), inodes)
			require.NoError(t, lim.Release(7))
		})
	}
}

// Holds recognises each kind of step volume mount by what it holds, and
// refuses one made for another volume: how a plugin with records from
// before mount roots finds its mounts from a new mount namespace. Its
// paths hold what mountinfo escapes (a comma splits mount options, a space
// splits fields): a state or kubelet dir may.
func TestHoldsRecognisesItsMounts(t *testing.T) {
	testfs.Need(t)
	root := filepath.Join(testfs.Mount(t, testfs.XFS, 1<<30), "state, with=odd\\names\ttoo")
	require.NoError(t, os.Mkdir(root, 0o755))
	m := NewSysMounter()
	layer := func(name string) string {
		d := filepath.Join(root, name)
		require.NoError(t, os.MkdirAll(d, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(d, name), []byte(name), 0o644))
		return d
	}
	l1, l2 := layer("l1"), layer("l2")
	tests := []struct {
		name   string
		kind   Kind
		lowers []string
		ro     bool
		idmap  bool
	}{
		{"a writable overlay", KindOverlay, []string{l1, l2}, false, false},
		{"a writable tree", KindCopy, []string{l1}, false, false},
		{"a read-only chain", KindOverlay, []string{l1, l2}, true, false},
		{"a read-only chain as a tree of its own", KindReflink, []string{l1, l2}, true, true},
		{"a read-only layer", KindReflink, []string{l1}, true, false},
		{"a read-only empty volume", KindOverlay, nil, true, false},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := New(tc.kind, m, nil)
			require.NoError(t, err)
			target := filepath.Join(root, fmt.Sprintf("target-%d", i))
			require.NoError(t, os.Mkdir(target, 0o755))
			s := Spec{Dir: filepath.Join(root, fmt.Sprintf("view-%d", i)), Target: target, Lowers: tc.lowers, Attrs: Attrs{ReadOnly: tc.ro}, Idmapped: tc.idmap}
			require.NoError(t, b.Prepare(context.Background(), s))
			defer func() { require.NoError(t, Unmount(m, s)) }()
			var st unix.Stat_t
			require.NoError(t, unix.Stat(target, &st))
			require.True(t, Holds(b, s, target, mountid.Root(&st)), "its own mount")
			mounts, err := MountsUnder(root)
			require.NoError(t, err)
			require.Contains(t, mounts, target)
			other := s
			other.Dir = filepath.Join(root, "another-view")
			if len(s.Lowers) > 1 {
				other.Lowers = []string{l2, l1}
			} else if len(s.Lowers) == 1 {
				other.Lowers = []string{l2}
			}
			require.False(t, Holds(b, other, target, mountid.Root(&st)), "another volume's spec")
		})
	}
}

// Prepare may be called again after it was cut short at any point: a build
// that did not finish (its tree still under the staged name) is made again,
// and a built tree is mounted again as the step left it, its root included.
func TestPrepareIsRestartable(t *testing.T) {
	testfs.Need(t)
	root := testfs.Mount(t, testfs.XFS, 1<<30)
	m := NewSysMounter()
	lower := filepath.Join(root, "lower")
	require.NoError(t, os.MkdirAll(lower, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(lower, "f"), []byte("lower"), 0o644))
	for i, kind := range []Kind{KindOverlay, KindReflink, KindCopy} {
		t.Run(string(kind), func(t *testing.T) {
			b, err := New(kind, m, nil)
			require.NoError(t, err)
			target := filepath.Join(root, fmt.Sprintf("target-%d", i))
			require.NoError(t, os.Mkdir(target, 0o755))
			s := Spec{Dir: filepath.Join(root, fmt.Sprintf("view-%d", i)), Target: target, Lowers: []string{lower}}
			require.False(t, Built(b, s))

			// A build cut short: the staged tree, with a stray file and
			// the wrong root mode.
			content, _ := b.Content(s)
			require.NoError(t, os.MkdirAll(content+stagedSuffix, 0o700))
			require.NoError(t, os.WriteFile(filepath.Join(content+stagedSuffix, "stray"), nil, 0o644))
			require.NoError(t, b.Prepare(context.Background(), s))
			t.Cleanup(func() { require.NoError(t, Unmount(m, s)) })
			require.True(t, Built(b, s))
			require.NoFileExists(t, filepath.Join(target, "stray"), "the cut-short build is not what is mounted")
			require.NoDirExists(t, content+stagedSuffix)
			got, err := os.ReadFile(filepath.Join(target, "f"))
			require.NoError(t, err)
			require.Equal(t, "lower", string(got))
			var st unix.Stat_t
			require.NoError(t, unix.Stat(target, &st))
			require.Equal(t, uint32(0o755), st.Mode&0o7777, "the view's root is its source's")

			// The step writes and changes its root; the mount goes.
			require.NoError(t, os.WriteFile(filepath.Join(target, "new"), []byte("step"), 0o644))
			require.NoError(t, os.Chmod(target, 0o700))
			require.NoError(t, Unmount(m, s))
			require.NoError(t, b.Prepare(context.Background(), s))
			got, err = os.ReadFile(filepath.Join(target, "new"))
			require.NoError(t, err)
			require.Equal(t, "step", string(got), "mounted again as the step left it")
			require.NoError(t, unix.Stat(target, &st))
			require.Equal(t, uint32(0o700), st.Mode&0o7777, "the root as the step left it")
		})
	}
}
