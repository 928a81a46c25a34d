package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/fill"
)

// defaultKeeperGrace is how long the readers a dead plugin held wait for
// the next one: a container the kubelet restarts at once, plus the
// plugin's recovery.
const defaultKeeperGrace = time.Minute

// runFillKeeper is `cowvol-plugin fill-keeper`: the node plugin pod's
// sidecar that keeps the fanotify group of lazy fills while the plugin
// restarts (pkg/fill, keeper.go).
func runFillKeeper(args []string) error {
	fs := flag.NewFlagSet("cowvol-plugin fill-keeper", flag.ContinueOnError)
	socket := fs.String("socket", "/run/cowvol/fill-keeper.sock", "the socket the node plugin reaches it on (its --fill-keeper-socket)")
	grace := fs.Duration("grace", defaultKeeperGrace,
		"how long a reader of a file not filled yet, held when the plugin went, waits for the next plugin before it gets EIO")
	klog.InitFlags(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *grace <= 0 {
		return errors.New("--grace: want a positive duration")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := fill.ServeKeeper(ctx, *socket, *grace); err != nil {
		return fmt.Errorf("keeping lazy fills at %s: %w", *socket, err)
	}
	return nil
}
