// Command cowvol-plugin is cowvol's one binary: the CSI node plugin, the
// controller, or both (--mode); `cowvol-plugin demo`, which plays a small
// CI pipeline through a plugin of its own on a temporary state dir; and
// `cowvol-plugin fill-keeper`, the node plugin pod's sidecar that keeps
// lazy fills' readers held while the plugin restarts.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/plugin"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// subcommands run instead of the plugin when named first.
var subcommands = map[string]func(args []string) error{"demo": runDemo, "fill-keeper": runFillKeeper}

func main() {
	if len(os.Args) > 1 {
		if sub := subcommands[os.Args[1]]; sub != nil {
			if err := sub(os.Args[2:]); err != nil {
				fmt.Fprintf(os.Stderr, "cowvol-plugin %s failed: %v\n", os.Args[1], err)
				os.Exit(1)
			}
			klog.Flush()
			return
		}
	}
	opts := plugin.Defaults()
	opts.Version = version
	// The mode says which components run, and so which flags there are.
	mode := plugin.ModeFromArgs(os.Args[1:], opts.Mode)
	fs := flag.NewFlagSet("cowvol-plugin", flag.ContinueOnError)
	opts.AddFlags(fs, mode)
	showVersion := fs.Bool("version", false, "print the version and exit")
	klog.InitFlags(fs)
	// A mistake is said in a line, not drowned in klog's flags.
	fs.SetOutput(io.Discard)
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintf(os.Stderr, "cowvol-plugin --mode=%s flags (docs/options.md lists every mode's):\n", mode)
			fs.SetOutput(os.Stderr)
			fs.PrintDefaults()
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "cowvol-plugin:", err)
		if name, ok := strings.CutPrefix(err.Error(), "flag provided but not defined: -"); ok {
			if modes := plugin.FlagsOfOtherModes(mode)[name]; modes != "" {
				fmt.Fprintf(os.Stderr, "--%s is a flag of --mode=%s, not of --mode=%s\n", name, modes, mode)
			}
		}
		os.Exit(2)
	}
	if *showVersion {
		fmt.Println("cowvol-plugin", version)
		return
	}
	if err := run(opts); err != nil {
		klog.ErrorS(err, "cowvol-plugin failed")
		klog.Flush()
		os.Exit(1)
	}
	klog.Flush()
}

func run(opts plugin.Options) error {
	kube, err := plugin.KubeClient(opts.Kubeconfig)
	if err != nil {
		return err
	}
	d, err := plugin.New(opts, plugin.Deps{Mounter: overlay.NewSysMounter(), Kube: kube.Client, Metadata: kube.Metadata})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	return d.Run(ctx)
}
