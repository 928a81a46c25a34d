// Package client is what a scheduler (a Kubernetes runtime for Concourse CI,
// say) uses to drive cowvol: the controller's Cache API, reached with a
// token over TLS (or plaintext on loopback), and the parts of a step pod's
// spec: inline volumes for inputs, outputs and task caches, and the node
// affinity that places the step beside its inputs. It depends only on the
// API and the shared volume types, never on the plugin's insides.
package client

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// Options say how to reach the controller.
type Options struct {
	// Address is the controller's host:port.
	Address string
	// Token is presented on every call (from the controller's tokens
	// file); TokenFile is read for it where Token is empty.
	Token, TokenFile string
	// CAFile verifies the controller's certificate. Without one the
	// connection is plaintext, which the controller serves on loopback
	// only.
	CAFile string
}

// Client is a connection to the controller's Cache API.
type Client struct {
	conn  *grpc.ClientConn
	Cache controllerv1.CacheClient
}

// Dial connects to the controller (lazily: the first call connects).
func Dial(o Options) (*Client, error) {
	if o.Address == "" {
		return nil, errors.New("the controller's address is required")
	}
	opts, err := DialOptions(o)
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(o.Address, opts...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, Cache: controllerv1.NewCacheClient(conn)}, nil
}

// MaxMessage bounds one message a caller sends the controller, which reads
// no more (a node's whole inventory larger than that goes in parts).
const MaxMessage = controllerv1.MaxMessage

// MaxAnswer bounds one answer a caller reads from the controller: a page
// of 500 volumes that names every holder of each (max_nodes 0) is about 6
// MiB on a 1,000-node fleet whose popular volumes are on every node.
const MaxAnswer = 64 << 20

// callLimits are every caller's message bounds.
var callLimits = grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(MaxMessage), grpc.MaxCallRecvMsgSize(MaxAnswer))

// DialOptions are how anyone reaches the controller, a scheduler or a
// node: TLS verified against the CA where one is given (plaintext, which
// the controller serves on loopback only, otherwise), and the token on
// every call.
func DialOptions(o Options) ([]grpc.DialOption, error) {
	transport := insecure.NewCredentials()
	if o.CAFile != "" {
		var err error
		if transport, err = credentials.NewClientTLSFromFile(o.CAFile, ""); err != nil {
			return nil, fmt.Errorf("loading the controller's CA: %w", err)
		}
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(transport), callLimits}
	if o.Token != "" || o.TokenFile != "" {
		b := Bearer{Token: o.Token, Secure: o.CAFile != ""}
		if o.Token == "" {
			b.File = o.TokenFile
			if _, err := b.token(); err != nil {
				return nil, err
			}
		}
		opts = append(opts, grpc.WithPerRPCCredentials(b))
	}
	return opts, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Bearer presents a token on every call: Token, or what File holds when
// the call is made (a projected ServiceAccount token is rotated in
// place). Secure refuses to send it over plaintext.
type Bearer struct {
	Token, File string
	Secure      bool
}

func (b Bearer) token() (string, error) {
	if b.File == "" {
		return b.Token, nil
	}
	raw, err := os.ReadFile(b.File)
	if err != nil {
		return "", fmt.Errorf("reading the token: %w", err)
	}
	t := strings.TrimSpace(string(raw))
	if t == "" {
		return "", fmt.Errorf("the token file %s is empty", b.File)
	}
	return t, nil
}

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (b Bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	t, err := b.token()
	if err != nil {
		return nil, err
	}
	return map[string]string{"authorization": "Bearer " + t}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials.
func (b Bearer) RequireTransportSecurity() bool { return b.Secure }

// Properties are a volume's properties as a node reports them: sorted by
// key.
func Properties(m map[string]string) []*controllerv1.Property {
	if len(m) == 0 {
		return nil
	}
	out := make([]*controllerv1.Property, 0, len(m))
	for k, v := range m {
		out = append(out, &controllerv1.Property{Key: k, Value: v})
	}
	slices.SortFunc(out, func(a, b *controllerv1.Property) int { return strings.Compare(a.Key, b.Key) })
	return out
}

// Lookup says where each volume is, in order, naming every node that
// holds it ready.
func (c *Client) Lookup(ctx context.Context, vols ...volume.Ref) ([]*controllerv1.VolumeLocation, error) {
	return c.LookupFirst(ctx, 0, vols...)
}

// LookupFirst is Lookup naming at most maxNodes of each volume's nodes,
// the first by ID (NodeCount says how many hold it): in a big fleet a
// popular volume is on every node, and a caller that asks whether it is
// held at all needs none of their names.
func (c *Client) LookupFirst(ctx context.Context, maxNodes int, vols ...volume.Ref) ([]*controllerv1.VolumeLocation, error) {
	resp, err := c.Cache.LookupVolumes(ctx, &controllerv1.LookupVolumesRequest{Refs: controllerv1.RefsOf(vols), MaxNodes: int32(maxNodes)})
	return resp.GetVolumes(), err
}

// Place ranks every node that takes captures for a step with these
// inputs, best first.
func (c *Client) Place(ctx context.Context, inputs ...volume.Ref) ([]*controllerv1.NodePlacement, error) {
	return c.PlaceBest(ctx, 0, inputs...)
}

// PlaceBest is Place answering only the best limit nodes (all: 0), as
// many as PreferNodes uses (PreferredNodes) for a step pod's affinity.
func (c *Client) PlaceBest(ctx context.Context, limit int, inputs ...volume.Ref) ([]*controllerv1.NodePlacement, error) {
	return c.PlaceStep(ctx, limit, inputs, nil)
}

// PlaceStep is PlaceBest for a step that names caches too: each counts as
// an input, the newest version of its key.
func (c *Client) PlaceStep(ctx context.Context, limit int, inputs []volume.Ref, caches []volume.CacheRef) ([]*controllerv1.NodePlacement, error) {
	req := &controllerv1.PlaceRequest{Inputs: controllerv1.RefsOf(inputs), Limit: int32(limit)}
	for _, k := range caches {
		req.Caches = append(req.Caches, &controllerv1.CacheRef{Namespace: k.Namespace, Key: k.Key})
	}
	resp, err := c.Cache.Place(ctx, req)
	return resp.GetNodes(), err
}

// Destroy destroys volumes on every node holding them, saying which nodes
// were asked.
func (c *Client) Destroy(ctx context.Context, vols ...volume.Ref) ([]*controllerv1.VolumeNodes, error) {
	resp, err := c.Cache.DestroyVolumes(ctx, &controllerv1.DestroyVolumesRequest{Refs: controllerv1.RefsOf(vols)})
	return resp.GetVolumes(), err
}

// Pin pins volumes on every node holding them, until until (zero: for
// good).
func (c *Client) Pin(ctx context.Context, until time.Time, vols ...volume.Ref) ([]*controllerv1.VolumeNodes, error) {
	req := &controllerv1.PinVolumesRequest{Refs: controllerv1.RefsOf(vols)}
	if !until.IsZero() {
		req.Until = timestamppb.New(until)
	}
	resp, err := c.Cache.PinVolumes(ctx, req)
	return resp.GetVolumes(), err
}

// Unpin unpins volumes on every node holding them.
func (c *Client) Unpin(ctx context.Context, vols ...volume.Ref) ([]*controllerv1.VolumeNodes, error) {
	resp, err := c.Cache.PinVolumes(ctx, &controllerv1.PinVolumesRequest{Refs: controllerv1.RefsOf(vols), Unpin: true})
	return resp.GetVolumes(), err
}

// Caches says where each cache key of namespace has its newest version
// (with no keys: every key of namespace that has one), naming every node
// that holds it.
func (c *Client) Caches(ctx context.Context, namespace string, keys ...string) ([]*controllerv1.CacheLocation, error) {
	resp, err := c.Cache.LookupCaches(ctx, &controllerv1.LookupCachesRequest{Namespace: namespace, Keys: keys})
	return resp.GetCaches(), err
}

// ClearCaches clears cache keys of namespace on every node holding a
// version of them.
func (c *Client) ClearCaches(ctx context.Context, namespace string, keys ...string) ([]*controllerv1.ClearedCache, error) {
	resp, err := c.Cache.ClearCaches(ctx, &controllerv1.ClearCachesRequest{Namespace: namespace, Keys: keys})
	return resp.GetCaches(), err
}

// Nodes lists the nodes the controller knows.
func (c *Client) Nodes(ctx context.Context) ([]*controllerv1.NodeStatus, error) {
	resp, err := c.Cache.ListNodes(ctx, &controllerv1.ListNodesRequest{})
	return resp.GetNodes(), err
}

// SetLifecycle lands, retires or resumes a node.
func (c *Client) SetLifecycle(ctx context.Context, node, action string) (*controllerv1.NodeStatus, error) {
	return c.Cache.SetNodeLifecycle(ctx, &controllerv1.SetNodeLifecycleRequest{NodeId: node, Action: action})
}

// List lists every volume the query selects, page by page (its limit is
// the page size; its page token is ignored).
func (c *Client) List(ctx context.Context, q *controllerv1.ListVolumesRequest) ([]*controllerv1.VolumeLocation, error) {
	var out []*controllerv1.VolumeLocation
	page := proto.Clone(q).(*controllerv1.ListVolumesRequest)
	page.PageToken = ""
	for {
		resp, err := c.Cache.ListVolumes(ctx, page)
		if err != nil {
			return nil, err
		}
		out = append(out, resp.GetVolumes()...)
		if page.PageToken = resp.GetNextPageToken(); page.PageToken == "" {
			return out, nil
		}
	}
}

// Chain is a volume and its ancestors, each the parent of the one before,
// as far as live nodes hold them (the last one's parent, if it has one the
// controller does not know, is left out).
func (c *Client) Chain(ctx context.Context, vol volume.Ref) ([]*controllerv1.VolumeLocation, error) {
	var out []*controllerv1.VolumeLocation
	seen := map[volume.Ref]bool{}
	for r := vol; r.Handle != "" && !seen[r] && len(out) < maxChain; {
		seen[r] = true
		locs, err := c.Lookup(ctx, r)
		if err != nil {
			return nil, err
		}
		if len(locs) != 1 || !locs[0].GetFound() {
			break
		}
		out = append(out, locs[0])
		r = volume.Ref{Namespace: locs[0].GetParent().GetNamespace(), Handle: locs[0].GetParent().GetHandle()}
	}
	return out, nil
}

// maxChain bounds a lineage walk: captures of captures rarely go past tens.
const maxChain = 1000
