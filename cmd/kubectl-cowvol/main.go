// Command kubectl-cowvol is cowvol's operator CLI, a kubectl plugin
// (`kubectl cowvol ...`): the nodes and their caches, the cached volumes,
// and what an operator does with them (destroy, pin, take nodes out of
// service), all through the controller's Cache API. It prints tables for
// people and -o json or -o yaml for scripts, and takes the namespace from
// -n or the kubeconfig's context as kubectl does.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/status"
	"k8s.io/client-go/tools/clientcmd"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/volume"
)

var version = "dev"

// options are the flags every command shares.
type options struct {
	kube    clientcmd.ClientConfig
	dial    client.Options
	via     client.KubeOptions
	output  string
	timeout time.Duration
	out     io.Writer
}

func main() {
	if err := newRoot(os.Stdout).Execute(); err != nil {
		msg := err.Error()
		if st, ok := status.FromError(err); ok {
			msg = st.Code().String() + ": " + st.Message()
		}
		fmt.Fprintln(os.Stderr, "error:", msg)
		os.Exit(1)
	}
}

func newRoot(out io.Writer) *cobra.Command {
	o := &options{out: out}
	root := &cobra.Command{
		Use:           "kubectl-cowvol",
		Short:         "Operate cowvol: the nodes' caches and the volumes in them",
		Version:       version,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	flags := root.PersistentFlags()
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	flags.StringVar(&rules.ExplicitPath, "kubeconfig", "", "path to the kubeconfig file (for the namespace of its context)")
	overrides := &clientcmd.ConfigOverrides{}
	flags.StringVarP(&overrides.Context.Namespace, "namespace", "n", "", "the namespace whose volumes to act on")
	flags.StringVar(&overrides.CurrentContext, "context", "", "the kubeconfig context to use")
	o.kube = clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, overrides)
	flags.StringVar(&o.dial.Address, "controller-address", os.Getenv("COWVOL_CONTROLLER_ADDRESS"),
		"the controller's Cache API, host:port (default $COWVOL_CONTROLLER_ADDRESS; unset: a port-forward to its leader through the kubeconfig's API server)")
	flags.StringVar(&o.dial.TokenFile, "token-file", os.Getenv("COWVOL_TOKEN_FILE"),
		"a file holding the bearer token to present (default $COWVOL_TOKEN_FILE, else the kubeconfig user's token)")
	flags.StringVar(&o.dial.CAFile, "tls-ca-file", os.Getenv("COWVOL_TLS_CA_FILE"), "the CA that signed the controller's certificate (default $COWVOL_TLS_CA_FILE)")
	flags.StringVar(&o.via.Namespace, "controller-namespace", "cowvol",
		"without --controller-address: the namespace of the controller's pods, Lease and TLS Secret, reached through the API server")
	flags.StringVar(&o.via.Lease, "controller-lease", "cowvol-controller", "without --controller-address: the controller's leader-election Lease")
	flags.IntVar(&o.via.Port, "controller-port", 7070, "without --controller-address: the controller's API port in its pod")
	flags.StringVarP(&o.output, "output", "o", "", "output format: json or yaml (default: a table)")
	flags.DurationVar(&o.timeout, "request-timeout", 30*time.Second, "how long to wait for the controller")
	root.AddCommand(o.nodesCmd(), o.volumesCmd(), o.cachesCmd(), o.chainCmd(), o.destroyCmd(), o.pinCmd(), o.unpinCmd(), o.catCmd(), o.cpCmd())
	for _, action := range []string{"land", "retire", "resume"} {
		root.AddCommand(o.lifecycleCmd(action))
	}
	return root
}

// call dials the controller for one command and runs do with it.
func (o *options) call(cmd *cobra.Command, do func(context.Context, *client.Client) error) error {
	if o.output != "" && o.output != "json" && o.output != "yaml" {
		return fmt.Errorf("output %q: want json or yaml", o.output)
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), o.timeout)
	defer cancel()
	c, err := o.dialController(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	return do(ctx, c)
}

// dialController reaches the controller at --controller-address, or else
// through the kubeconfig's cluster, as kubectl port-forward does.
func (o *options) dialController(ctx context.Context) (*client.Client, error) {
	if o.dial.Address == "" {
		cfg, err := o.kube.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("no controller: give --controller-address, or a kubeconfig to reach it through (%w)", err)
		}
		o.via.CAFile = o.dial.CAFile
		return client.DialKube(ctx, cfg, o.via)
	}
	dial := o.dial
	if dial.TokenFile == "" {
		// As kubectl would: the kubeconfig's own credentials, which a
		// controller with --kube-auth checks with the API server.
		if cfg, err := o.kube.ClientConfig(); err == nil {
			dial.Token, dial.TokenFile = cfg.BearerToken, cfg.BearerTokenFile
		}
	}
	return client.Dial(dial)
}

// namespace is -n's, else the kubeconfig context's, else "default".
func (o *options) namespace() (string, error) {
	ns, _, err := o.kube.Namespace()
	if err != nil && !clientcmd.IsEmptyConfig(err) {
		return "", err
	}
	if ns == "" {
		ns = "default"
	}
	return ns, volume.ValidateNamespace(ns)
}

// refs are handles in the namespace; "ns/handle" names another's.
func (o *options) refs(args []string) ([]volume.Ref, error) {
	ns, err := o.namespace()
	if err != nil {
		return nil, err
	}
	out := make([]volume.Ref, len(args))
	for i, a := range args {
		r, perr := volume.ParseRef(a)
		if perr != nil {
			r = volume.Ref{Namespace: ns, Handle: a}
		}
		if err := r.Validate(); err != nil {
			return nil, fmt.Errorf("%s: %w", volume.Quote(a), err)
		}
		out[i] = r
	}
	return out, nil
}

func (o *options) nodesCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "nodes",
		Short: "List the nodes the controller knows: state, store, volumes, bytes, free space, last heartbeat",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return o.call(cmd, func(ctx context.Context, c *client.Client) error {
				nodes, err := c.Nodes(ctx)
				if err != nil {
					return err
				}
				return o.print(nodeRows(nodes, time.Now()))
			})
		},
	}
}

func (o *options) volumesCmd() *cobra.Command {
	var all bool
	q := &controllerv1.ListVolumesRequest{}
	cmd := &cobra.Command{
		Use:   "volumes",
		Short: "List cached volumes, by namespace, node and property selector",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !all {
				ns, err := o.namespace()
				if err != nil {
					return err
				}
				q.Namespace = ns
			}
			return o.call(cmd, func(ctx context.Context, c *client.Client) error {
				vols, err := c.List(ctx, q)
				if err != nil {
					return err
				}
				return o.print(volumeRows(vols))
			})
		},
	}
	cmd.Flags().BoolVarP(&all, "all-namespaces", "A", false, "every namespace you may see")
	cmd.Flags().StringVar(&q.NodeId, "node", "", "only volumes this node holds (in any state)")
	cmd.Flags().StringVarP(&q.Selector, "selector", "l", "", "a selector over the volumes' properties, e.g. resource=repo,version=3")
	return cmd
}

func (o *options) cachesCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "caches [KEY...]",
		Short: "List the namespace's cache keys: each one's newest version, its size, the nodes holding it, when and by which step it was promoted",
		RunE: o.onKeys(func(ctx context.Context, c *client.Client, ns string, keys []string) (table, error) {
			caches, err := c.Caches(ctx, ns, keys...)
			return cacheRows(caches, time.Now()), err
		}),
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "clear KEY...",
		Short: "Clear cache keys on every node: the next step naming one starts empty; a step reading a version keeps it until it ends",
		Args:  cobra.MinimumNArgs(1),
		RunE: o.onKeys(func(ctx context.Context, c *client.Client, ns string, keys []string) (table, error) {
			cleared, err := c.ClearCaches(ctx, ns, keys...)
			return clearedRows(ns, cleared), err
		}),
	})
	return cmd
}

// onKeys runs a command on the cache keys its arguments name, in the
// namespace, printing what do answers.
func (o *options) onKeys(do func(ctx context.Context, c *client.Client, namespace string, keys []string) (table, error)) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, keys []string) error {
		ns, err := o.namespace()
		if err != nil {
			return err
		}
		return o.call(cmd, func(ctx context.Context, c *client.Client) error {
			t, err := do(ctx, c, ns, keys)
			if err != nil {
				return err
			}
			return o.print(t)
		})
	}
}

func (o *options) chainCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "chain HANDLE",
		Short: "Show a volume and the volumes it was captured from, newest first",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			refs, err := o.refs(args)
			if err != nil {
				return err
			}
			return o.call(cmd, func(ctx context.Context, c *client.Client) error {
				chain, err := c.Chain(ctx, refs[0])
				if err != nil {
					return err
				}
				if len(chain) == 0 {
					return fmt.Errorf("volume %s: no live node holds it", refs[0])
				}
				return o.print(volumeRows(chain))
			})
		},
	}
}

func (o *options) destroyCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "destroy HANDLE...",
		Short: "Destroy volumes on every node holding them (once no step uses them)",
		Args:  cobra.MinimumNArgs(1),
		RunE: o.onVolumes(func(ctx context.Context, c *client.Client, refs []volume.Ref) ([]*controllerv1.VolumeNodes, error) {
			return c.Destroy(ctx, refs...)
		}),
	}
}

func (o *options) pinCmd() *cobra.Command {
	var until time.Duration
	cmd := &cobra.Command{
		Use:   "pin HANDLE...",
		Short: "Keep volumes from TTL expiry and eviction, for good or --for a while",
		Args:  cobra.MinimumNArgs(1),
		RunE: o.onVolumes(func(ctx context.Context, c *client.Client, refs []volume.Ref) ([]*controllerv1.VolumeNodes, error) {
			var at time.Time
			if until > 0 {
				at = time.Now().Add(until)
			}
			return c.Pin(ctx, at, refs...)
		}),
	}
	cmd.Flags().DurationVar(&until, "for", 0, "how long the pin lasts (default: for good)")
	return cmd
}

func (o *options) unpinCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "unpin HANDLE...",
		Short: "Let pinned volumes expire and be evicted again",
		Args:  cobra.MinimumNArgs(1),
		RunE: o.onVolumes(func(ctx context.Context, c *client.Client, refs []volume.Ref) ([]*controllerv1.VolumeNodes, error) {
			return c.Unpin(ctx, refs...)
		}),
	}
}

// onVolumes runs a command on the volumes its arguments name, printing
// which nodes were asked.
func (o *options) onVolumes(do func(context.Context, *client.Client, []volume.Ref) ([]*controllerv1.VolumeNodes, error)) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		refs, err := o.refs(args)
		if err != nil {
			return err
		}
		return o.call(cmd, func(ctx context.Context, c *client.Client) error {
			asked, err := do(ctx, c, refs)
			if err != nil {
				return err
			}
			return o.print(askedRows(cmd.Name(), asked))
		})
	}
}

func (o *options) lifecycleCmd(action string) *cobra.Command {
	short := map[string]string{
		"land":   "Take a node out of service, keeping its volumes: no new placements or captures",
		"retire": "Take a node out of service for good: once its steps finish, its volumes are destroyed and it is forgotten",
		"resume": "Put a landed or retiring node back in service",
	}[action]
	return &cobra.Command{
		Use:   action + " NODE",
		Short: short,
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return o.call(cmd, func(ctx context.Context, c *client.Client) error {
				st, err := c.SetLifecycle(ctx, args[0], action)
				if err != nil {
					return err
				}
				return o.print(nodeRows([]*controllerv1.NodeStatus{st}, time.Now()))
			})
		},
	}
}
