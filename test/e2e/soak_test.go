//go:build e2e

package e2e

import (
	"bufio"
	"context"
	"crypto/md5"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/examples/scheduler"
	"github.com/concourse/cowvol/internal/tb"
	cowvolume "github.com/concourse/cowvol/pkg/volume"
	"github.com/concourse/cowvol/test/localcluster"
)

// The soak's builds: a get writes soakFiles files of soakFileBytes (64
// MiB) on one node; a step pinned to the next node reads them one by one
// (its input pulled across the bridge), a step placed by the Cache API
// sums them, and a last step, placed next to its three inputs, prints
// what the build made. Every node's link carries soakLink, so that a pull
// lasts a few seconds and a fault can land in one.
const (
	soakFiles, soakFileBytes = 1000, 65536
	soakLink                 = "100mbit"
	// soakBuilds run side by side, without pause.
	soakBuilds = 2
	// soakDeadline bounds a step's attempt: one that runs longer hung.
	soakDeadline = 5 * time.Minute
	// soakAttempts is how many times a step runs before its build fails.
	soakAttempts = 4
)

// TestSoak (make soak): builds without pause on a fleet of three real
// kubelets with cowvol installed by its chart, and a fault every few
// seconds, at random: a plugin SIGKILLed, a kubelet restarted, the holder
// of an input being pulled SIGKILLed, a node's disk filled past its high
// watermark, the controller's leader deleted, a node cordoned. At the end
// every finished build's outputs equal the reference, every failed
// attempt failed with a reason and was retried, no attempt hung past its
// deadline, and, once the CI's GC (each build destroying its outputs, and a
// pass of examples/scheduler's Reconcile every 20 s) has run, no node is
// left with a step's mount, process, view or volume.
func TestSoak(t *testing.T) {
	minutes, _ := strconv.Atoi(os.Getenv("COWVOL_SOAK_MINUTES"))
	if minutes <= 0 {
		t.Skip("the soak runs under make soak (COWVOL_SOAK_MINUTES: how many minutes)")
	}
	f := startFleet(t, 3)
	f.InstallCowvol()
	s := &soak{f: f, rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1)), faults: map[string]int{},
		cordoned: map[string]bool{}, full: map[string]bool{}, sent: map[string]float64{}, killed: map[string]time.Time{}, pulls: map[string]bool{}, collected: map[string]bool{}}
	s.sum = s.referenceSum()
	t.Cleanup(func() { keepLogs(t, f) })
	for _, n := range f.Nodes {
		n.Host.Throttle(soakLink)
	}
	log, err := os.Create(filepath.Join(f.Work, "logs", "soak.log"))
	require.NoError(t, err)
	defer log.Close()
	s.log = log

	ctx, stop := context.WithTimeout(context.Background(), time.Duration(minutes)*time.Minute)
	defer stop()
	started := time.Now()
	builds := s.runBuilds(ctx)
	s.injectFaults(ctx)
	s.undoAll()
	outcomes := builds()
	took := time.Since(started)
	s.scrapeSent()
	s.check(outcomes)
	s.report(outcomes, took)
}

// soak is a soak's state: what it did, and what it must undo.
type soak struct {
	f   *fleet
	rng *rand.Rand
	// sum is md5sum's line for the get's files' sums: what every build's
	// sums come to; sums are those lines.
	sum  string
	sums []string
	log  *os.File
	// faults counts what was injected, by kind.
	faults map[string]int
	// undos are what injected faults leave to be put back, and when.
	undos []soakUndo
	// cordoned and full are the nodes cordoned and filled now.
	cordoned, full map[string]bool
	// killed is when each node's plugin was last SIGKILLed, and pulls the
	// step pods whose pull had its holder killed.
	killed map[string]time.Time
	pulls  map[string]bool
	// collected are the volumes the CI's GC found that no build owned (a
	// destroy lost when the leader moved, or not yet carried out).
	collected map[string]bool
	// sent is each node's peers' sent-bytes counter last read, moved the
	// bytes they sent in all.
	sent  map[string]float64
	moved float64
}

type soakUndo struct {
	due  time.Time
	undo func()
}

// soakOutcome is how a build ended.
type soakOutcome struct {
	build   string
	results []scheduler.Result
	err     error
	// wrong says how the build's sums differ from the reference's,
	// where its report was not what was wanted.
	wrong string
}

// soakBuild is build number i's steps: its get pinned to one node, its
// reader to the next.
func soakBuild(i int, nodes []localcluster.Node) []scheduler.Step {
	get, far := nodes[i%len(nodes)].Name, nodes[(i+1)%len(nodes)].Name
	// Busybox's md5sum exits 0 when writing what it printed fails, so a
	// step whose output's filesystem is full (the soak fills disks) lost
	// lines and still succeeded: the sums reach the output through tee,
	// which fails on a failed write as a step must (pipefail), and the
	// build runs the step again.
	return []scheduler.Step{
		{Name: "get", Output: "src", Node: get,
			Script: fmt.Sprintf("set -e; mktree /out %d %d; echo $(hostname) > /out/build", soakFiles, soakFileBytes)},
		{Name: "read", Inputs: []string{"src"}, Output: "sums", Node: far,
			Script: `set -eo pipefail; cd /in/src; find data -type f | sort | while read f; do md5sum "$f"; usleep 2000; done | tee /out/sums >/dev/null; cp build /out/build`},
		{Name: "sum", Inputs: []string{"src"}, Output: "sum",
			Script: "set -eo pipefail; cd /in/src; { find data -type f | sort | xargs md5sum | md5sum; ./bin/hello; } | tee /out/sum >/dev/null"},
		// Its report is an output too: cowvol vouches for what a step read
		// by capturing its outputs (a step that may have read holes, its
		// node's plugin dead under a lazy pull, captures nothing and is
		// run again), so the log compared is that of an attempt whose
		// output was captured.
		{Name: "check", Inputs: []string{"sums", "sum", "src"}, Output: "report",
			Script: "set -eo pipefail; { md5sum < /in/sums/sums; cat /in/sum/sum /in/src/build /in/sums/build; } | tee /out/report"},
	}
}

// referenceSum writes the get's files here, with the same program, and
// sums them as the steps do.
func (s *soak) referenceSum() string {
	t := s.f.T
	dir := t.TempDir()
	localcluster.Run(t, filepath.Join(s.f.Work, "images", "mktree"), dir, strconv.Itoa(soakFiles), strconv.Itoa(soakFileBytes))
	var files []string
	require.NoError(t, filepath.WalkDir(filepath.Join(dir, "data"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			rel, _ := filepath.Rel(dir, p)
			files = append(files, rel)
		}
		return err
	}))
	sort.Strings(files)
	var lines strings.Builder
	for _, rel := range files {
		b, err := os.ReadFile(filepath.Join(dir, rel))
		require.NoError(t, err)
		fmt.Fprintf(&lines, "%x  %s\n", md5.Sum(b), rel)
	}
	s.sums = strings.SplitAfter(lines.String(), "\n")
	sum := md5.Sum([]byte(lines.String()))
	return hex.EncodeToString(sum[:]) + "  -\n"
}

// diagnose says how a build's sums volume differs from the reference:
// which files' sums are wrong, and whether they are the sums of holes
// (zeros: a lazily pulled file read while nothing held its reader).
func (s *soak) diagnose(handle string) string {
	var got strings.Builder
	if _, err := s.f.Cache.Read(context.Background(), cowvolume.Ref{Namespace: "ci", Handle: handle}, "sums", "file", "", &got, nil); err != nil {
		return fmt.Sprintf("reading %s's sums: %v", handle, err)
	}
	holes := md5.Sum(make([]byte, soakFileBytes))
	lines := strings.SplitAfter(got.String(), "\n")
	var wrong []string
	zeros := 0
	for i, line := range lines {
		if i < len(s.sums) && line == s.sums[i] {
			continue
		}
		if strings.HasPrefix(line, hex.EncodeToString(holes[:])) {
			zeros++
		}
		wrong = append(wrong, strings.TrimSpace(line))
	}
	// Fewer lines than files is the step's own writes lost, not wrong
	// data read: the lines after the first lost one are each compared
	// with an earlier file's.
	return fmt.Sprintf("%d of %d lines wrong (%d the sums of holes; %d lines where %d were wanted), the first: %q",
		len(wrong), len(lines), zeros, len(lines), len(s.sums), wrong[:min(3, len(wrong))])
}

// want is what a build's last step prints: the sums alike both ways, and
// the build's own get's pod named by both steps that read it.
func (s *soak) want(build string, results []scheduler.Result) string {
	get := fmt.Sprintf("%s-get-%d", build, results[0].Attempts)
	return s.sum + s.sum + "hello\n" + get + "\n" + get + "\n"
}

// runBuilds runs soakBuilds builds at a time until ctx ends (a build
// begun runs to its end), each destroyed when done, as a CI's GC does;
// wait returns how they ended.
func (s *soak) runBuilds(ctx context.Context) (wait func() []soakOutcome) {
	f := s.f
	cfg, err := clientcmd.BuildConfigFromFlags("", f.Kubeconfig)
	require.NoError(f.T, err)
	kube, err := kubernetes.NewForConfig(cfg)
	require.NoError(f.T, err)
	runner := func() *scheduler.Runner {
		return &scheduler.Runner{Kube: kube, Cache: f.Cache, Namespace: "ci", Image: localcluster.BusyboxImage,
			Attempts: soakAttempts, Timeout: soakDeadline, KeepFor: time.Hour, Logf: s.logf}
	}
	var mu sync.Mutex
	var outcomes []soakOutcome
	running := map[string]bool{} // builds, until their outputs are destroyed
	var wg sync.WaitGroup
	for loop := range soakBuilds {
		wg.Go(func() {
			r := runner()
			for i := loop; ctx.Err() == nil; i += soakBuilds {
				build := fmt.Sprintf("soak-%d", i)
				mu.Lock()
				running[build] = true
				mu.Unlock()
				results, err := r.Run(context.Background(), build, soakBuild(i, f.Nodes))
				var wrong string
				if err == nil && results[len(results)-1].Log != s.want(build, results) {
					wrong = s.diagnose(results[1].Handle)
				}
				var made []string
				for _, res := range results {
					if res.Handle != "" {
						made = append(made, res.Handle)
					}
				}
				if len(made) > 0 {
					if derr := r.Destroy(context.Background(), made...); derr != nil {
						s.logf("Destroying build %s's outputs: %v", build, derr)
					}
				}
				s.logf("Build %s ended: %v", build, err)
				mu.Lock()
				delete(running, build)
				outcomes = append(outcomes, soakOutcome{build: build, results: results, err: err, wrong: wrong})
				mu.Unlock()
			}
		})
	}
	// The CI's GC: a pass every 20 s over what the nodes hold destroys
	// what no running build owns.
	owned := func(handle string) bool {
		parts := strings.SplitN(handle, "-", 3)
		mu.Lock()
		defer mu.Unlock()
		return len(parts) == 3 && running[parts[0]+"-"+parts[1]]
	}
	gc := runner()
	collect := func() int {
		found, err := gc.Reconcile(context.Background(), owned)
		if err != nil {
			s.logf("Garbage collection: %v", err)
		}
		for _, h := range found {
			s.collected[h] = true
		}
		return len(found)
	}
	stopGC := make(chan struct{})
	gcDone := make(chan struct{})
	go func() {
		defer close(gcDone)
		for {
			select {
			case <-stopGC:
				return
			case <-time.After(20 * time.Second):
				collect()
			}
		}
	}()
	return func() []soakOutcome {
		wg.Wait()
		close(stopGC)
		<-gcDone
		// The builds done, passes until one finds nothing.
		for deadline := time.Now().Add(2 * time.Minute); collect() > 0 && time.Now().Before(deadline); {
			time.Sleep(10 * time.Second)
		}
		return outcomes
	}
}

func (s *soak) logf(format string, args ...any) {
	fmt.Fprintf(s.log, time.Now().Format("15:04:05.000 ")+format+"\n", args...)
}

// injectFaults injects a fault every 3 to 7 seconds until ctx ends,
// putting back what earlier ones left when it is due.
func (s *soak) injectFaults(ctx context.Context) {
	kinds := []struct {
		name   string
		inject func() bool
	}{
		{"plugin SIGKILLed", s.killPlugin},
		{"kubelet restarted", s.restartKubelet},
		{"holder SIGKILLed mid-pull", s.killHolderMidPull},
		{"disk filled past its high watermark", s.fillDisk},
		{"controller's leader deleted", s.deleteLeader},
		{"node cordoned", s.cordon},
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(3*time.Second + time.Duration(s.rng.Int64N(int64(4*time.Second)))):
		}
		s.undoDue(time.Now())
		s.scrapeSent()
		// A kind that cannot be injected now (no pull under way, say)
		// gives way to another.
		for _, i := range s.rng.Perm(len(kinds)) {
			if kinds[i].inject() {
				s.faults[kinds[i].name]++
				s.logf("Fault: %s", kinds[i].name)
				break
			}
		}
	}
}

func (s *soak) later(after time.Duration, undo func()) {
	s.undos = append(s.undos, soakUndo{due: time.Now().Add(after), undo: undo})
}

func (s *soak) undoDue(now time.Time) {
	var left []soakUndo
	for _, u := range s.undos {
		if now.After(u.due) {
			u.undo()
		} else {
			left = append(left, u)
		}
	}
	s.undos = left
}

func (s *soak) undoAll() { s.undoDue(time.Now().Add(time.Hour)) }

func (s *soak) anyNode() *localcluster.Node { return &s.f.Nodes[s.rng.IntN(len(s.f.Nodes))] }

// killPlugin SIGKILLs cowvol's plugin on a node; its kubelet restarts it.
func (s *soak) killPlugin() bool { return s.killPluginOn(s.anyNode()) }

// killPluginOn SIGKILLs a node's plugin, unless it was killed in the last
// pluginKillEvery: a plugin that dies every few seconds is an outage,
// not a fault, and a pull from it would never finish.
func (s *soak) killPluginOn(n *localcluster.Node) bool {
	pid := nodePluginPid(n.CgroupRoot)
	if pid == 0 || time.Since(s.killed[n.Name]) < pluginKillEvery {
		return false // restarting, or killed a moment ago
	}
	s.killed[n.Name] = time.Now()
	return syscall.Kill(pid, syscall.SIGKILL) == nil
}

const pluginKillEvery = 45 * time.Second

// nodePluginPid is the pid of cowvol's node plugin among the processes of
// a node's pods (0: none runs).
func nodePluginPid(cgroupRoot string) int {
	for _, pid := range localcluster.CgroupPids("/sys/fs/cgroup/pids" + cgroupRoot) {
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if strings.TrimSpace(string(comm)) == "cowvol-plugin" && strings.Contains(string(cmdline), "--mode=node\x00") {
			return pid
		}
	}
	return 0
}

// restartKubelet stops a node's kubelet and starts it again, its pods
// running on meanwhile.
func (s *soak) restartKubelet() bool {
	n := s.anyNode()
	s.f.Procs[n.Proc("kubelet")].Stop(syscall.SIGTERM, 10*time.Second)
	s.f.StartKubeletOn(n.NodeHost, n.Containerd)
	return true
}

// killHolderMidPull SIGKILLs the plugin of a node that holds an input a
// step's node is pulling now: a step bound to a node the controller does
// not list among its input's holders. Each step's pull is cut once: one
// cut every time it is tried again would keep it from ever finishing.
func (s *soak) killHolderMidPull() bool {
	out, err := s.f.Kubectl("", "get", "pods", "-n", "ci", "-o", "json")
	if err != nil {
		return false
	}
	var pods struct {
		Items []struct {
			Metadata struct {
				Name string `json:"name"`
			} `json:"metadata"`
			Spec struct {
				NodeName string `json:"nodeName"`
				Volumes  []struct {
					CSI *struct {
						VolumeAttributes map[string]string `json:"volumeAttributes"`
					} `json:"csi"`
				} `json:"volumes"`
			} `json:"spec"`
			Status struct {
				Phase string `json:"phase"`
			} `json:"status"`
		} `json:"items"`
	}
	if json.Unmarshal([]byte(out), &pods) != nil {
		return false
	}
	for _, p := range pods.Items {
		if p.Spec.NodeName == "" || (p.Status.Phase != "Pending" && p.Status.Phase != "Running") || s.pulls[p.Metadata.Name] {
			continue
		}
		for _, v := range p.Spec.Volumes {
			if v.CSI == nil || v.CSI.VolumeAttributes["source"] == "" {
				continue
			}
			holders := s.f.holders("ci", v.CSI.VolumeAttributes["source"])
			if len(holders) == 0 || slices.Contains(holders, p.Spec.NodeName) {
				continue
			}
			if !s.killPluginOn(s.f.Node(holders[s.rng.IntN(len(holders))])) {
				return false
			}
			s.pulls[p.Metadata.Name] = true
			return true
		}
	}
	return false
}

// fillDisk fills a node's cowvol filesystem to 93% with a file the plugin
// did not make (its high watermark is 90%) for 15 to 30 seconds.
func (s *soak) fillDisk() bool {
	n := s.anyNode()
	if s.full[n.Name] {
		return false
	}
	var st unix.Statfs_t
	if unix.Statfs(n.State, &st) != nil {
		return false
	}
	total, free := int64(st.Blocks)*st.Bsize, int64(st.Bavail)*st.Bsize
	size := total*93/100 - (total - free)
	if size <= 0 {
		return false
	}
	path := filepath.Join(n.State, "soak-ballast")
	file, err := os.Create(path)
	if err != nil {
		return false
	}
	err = unix.Fallocate(int(file.Fd()), 0, 0, size)
	file.Close()
	if err != nil {
		s.logf("Filling %s: %v", n.Name, err)
		_ = os.Remove(path)
		return false
	}
	s.full[n.Name] = true
	s.later(15*time.Second+time.Duration(s.rng.Int64N(int64(15*time.Second))), func() {
		// Not the plugin's to remove: it must leave what it did not make.
		require.NoError(s.f.T, os.Remove(path), "the ballast on %s", n.Name)
		delete(s.full, n.Name)
	})
	return true
}

// deleteLeader deletes the controller's leading replica's pod while the
// other runs ready.
func (s *soak) deleteLeader() bool {
	ready, err := s.f.Kubectl("", "get", "deployment", "cowvol-controller", "-n", "cowvol", "-o", "jsonpath={.status.readyReplicas}")
	leader := s.f.Leader()
	if err != nil || ready != "2" || leader == "" {
		return false
	}
	_, err = s.f.Kubectl("", "delete", "pod", "-n", "cowvol", leader, "--wait=false")
	return err == nil
}

// cordon cordons a node for 15 to 30 seconds, one at a time.
func (s *soak) cordon() bool {
	if len(s.cordoned) > 0 {
		return false
	}
	n := s.anyNode()
	if _, err := s.f.Kubectl("", "cordon", n.Name); err != nil {
		return false
	}
	s.cordoned[n.Name] = true
	s.later(15*time.Second+time.Duration(s.rng.Int64N(int64(15*time.Second))), func() {
		s.f.MustKubectl("", "uncordon", n.Name)
		delete(s.cordoned, n.Name)
	})
	return true
}

// scrapeSent adds what each node's peer server sent since it was last
// read (a restarted plugin's counter starts again from 0).
func (s *soak) scrapeSent() {
	for _, n := range s.f.Nodes {
		now, ok := peerSentBytes(n.Address)
		if !ok {
			continue
		}
		last := s.sent[n.Name]
		if now < last {
			last = 0
		}
		s.moved += now - last
		s.sent[n.Name] = now
	}
}

// peerSentBytes reads cowvol_peer_sent_bytes_total from a node's plugin's
// metrics, summed over its labels.
func peerSentBytes(address string) (float64, bool) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + address + ":9808/metrics")
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "cowvol_peer_sent_bytes_total") {
			continue
		}
		fields := strings.Fields(line)
		if v, err := strconv.ParseFloat(fields[len(fields)-1], 64); err == nil {
			sum += v
		}
	}
	return sum, sc.Err() == nil
}

// check asserts on how the builds ended, then that nothing of them is
// left on any node.
func (s *soak) check(outcomes []soakOutcome) {
	t := s.f.T
	require.NotEmpty(t, outcomes)
	for _, o := range outcomes {
		for _, r := range o.results {
			for _, fl := range r.Failures {
				require.Error(t, fl.Err, "build %s step %s failed without a reason", o.build, r.Step)
				require.NotContains(t, fl.Err.Error(), "did not end", "build %s step %s hung past its %s deadline on %s", o.build, r.Step, soakDeadline, fl.Node)
			}
		}
		if o.err != nil {
			last := o.results[len(o.results)-1]
			require.Equal(t, soakAttempts, last.Attempts, "build %s failed without retrying its step %s: %v", o.build, last.Step, o.err)
			continue
		}
		last := o.results[len(o.results)-1]
		require.Equal(t, s.want(o.build, o.results), last.Log, "build %s's outputs: %s", o.build, o.wrong)
	}
	s.checkNothingLeft()
}

// checkNothingLeft: once the builds are destroyed, no node holds a soak
// volume, a step's view or mount, or a process of a pod that is gone.
func (s *soak) checkNothingLeft() {
	f := s.f
	f.Until("the step pods to be gone", 2*time.Minute, func() bool {
		out, err := f.Kubectl("", "get", "pods", "-n", "ci", "-o", "name")
		return err == nil && strings.TrimSpace(out) == ""
	})
	for _, n := range f.Nodes {
		var left, handles []string
		for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(time.Second) {
			if left, handles = soakLeft(f, n); len(left) == 0 || time.Now().After(deadline) {
				break
			}
		}
		// The plugin may be restarting (a fault's kill, or its liveness
		// probe's): its node API answers again within a minute.
		var kept string
		var err error
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Second) {
			if kept, err = nodeKeeps(n); err == nil || time.Now().After(deadline) {
				break
			}
		}
		require.NoError(f.T, err)
		if len(left) > 0 {
			require.Empty(f.T, left, "left on %s 3 minutes after the builds ended; its plugin keeps (none: a dir no record names):\n%s\n%s", n.Name, kept, s.whyLeft(n, handles))
		}
		require.Empty(f.T, kept, "%s's plugin keeps soak volumes, destroyed ones included", n.Name)
		out := f.MustKubectl("", "get", "pods", "-A", "--field-selector", "spec.nodeName="+n.Name, "-o", "jsonpath={.items[*].metadata.uid}")
		live := strings.Fields(out)
		// Pod cgroups are kubepods/pod<uid> (guaranteed) and
		// kubepods/<class>/pod<uid>.
		pods, _ := filepath.Glob("/sys/fs/cgroup/pids" + n.CgroupRoot + "/kubepods*/pod*")
		classed, _ := filepath.Glob("/sys/fs/cgroup/pids" + n.CgroupRoot + "/kubepods*/*/pod*")
		for _, dir := range append(pods, classed...) {
			uid := strings.TrimPrefix(filepath.Base(dir), "pod")
			if slices.Contains(live, uid) {
				continue
			}
			require.Empty(f.T, localcluster.CgroupPids(dir), "processes of pod %s, gone, still run on %s", uid, n.Name)
		}
	}
}

// keepLogs copies a failed soak's logs (the harness's and every pod's)
// where the fleet's teardown leaves them.
func keepLogs(t tb.TB, f *fleet) {
	if !t.Failed() {
		return
	}
	dir, err := os.MkdirTemp("", "cowvol-soak-logs-")
	if err != nil {
		return
	}
	_ = os.CopyFS(filepath.Join(dir, "logs"), os.DirFS(filepath.Join(f.Work, "logs")))
	for _, n := range f.Nodes {
		_ = os.CopyFS(filepath.Join(dir, n.Name), os.DirFS(filepath.Join(n.Dir, "pod-logs")))
	}
	t.Logf("the soak's logs are kept in %s", dir)
}

// nodeKeeps is what a node's plugin says, through its node API, of the
// soak volumes it keeps (destroyed ones too): their state and what holds
// them, so that a failed soak says why one was kept. The API's socket is
// in the node's mount namespace, reached through its root; connect(2)
// takes a path of at most 108 bytes, so the socket's dir is opened and
// named as /proc/self/fd/N.
func nodeKeeps(n localcluster.Node) (string, error) {
	dir := strings.TrimSuffix(n.Mountns, "ns/mnt") + "root" + filepath.Join(n.KubeletDir, "plugins", "cowvol.concourse-ci.org")
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("opening %s's node API's dir: %w", n.Name, err)
	}
	defer unix.Close(fd)
	conn, err := grpc.NewClient(fmt.Sprintf("unix:///proc/self/fd/%d/node-api.sock", fd), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	list, err := nodev1.NewNodeAPIClient(conn).ListVolumes(ctx, &nodev1.ListVolumesRequest{Namespace: "ci", IncludeDestroyed: true, PageSize: 5000})
	if err != nil {
		return "", fmt.Errorf("listing %s's volumes through its node API: %w", n.Name, err)
	}
	var kept strings.Builder
	for _, v := range list.GetVolumes() {
		if strings.HasPrefix(v.GetRef().GetHandle(), "soak-") {
			fmt.Fprintf(&kept, "%s %s: held by step volumes %v, images %v, %d children, %d streams, %d fills\n", v.GetRef().GetHandle(), v.GetState(),
				v.GetHoldingStepVolumes(), v.GetHoldingImages(), len(v.GetHoldingChildren()), v.GetHoldingStreams(), v.GetHoldingFills())
		}
	}
	return kept.String(), nil
}

// whyLeft gathers what may say why a node kept what the soak left there,
// for the failure's message (the only part of a failed CI run's output
// that is sure to be read): the controller's word on the node, its
// plugin's restarts, and the lines of the plugin's logs (this run's and
// the one before), of the controller's and of the soak's own that name
// one of the volumes left, handles.
func (s *soak) whyLeft(n localcluster.Node, handles []string) string {
	f := s.f
	var b strings.Builder
	if nodes, err := f.Cache.Nodes(context.Background()); err != nil {
		fmt.Fprintf(&b, "the controller's nodes: %v\n", err)
	} else {
		for _, st := range nodes {
			if st.GetNodeId() == n.Name {
				fmt.Fprintf(&b, "the controller: %s is %s, its last report %s ago, at revision %d, %d volumes\n", n.Name, st.GetState(),
					time.Since(st.GetLastReport().AsTime()).Round(time.Second), st.GetRevision(), st.GetVolumes())
			}
		}
	}
	pod, err := f.Kubectl("", "get", "pods", "-n", "cowvol", "-l", "app=cowvol-node", "--field-selector", "spec.nodeName="+n.Name,
		"-o", `jsonpath={.items[0].metadata.name}`)
	if err != nil || pod == "" {
		return b.String() + fmt.Sprintf("its plugin's pod: %q %v\n", pod, err)
	}
	status, _ := f.Kubectl("", "get", "pod", "-n", "cowvol", pod, "-o",
		`jsonpath={range .status.containerStatuses[?(@.name=="cowvol")]}restarts {.restartCount}, running since {.state.running.startedAt}, the last ended {.lastState.terminated.finishedAt} ({.lastState.terminated.reason}, exit {.lastState.terminated.exitCode}){end}`)
	fmt.Fprintf(&b, "its plugin (%s): %s\n", pod, status)
	// Besides the volumes' names: whom the node reported to, and who led.
	needles := append(slices.Clone(handles), "Reporting to the controller", "Leading: serving", "Forgot a node")
	naming := func(what, text string, err error) {
		if err != nil {
			fmt.Fprintf(&b, "---- %s: %v\n", what, err)
			return
		}
		var lines []string
		for _, line := range strings.Split(text, "\n") {
			if slices.ContainsFunc(needles, func(n string) bool { return strings.Contains(line, n) }) {
				lines = append(lines, line)
			}
		}
		fmt.Fprintf(&b, "---- %s: %d lines name %v or say whom a node reports to, the last 15:\n%s\n", what, len(lines),
			handles, strings.Join(lines[max(0, len(lines)-15):], "\n"))
	}
	for _, previous := range []bool{false, true} {
		args := []string{"logs", "-n", "cowvol", pod, "-c", "cowvol", "--tail=-1"}
		if previous {
			args = append(args, "--previous")
		}
		out, err := f.Kubectl("", args...)
		if err != nil && previous {
			continue // it did not restart
		}
		naming(fmt.Sprintf("its plugin's log (previous: %t)", previous), out, err)
	}
	out, err := f.Kubectl("", "logs", "-n", "cowvol", "-l", "app=cowvol-controller", "-c", "cowvol", "--tail=-1", "--prefix")
	naming("the controllers' logs", out, err)
	soakLog, err := os.ReadFile(s.log.Name())
	naming("the soak's log", string(soakLog), err)
	return b.String()
}

// soakLeft is what the soak left on a node: the soak volumes the
// controller lists there (in any state), the volume dirs and step views
// in its state dir, and the CSI mounts in its mount namespace; and the
// handles of the volumes among them, sorted.
func soakLeft(f *fleet, n localcluster.Node) (left, handles []string) {
	vols, err := f.Cache.List(context.Background(), &controllerv1.ListVolumesRequest{Namespace: "ci", NodeId: n.Name})
	if err != nil {
		return []string{"listing its volumes: " + err.Error()}, nil
	}
	for _, v := range vols {
		if h := v.GetRef().GetHandle(); strings.HasPrefix(h, "soak-") {
			left = append(left, "volume "+h+" "+v.GetState())
			handles = append(handles, h)
		}
	}
	for _, dir := range []string{"volumes/ci", "views"} {
		entries, _ := os.ReadDir(filepath.Join(n.State, dir))
		for _, e := range entries {
			left = append(left, dir+"/"+e.Name())
			if dir == "volumes/ci" {
				handles = append(handles, e.Name())
			}
		}
	}
	slices.Sort(handles)
	handles = slices.Compact(handles)
	mountinfo, err := os.ReadFile(strings.TrimSuffix(n.Mountns, "ns/mnt") + "mountinfo")
	if err != nil {
		return append(left, "reading its mounts: "+err.Error()), handles
	}
	for _, line := range strings.Split(string(mountinfo), "\n") {
		if strings.Contains(line, "kubernetes.io~csi") || strings.Contains(line, "/cowvol/views/") {
			left = append(left, "mount "+strings.Fields(line)[4])
		}
	}
	return left, handles
}

// report prints the soak's counts.
func (s *soak) report(outcomes []soakOutcome, took time.Duration) {
	var ok, failed, steps, attempts, retried int
	for _, o := range outcomes {
		if o.err == nil {
			ok++
		} else {
			failed++
		}
		for _, r := range o.results {
			steps++
			attempts += r.Attempts
			retried += r.Attempts - 1
		}
	}
	var kinds []string
	for k := range s.faults {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	var b strings.Builder
	fmt.Fprintf(&b, "soak, %s on 3 real kubelets: 0 outputs lost or wrong, 0 attempts hung, nothing left on any node\n", took.Round(time.Second))
	row := func(what string, n any) { fmt.Fprintf(&b, "  %-40s %v\n", what, n) }
	row("builds", len(outcomes))
	row("  ended right", ok)
	row(fmt.Sprintf("  failed (a step failed %d times)", soakAttempts), failed)
	row("steps", steps)
	row("attempts", attempts)
	row("  retries", retried)
	total := 0
	for _, k := range kinds {
		total += s.faults[k]
	}
	row("faults", total)
	for _, k := range kinds {
		row("  "+k, s.faults[k])
	}
	row("volumes the GC found no build owned", len(s.collected))
	row("GiB peers sent", fmt.Sprintf("%.1f", s.moved/(1<<30)))
	report(s.f.T, b.String())
}
