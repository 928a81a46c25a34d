package overlay

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/mountid"
	"github.com/concourse/cowvol/internal/testfs"
)

// failingDetach is the real mounter whose detached overlays fail: a mount
// the kernel refuses, which a real tree cannot be made to cause on demand.
type failingDetach struct {
	*SysMounter
	err error
}

func (f failingDetach) OverlayDetached([]string, string, string, Attrs) (Detached, error) {
	return nil, f.err
}

// Stage makes a writable view (of a source, or empty), from a tree made
// ahead or its own, with a mount nothing sees until it is attached; every
// other view is left to Prepare, and a failed Stage leaves nothing.
func TestStage(t *testing.T) {
	testfs.Need(t)
	root := testfs.Mount(t, testfs.XFS, 1<<30)
	lower := filepath.Join(root, "lower")
	require.NoError(t, os.Mkdir(lower, 0o751))
	require.NoError(t, os.Chown(lower, 1000, 1001))
	require.NoError(t, os.WriteFile(filepath.Join(lower, "f"), []byte("lower"), 0o644))
	trees, err := OpenTrees(filepath.Join(root, "trees"), 2)
	require.NoError(t, err)

	tests := []struct {
		name    string
		spec    func(s *Spec)
		exists  bool  // the view's dir is there already
		mounter error // the detached mount fails so
		fill    bool  // trees are made ahead
		wantErr error // nil: staged
	}{
		{name: "a writable view, from a tree made ahead", fill: true},
		{name: "a writable view, no tree ready"},
		{name: "read-only", spec: func(s *Spec) { s.Attrs.ReadOnly = true }, wantErr: ErrNotStaged},
		{name: "an empty volume", fill: true, spec: func(s *Spec) { s.Lowers = nil }},
		{name: "idmapped", spec: func(s *Spec) { s.Idmapped = true }, wantErr: ErrNotStaged},
		{name: "size-limited", spec: func(s *Spec) { s.Limit, s.QuotaID = 1<<20, 7 }, wantErr: ErrNotStaged},
		{name: "a tree already there", exists: true, wantErr: ErrNotStaged},
		{name: "the kernel lacks detached mounts", fill: true, mounter: ErrNotDetachable, wantErr: ErrNotStaged},
		{name: "the mount fails", fill: true, mounter: unix.EINVAL, wantErr: unix.EINVAL},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var m Mounter = NewSysMounter()
			if tc.mounter != nil {
				m = failingDetach{NewSysMounter(), tc.mounter}
			}
			b, err := New(KindOverlay, m, nil)
			require.NoError(t, err)
			if tc.fill {
				require.NoError(t, trees.Fill())
			}
			readyBefore := trees.Ready()
			s := Spec{Dir: filepath.Join(root, fmt.Sprintf("view-%d", i)), Lowers: []string{lower}}
			if tc.spec != nil {
				tc.spec(&s)
			}
			if tc.exists {
				require.NoError(t, os.MkdirAll(filepath.Join(s.Dir, "upper"), 0o700))
			}
			d, err := b.(Stager).Stage(s, trees)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				require.Nil(t, d)
				if !tc.exists {
					require.NoDirExists(t, s.Dir, "a failed Stage leaves nothing")
				}
				if errors.Is(tc.wantErr, ErrNotStaged) && tc.mounter == nil {
					require.Equal(t, readyBefore, trees.Ready(), "no tree is taken for a view Stage does not make")
				}
				return
			}
			require.NoError(t, err)
			if tc.fill {
				require.Equal(t, readyBefore-1, trees.Ready(), "a tree made ahead was taken")
			}
			upper, _ := b.Content(s)
			var st unix.Stat_t
			require.NoError(t, unix.Lstat(upper, &st))
			wantRoot := [3]uint32{1000, 1001, 0o751} // the source's
			if len(s.Lowers) == 0 {
				wantRoot = [3]uint32{0, 0, emptyRootMode}
			}
			require.Equal(t, wantRoot, [3]uint32{st.Uid, st.Gid, st.Mode & 0o7777}, "the upper root's owner and mode")

			target := filepath.Join(root, fmt.Sprintf("target-%d", i))
			require.NoError(t, os.Mkdir(target, 0o755))
			mounted, err := m.IsMountPoint(target)
			require.NoError(t, err)
			require.False(t, mounted, "nothing is mounted before Attach")
			require.NoError(t, d.Attach(target))
			require.NoError(t, d.Close(), "the mount stays attached without its descriptor")
			defer func() { require.NoError(t, Unmount(m, Spec{Dir: s.Dir, Target: target, Lowers: s.Lowers})) }()
			if len(s.Lowers) > 0 {
				got, err := os.ReadFile(filepath.Join(target, "f"))
				require.NoError(t, err)
				require.Equal(t, "lower", string(got))
			}
			require.NoError(t, os.WriteFile(filepath.Join(target, "new"), []byte("step"), 0o644))
			require.FileExists(t, filepath.Join(upper, "new"), "the step writes into the view's own upper dir")
			require.NoFileExists(t, filepath.Join(lower, "new"))
			require.NoError(t, unix.Stat(target, &st))
			require.True(t, Holds(b, s, target, mountid.Root(&st)), "recognised as the view's mount")
		})
	}
}

// Trees made ahead are handed out once each; what a dead process left in
// their dir is removed when it is opened again.
func TestTrees(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "trees")
	var none *Trees
	require.Empty(t, none.take(), "no trees: none is ever ready")

	trees, err := OpenTrees(dir, 3)
	require.NoError(t, err)
	require.Zero(t, trees.Ready())
	require.Empty(t, trees.take())
	require.NoError(t, trees.Fill())
	require.Equal(t, 3, trees.Ready())
	require.NoError(t, trees.Fill())
	require.Equal(t, 3, trees.Ready(), "filling a full pool makes nothing")
	taken := map[string]bool{}
	for range 3 {
		tree := trees.take()
		require.NotEmpty(t, tree)
		require.False(t, taken[tree], "each tree is handed out once")
		taken[tree] = true
		for _, sub := range []string{"upper", "work"} {
			fi, err := os.Stat(filepath.Join(tree, sub))
			require.NoError(t, err)
			require.True(t, fi.IsDir())
			require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
		}
	}
	require.Empty(t, trees.take())
	require.NoError(t, trees.Fill())

	// A process dies: its trees (one written into) and a half-made one
	// are left behind.
	left := trees.take()
	require.NoError(t, os.WriteFile(filepath.Join(left, "upper", "stray"), nil, 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "half", "upper"), 0o700))
	again, err := OpenTrees(dir, 1)
	require.NoError(t, err)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries, "a new process starts from nothing")
	require.NoError(t, again.Fill())
	tree := again.take()
	require.NoFileExists(t, filepath.Join(tree, "upper", "stray"), "nor hands out what the dead process left")
}

// A leftover that cannot be removed (an immutable file in it) is said, and
// the pool works around it: the leftover, under the very name the pool
// would give its first tree, is never handed out.
func TestTreesAroundALeftover(t *testing.T) {
	testfs.Need(t, "chattr")
	dir := filepath.Join(t.TempDir(), "trees")
	stuck := filepath.Join(dir, "t1", "upper", "stuck")
	require.NoError(t, os.MkdirAll(filepath.Dir(stuck), 0o700))
	require.NoError(t, os.WriteFile(stuck, []byte("left"), 0o644))
	if out, err := exec.Command("chattr", "+i", stuck).CombinedOutput(); err != nil {
		t.Skipf("chattr +i on %s: %v: %s (the temp dir's filesystem has no immutable flag)", stuck, err, out)
	}
	t.Cleanup(func() { _ = exec.Command("chattr", "-i", stuck).Run() })

	trees, err := OpenTrees(dir, 2)
	require.Error(t, err, "what could not be removed is said")
	require.NotNil(t, trees)
	require.ErrorIs(t, trees.Fill(), os.ErrExist, "the leftover's name is not made over")
	require.FileExists(t, stuck, "nor removed")
	require.NoError(t, trees.Fill())
	require.Equal(t, 2, trees.Ready())
	for range 2 {
		tree := trees.take()
		require.NotEqual(t, filepath.Join(dir, "t1"), tree, "the leftover is never handed out")
		require.NoFileExists(t, filepath.Join(tree, "upper", "stuck"))
	}
}
