package bench

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/snapshotter"
)

// runtimeBin is where make e2e builds containerd, ctr and runc.
func runtimeBin(b *testing.B) string {
	dir := os.Getenv("COWVOL_RUNTIME_BIN")
	if dir == "" {
		dir, _ = filepath.Abs("../test/e2e/bin/runtime")
	}
	for _, bin := range []string{"containerd", "containerd-shim-runc-v2", "ctr", "runc"} {
		if _, err := os.Stat(filepath.Join(dir, bin)); err != nil {
			b.Skipf("no %s in %s: make e2e builds containerd and runc there (or set COWVOL_RUNTIME_BIN)", bin, dir)
		}
	}
	return dir
}

// containerd runs a containerd of its own, its root on a filesystem of
// its own (rootSize bytes), with extra config, and returns a ctr for it.
func containerd(b *testing.B, bin, extra string, rootSize int64) func(args ...string) {
	dir := b.TempDir()
	root := testfs.Mount(b, testfs.XFS, rootSize)
	// A loop filesystem's first writes also allocate its tmpfs backing
	// (a first pull onto a fresh one took twice as long): written through
	// once, so that no path pays for it.
	warm := fmt.Sprintf("dd if=/dev/zero of=%s/warm bs=1M count=%d status=none && rm %s/warm", root, rootSize*7/8>>20, root)
	if out, err := exec.Command("sh", "-c", warm).CombinedOutput(); err != nil {
		b.Fatalf("warming %s: %v: %s", root, err, out)
	}
	sock := filepath.Join(dir, "containerd.sock")
	config := filepath.Join(dir, "config.toml")
	// As the e2e's: restrict_oom_score_adj, since root here lacks
	// CAP_SYS_RESOURCE.
	if err := os.WriteFile(config, fmt.Appendf(nil, `version = 3
root = %q
state = %q
[grpc]
  address = %q
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
%s`, root, filepath.Join(dir, "state"), sock, extra), 0o644); err != nil {
		b.Fatal(err)
	}
	path := bin + ":" + os.Getenv("PATH")
	cmd := exec.Command(filepath.Join(bin, "containerd"), "--config", config)
	cmd.Env = append(os.Environ(), "PATH="+path)
	b.Cleanup(func() {
		// What its shims and snapshots left mounted under its root, once
		// it is killed (cleanups run last first).
		_ = exec.Command("sh", "-c", "grep -o ' "+root+"/[^ ]*' /proc/mounts | sort -r | xargs -r -n1 umount -l").Run()
	})
	log := filepath.Join(dir, "containerd.log")
	startLogged(b, cmd, log)
	ctr := func(args ...string) {
		c := exec.Command(filepath.Join(bin, "ctr"), append([]string{"--address", sock}, args...)...)
		c.Env = append(os.Environ(), "PATH="+path)
		if out, err := c.CombinedOutput(); err != nil {
			raw, _ := os.ReadFile(log)
			b.Fatalf("ctr %s: %v: %s\ncontainerd's log:\n%s", strings.Join(args, " "), err, out, tail(string(raw), 4000))
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for exec.Command(filepath.Join(bin, "ctr"), "--address", sock, "version").Run() != nil {
		if time.Now().After(deadline) {
			raw, _ := os.ReadFile(log)
			b.Fatalf("containerd did not start:\n%s", tail(string(raw), 4000))
		}
		time.Sleep(100 * time.Millisecond)
	}
	return ctr
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// BenchmarkStepImage: a step's container from an image a cowvol volume
// holds (rootfs format: busybox and a tree of files), run on the volume's
// own layers through the plugin's snapshotter (ctr images pull of the
// :cowvol tag into it; ctr run on it), and pulled from the node plugin's
// loopback registry, unpacked and run, against `ctr images import` of the
// same image as an archive, and run, in the same run. Finding the image
// for a pull, once per volume, hashes its tree (the layer's digest):
// measured apart, before the pulls.
func BenchmarkStepImage(b *testing.B) {
	testfs.Need(b)
	socket := filepath.Join(b.TempDir(), "sn.sock")
	// As the README has a node configure it.
	ctr := containerd(b, runtimeBin(b), snapshotter.ContainerdConfig(socket, "linux/"+runtime.GOARCH), 8<<30)
	busybox := readBusybox(b)
	registry := plugintest.FreeAddr(b)
	n := &node{b: b, p: plugintest.Start(b, plugintest.Config{StateDir: testfs.Mount(b, testfs.XFS, 6<<30), Backend: "overlay",
		Args: []string{"--image-registry-address=" + registry, "--image-registry-auth=grace", "--image-snapshotter-endpoint=unix://" + socket}})}
	work := testfs.Mount(b, testfs.XFS, 6<<30)
	var rows []string
	for _, size := range []int64{100 << 20, 2 << 30} {
		handle := fmt.Sprintf("img-%dm", size>>20)
		captureImage(n, handle, size, busybox)
		n.settle()
		ref := registry + "/ci/" + handle + ":latest"
		run := func(id string) { ctr("run", "--rm", ref, id, "/bin/true") }
		timed := func(fn func()) time.Duration {
			start := time.Now()
			fn()
			return time.Since(start)
		}
		// What the first pull of a rootfs volume costs beyond the others:
		// finding the image hashes the tree for the layer's digest.
		find := timed(func() {
			resp, err := http.Get("http://" + registry + "/v2/ci/" + handle + "/manifests/latest")
			if err != nil {
				b.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b.Fatalf("the image's manifest: %s", resp.Status)
			}
		})
		first := timed(func() { ctr("images", "pull", "--plain-http", ref); run(handle + "-first") })
		archive := filepath.Join(work, handle+".tar")
		ctr("images", "export", archive, ref)
		ctr("images", "rm", "--sync", ref)
		// The first pull into this containerd's root ran slower however
		// its filesystem was warmed: both paths go twice, alternating, and
		// the second of each counts.
		remote := registry + "/ci/" + handle + ":cowvol"
		var imported, again, onVolume time.Duration
		for i := range 2 {
			imported = timed(func() { ctr("images", "import", archive); run(fmt.Sprintf("%s-import-%d", handle, i)) })
			ctr("images", "rm", "--sync", ref)
			again = timed(func() { ctr("images", "pull", "--plain-http", ref); run(fmt.Sprintf("%s-pull-%d", handle, i)) })
			ctr("images", "rm", "--sync", ref)
			onVolume = timed(func() {
				ctr("images", "pull", "--plain-http", "--snapshotter", "cowvol", remote)
				ctr("run", "--rm", "--snapshotter", "cowvol", remote, fmt.Sprintf("%s-snapshotter-%d", handle, i), "/bin/true")
			})
			ctr("images", "rm", "--sync", remote)
		}
		b.ReportMetric(onVolume.Seconds(), fmt.Sprintf("snapshotter-%dMiB-s", size>>20))
		b.ReportMetric(again.Seconds(), fmt.Sprintf("registry-%dMiB-s", size>>20))
		b.ReportMetric(imported.Seconds(), fmt.Sprintf("import-%dMiB-s", size>>20))
		rows = append(rows, fmt.Sprintf("| %d MiB | %.2f s (%s) | %.2f s | %.2f s | %.2f s (%s) | %.2f s |", size>>20,
			onVolume.Seconds(), ratio(imported, onVolume), find.Seconds(), first.Seconds(), again.Seconds(), ratio(imported, again), imported.Seconds()))
	}
	fmt.Println("\n| image volume | on the volume's layers (snapshotter): pull :cowvol and run | finding the image for a pull (once per volume) | " +
		"first pull and run from the loopback registry | pull and run | ctr images import and run |")
	fmt.Println("|---|---|---|---|---|---|")
	for _, r := range rows {
		fmt.Println(r)
	}
}

// readBusybox is the static busybox the benches' images run.
func readBusybox(b *testing.B) []byte {
	busybox, err := os.ReadFile("/bin/busybox")
	if err != nil {
		b.Skip("no /bin/busybox to make the image from (apt-get install busybox-static)")
	}
	return busybox
}

// captureImage captures on n a step image in rootfs format: busybox as
// bin/true and bin/sh, and a tree of size bytes of 64 KiB files.
func captureImage(n *node, handle string, size int64, busybox []byte) {
	b := n.b
	n.capture("", handle, func(dir string) {
		rootfs := filepath.Join(dir, "rootfs")
		genTree(b, filepath.Join(rootfs, "data"), int(size/(64<<10)), size)
		for _, f := range []struct{ name, link string }{{"bin/busybox", ""}, {"bin/true", "busybox"}, {"bin/sh", "busybox"}} {
			p := filepath.Join(rootfs, f.name)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				b.Fatal(err)
			}
			var err error
			if f.link != "" {
				err = os.Symlink(f.link, p)
			} else {
				err = os.WriteFile(p, busybox, 0o755)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, "metadata.json"), []byte(`{"env":["PATH=/bin"],"cmd":["/bin/true"]}`), 0o644); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkStepImageElsewhere: a :cowvol step image whose volume only
// another node holds, run through the snapshotter of a node that pulls it
// lazily, from `ctr images pull` of the :cowvol tag to the container's exit,
// for a 100 MiB and a 2 GiB image (1,600 and 32,768 files; issue 38: at
// most 2 s, flat in the size; issue 51: 30,000 files in 0.5 s), as an
// index and as a stub tree, against the same node pulling it eagerly, in
// the same run. Each case runs on a fresh puller with the page cache
// dropped.
func BenchmarkStepImageElsewhere(b *testing.B) {
	testfs.Need(b)
	socket := filepath.Join(b.TempDir(), "sn.sock")
	// The images' data stays in the plugins' volumes: containerd's root
	// holds manifests and configs.
	ctr := containerd(b, runtimeBin(b), snapshotter.ContainerdConfig(socket, "linux/"+runtime.GOARCH), 1<<30)
	busybox := readBusybox(b)
	peer := plugintest.FreeAddr(b)
	holder := &node{b: b, p: plugintest.Start(b, plugintest.Config{StateDir: testfs.Mount(b, testfs.XFS, 3<<30), Backend: "overlay",
		NodeID: "holder", Args: []string{"--peer-address=" + peer}})}
	pullerDisk := testfs.Mount(b, testfs.XFS, 3<<30)
	var rows []string
	for _, size := range []int64{100 << 20, 2 << 30} {
		handle := fmt.Sprintf("img-%dm", size>>20)
		captureImage(holder, handle, size, busybox)
		holder.settle()
		took, pulled := map[string]time.Duration{}, map[string]time.Duration{}
		states := map[string]string{}
		for _, mode := range []struct{ name, pullMode, index string }{{"lazy", "lazy", "true"}, {"stubs", "lazy", "false"}, {"eager", "eager", "false"}} {
			dropCaches(b)
			registry := plugintest.FreeAddr(b)
			puller := &node{b: b, p: plugintest.Start(b, plugintest.Config{StateDir: filepath.Join(pullerDisk, mode.name+"-"+handle), Backend: "overlay",
				NodeID: "puller", Args: []string{"--peers=holder=" + peer, "--pull-mode=" + mode.pullMode, "--pull-index=" + mode.index, "--pull-wait=5m",
					"--image-registry-address=" + registry, "--image-registry-auth=grace", "--image-snapshotter-endpoint=unix://" + socket}})}
			remote := registry + "/ci/" + handle + ":cowvol"
			start := time.Now()
			ctr("images", "pull", "--plain-http", "--snapshotter", "cowvol", remote)
			pulled[mode.name] = time.Since(start)
			ctr("run", "--rm", "--snapshotter", "cowvol", remote, handle+"-"+mode.name, "/bin/true")
			took[mode.name] = time.Since(start)
			v, err := puller.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: &nodev1.VolumeRef{Namespace: "ci", Handle: handle}})
			if err != nil {
				b.Fatal(err)
			}
			states[mode.name] = v.State
			ctr("images", "rm", "--sync", remote)
			if err := waitReady(puller, handle); err != nil {
				b.Fatal(err)
			}
			puller.p.Stop()
			dropTree(b, puller.p.StateDir)
			b.ReportMetric(took[mode.name].Seconds(), fmt.Sprintf("%s-%dMiB-s", mode.name, size>>20))
		}
		cell := func(mode string) string {
			return fmt.Sprintf("%.2f s (pulled in %.2f s; the volume %s when it exited)", took[mode].Seconds(), pulled[mode].Seconds(), states[mode])
		}
		rows = append(rows, fmt.Sprintf("| %d MiB | %s | %s; %s the index's | %s; %s the index's |", size>>20,
			cell("lazy"), cell("stubs"), ratio(took["stubs"], took["lazy"]), cell("eager"), ratio(took["eager"], took["lazy"])))
	}
	fmt.Println("\n| image volume, held by another node | ctr images pull :cowvol and ctr run, lazily as an index | as a stub tree | eagerly |")
	fmt.Println("|---|---|---|---|")
	for _, r := range rows {
		fmt.Println(r)
	}
}
