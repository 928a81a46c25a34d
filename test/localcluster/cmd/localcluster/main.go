// Command localcluster is make cluster: a cluster of real nodes on this
// machine (test/localcluster's fleet) with cowvol installed from its Helm
// chart, and Argo Workflows when asked, kept up in the background for a
// user to try until it is asked to go; then it is taken down as every e2e
// cluster is, leaving nothing.
//
//	localcluster up DIR     starts it (or finds it running) and prints, last,
//	                        "kubeconfig: PATH"
//	localcluster down DIR   takes it down and says how that went
//	localcluster run DIR    runs it in the foreground (what up starts): up
//	                        until SIGTERM, SIGINT or the file DIR/down
//
// The flags -nodes (default 3) and -with (argo) go before DIR. It needs
// root and make e2e's binaries, named by the environment make cluster
// gives it (the COWVOL_E2E_* variables and PATH).
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/concourse/cowvol/test/localcluster"
)

const usage = "usage: localcluster [-nodes N] [-with argo] up|down|run DIR"

func main() {
	nodes := flag.Int("nodes", 3, "how many nodes (at least 2: the controller's two replicas need two)")
	with := flag.String("with", "", "what to add besides cowvol, comma-separated: argo (Argo Workflows)")
	flag.Usage = func() { fmt.Fprintln(os.Stderr, usage); flag.PrintDefaults() }
	flag.Parse()
	if flag.NArg() != 2 {
		flag.Usage()
		os.Exit(2)
	}
	dir, err := filepath.Abs(flag.Arg(1))
	if err == nil {
		err = os.MkdirAll(dir, 0o755)
	}
	if err != nil {
		fail("%v", err)
	}
	c := clusterDir(dir)
	switch flag.Arg(0) {
	case "up":
		err = c.up(os.Args[1 : len(os.Args)-2])
	case "down":
		err = c.down()
	case "run":
		var extras []string
		extras, err = parseWith(*with)
		if err == nil && *nodes < 2 {
			err = errors.New("-nodes: the controller's two replicas need two nodes")
		}
		if err == nil {
			os.Exit(c.run(*nodes, extras))
		}
	default:
		flag.Usage()
		os.Exit(2)
	}
	if err != nil {
		fail("%v", err)
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "localcluster: "+format+"\n", args...)
	os.Exit(1)
}

func parseWith(with string) ([]string, error) {
	var extras []string
	for _, extra := range strings.FieldsFunc(with, func(r rune) bool { return r == ',' || r == ' ' }) {
		if extra != "argo" {
			return nil, fmt.Errorf("-with %s: a cluster can have argo", extra)
		}
		if localcluster.ArgoBin() == "" {
			return nil, errors.New("-with argo: Argo Workflows was not built (make cluster WITH=argo builds it)")
		}
		extras = append(extras, extra)
	}
	return extras, nil
}

// clusterDir is where a cluster keeps what make cluster and make
// cluster-down share: pid (the run's), log, ready (what runs), kubeconfig,
// down (asked to go) and exit (the run's exit code).
type clusterDir string

func (d clusterDir) path(name string) string { return filepath.Join(string(d), name) }

func (d clusterDir) exists(name string) bool {
	_, err := os.Stat(d.path(name))
	return err == nil
}

// running is whether the run that pid names is alive.
func (d clusterDir) running() bool {
	b, err := os.ReadFile(d.path("pid"))
	if err != nil {
		return false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	return err == nil && syscall.Kill(pid, 0) == nil
}

// up starts run in the background, in a session of its own and with none
// of this process's files (the cluster outlives it, its terminal and
// whatever reads its output), and waits until it is ready or has died.
func (d clusterDir) up(flags []string) error {
	if d.running() {
		if !d.exists("ready") {
			return fmt.Errorf("a cluster is still starting or stopping (pid file %s): try again, or make cluster-down", d.path("pid"))
		}
		fmt.Printf("a cluster runs already (%s)\nkubeconfig: %s\n", d.ready(), d.path("kubeconfig"))
		return nil
	}
	for _, name := range []string{"ready", "down", "exit", "kubeconfig"} {
		if err := os.Remove(d.path(name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	log, err := os.Create(d.path("log"))
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command(self, append(append([]string{}, flags...), "run", string(d))...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	if err := os.WriteFile(d.path("pid"), []byte(strconv.Itoa(cmd.Process.Pid)+"\n"), 0o644); err != nil {
		return err
	}
	// Reaped in the background, so that running sees it go.
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	fmt.Printf("starting a cluster (log: %s)...\n", d.path("log"))
	for !d.exists("ready") {
		select {
		case <-exited:
			tail, _ := exec.Command("tail", "-40", d.path("log")).Output()
			return fmt.Errorf("%sthe cluster did not come up (log: %s)", tail, d.path("log"))
		case <-time.After(2 * time.Second):
		}
	}
	fmt.Printf("%s\nkubeconfig: %s\n", d.ready(), d.path("kubeconfig"))
	return nil
}

func (d clusterDir) ready() string {
	b, _ := os.ReadFile(d.path("ready"))
	return strings.TrimSpace(string(b))
}

// down asks the run to go and waits until it has, its teardown checked.
func (d clusterDir) down() error {
	if !d.running() {
		fmt.Printf("no cluster runs from %s\n", d)
		return os.RemoveAll(string(d))
	}
	if err := os.WriteFile(d.path("down"), nil, 0o644); err != nil {
		return err
	}
	deadline := time.Now().Add(5 * time.Minute)
	for d.running() {
		if time.Now().After(deadline) {
			return fmt.Errorf("the cluster did not go down in 5 minutes (log: %s)", d.path("log"))
		}
		time.Sleep(time.Second)
	}
	if b, _ := os.ReadFile(d.path("exit")); strings.TrimSpace(string(b)) != "0" {
		tail, _ := exec.Command("tail", "-40", d.path("log")).Output()
		return fmt.Errorf("%sthe cluster's teardown failed (log: %s)", tail, d.path("log"))
	}
	fmt.Println("the cluster is down (its teardown checked that no process, mount, cgroup or interface of it is left)")
	return os.RemoveAll(string(d))
}

// run brings the cluster up, says so in ready, and keeps it until it is
// asked to go; its exit code (also in exit) says whether everything came
// up and went down clean.
func (d clusterDir) run(nodes int, extras []string) int {
	t := newProgramTB()
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	t.run(func() {
		c := localcluster.StartFleet(t, nodes)
		c.InstallCowvol()
		with := ""
		for _, extra := range extras {
			if extra == "argo" {
				c.InstallArgo()
				with += "; Argo Workflows " + localcluster.ArgoVersion + " in namespace argo (its steps run in ci as ServiceAccount argo-steps, on the pod network)"
			}
		}
		localcluster.WriteFile(t, d.path("kubeconfig"), string(localcluster.MustRead(t, c.Kubeconfig)))
		localcluster.WriteFile(t, d.path("ready"), fmt.Sprintf("%d nodes%s; logs in %s\n", nodes, with, filepath.Join(c.Work, "logs")))
		t.Logf("ready: %s", d.ready())
		for !d.exists("down") {
			select {
			case s := <-signals:
				t.Logf("%s: taking the cluster down", s)
				return
			case <-time.After(time.Second):
			}
		}
		t.Logf("asked to go (%s): taking the cluster down", d.path("down"))
	})
	code := 0
	if t.Failed() {
		code = 1
	}
	if err := os.WriteFile(d.path("exit"), []byte(strconv.Itoa(code)+"\n"), 0o644); err != nil {
		t.Logf("%v", err)
		code = 1
	}
	return code
}
