package test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

// cuttableProxy forwards TCP to a holder until Cut, which drops every
// connection and every later one: a holder that dies; or until Freeze,
// which forwards nothing more either way and closes nothing: a holder
// that hangs, or a link that drops every packet. With a rate, what the
// holder sends comes at about that many bytes a second, each connection
// alone: a slow link.
type cuttableProxy struct {
	addr   string
	rate   int
	mu     sync.Mutex
	conns  []net.Conn
	cut    bool
	frozen chan struct{}
}

func newCuttableProxy(t *testing.T, addr string, rate int) *cuttableProxy {
	t.Helper()
	p := &cuttableProxy{rate: rate, frozen: make(chan struct{})}
	t.Cleanup(p.Cut)
	p.addr = tcpProxy(t, addr, func(in, out net.Conn) {
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			in.Close()
			out.Close()
			return
		}
		p.conns = append(p.conns, in, out)
		p.mu.Unlock()
		go func() { p.copy(out, in, 0); out.Close() }()
		p.copy(in, out, p.rate)
		in.Close()
	})
	return p
}

// copy copies from to to, at rate bytes a second (0: as fast as it goes),
// until either end closes; once frozen, what it reads goes nowhere.
func (p *cuttableProxy) copy(to, from net.Conn, rate int) {
	buf := make([]byte, 16<<10)
	start, sent := time.Now(), 0
	for {
		n, err := from.Read(buf)
		select {
		case <-p.frozen:
			n = 0
		default:
		}
		if n > 0 {
			if _, werr := to.Write(buf[:n]); werr != nil {
				return
			}
			sent += n
			if rate == 0 {
				continue
			}
			if ahead := time.Duration(sent)*time.Second/time.Duration(rate) - time.Since(start); ahead > 0 {
				time.Sleep(ahead)
			}
		}
		if err != nil {
			return
		}
	}
}

// Freeze stops every connection, now and to come, without closing it.
func (p *cuttableProxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.frozen:
	default:
		close(p.frozen)
	}
}

// Cut drops every connection, now and to come.
func (p *cuttableProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for _, c := range p.conns {
		c.Close()
	}
}

// lazyNodes are a holder A and a node B that pulls from it lazily through
// a proxy that can cut A off.
func lazyNodes(t *testing.T) (a, b *env, proxy *cuttableProxy) {
	return lazyNodesAt(t, 0)
}

// lazyNodesAt are lazyNodes over a link of rate bytes a second (0: as
// fast as it goes). Over a slow link, a reader's file queues behind the
// stream's data on the one connection: B waits 30 s for data, not 1 s.
func lazyNodesAt(t *testing.T, rate int, bArgs ...string) (a, b *env, proxy *cuttableProxy) {
	t.Helper()
	return lazyNodesOn(t, testfs.XFS, rate, bArgs...)
}

// lazyNodesOn are lazyNodesAt with both state dirs on a filesystem of kind.
func lazyNodesOn(t *testing.T, kind testfs.Kind, rate int, bArgs ...string) (a, b *env, proxy *cuttableProxy) {
	t.Helper()
	testfs.Need(t, "mkfs."+string(kind))
	peerAddr := plugintest.FreeAddr(t)
	a = newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", StateDir: testfs.Mount(t, kind, 1<<30),
		Args: []string{"--peer-address=" + peerAddr}})
	proxy = newCuttableProxy(t, peerAddr, rate)
	wait := "1s"
	if rate > 0 {
		wait = "30s"
	}
	b = newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-b", StateDir: testfs.Mount(t, kind, 1<<30),
		Args: append([]string{"--peers=node-a=" + proxy.addr, "--pull-wait=" + wait, "--pull-mode=lazy"}, bArgs...)})
	return a, b, proxy
}

func volumeState(t *testing.T, e *env, handle string) string {
	got, err := e.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", handle)})
	if code(err) == codes.NotFound {
		return "gone"
	}
	require.NoError(t, err)
	return got.State
}

// A source held only on A is published on B at once, over stubs or an
// index: the step reads A's bytes, runs a program from it, writes over it
// and captures its output; the data arrives behind, and the volume becomes
// an ordinary ready one (an index's ready as the index while a step
// mounts it, then copied into a plain layer and unmounted once nothing
// does). The tree B publishes is the stub
// tree A kept after the capture (it has enough files to be kept); once
// filled, B keeps its own for the peers that pull from it.
func TestLazyPull(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) { lazyPull(t, form) })
	}
}

func lazyPull(t *testing.T, form pullForm) {
	a, b, _ := lazyNodesAs(t, form, 0)
	truePath, err := exec.LookPath("true")
	require.NoError(t, err)
	prog, err := os.ReadFile(truePath)
	require.NoError(t, err)
	var want testfs.Tree
	a.step("", "src", func(dir string) {
		testfs.LayerTree(t, dir)
		require.NoError(t, os.WriteFile(filepath.Join(dir, "true"), prog, 0o755))
		for i := range 8 {
			randomFile(t, dir, fmt.Sprintf("big-%d", i), 4<<20, uint64(i+1))
		}
		require.NoError(t, os.Mkdir(filepath.Join(dir, "many"), 0o755))
		for i := range keptStubsMin {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "many", strconv.Itoa(i)), []byte(strconv.Itoa(i*i)), 0o644))
		}
	})
	a.read("src", func(dir string) { want = testfs.Describe(t, dir) })
	eventually(t, "A to keep the source's stub tree", func() bool { return keptStubs(t, a, "src") })

	v := b.volume(map[string]string{driver.AttrSource: "src", driver.AttrCapture: "out"}, false)
	require.NoError(t, b.publishWaiting(v))
	if form.index {
		require.Len(t, erofsMountsUnder(t, b.p.StateDir), 1, "the source is an index mounted under the step's overlay")
	}
	reader := b.mount(map[string]string{driver.AttrSource: "src"}, true) // mounts it until it is ready
	require.Equal(t, 1.0, metricValue(t, a, fmt.Sprintf(`cowvol_peer_stub_trees_served_total{form=%q,source="kept"}`, form.stubTree())),
		"B published A's kept stub tree, as %s", form.stubTree())
	require.Zero(t, metricValue(t, a, fmt.Sprintf(`cowvol_peer_stub_trees_served_total{form=%q,source="walked"}`, form.stubTree())))
	require.Equal(t, strconv.Itoa(77*77), readFile(t, filepath.Join(v.Target, "many"), "77"))
	out, err := exec.Command(filepath.Join(v.Target, "true")).CombinedOutput()
	require.NoError(t, err, "running a program from a lazy input: %s", out)
	for i := range 8 {
		name := fmt.Sprintf("big-%d", i)
		require.Equal(t, fileDigestOf(t, &peerNode{env: a}, "src", name), fileDigest(t, filepath.Join(v.Target, name)), "the step reads A's %s", name)
	}
	write(t, v.Target, "result", "built")
	write(t, v.Target, "big-0", "written over")
	require.NoError(t, os.Remove(filepath.Join(v.Target, "big-1")))
	b.umount(v)
	require.Equal(t, "ready", volumeState(t, b, "out"), "the step's output is captured")
	b.read("out", func(dir string) {
		require.Equal(t, "written over", readFile(t, dir, "big-0"))
		_, err := os.Stat(filepath.Join(dir, "big-1"))
		require.ErrorIs(t, err, os.ErrNotExist)
		require.Equal(t, fileDigestOf(t, &peerNode{env: a}, "src", "big-2"), fileDigest(t, filepath.Join(dir, "big-2")))
	})

	eventually(t, "the lazily pulled volume to be ready", func() bool { return volumeState(t, b, "src") == "ready" })
	got, err := b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "src")})
	require.NoError(t, err)
	require.True(t, got.Synced)
	if form.index {
		// Ready as its index, no copy made, while a step mounts it: one
		// layer, the index, with A's sums kept beside it.
		file, sums := layerFile(t, b, "src", "true")
		var st syscall.Statfs_t
		require.NoError(t, syscall.Statfs(file, &st))
		require.EqualValues(t, 0xe0f5e1e2, st.Type, "ready as its index while a step mounts it")
		require.FileExists(t, sums)
		b.read("src", func(dir string) { require.Equal(t, want, testfs.Describe(t, dir)) })
	}
	b.umount(reader)
	// Once filled, it is A's tree to the last time stamp (a stat while a
	// file is being filled shows the fill's mtime).
	b.read("src", func(dir string) { require.Equal(t, want, testfs.Describe(t, dir)) })
	// The store says ready a moment before the fill is counted.
	eventually(t, "the fill counted", func() bool {
		return metricValue(t, b, `cowvol_lazy_fills_total{result="ok"}`) > 0
	})
	eventually(t, "no index mounted once nothing mounts it", func() bool { return len(erofsMountsUnder(t, b.p.StateDir)) == 0 })
	eventually(t, "B to keep the filled source's stub tree", func() bool { return keptStubs(t, b, "src") })
	// B's layer keeps A's table of sums (an index's copy kept the sums its
	// extents were checked against), which is what it holds.
	requireKeptSums(t, a, b, "src", "true")
	b.noLeaks(t)
}

// A layer whose stub tree its holder does not keep (made before trees were
// kept, or its kept tree lost) is walked for the first pull of its stubs,
// and kept from then on.
func TestLazyPullOfATreeNotKept(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) { lazyPullOfATreeNotKept(t, form) })
	}
}

func lazyPullOfATreeNotKept(t *testing.T, form pullForm) {
	a, b, _ := lazyNodesAs(t, form, 0)
	a.step("", "src", func(dir string) {
		for i := range keptStubsMin {
			require.NoError(t, os.WriteFile(filepath.Join(dir, strconv.Itoa(i)), []byte(strconv.Itoa(i*i)), 0o644))
		}
	})
	eventually(t, "A to keep the source's stub tree", func() bool { return keptStubs(t, a, "src") })
	kept, err := filepath.Glob(filepath.Join(a.p.StateDir, "volumes", "ci", "src", "*.stubs"))
	require.NoError(t, err)
	require.NoError(t, os.Remove(kept[0]))

	v := b.volume(map[string]string{driver.AttrSource: "src"}, true)
	require.NoError(t, b.publishWaiting(v))
	require.Equal(t, 1.0, metricValue(t, a, fmt.Sprintf(`cowvol_peer_stub_trees_served_total{form=%q,source="walked"}`, form.stubTree())))
	require.Equal(t, strconv.Itoa(77*77), readFile(t, v.Target, "77"))
	b.umount(v)
	eventually(t, "A to keep the tree it walked", func() bool { return keptStubs(t, a, "src") })
}

// keptStubsMin is the fewest files a layer has for its node to keep its
// stub tree (pkg/node's).
const keptStubsMin = 4096

// keptStubs says whether e keeps the stub tree of its volume handle's
// layer (pkg/cache: <layer>.stubs beside it).
func keptStubs(t *testing.T, e *env, handle string) bool {
	t.Helper()
	matches, err := filepath.Glob(filepath.Join(e.p.StateDir, "volumes", "ci", handle, "*.stubs"))
	require.NoError(t, err)
	return len(matches) > 0
}

// A holder cut off mid-fill, with no other: each file a reader opens is
// either all there or answers EIO (never holes, of a stub or of an
// index's blob), the volume fails, and the step over it captures nothing.
func TestLazyPullWithItsHolderGone(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) {
			a, b, proxy := lazyNodesAs(t, form, 0)
			sums := a.captureRandom("src", 48, 4<<20)
			v := b.volume(map[string]string{driver.AttrSource: "src", driver.AttrCapture: "out"}, false)
			require.NoError(t, b.publishWaiting(v))
			proxy.Cut()
			start := time.Now()
			eio := 0
			for name, sum := range sums {
				err := readsAs(filepath.Join(v.Target, name), sum)
				if errors.Is(err, syscall.EIO) {
					eio++
					continue
				}
				require.NoError(t, err)
			}
			require.Positive(t, eio, "192 MiB crossed a cut link")
			require.Less(t, time.Since(start), time.Minute, "readers are not held for long")
			eventually(t, "the volume that cannot be filled to fail", func() bool {
				s := volumeState(t, b, "src")
				return s == "failed" || s == "gone"
			})
			b.umount(v)
			require.Equal(t, "gone", volumeState(t, b, "out"), "a step whose input was incomplete captures nothing")
		})
	}
}

// A holder that hangs mid-fill (alive, its connections open, sending
// nothing) holds no reader for long: each file a reader opens is either
// all there or answers EIO within about --pull-wait, whether the
// background stream, a read-ahead or a reader's own fetch was bringing it.
func TestLazyPullWithItsHolderHung(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) { lazyPullWithItsHolderHung(t, form) })
	}
}

func lazyPullWithItsHolderHung(t *testing.T, form pullForm) {
	// Slow enough to freeze mid-stream; a shorter wait than a slow link's.
	a, b, proxy := lazyNodesAs(t, form, 8<<20, "--pull-wait=5s")
	const files = 24
	a.step("", "src", func(dir string) {
		for i := range files {
			randomFile(t, dir, fmt.Sprintf("f-%02d", i), 2<<20, uint64(i+1))
		}
	})
	v := b.volume(map[string]string{driver.AttrSource: "src", driver.AttrCapture: "out"}, false)
	require.NoError(t, b.publishWaiting(v))
	time.Sleep(500 * time.Millisecond) // the stream is under way
	// An operator asking why its data is kept is told: a fill writes it.
	filling, err := b.p.NodeAPI.GetVolume(context.Background(), &nodev1.GetVolumeRequest{Ref: vref("ci", "src")})
	require.NoError(t, err)
	require.Equal(t, "filling", filling.State)
	require.Equal(t, int32(1), filling.HoldingFills)
	proxy.Freeze()
	type result struct {
		eio  int
		errs []error
	}
	done := make(chan result, 1)
	go func() { // not t's: it may outlive a test that gave up on it
		var r result
		for i := range files {
			if _, err := os.ReadFile(filepath.Join(v.Target, fmt.Sprintf("f-%02d", i))); errors.Is(err, syscall.EIO) {
				r.eio++
			} else if err != nil {
				r.errs = append(r.errs, err)
			}
		}
		done <- r
	}()
	select {
	case r := <-done:
		require.Empty(t, r.errs)
		require.Positive(t, r.eio, "48 MiB crossed a frozen link")
	case <-time.After(time.Minute): // --pull-wait is 5 s
		t.Fatal("a reader is held by a holder that hangs")
	}
	eventually(t, "the volume that cannot be filled to fail", func() bool {
		s := volumeState(t, b, "src")
		return s == "failed" || s == "gone"
	})
	b.umount(v)
	require.Equal(t, "gone", volumeState(t, b, "out"), "a step whose input was incomplete captures nothing")
}

// A puller SIGKILLed mid-fill comes back with the volume that was filling
// failed (its readers, let go by the kernel, may have read holes), and the
// step that mounted it captures nothing.
func TestLazyPullerKilledMidFill(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) {
			a, b, _ := lazyNodesAs(t, form, 0)
			a.step("", "src", func(dir string) {
				for i := range 48 {
					randomFile(t, dir, fmt.Sprintf("f-%02d", i), 4<<20, uint64(i+1))
				}
			})
			v := b.volume(map[string]string{driver.AttrSource: "src", driver.AttrCapture: "out"}, false)
			require.NoError(t, b.publishWaiting(v))
			write(t, v.Target, "result", "built")
			b.p.Restart()
			require.Contains(t, []string{"failed", "gone"}, volumeState(t, b, "src"), "a volume whose filler died is not ready")
			b.umount(v)
			require.Equal(t, "gone", volumeState(t, b, "out"), "a step whose input may have read holes captures nothing")
			eventually(t, "the failed volume's data freed", func() bool { return len(erofsMountsUnder(t, b.p.StateDir)) == 0 })
			b.noLeaks(t)
		})
	}
}

// The same with the step's output in a volume of its own, as a scheduler's
// steps have it (inputs and outputs are separate volumes of one pod): the
// output is not captured either, though it never mounted the input, nor
// is one published after the plugin came back; another pod's output is.
func TestLazyPullerKilledMidFillOutputApart(t *testing.T) {
	a, b, _ := lazyNodes(t)
	a.step("", "src", func(dir string) {
		for i := range 48 {
			randomFile(t, dir, fmt.Sprintf("f-%02d", i), 4<<20, uint64(i+1))
		}
	})
	pod := kubeletsim.NewPod("ci", "reader")
	in := kubeletsim.NewInlineVolume(b.p.KubeletDir, pod, "in", map[string]string{driver.AttrSource: "src"})
	in.ReadOnly = true
	out := kubeletsim.NewInlineVolume(b.p.KubeletDir, pod, "out", map[string]string{driver.AttrCapture: "out"})
	bystander := b.volume(map[string]string{driver.AttrCapture: "bystander"}, false)
	for _, v := range []kubeletsim.InlineVolume{in, out} {
		require.NoError(t, os.MkdirAll(filepath.Dir(v.Target), 0o750))
	}
	require.NoError(t, b.publishWaiting(in))
	require.NoError(t, b.publish(out))
	require.NoError(t, b.publish(bystander))
	write(t, out.Target, "result", "built from what may be holes")
	write(t, bystander.Target, "result", "built from nothing lazy")
	b.p.Restart()
	require.Contains(t, []string{"failed", "gone"}, volumeState(t, b, "src"), "a volume whose filler died is not ready")
	// A volume of the pod published only now (the kubelet retried it
	// while the plugin was down): the step starts after it, over holes.
	late := kubeletsim.NewInlineVolume(b.p.KubeletDir, pod, "late", map[string]string{driver.AttrCapture: "late"})
	require.NoError(t, os.MkdirAll(filepath.Dir(late.Target), 0o750))
	require.NoError(t, b.publish(late))
	write(t, late.Target, "result", "built after the plugin came back, from holes")
	for _, v := range []kubeletsim.InlineVolume{in, out, late, bystander} {
		b.umount(v)
	}
	require.Equal(t, "gone", volumeState(t, b, "out"), "the output of a step whose input may have read holes is not captured")
	require.Equal(t, "gone", volumeState(t, b, "late"), "nor one its pod mounted after the plugin came back")
	require.Equal(t, "ready", volumeState(t, b, "bystander"), "another pod's output is captured")
	b.noLeaks(t)
}

// A lazy pull records the order its step opens files in under the step's
// read profile, and the next lazy pull under that name (the next build's
// new version of the input) fetches those files first: over a slow link,
// they are here while most of the rest is still on its way. As stubs or an
// index alike.
func TestLazyPullReadsInTheRecordedOrder(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) {
			a, b, _ := lazyNodesAs(t, form, 6<<20)
			o := newOrderedInputs(t, a)
			o.form = form
			o.readUnder(b, "v1", "main/unit/repo")
			o.arriveInOrder(b, "v2", "main/unit/repo")
			eventually(t, "the indexes unmounted", func() bool { return len(erofsMountsUnder(t, b.p.StateDir)) == 0 })
			b.noLeaks(t)
		})
	}
}

// The order one node recorded reaches the others through the controller:
// a node that never ran the job fetches the files its steps read first,
// in the first lazy pull under the profile; another namespace's pull under
// the same name finds no order.
func TestLazyPullReadsInTheFleetsOrder(t *testing.T) {
	testfs.Need(t, "mkfs.xfs")
	f := startFleet(t, nil)
	peerAddr := plugintest.FreeAddr(t)
	proxy := newCuttableProxy(t, peerAddr, 6<<20)
	a := newEnv(t, plugintest.Config{Backend: "overlay", NodeID: "node-a", StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
		Args: []string{"--controller-address=" + f.addr, "--peer-address=" + peerAddr, "--peer-advertise-address=" + proxy.addr}})
	lazyNode := func(id string) *env {
		return newEnv(t, plugintest.Config{Backend: "overlay", NodeID: id, StateDir: testfs.Mount(t, testfs.XFS, 1<<30),
			Args: []string{"--controller-address=" + f.addr, "--pull-wait=30s", "--pull-mode=lazy", "--pull-index=false"}})
	}
	b, c := lazyNode("node-b"), lazyNode("node-c") // stub trees, as newOrderedInputs reads them
	o := newOrderedInputs(t, a)
	for _, handle := range []string{"v1", "v2"} {
		eventually(t, "the controller to know where "+handle+" is", func() bool {
			resp, err := f.api.LookupVolumes(context.Background(), &controllerv1.LookupVolumesRequest{Refs: []*controllerv1.VolumeRef{cref("ci", handle)}})
			require.NoError(t, err)
			return len(resp.Volumes[0].Nodes) == 1
		})
	}
	o.readUnder(b, "v1", "main/unit/repo")
	require.Equal(t, 1.0, metricValue(t, b, `cowvol_lazy_read_orders_total{source="none"}`), "the first node had no order")
	eventually(t, "node-b to share the order it recorded", func() bool {
		_, err := f.registry.GetReadOrder(context.Background(), &controllerv1.GetReadOrderRequest{Namespace: "ci", Name: "main/unit/repo"})
		return err == nil
	})
	_, err := f.registry.GetReadOrder(context.Background(), &controllerv1.GetReadOrderRequest{Namespace: "other", Name: "main/unit/repo"})
	require.Equal(t, codes.NotFound, code(err), "another namespace's profile of the same name has no order")
	o.arriveInOrder(c, "v2", "main/unit/repo")
	require.Equal(t, 1.0, metricValue(t, c, `cowvol_lazy_read_orders_total{source="fleet"}`), "node-c read in node-b's order")
	b.noLeaks(t)
	c.noLeaks(t)
}

// orderedInputs are two versions of an input on one node, of files a
// step reads in the reverse of the order a walk of the layer meets them:
// a stream in walk order would bring them last.
type orderedInputs struct {
	t              *testing.T
	walked, read   []string
	files, fileLen int
	form           pullForm // how the puller pulls (stubs unless said)
}

func newOrderedInputs(t *testing.T, holder *env) *orderedInputs {
	o := &orderedInputs{t: t, files: 24, fileLen: 1 << 20}
	for _, version := range []string{"v1", "v2"} {
		holder.step("", version, func(dir string) {
			for i := range o.files {
				randomFile(t, dir, fmt.Sprintf("f-%02d", i), o.fileLen, uint64(len(version)*100+i))
			}
		})
	}
	holder.read("v1", func(dir string) {
		d, err := os.Open(dir)
		require.NoError(t, err)
		o.walked, err = d.Readdirnames(-1)
		require.NoError(t, err)
		require.NoError(t, d.Close())
	})
	require.Len(t, o.walked, o.files)
	o.read = []string{o.walked[o.files-1], o.walked[o.files-2], o.walked[o.files-3]}
	return o
}

// readUnder runs a step on n that reads the files, lazily, under profile.
func (o *orderedInputs) readUnder(n *env, handle, profile string) {
	v := n.volume(map[string]string{driver.AttrSource: handle, driver.AttrReadProfile: profile}, true)
	require.NoError(o.t, n.publishWaiting(v))
	for _, name := range o.read {
		_, err := os.ReadFile(filepath.Join(v.Target, name))
		require.NoError(o.t, err)
	}
	eventually(o.t, handle+" to be filled", func() bool { return volumeState(o.t, n, handle) == "ready" })
	n.umount(v)
}

// arriveInOrder pulls handle lazily on n under profile, reading nothing,
// and checks that the files a step read before arrive before most others.
func (o *orderedInputs) arriveInOrder(n *env, handle, profile string) {
	t := o.t
	v := n.volume(map[string]string{driver.AttrSource: handle, driver.AttrReadProfile: profile}, true)
	require.NoError(t, n.publishWaiting(v))
	filled := func(name string) bool {
		if o.form.index {
			return o.extentFilled(n, handle, name)
		}
		stubs, err := filepath.Glob(filepath.Join(n.p.StateDir, "volumes", "ci", handle, "*", name))
		require.NoError(t, err)
		require.Len(t, stubs, 1, name)
		var st unix.Stat_t
		require.NoError(t, unix.Stat(stubs[0], &st)) // a stat is not held: it reads no data
		return st.Blocks*512 >= int64(o.fileLen)
	}
	eventually(t, "the files the profile names to arrive", func() bool {
		for _, name := range o.read {
			if !filled(name) {
				return false
			}
		}
		return true
	})
	others := 0
	for _, name := range o.walked[:o.files-3] {
		if filled(name) {
			others++
		}
	}
	require.Less(t, others, (o.files-3)/2, "the files read first last time come before most others")
	eventually(t, handle+" to be filled", func() bool { return volumeState(t, n, handle) == "ready" })
	n.umount(v)
}

// extentFilled says whether the data of name, of handle pulled on n as an
// index, is in its blob: the blob holds the files' data in the order of
// their names, each at a block-aligned extent of its own, from its start
// (the files are all of one size, a whole number of blocks: checked), and
// an extent not filled is a hole.
func (o *orderedInputs) extentFilled(n *env, handle, name string) bool {
	t := o.t
	blobs, err := filepath.Glob(filepath.Join(n.p.StateDir, "volumes", "ci", handle, "*.index", "blob"))
	require.NoError(t, err)
	require.Len(t, blobs, 1)
	f, err := os.Open(blobs[0])
	require.NoError(t, err)
	defer f.Close()
	st, err := f.Stat()
	require.NoError(t, err)
	require.Equal(t, int64(o.files*o.fileLen), st.Size(), "the files' extents, end to end")
	sorted := slices.Sorted(slices.Values(o.walked))
	at := int64(slices.Index(sorted, name) * o.fileLen)
	hole, err := unix.Seek(int(f.Fd()), at, unix.SEEK_HOLE) // a seek reads nothing: not held
	require.NoError(t, err)
	return hole >= at+int64(o.fileLen)
}

// The data a lazy pull will fetch is bounded as an eager pull's stream is
// (--stream-size-limit), by the sizes the holder gave the stubs: a layer
// over the limit is refused before it is mountable, and leaves nothing.
func TestLazyPullWithinTheStreamLimit(t *testing.T) {
	for _, form := range pullForms {
		t.Run(form.name, func(t *testing.T) { lazyPullWithinTheStreamLimit(t, form) })
	}
}

func lazyPullWithinTheStreamLimit(t *testing.T, form pullForm) {
	a, b, _ := lazyNodesAs(t, form, 0, "--stream-size-limit=6Mi")
	a.step("", "small", func(dir string) { randomFile(t, dir, "f", 4<<20, 1) })
	a.step("", "big", func(dir string) {
		for i := range 2 {
			randomFile(t, dir, fmt.Sprintf("f-%d", i), 4<<20, uint64(i+1))
		}
	})
	v := b.volume(map[string]string{driver.AttrSource: "small"}, true)
	require.NoError(t, b.publishWaiting(v))
	b.umount(v)

	v = b.volume(map[string]string{driver.AttrSource: "big"}, true)
	err := b.publishWaiting(v)
	require.Equal(t, codes.Unavailable, code(err), "as an eager pull past the limit: retried, with a backoff: %v", err)
	require.Contains(t, err.Error(), "stream size limit")
	require.Equal(t, "gone", volumeState(t, b, "big"), "no stubs or index are left")
	form.settled(t, b)
	b.noLeaks(t)
}

// The small files of a lazily pulled tree come with it whole: a step has
// them before it starts, even with the holder gone right after the
// publish, while a large file is a stub that its holder's loss fails.
func TestLazyPullCarriesSmallFilesWithTheTree(t *testing.T) {
	// A large file takes seconds, so the cut comes first; its reader
	// gets EIO once the holder has been gone for the pull's wait.
	a, b, proxy := lazyNodesAt(t, 1<<20, "--pull-wait=5s")
	a.step("", "src", func(dir string) {
		for i := range 20 {
			randomFile(t, dir, fmt.Sprintf("small-%02d", i), 1000+i*300, uint64(i+1))
		}
		randomFile(t, dir, "large", 8<<20, 99)
	})
	sums := map[string]string{}
	a.read("src", func(dir string) {
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		for _, e := range entries {
			sums[e.Name()] = fileDigest(t, filepath.Join(dir, e.Name()))
		}
	})
	require.Len(t, sums, 21)

	v := b.volume(map[string]string{driver.AttrSource: "src"}, true)
	require.NoError(t, b.publishWaiting(v))
	proxy.Cut()
	for name, sum := range sums {
		if name == "large" {
			continue
		}
		require.Equal(t, sum, fileDigest(t, filepath.Join(v.Target, name)), "%s came with the tree", name)
	}
	_, err := os.ReadFile(filepath.Join(v.Target, "large"))
	require.ErrorIs(t, err, syscall.EIO, "a large file is a stub, which the cut fails")
	b.umount(v)
}

// captureRandom captures handle on e holding files files of size random
// bytes each (f-00, f-01, ...), and returns each one's SHA-256.
func (e *env) captureRandom(handle string, files, size int) map[string]string {
	e.t.Helper()
	e.step("", handle, func(dir string) {
		for i := range files {
			randomFile(e.t, dir, fmt.Sprintf("f-%02d", i), size, uint64(i+1))
		}
	})
	sums := map[string]string{}
	e.read(handle, func(dir string) {
		for i := range files {
			name := fmt.Sprintf("f-%02d", i)
			sums[name] = fileDigest(e.t, filepath.Join(dir, name))
		}
	})
	return sums
}

// readsAs reads the file at path whole, and says why it could not or why
// what it read is not the data whose SHA-256 is sum (holes, say).
func readsAs(path, sum string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if digest := sha256.Sum256(data); hex.EncodeToString(digest[:]) != sum {
		return fmt.Errorf("%s read with data that is not the file's (holes?)", filepath.Base(path))
	}
	return nil
}

// startFillKeeper runs `cowvol-plugin fill-keeper`, as the node plugin
// pod's sidecar does, for the test's life, and returns its socket.
func startFillKeeper(t *testing.T, grace time.Duration) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cowvol-keeper-") // (a socket's path is short)
	require.NoError(t, err)
	sock := filepath.Join(dir, "keeper.sock")
	cmd := exec.Command(plugintest.Binary(t), "fill-keeper", "--socket="+sock, "--grace="+grace.String(), "-v=2")
	log, err := os.Create(filepath.Join(dir, "log"))
	require.NoError(t, err)
	cmd.Stdout, cmd.Stderr = log, log
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			out, _ := os.ReadFile(log.Name())
			t.Logf("fill keeper log:\n%s", out)
		}
		log.Close()
		os.RemoveAll(dir)
	})
	eventually(t, "the fill keeper to listen", func() bool { return testfs.Listening(sock) })
	return sock
}

// A node plugin SIGKILLed while a step reads files not filled yet (its
// holder sending nothing more) lets no reader read a hole: the fill keeper
// holds every reader while the plugin is down, those that came meanwhile
// too, and the restarted plugin answers them EIO (the volume that was
// filling is failed), or the keeper does once its grace passed with no
// plugin back. A step with an output captures nothing; one without only
// reads. Without the keeper, the dying plugin's group let the readers
// through to the stubs' holes.
func TestLazyReadersHeldAcrossAPluginRestart(t *testing.T) {
	tests := []struct {
		name       string
		withOutput bool
		grace      time.Duration
		down       time.Duration
	}{
		{name: "a step without an output", grace: time.Hour, down: 3 * time.Second},
		{name: "a step with an output", withOutput: true, grace: time.Hour, down: 3 * time.Second},
		{name: "no plugin back within the grace", grace: 2 * time.Second, down: 6 * time.Second},
	}
	for _, form := range pullForms {
		for _, tc := range tests {
			t.Run(form.name+"/"+tc.name, func(t *testing.T) { lazyReadersHeldAcrossAPluginRestart(t, form, tc.withOutput, tc.grace, tc.down) })
		}
	}
}

// lazyReadersHeldAcrossAPluginRestart is a case of
// TestLazyReadersHeldAcrossAPluginRestart.
func lazyReadersHeldAcrossAPluginRestart(t *testing.T, form pullForm, withOutput bool, grace, down time.Duration) {
	keeper := startFillKeeper(t, grace)
	// 48 files of 4 MiB at 4 MiB a second: most are not filled
	// when the link freezes.
	a, b, proxy := lazyNodesAs(t, form, 4<<20, "--fill-keeper-socket="+keeper, "--pull-wait=10m")
	const files = 48
	sums := a.captureRandom("src", files, 4<<20)
	attrs := map[string]string{driver.AttrSource: "src"}
	if withOutput {
		attrs[driver.AttrCapture] = "out"
	}
	v := b.volume(attrs, !withOutput)
	require.NoError(t, b.publishWaiting(v))
	proxy.Freeze()

	type result struct {
		name string
		err  error
		at   time.Time
	}
	results := make(chan result, files+1)
	read := func(name string) {
		results <- result{name, readsAs(filepath.Join(v.Target, name), sums[name]), time.Now()}
	}
	for i := range files - 1 {
		go read(fmt.Sprintf("f-%02d", i))
	}
	time.Sleep(time.Second) // the readers of files not filled are held
	// Stamped before the kill: Kill returns once the process is
	// reaped, after the keeper may have seen it go.
	killed := time.Now()
	b.p.Kill()
	time.Sleep(time.Second)
	go read(fmt.Sprintf("f-%02d", files-1)) // a reader while no plugin runs
	time.Sleep(down - time.Second)
	restarted := time.Now()
	b.p.Restart()

	eio := 0
	for range files {
		var r result
		select {
		case r = <-results:
		case <-time.After(2 * time.Minute):
			t.Fatal("readers still held two minutes after the plugin came back")
		}
		if r.err == nil {
			continue
		}
		require.ErrorIs(t, r.err, syscall.EIO, "%s: only the file's data or EIO", r.name)
		eio++
		require.True(t, r.at.After(killed.Add(grace)) || r.at.After(restarted),
			"%s answered EIO %s after the plugin died: held until the next plugin or the keeper's grace", r.name, r.at.Sub(killed))
		if grace < down {
			require.True(t, r.at.Before(restarted), "%s: the keeper answers once its grace passed", r.name)
		}
	}
	require.Greater(t, eio, files/2, "most files were not filled when the link froze")
	require.Contains(t, []string{"failed", "gone"}, volumeState(t, b, "src"), "a volume whose filler died is not ready")
	if withOutput {
		write(t, v.Target, "result", "built from what could be read")
	}
	proxy.Cut()
	b.umount(v)
	require.Equal(t, "gone", volumeState(t, b, "out"), "nothing captured from a step whose input was not whole")
}

// A holder whose plugin restarts (SIGKILLed, as a crash or a roll of the
// node plugins does) is waited for: readers of files not filled yet on the
// puller wait until it is back and get its bytes, not EIO; only a holder
// gone for longer than --pull-wait fails them.
func TestLazyPullWaitsForARestartingHolder(t *testing.T) {
	a, b, _ := lazyNodesAt(t, 4<<20, "--pull-wait=30s")
	const files = 24
	sums := a.captureRandom("src", files, 1<<20)
	v := b.volume(map[string]string{driver.AttrSource: "src"}, true)
	require.NoError(t, b.publishWaiting(v))
	a.p.Kill()
	errs := make(chan error, files)
	for name, sum := range sums {
		go func() { errs <- readsAs(filepath.Join(v.Target, name), sum) }()
	}
	time.Sleep(3 * time.Second) // the readers of what was not filled wait
	a.p.Restart()
	for range files {
		require.NoError(t, <-errs, "a reader waits for its holder's plugin to come back")
	}
	eventually(t, "the volume to be filled", func() bool { return volumeState(t, b, "src") == "ready" })
	b.umount(v)
}
