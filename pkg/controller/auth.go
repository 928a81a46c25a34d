package controller

import (
	"bufio"
	"context"
	"crypto/subtle"
	"fmt"
	"os"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// Caller is who is calling: a user and the namespaces they may act in
// (every one when All).
type Caller struct {
	User       string
	All        bool
	Namespaces []string
}

// Can says whether the caller may act in namespace ns.
func (c Caller) Can(ns string) bool { return c.All || slices.Contains(c.Namespaces, ns) }

// anyone is the caller where no authentication is configured: the APIs
// then listen on loopback only, so only this machine's root can call.
var anyone = Caller{User: "loopback", All: true}

type callerKey struct{}

// CallerFrom is the authenticated caller of a call.
func CallerFrom(ctx context.Context) Caller {
	if c, ok := ctx.Value(callerKey{}).(Caller); ok {
		return c
	}
	return anyone
}

// Tokens authenticates callers by bearer token, from a file of
// "token,user,namespaces" lines, namespaces "*" or "a;b".
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
		if len(parts) != 3 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
			return nil, fmt.Errorf("%s:%d: want token,user,namespaces", path, line)
		}
		c := Caller{User: parts[1], All: parts[2] == "*"}
		if !c.All {
			for _, ns := range strings.Split(parts[2], ";") {
				if err := volume.ValidateNamespace(ns); err != nil {
					return nil, fmt.Errorf("%s:%d: %w", path, line, err)
				}
				c.Namespaces = append(c.Namespaces, ns)
			}
		}
		if len(parts[0]) < 16 {
			return nil, fmt.Errorf("%s:%d: a token must be at least 16 characters", path, line)
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

// authenticate finds the caller of a bearer token, comparing in constant
// time.
func (t *Tokens) authenticate(ctx context.Context) (Caller, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	var token string
	for _, v := range md.Get("authorization") {
		if rest, ok := strings.CutPrefix(v, "Bearer "); ok {
			token = rest
		}
	}
	if token == "" {
		return Caller{}, status.Error(codes.Unauthenticated, "no bearer token: present one from the controller's tokens file")
	}
	for known, c := range t.callers {
		if subtle.ConstantTimeCompare([]byte(known), []byte(token)) == 1 {
			return c, nil
		}
	}
	return Caller{}, status.Error(codes.Unauthenticated, "unknown bearer token")
}

// Interceptor authenticates every call, refusing those without a known
// token. A nil Tokens lets every call through as anyone.
func (t *Tokens) Interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if t == nil {
		return handler(ctx, req)
	}
	c, err := t.authenticate(ctx)
	if err != nil {
		return nil, err
	}
	return handler(context.WithValue(ctx, callerKey{}, c), req)
}

// needAll refuses a call only a cluster-wide caller may make.
func needAll(ctx context.Context, what string) error {
	if c := CallerFrom(ctx); !c.All {
		return status.Errorf(codes.PermissionDenied, "%s %s needs a cluster-wide token (namespaces *)", c.User, what)
	}
	return nil
}

// needNamespaces refuses a call that acts on volumes outside the caller's
// namespaces. The answer does not depend on whether the volumes exist.
func needNamespaces(ctx context.Context, refs []*controllerv1.VolumeRef) error {
	c := CallerFrom(ctx)
	for _, r := range refs {
		if !c.Can(r.GetNamespace()) {
			return status.Errorf(codes.PermissionDenied, "%s may not act in namespace %s", c.User, volume.Quote(r.GetNamespace()))
		}
	}
	return nil
}
