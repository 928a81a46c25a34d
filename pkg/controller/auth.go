package controller

import (
	"bufio"
	"context"
	"crypto/subtle"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// What callers act on, as Kubernetes RBAC names it: a virtual resource
// per namespace for the cached volumes, and a cluster-wide one for the
// nodes' caches. Operators grant them with ordinary Roles and ClusterRoles.
const (
	APIGroup = "cowvol.concourse-ci.org"
	// ResourceVolumes (namespaced): get (lookups, placement), list
	// (listings), delete (destroy), update (pin, unpin).
	ResourceVolumes = "cachedvolumes"
	// ResourceNodes (cluster-wide): update (a node reporting its cache),
	// list (listing the nodes), patch (land, retire, resume).
	ResourceNodes = "cachenodes"
)

// Caller is who is calling, and what they may do.
type Caller struct {
	User string
	// Node is the node the caller proved to be ("" for none): it speaks
	// for that node alone. nodeBound says a caller that proved no node
	// speaks for none (one checked by the API server: only a token bound
	// to a pod on a node says which node it is).
	Node      string
	nodeBound bool
	// may says whether the caller may do verb on resource in namespace
	// ("" for a cluster-wide resource, or every namespace).
	may func(ctx context.Context, verb, resource, namespace string) bool
}

// May says whether the caller may do verb on resource in namespace.
func (c Caller) May(ctx context.Context, verb, resource, namespace string) bool {
	return c.may(ctx, verb, resource, namespace)
}

// MayIn is May for verb on the cached volumes, as a predicate over
// namespaces that asks once per namespace: a call that answers for a
// thousand volumes of a few namespaces makes a few checks.
func (c Caller) MayIn(ctx context.Context, verb string) func(namespace string) bool {
	seen := map[string]bool{}
	return func(ns string) bool {
		may, ok := seen[ns]
		if !ok {
			may = c.may(ctx, verb, ResourceVolumes, ns)
			seen[ns] = may
		}
		return may
	}
}

// anyone is the caller where no authentication is configured: the APIs
// then listen on loopback only, so only this machine's root can call.
var anyone = Caller{User: "loopback", may: func(context.Context, string, string, string) bool { return true }}

type callerKey struct{}

// CallerFrom is the authenticated caller of a call.
func CallerFrom(ctx context.Context) Caller {
	if c, ok := ctx.Value(callerKey{}).(Caller); ok {
		return c
	}
	return anyone
}

// Authenticator finds the caller a bearer token belongs to; it answers
// Unauthenticated for a token it does not know.
type Authenticator interface {
	Authenticate(ctx context.Context, token string) (Caller, error)
}

// speaksFor refuses a call that speaks for a node (a report, a shared read
// order) unless its caller proved to be that node, or is one that may
// speak for any (no authentication on loopback, a tokens-file line naming
// no node).
func speaksFor(ctx context.Context, node string) error {
	c := CallerFrom(ctx)
	if c.Node == node || (c.Node == "" && !c.nodeBound) {
		return nil
	}
	if c.Node == "" {
		return status.Errorf(codes.PermissionDenied, "%s may not speak for node %s: only a token bound to a pod on that node may",
			volume.Quote(c.User), volume.Quote(node))
	}
	return status.Errorf(codes.PermissionDenied, "%s is node %s: it may not speak for node %s",
		volume.Quote(c.User), volume.Quote(c.Node), volume.Quote(node))
}

// reviewInTap bounds how long the tap waits for the API server to review
// an unseen token (the connection's other calls wait meanwhile).
const reviewInTap = 5 * time.Second

// Tap admits a call before gRPC reads its message: a call without a
// token the authenticator accepts is turned away having cost its headers,
// the nodes' Registry is closed to callers that may not report, and the
// call takes one of msgs' slots (nil: none). It runs on the connection's
// reader, so only that connection waits while an unseen token is reviewed
// (a known one is answered from the authenticator's cache). The caller
// goes in the call's context for the interceptors. A nil Authenticator
// lets every caller through.
func Tap(auth Authenticator, msgs *Messages) tap.ServerInHandle {
	registry := "/" + controllerv1.Registry_ServiceDesc.ServiceName + "/"
	return func(ctx context.Context, info *tap.Info) (context.Context, error) {
		if auth != nil {
			token := bearerToken(info.Header)
			if token == "" {
				return nil, status.Error(codes.Unauthenticated, "no bearer token")
			}
			reviewCtx, cancel := context.WithTimeout(ctx, reviewInTap)
			c, err := auth.Authenticate(reviewCtx, token)
			cancel()
			if err != nil {
				return nil, err
			}
			ctx = context.WithValue(ctx, callerKey{}, c)
			if strings.HasPrefix(info.FullMethodName, registry) {
				if err := need(ctx, "update", ResourceNodes, "", "call the nodes' Registry"); err != nil {
					return nil, err
				}
			}
		}
		if msgs == nil {
			return ctx, nil
		}
		return msgs.take(ctx)
	}
}

// Interceptor authenticates every call, refusing those without a known
// token, unless Tap did already; and gives back the call's slot among the
// messages being read (Messages), its message read. A nil Authenticator
// lets every call through as anyone.
func Interceptor(auth Authenticator) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		messageRead(ctx)
		ctx, err := authenticate(ctx, auth)
		if err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

// StreamInterceptor is Interceptor for streaming calls (volume reads and
// uploads).
func StreamInterceptor(auth Authenticator) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx, err := authenticate(ss.Context(), auth)
		if err != nil {
			return err
		}
		return handler(srv, &callerStream{ServerStream: ss, ctx: ctx})
	}
}

// callerStream carries the authenticated caller in its context.
type callerStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *callerStream) Context() context.Context { return s.ctx }

// authenticate puts the bearer token's caller in ctx (with no
// authenticator, the anonymous caller who may do anything stays), unless
// Tap put it there already.
func authenticate(ctx context.Context, auth Authenticator) (context.Context, error) {
	if auth == nil {
		return ctx, nil
	}
	if _, ok := ctx.Value(callerKey{}).(Caller); ok {
		return ctx, nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	token := bearerToken(md)
	if token == "" {
		return nil, status.Error(codes.Unauthenticated, "no bearer token")
	}
	c, err := auth.Authenticate(ctx, token)
	if err != nil {
		return nil, err
	}
	return context.WithValue(ctx, callerKey{}, c), nil
}

// bearerToken is the token of a call's authorization header ("" if none).
func bearerToken(md metadata.MD) string {
	var token string
	for _, v := range md.Get("authorization") {
		if rest, ok := strings.CutPrefix(v, "Bearer "); ok {
			token = rest
		}
	}
	return token
}

// Tokens authenticates callers by bearer token, from a file of
// "token,user,namespaces[,node]" lines, namespaces "*" or "a;b". A "*"
// caller may do anything; another may act on the cached volumes of its
// namespaces. A line naming a node speaks for that node alone; one naming
// none, for any (a tokens file is for tests and single-machine fleets:
// bind each node's token to its node there too).
type Tokens struct{ callers map[string]Caller }

// LoadTokens reads a tokens file.
func LoadTokens(path string) (*Tokens, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading the tokens file: %w", err)
	}
	defer f.Close()
	t := &Tokens{callers: map[string]Caller{}}
	sc := bufio.NewScanner(f)
	for line := 1; sc.Scan(); line++ {
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		parts := strings.Split(text, ",")
		if len(parts) < 3 || len(parts) > 4 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
			return nil, fmt.Errorf("%s:%d: want token,user,namespaces[,node]", path, line)
		}
		if len(parts[0]) < 16 {
			return nil, fmt.Errorf("%s:%d: a token must be at least 16 characters", path, line)
		}
		c := Caller{User: parts[1], may: anyone.may}
		if len(parts) == 4 {
			if parts[3] == "" {
				return nil, fmt.Errorf("%s:%d: an empty node name", path, line)
			}
			c.Node, c.nodeBound = parts[3], true
		}
		if parts[2] != "*" {
			var namespaces []string
			for _, ns := range strings.Split(parts[2], ";") {
				if err := volume.ValidateNamespace(ns); err != nil {
					return nil, fmt.Errorf("%s:%d: %w", path, line, err)
				}
				namespaces = append(namespaces, ns)
			}
			c.may = func(_ context.Context, _, resource, ns string) bool {
				return resource == ResourceVolumes && slices.Contains(namespaces, ns)
			}
		}
		t.callers[parts[0]] = c
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(t.callers) == 0 {
		return nil, fmt.Errorf("%s holds no token", path)
	}
	return t, nil
}

// Authenticate finds the caller of a token, comparing in constant time.
func (t *Tokens) Authenticate(_ context.Context, token string) (Caller, error) {
	for known, c := range t.callers {
		if subtle.ConstantTimeCompare([]byte(known), []byte(token)) == 1 {
			return c, nil
		}
	}
	return Caller{}, status.Error(codes.Unauthenticated, "unknown bearer token")
}

// need refuses a call the caller may not make.
func need(ctx context.Context, verb, resource, namespace, what string) error {
	c := CallerFrom(ctx)
	if c.May(ctx, verb, resource, namespace) {
		return nil
	}
	where := "cluster-wide"
	if namespace != "" {
		where = "in namespace " + volume.Quote(namespace)
	}
	return status.Errorf(codes.PermissionDenied, "%s may not %s: that needs %s on %s.%s %s", volume.Quote(c.User), what, verb,
		resource, APIGroup, where)
}

// needNamespaces refuses a call that does verb to volumes outside the
// namespaces where the caller may. The answer does not depend on whether
// the volumes exist.
func needNamespaces(ctx context.Context, verb, what string, refs []*controllerv1.VolumeRef) error {
	seen := map[string]bool{}
	for _, r := range refs {
		if ns := r.GetNamespace(); !seen[ns] {
			seen[ns] = true
			if err := need(ctx, verb, ResourceVolumes, ns, what); err != nil {
				return err
			}
		}
	}
	return nil
}
