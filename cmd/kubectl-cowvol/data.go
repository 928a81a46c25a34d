package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"
	"google.golang.org/protobuf/types/known/durationpb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// transfer dials the controller (within --request-timeout) and runs do
// with it for as long as the data takes.
func (o *options) transfer(cmd *cobra.Command, do func(context.Context, *client.Client) error) error {
	dialCtx, cancel := context.WithTimeout(cmd.Context(), o.timeout)
	c, err := o.dialController(dialCtx)
	cancel()
	if err != nil {
		return err
	}
	defer c.Close()
	return do(cmd.Context(), c)
}

// volumePath splits "[ns/]handle:path", saying whether arg names a volume
// (it has the colon, as kubectl cp's pod:path does).
func (o *options) volumePath(arg string) (volume.Ref, string, bool, error) {
	name, path, ok := strings.Cut(arg, ":")
	if !ok || strings.HasPrefix(arg, ".") || strings.HasPrefix(arg, "/") {
		return volume.Ref{}, "", false, nil
	}
	refs, err := o.refs([]string{name})
	if err != nil {
		return volume.Ref{}, "", true, err
	}
	return refs[0], path, true, nil
}

func (o *options) catCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "cat VOLUME:PATH",
		Short: "Print a file of a cached volume (a task config, metadata.json, an image's /etc/passwd)",
		Long: "Print one regular file of a cached volume, read through the controller from a node that holds it.\n" +
			"PATH resolves inside the volume, symlinks included, never out of it.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ref, path, ok, err := o.volumePath(args[0])
			if err != nil {
				return err
			}
			if !ok || path == "" {
				return fmt.Errorf("%s: want VOLUME:PATH", volume.Quote(args[0]))
			}
			return o.transfer(cmd, func(ctx context.Context, c *client.Client) error {
				_, err := c.Read(ctx, ref, path, string(streamer.FormatFile), "", o.out, nil)
				return err
			})
		},
	}
}

func (o *options) cpCmd() *cobra.Command {
	var scope, ttl, node string
	var props []string
	cmd := &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy a cached volume (or a dir in it) out to a local dir, or a local dir in as a new cached volume",
		Long: "Copy between cached volumes and local dirs, through the controller, as kubectl cp does for pods:\n" +
			"  kubectl cowvol cp [NS/]VOLUME:[PATH] DIR    extract the volume's tree (or PATH's) into DIR\n" +
			"  kubectl cowvol cp [NS/]VOLUME:[PATH] -      write it to stdout as a tar\n" +
			"  kubectl cowvol cp DIR [NS/]VOLUME:          upload DIR's tree as a new cached volume\n" +
			"  kubectl cowvol cp - [NS/]VOLUME:            upload a tar read from stdin\n" +
			"A progress bar is drawn on a terminal.",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			src, srcPath, srcIsVol, err := o.volumePath(args[0])
			if err != nil {
				return err
			}
			dst, dstPath, dstIsVol, err := o.volumePath(args[1])
			if err != nil {
				return err
			}
			switch {
			case srcIsVol && !dstIsVol:
				return o.download(cmd, src, srcPath, args[1])
			case dstIsVol && !srcIsVol:
				if dstPath != "" {
					return fmt.Errorf("%s: an upload makes a whole volume: name it as VOLUME: with no path", volume.Quote(args[1]))
				}
				nv, err := newVolume(dst, scope, ttl, node, props)
				if err != nil {
					return err
				}
				return o.upload(cmd, args[0], nv)
			}
			return errors.New("one of SRC and DST must be a volume ([NS/]VOLUME:[PATH]) and the other a local dir or -")
		},
	}
	cmd.Flags().StringVar(&scope, "scope", "", "uploads: who may use the volume, namespace (default) or cluster")
	cmd.Flags().StringVar(&ttl, "ttl", "", "uploads: destroy the volume this long after its last use (such as 72h)")
	cmd.Flags().StringArrayVar(&props, "property", nil, "uploads: a property of the volume, key=value (repeatable)")
	cmd.Flags().StringVar(&node, "node", "", "uploads: the node to keep the volume on (default: the controller picks)")
	return cmd
}

func newVolume(ref volume.Ref, scope, ttl, node string, props []string) (*controllerv1.NewVolume, error) {
	nv := &controllerv1.NewVolume{Ref: controllerv1.RefOf(ref), Scope: scope, NodeId: node, Encoding: string(streamer.S2)}
	if ttl != "" {
		d, err := time.ParseDuration(ttl)
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("--ttl %s: want a positive duration such as 72h", volume.Quote(ttl))
		}
		nv.Ttl = durationpb.New(d)
	}
	for _, p := range props {
		k, v, ok := strings.Cut(p, "=")
		if !ok {
			return nil, fmt.Errorf("--property %s: want key=value", volume.Quote(p))
		}
		if nv.Properties == nil {
			nv.Properties = map[string]string{}
		}
		if err := volume.ValidateUserProperty(k, v); err != nil {
			return nil, err
		}
		nv.Properties[k] = v
	}
	return nv, nil
}

// download reads a volume's tree as a tar, to stdout or extracted (safely:
// nothing lands outside dir) into dir.
func (o *options) download(cmd *cobra.Command, ref volume.Ref, path, dir string) error {
	bar := newProgressBar("download")
	defer bar.done()
	return o.transfer(cmd, func(ctx context.Context, c *client.Client) error {
		if dir == "-" {
			_, err := c.Read(ctx, ref, path, string(streamer.FormatTar), string(streamer.Raw), o.out, bar.update)
			return err
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		pr, pw := io.Pipe()
		extracted := make(chan error, 1)
		go func() {
			_, err := streamer.Unpack(ctx, pr, streamer.S2, dir, streamer.DefaultLimits)
			pr.CloseWithError(err)
			extracted <- err
		}()
		_, err := c.Read(ctx, ref, path, string(streamer.FormatTar), string(streamer.S2), pw, bar.update)
		pw.CloseWithError(err)
		if xerr := <-extracted; err == nil && xerr != nil {
			err = fmt.Errorf("extracting into %s: %w", dir, xerr)
		}
		return err
	})
}

// upload sends a local dir's tree (or a tar from stdin) as a new volume.
func (o *options) upload(cmd *cobra.Command, src string, nv *controllerv1.NewVolume) error {
	bar := newProgressBar("upload")
	defer bar.done()
	return o.transfer(cmd, func(ctx context.Context, c *client.Client) error {
		var r io.Reader = os.Stdin
		packed := make(chan error, 1)
		if src == "-" {
			nv.Encoding = string(streamer.Raw)
			packed <- nil
		} else {
			pr, pw := io.Pipe()
			go func() {
				_, err := streamer.Pack(ctx, src, pw, streamer.Encoding(nv.Encoding), streamer.SparseTar)
				pw.CloseWithError(err)
				packed <- err
			}()
			r = pr
		}
		loc, err := c.Write(ctx, nv, r, bar.update)
		if perr := <-packed; err == nil && perr != nil {
			err = perr
		}
		if err != nil {
			return err
		}
		bar.done()
		fmt.Fprintf(o.out, "%s uploaded to node %s\n", volume.Ref{Namespace: loc.GetRef().GetNamespace(), Handle: loc.GetRef().GetHandle()},
			strings.Join(loc.GetNodes(), ", "))
		return nil
	})
}

// progressBar draws a transfer's progress on stderr when it is a terminal,
// at most a few times a second; elsewhere it draws nothing.
type progressBar struct {
	what  string
	on    bool
	start time.Time
	mu    sync.Mutex
	last  time.Time
	drawn bool
}

func newProgressBar(what string) *progressBar {
	return &progressBar{what: what, on: term.IsTerminal(int(os.Stderr.Fd())), start: time.Now()}
}

func (p *progressBar) update(done, total int64) {
	if !p.on {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Since(p.last) < 200*time.Millisecond {
		return
	}
	p.last, p.drawn = time.Now(), true
	rate := float64(done) / time.Since(p.start).Seconds() / (1 << 20)
	line := fmt.Sprintf("%s: %s", p.what, size(done))
	if total > 0 {
		line += fmt.Sprintf(" of ~%s (%d%%)", size(total), min(100, done*100/total))
	}
	fmt.Fprintf(os.Stderr, "\r\033[K%s, %.1f MiB/s", line, rate)
}

func (p *progressBar) done() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drawn {
		fmt.Fprintln(os.Stderr)
		p.drawn = false
	}
}

func size(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%d KiB", n>>10)
}
