package test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// dataFleet is a controller with tokens and two node plugins serving
// their volumes to it, all on loopback.
func dataFleet(t *testing.T) (addr string, nodes map[string]*env, dial func(token string) *client.Client) {
	t.Helper()
	testfs.Need(t)
	dir := t.TempDir()
	tokens := filepath.Join(dir, "tokens")
	require.NoError(t, os.WriteFile(tokens, []byte("node-token-0123456789,system:cowvol-node,*\n"+
		"admin-token-0123456789,admin,*\nci-token-0123456789ab,ci-scheduler,ci\n"), 0o600))
	nodeToken := filepath.Join(dir, "node-token")
	require.NoError(t, os.WriteFile(nodeToken, []byte("node-token-0123456789\n"), 0o600))
	addr = plugintest.FreeAddr(t)
	plugintest.Start(t, plugintest.Config{Mode: "controller", Args: []string{"--api-address=" + addr, "--tokens-file=" + tokens}})
	nodes = map[string]*env{}
	for _, id := range []string{"node-a", "node-b"} {
		nodes[id] = newEnv(t, plugintest.Config{Backend: "overlay", NodeID: id, Args: []string{"--controller-address=" + addr,
			"--token-file=" + nodeToken, "--peer-address=" + plugintest.FreeAddr(t)}})
	}
	dial = func(token string) *client.Client {
		c, err := client.Dial(client.Options{Address: addr, Token: token})
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		return c
	}
	return addr, nodes, dial
}

// A scheduler reads volumes and writes new ones through the controller: a
// volume's merged tree (or a dir in it) as a tar, a single file with paths
// resolved inside the volume, uploads extracted strictly; a caller sees
// only what its namespaces may, and the CLI does the same with cp and cat.
func TestDataThroughTheController(t *testing.T) {
	addr, nodes, dial := dataFleet(t)
	a := nodes["node-a"]
	admin, ci := dial("admin-token-0123456789"), dial("ci-token-0123456789ab")
	ctx := context.Background()

	a.step("", "image", func(dir string) {
		write(t, dir, "etc/passwd", "root:x:0:0:volume's own:/root:/bin/sh\n")
		write(t, dir, "etc/gone", "deleted by the child")
		write(t, dir, "sub/deep/file", "deep")
		require.NoError(t, os.Symlink("/etc/passwd", filepath.Join(dir, "passwd-link")))
		require.NoError(t, os.Symlink("/etc", filepath.Join(dir, "etc-link")))
	})
	a.step("image", "task-out", func(dir string) {
		require.NoError(t, os.Remove(filepath.Join(dir, "etc/gone")))
		write(t, dir, "metadata.json", `{"ok":true}`)
	})
	a.captureIn("other", "private", nil)
	var want testfs.Tree
	a.read("task-out", func(dir string) { want = testfs.Describe(t, dir) })
	eventually(t, "the controller to see the volumes", func() bool {
		locs, err := admin.Lookup(ctx, volume.Ref{Namespace: "ci", Handle: "task-out"}, volume.Ref{Namespace: "other", Handle: "private"})
		return err == nil && locs[0].Found && locs[1].Found
	})

	read := func(c *client.Client, ns, handle, path, format string) (string, error) {
		var buf bytes.Buffer
		_, err := c.Read(ctx, volume.Ref{Namespace: ns, Handle: handle}, path, format, "", &buf, nil)
		return buf.String(), err
	}

	t.Run("single files, resolved inside the volume", func(t *testing.T) {
		tests := []struct {
			name, path, want string
			wantCode         codes.Code
		}{
			{"a file", "etc/passwd", "root:x:0:0:volume's own:/root:/bin/sh\n", codes.OK},
			{"a leading slash", "/metadata.json", `{"ok":true}`, codes.OK},
			{"an absolute symlink stays inside", "passwd-link", "root:x:0:0:volume's own:/root:/bin/sh\n", codes.OK},
			{"a symlinked dir stays inside", "etc-link/passwd", "root:x:0:0:volume's own:/root:/bin/sh\n", codes.OK},
			{"dot-dots stop at the root", "../../../../etc/passwd", "root:x:0:0:volume's own:/root:/bin/sh\n", codes.OK},
			{"a file the child deleted", "etc/gone", "", codes.NotFound},
			{"a dir", "etc", "", codes.FailedPrecondition},
			{"a NUL", "etc/\x00", "", codes.InvalidArgument},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				got, err := read(ci, "ci", "task-out", tc.path, "file")
				require.Equal(t, tc.wantCode, code(err), "%v", err)
				require.Equal(t, tc.want, got)
			})
		}
	})

	t.Run("a tree as a tar, whole or a dir of it", func(t *testing.T) {
		for _, enc := range []streamer.Encoding{streamer.Raw, streamer.Zstd} {
			dst := t.TempDir()
			var tarred bytes.Buffer
			_, err := ci.Read(ctx, volume.Ref{Namespace: "ci", Handle: "task-out"}, "", "tar", string(enc), &tarred, nil)
			require.NoError(t, err)
			_, err = streamer.Unpack(ctx, &tarred, enc, dst, streamer.DefaultLimits)
			require.NoError(t, err)
			require.Equal(t, want, testfs.Describe(t, dst), "the merged tree, as pods see it")
		}
		var tarred bytes.Buffer
		_, err := ci.Read(ctx, volume.Ref{Namespace: "ci", Handle: "task-out"}, "sub", "tar", "", &tarred, nil)
		require.NoError(t, err)
		dst := t.TempDir()
		_, err = streamer.Unpack(ctx, &tarred, streamer.Raw, dst, streamer.DefaultLimits)
		require.NoError(t, err)
		require.Equal(t, "deep", readFile(t, dst, "deep/file"))
		_, err = read(ci, "ci", "task-out", "metadata.json", "tar")
		require.Equal(t, codes.FailedPrecondition, code(err), "a file is read as a file")
	})

	t.Run("another namespace's volume is not found", func(t *testing.T) {
		_, err := read(ci, "other", "private", "file", "file")
		require.Equal(t, codes.NotFound, code(err))
		_, errMissing := read(ci, "other", "nothing-here", "file", "file")
		require.Equal(t, codes.NotFound, code(errMissing))
		got, err := read(admin, "other", "private", "file", "file")
		require.NoError(t, err)
		require.Equal(t, "other/private", got)
		_, err = read(dial(""), "ci", "task-out", "metadata.json", "file")
		require.Equal(t, codes.Unauthenticated, code(err))
	})

	t.Run("uploads", func(t *testing.T) {
		src := t.TempDir()
		write(t, src, "input/a.txt", "fly execute input")
		require.NoError(t, os.Symlink("a.txt", filepath.Join(src, "input/link")))
		require.NoError(t, os.Link(filepath.Join(src, "input/a.txt"), filepath.Join(src, "input/hard")))
		require.NoError(t, unix.Setxattr(filepath.Join(src, "input/a.txt"), "user.kept", []byte("y"), 0))
		wantUp := testfs.Describe(t, src)
		upload := func(c *client.Client, ns, handle string, tree string) (*controllerv1.VolumeLocation, error) {
			var buf bytes.Buffer
			_, err := streamer.Pack(ctx, tree, &buf, streamer.S2, streamer.SparseTar)
			require.NoError(t, err)
			return c.Write(ctx, &controllerv1.NewVolume{Ref: controllerv1.RefOf(volume.Ref{Namespace: ns, Handle: handle}),
				Encoding: string(streamer.S2), Properties: map[string]string{"kind": "upload"}}, &buf, nil)
		}
		loc, err := upload(ci, "ci", "uploaded", src)
		require.NoError(t, err)
		require.Len(t, loc.Nodes, 1)
		on := nodes[loc.Nodes[0]]
		on.read("uploaded", func(dir string) { require.Equal(t, wantUp, testfs.Describe(t, dir)) })
		eventually(t, "the upload to be reported", func() bool {
			locs, err := ci.Lookup(ctx, volume.Ref{Namespace: "ci", Handle: "uploaded"})
			return err == nil && locs[0].Found && locs[0].Properties["kind"] == "upload"
		})

		_, err = upload(ci, "ci", "uploaded", src)
		require.Equal(t, codes.AlreadyExists, code(err))
		_, err = upload(ci, "other", "mine-now", src)
		require.Equal(t, codes.PermissionDenied, code(err), "ci may not create other's volumes")

		evil := t.TempDir()
		require.NoError(t, unix.Mknod(filepath.Join(evil, "whiteout"), unix.S_IFCHR, 0))
		_, err = upload(ci, "ci", "evil", evil)
		require.Equal(t, codes.InvalidArgument, code(err), "an upload carries no whiteouts: %v", err)
		locs, err := ci.Lookup(ctx, volume.Ref{Namespace: "ci", Handle: "evil"})
		require.NoError(t, err)
		require.False(t, locs[0].Found, "nothing of a refused upload stays")
	})

	t.Run("kubectl cowvol cat and cp", func(t *testing.T) {
		bin := kubectlCowvol(t)
		parent := t.TempDir() // the CLI runs as a user too
		require.NoError(t, os.Chmod(parent, 0o777))
		require.NoError(t, os.Chmod(filepath.Dir(parent), 0o755))
		kubeconfig := filepath.Join(parent, "kubeconfig")
		require.NoError(t, os.WriteFile(kubeconfig, []byte("apiVersion: v1\nkind: Config\n"), 0o644))
		tokenFile := filepath.Join(parent, "token")
		require.NoError(t, os.WriteFile(tokenFile, []byte("ci-token-0123456789ab"), 0o644))
		run := func(uid uint32, stdin string, args ...string) (string, error) {
			cmd := exec.Command(bin, append([]string{"--controller-address=" + addr, "--kubeconfig=" + kubeconfig,
				"--token-file=" + tokenFile, "-n", "ci"}, args...)...)
			cmd.Stdin = strings.NewReader(stdin)
			if uid != 0 {
				cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
			}
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			err := cmd.Run()
			return out.String(), err
		}
		out, err := run(0, "", "cat", "task-out:metadata.json")
		require.NoError(t, err, out)
		require.Equal(t, `{"ok":true}`, out)

		// A user who is not root gets the files as their own.
		const nobody = 65534
		dst := filepath.Join(parent, "out")
		out, err = run(nobody, "", "cp", "task-out:", dst)
		require.NoError(t, err, out)
		require.Equal(t, `{"ok":true}`, readFile(t, dst, "metadata.json"))
		absent(t, dst, "etc/gone")
		var st unix.Stat_t
		require.NoError(t, unix.Lstat(filepath.Join(dst, "etc/passwd"), &st))
		require.Equal(t, uint32(nobody), st.Uid)

		src := t.TempDir()
		write(t, src, "x/y", "uploaded by the CLI")
		out, err = run(0, "", "cp", src, "from-cli:", "--property", "by=cli", "--ttl", "1h")
		require.NoError(t, err, out)
		require.Contains(t, out, "ci/from-cli uploaded to node ")
		out, err = run(0, "", "cat", "from-cli:x/y")
		require.NoError(t, err, out)
		require.Equal(t, "uploaded by the CLI", out)

		out, err = run(0, "", "cp", "from-cli:", "-")
		require.NoError(t, err)
		out2, err := run(0, out, "cp", "-", "from-stdin:")
		require.NoError(t, err, out2)
		out, err = run(0, "", "cat", "from-stdin:x/y")
		require.NoError(t, err, out)
		require.Equal(t, "uploaded by the CLI", out)

		out, err = run(0, "", "cp", "a", "b")
		require.Error(t, err)
		require.Contains(t, out, "one of SRC and DST must be a volume")
	})
}
