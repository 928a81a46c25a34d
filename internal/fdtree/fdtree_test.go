package fdtree

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// deepChain makes depth dirs of 200-byte names below dir, from
// descriptors, and returns their path relative to dir.
func deepChain(t *testing.T, dir string, depth int) string {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	require.NoError(t, err)
	name := strings.Repeat("d", 200)
	var rel []string
	for range depth {
		require.NoError(t, unix.Mkdirat(fd, name, 0o755))
		next, err := OpenDir(fd, name)
		require.NoError(t, err)
		unix.Close(fd)
		fd = next
		rel = append(rel, name)
	}
	require.NoError(t, unix.Mkdirat(fd, "end", 0o755))
	unix.Close(fd)
	return strings.Join(append(rel, "end"), "/")
}

func open(t *testing.T, dir string) int {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// Walk visits parents before children, names in order, leaves each dir it
// entered after its entries, leaves out what it is told to omit, and goes
// past PATH_MAX.
func TestWalk(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "b", "c"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "a"), nil, 0o644))
	require.NoError(t, os.Symlink("/etc", filepath.Join(dir, "b", "link")))
	require.NoError(t, os.Mkdir(filepath.Join(dir, "skipped"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "skipped", "unseen"), nil, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "b", "omitted"), nil, 0o644))
	deep := deepChain(t, filepath.Join(dir, "b", "c"), 45)
	var events []string
	err := Walk(open(t, dir), Visitor{
		Visit: func(e *Entry) (bool, error) {
			events = append(events, "visit "+e.Path)
			require.Equal(t, strings.Count(e.Path, "/")+1, e.Depth)
			return e.Name != "skipped", nil
		},
		Leave: func(e *Entry, _ int) error { events = append(events, "leave "+e.Path); return nil },
		Omit:  func(path string) bool { return path == "b/omitted" },
	})
	require.NoError(t, err)
	require.Greater(t, len("b/c/"+deep), 2*unix.PathMax)
	var want []string
	want = append(want, "visit a", "visit b", "visit b/c")
	parts := strings.Split(deep, "/")
	for i := range parts {
		want = append(want, "visit b/c/"+strings.Join(parts[:i+1], "/"))
	}
	for i := len(parts); i > 0; i-- {
		want = append(want, "leave b/c/"+strings.Join(parts[:i], "/"))
	}
	want = append(want, "leave b/c", "visit b/link", "leave b", "visit skipped")
	require.Equal(t, want, events, "the symlink is visited, not followed; skipped is not entered")
}

// OpenBeneath opens a dir however long its path, and refuses a path that
// climbs out or runs through a symlink.
func TestOpenBeneath(t *testing.T) {
	dir := t.TempDir()
	deep := deepChain(t, dir, 45)
	require.NoError(t, os.Symlink(".", filepath.Join(dir, "loop")))
	require.NoError(t, os.Symlink("/", filepath.Join(dir, "out")))
	root := open(t, dir)
	tests := []struct {
		name, rel string
		wantErr   error
	}{
		{"the root itself", "", nil},
		{"a short path, in one call", strings.Repeat("d", 200) + "/" + strings.Repeat("d", 200), nil},
		{"past twice PATH_MAX", deep, nil},
		{"a name too long to stretch over", strings.Repeat("x", unix.PathMax+1), unix.ENAMETOOLONG},
		{"through a symlink", "loop/" + deep, unix.ELOOP},
		{"an absolute symlink", "out/etc", unix.ELOOP},
		{"climbing out", strings.Repeat("d", 200) + "/../..", unix.EXDEV},
		{"missing", "nope", unix.ENOENT},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fd, err := OpenBeneath(root, tc.rel)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			defer unix.Close(fd)
			names, err := Names(fd)
			require.NoError(t, err)
			if tc.rel == deep {
				require.Empty(t, names, "the chain's end")
			}
		})
	}
}

// OpenFileBeneath opens a file in one call or, past PATH_MAX, from its
// dir, and follows no symlink, not even its last name.
func TestOpenFileBeneath(t *testing.T) {
	dir := t.TempDir()
	deep := deepChain(t, dir, 45)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), []byte("near"), 0o644))
	root := open(t, dir)
	deepDir, err := OpenBeneath(root, deep)
	require.NoError(t, err)
	fd, err := unix.Openat(deepDir, "f", unix.O_CREAT|unix.O_WRONLY, 0o644)
	require.NoError(t, err)
	_, err = unix.Write(fd, []byte("far"))
	require.NoError(t, err)
	unix.Close(fd)
	unix.Close(deepDir)
	require.NoError(t, os.Symlink("f", filepath.Join(dir, "link")))
	require.NoError(t, os.Symlink(".", filepath.Join(dir, "loop")))
	tests := []struct {
		name, rel, want string
		wantErr         error
	}{
		{"a file near the root", "f", "near", nil},
		{"a file past PATH_MAX", deep + "/f", "far", nil},
		{"a symlink to a file", "link", "", unix.ELOOP},
		{"through a symlink", "loop/f", "", unix.ELOOP},
		{"climbing out", "../f", "", unix.EXDEV},
		{"missing", "nope", "", unix.ENOENT},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fd, err := OpenFileBeneath(root, tc.rel, unix.O_RDONLY)
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			defer unix.Close(fd)
			buf := make([]byte, 16)
			n, err := unix.Read(fd, buf)
			require.NoError(t, err)
			require.Equal(t, tc.want, string(buf[:n]))
		})
	}
}

// File reads and writes at offsets through a bare descriptor, and says
// where a file ends.
func TestFile(t *testing.T) {
	fd, err := unix.Open(filepath.Join(t.TempDir(), "f"), unix.O_CREAT|unix.O_RDWR, 0o644)
	require.NoError(t, err)
	defer unix.Close(fd)
	f := File(fd)
	n, err := f.WriteAt([]byte("world"), 6)
	require.NoError(t, err)
	require.Equal(t, 5, n)
	_, err = f.WriteAt([]byte("hello "), 0)
	require.NoError(t, err)
	buf := make([]byte, 11)
	n, err = f.ReadAt(buf, 0)
	require.NoError(t, err)
	require.Equal(t, "hello world", string(buf[:n]))
	n, err = f.ReadAt(buf, 6)
	require.ErrorIs(t, err, io.EOF)
	require.Equal(t, "world", string(buf[:n]))
	_, err = File(-1).WriteAt(buf, 0)
	require.ErrorIs(t, err, unix.EBADF)
}

// Futimens sets the times of what a descriptor is open as, a dir's too.
func TestFutimens(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "f")
	require.NoError(t, os.WriteFile(f, nil, 0o644))
	ts := []unix.Timespec{{Sec: 1000, Nsec: 7}, {Sec: 2000, Nsec: 9}}
	for _, p := range []string{f, dir} {
		fd, err := unix.Open(p, unix.O_RDONLY, 0)
		require.NoError(t, err)
		require.NoError(t, Futimens(fd, ts))
		unix.Close(fd)
		var st unix.Stat_t
		require.NoError(t, unix.Stat(p, &st))
		require.Equal(t, ts[0], st.Atim, p)
		require.Equal(t, ts[1], st.Mtim, p)
	}
	require.ErrorIs(t, Futimens(-1, ts), unix.EBADF)
	require.ErrorIs(t, Futimens(0, ts[:1]), unix.EINVAL)
}

func TestNamesReadlinkProcPath(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []string{"c", "a", "b"} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, n), []byte(n), 0o644))
	}
	long := strings.Repeat("t", 3000)
	require.NoError(t, os.Symlink(long, filepath.Join(dir, "z")))
	fd := open(t, dir)
	for range 2 { // from the start each time
		names, err := Names(fd)
		require.NoError(t, err)
		require.Equal(t, []string{"a", "b", "c", "z"}, names)
	}
	target, err := Readlink(fd, "z")
	require.NoError(t, err)
	require.Equal(t, long, target)
	data, err := os.ReadFile(ProcPath(fd, "b"))
	require.NoError(t, err)
	require.Equal(t, "b", string(data))
	st, err := os.Stat(ProcPath(fd, ""))
	require.NoError(t, err)
	require.True(t, st.IsDir())
}

// ListXattrs and GetXattr read an entry's xattrs beneath a descriptor,
// a symlink's own (never its target's), with either kernel call.
func TestXattrsBeneathADescriptor(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	if err := unix.Lsetxattr(file, "user.a", []byte("value"), 0); errors.Is(err, unix.ENOTSUP) {
		t.Skipf("the temp dir's filesystem has no user xattrs: %v", err)
	}
	require.NoError(t, os.Symlink("f", filepath.Join(dir, "link")))
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	for _, atCalls := range []bool{true, false} {
		noXattrAt.Store(!atCalls)
		size, err := ListXattrs(fd, "f", nil)
		require.NoError(t, err)
		buf := make([]byte, size)
		n, err := ListXattrs(fd, "f", buf)
		require.NoError(t, err)
		require.Equal(t, "user.a\x00", string(buf[:n]))
		size, err = GetXattr(fd, "f", "user.a", nil)
		require.NoError(t, err)
		val := make([]byte, size)
		n, err = GetXattr(fd, "f", "user.a", val)
		require.NoError(t, err)
		require.Equal(t, "value", string(val[:n]))
		_, err = GetXattr(fd, "f", "user.a", make([]byte, 2))
		require.ErrorIs(t, err, unix.ERANGE)
		n, err = ListXattrs(fd, "link", nil)
		require.NoError(t, err)
		require.Zero(t, n, "the symlink's own, not its target's")
	}
	noXattrAt.Store(false)
}

// What a listxattr call reads becomes names, read again if the list grew
// between its sizing and its read (ERANGE), which a real file changes
// only in a race, so the calls here are made up.
func TestXattrNames(t *testing.T) {
	const one, two = "user.a\x00", "user.a\x00trusted.overlay.opaque\x00"
	tests := []struct {
		name    string
		answers []string // what each call lists, in turn
		fail    error    // what every call answers, if not nil
		want    []string
		wantErr error
	}{
		{name: "none", answers: []string{""}},
		{name: "one", answers: []string{one, one}, want: []string{"user.a"}},
		{name: "grown since it was sized", answers: []string{one, two, two, two},
			want: []string{"user.a", "trusted.overlay.opaque"}},
		{name: "growing on every read", answers: slices.Repeat([]string{one, two}, readSizedTries), wantErr: unix.ERANGE},
		{name: "no xattrs on the filesystem", fail: unix.ENOTSUP},
		{name: "a failure", fail: unix.EIO, wantErr: unix.EIO},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			calls := 0
			list := func(buf []byte) (int, error) {
				if tc.fail != nil {
					return 0, tc.fail
				}
				answer := tc.answers[calls]
				calls++
				if buf == nil {
					return len(answer), nil
				}
				if len(buf) < len(answer) {
					return 0, unix.ERANGE
				}
				return copy(buf, answer), nil
			}
			got, err := XattrNames(list)
			require.ErrorIs(t, err, tc.wantErr)
			require.Equal(t, tc.want, got)
			if tc.fail == nil {
				require.Equal(t, len(tc.answers), calls, "every answer asked for")
			}
		})
	}
}
