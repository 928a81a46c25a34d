package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/concourse/cowvol/internal/kubeletsim"
	"github.com/concourse/cowvol/pkg/driver"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/plugin"
)

// runDemo plays get → task → task through a real plugin on a unix socket,
// with real mounts, and proves the cached source unchanged at the end.
func runDemo(args []string) error {
	fs := flag.NewFlagSet("demo", flag.ExitOnError)
	stateDir := fs.String("state-dir", "", "state dir to use (default: a temporary dir, removed after)")
	backend := fs.String("cow-backend", "auto", "copy-on-write backend")
	_ = fs.Parse(args)
	if os.Geteuid() != 0 {
		return errors.New("the demo mounts filesystems: run it as root (sudo make demo)")
	}
	work, err := os.MkdirTemp("", "cowvol-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	if *stateDir == "" {
		*stateDir = filepath.Join(work, "state")
	}
	sock := filepath.Join(work, "csi.sock")
	kubeletDir := filepath.Join(work, "kubelet")
	opts := plugin.Defaults()
	opts.Endpoint, opts.NodeID, opts.Node.StateDir, opts.Node.Backend, opts.Version, opts.Node.KubeletDir =
		"unix://"+sock, "demo-node", *stateDir, *backend, version, kubeletDir
	d, err := plugin.New(opts, plugin.Deps{Mounter: overlay.NewSysMounter()})
	if err != nil {
		return err
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- d.Run(ctx) }()
	defer func() { stop(); <-served }()

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := waitServing(conn, served); err != nil {
		return err
	}
	p := &pipeline{node: csi.NewNodeClient(conn), kubeletDir: kubeletDir}
	fmt.Printf("cowvol demo: plugin %s on %s, state dir %s, COW backend %s\n\n", version, sock, *stateDir, d.Backend())
	return p.play()
}

// servingTimeout bounds how long the demo waits for its plugin to listen.
const servingTimeout = 30 * time.Second

// waitServing waits until the plugin Run started answers Probe. Run makes
// its socket only once it listens, and a call made before that fails at
// once ("no such file or directory"), so the first call waits for the
// connection; Run returning first (it could not start) ends the wait with
// its error.
func waitServing(conn *grpc.ClientConn, served chan error) error {
	ctx, cancel := context.WithTimeout(context.Background(), servingTimeout)
	defer cancel()
	probed := make(chan error, 1)
	go func() {
		_, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
		probed <- err
	}()
	select {
	case err := <-probed:
		if err != nil {
			return fmt.Errorf("the plugin did not answer within %s: %w", servingTimeout, err)
		}
		return nil
	case err := <-served:
		served <- err // for the deferred stop
		return fmt.Errorf("the plugin stopped before serving: %w", err)
	}
}

type pipeline struct {
	node       csi.NodeClient
	kubeletDir string
}

// step publishes a volume for a pretend pod, lets body act as the pod's
// container on the mounted path, then unpublishes it.
func (p *pipeline) step(name string, attrs map[string]string, readOnly bool, body func(dir string) error) error {
	v := kubeletsim.NewInlineVolume(p.kubeletDir, kubeletsim.NewPod("ci", name), "work", attrs)
	v.ReadOnly = readOnly
	// The kubelet makes the volume's dir; the plugin makes the target in it.
	if err := os.MkdirAll(filepath.Dir(v.Target), 0o750); err != nil {
		return err
	}
	start := time.Now()
	if _, err := p.node.NodePublishVolume(context.Background(), v.PublishRequest()); err != nil {
		return fmt.Errorf("%s: publish: %w", name, err)
	}
	published := time.Since(start)
	if err := body(v.Target); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	start = time.Now()
	if _, err := p.node.NodeUnpublishVolume(context.Background(), v.UnpublishRequest()); err != nil {
		return fmt.Errorf("%s: unpublish: %w", name, err)
	}
	fmt.Printf("  %-34s publish %8s   unpublish %8s\n", name, published.Round(time.Microsecond), time.Since(start).Round(time.Microsecond))
	return nil
}

func (p *pipeline) play() error {
	blob := make([]byte, 32<<20)
	if _, err := rand.Read(blob); err != nil {
		return err
	}
	fmt.Println("get: fetch a resource version into an output captured as res-v1")
	err := p.step("get-repo", map[string]string{driver.AttrCapture: "res-v1", driver.AttrScope: "cluster",
		"property.resource": "repo", "property.version": "v1"}, false, func(dir string) error {
		return writeFiles(dir, map[string][]byte{
			"README.md": []byte("hello\n"), "src/main.go": []byte("package main\n"),
			"src/old.go": []byte("package main // to be deleted\n"), "assets/blob.bin": blob,
		})
	})
	if err != nil {
		return err
	}
	fmt.Println("task: COW input res-v1, edit, delete and add files, captured as built-v1")
	err = p.step("task-build", map[string]string{driver.AttrSource: "res-v1", driver.AttrCapture: "built-v1"}, false,
		func(dir string) error {
			if err := os.WriteFile(filepath.Join(dir, "README.md"), []byte("hello, built\n"), 0o644); err != nil {
				return err
			}
			if err := os.Remove(filepath.Join(dir, "src/old.go")); err != nil {
				return err
			}
			return writeFiles(dir, map[string][]byte{"bin/app": []byte("#!/bin/sh\necho app\n")})
		})
	if err != nil {
		return err
	}
	fmt.Println("task: read-only input built-v1 sees exactly the previous task's changes")
	err = p.step("task-test", map[string]string{driver.AttrSource: "built-v1"}, true, func(dir string) error {
		return expect(dir, map[string][]byte{"README.md": []byte("hello, built\n"), "bin/app": []byte("#!/bin/sh\necho app\n"),
			"assets/blob.bin": blob}, []string{"src/old.go"})
	})
	if err != nil {
		return err
	}
	fmt.Println("check: the cached resource res-v1 is unchanged")
	err = p.step("check-source", map[string]string{driver.AttrSource: "res-v1"}, true, func(dir string) error {
		return expect(dir, map[string][]byte{"README.md": []byte("hello\n"), "src/old.go": []byte("package main // to be deleted\n"),
			"assets/blob.bin": blob}, []string{"bin/app"})
	})
	if err != nil {
		return err
	}
	fmt.Println("\nOK: every step saw what it should; the source never changed.")
	return nil
}

func writeFiles(root string, files map[string][]byte) error {
	for name, data := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

func expect(root string, files map[string][]byte, absent []string) error {
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("%s has unexpected content", name)
		}
	}
	for _, name := range absent {
		if _, err := os.Lstat(filepath.Join(root, name)); !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%s should not exist (err %v)", name, err)
		}
	}
	return nil
}
