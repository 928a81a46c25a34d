package controller

import (
	"context"
	"crypto/sha256"
	"strings"
	"sync"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// KubeAuth authenticates callers with the API server (a TokenReview of
// their bearer token: a ServiceAccount's, or any token the cluster
// accepts) and authorizes each call with a SubjectAccessReview on the
// virtual resources ResourceVolumes and ResourceNodes, so operators grant
// access with ordinary RBAC. Answers are cached briefly, as the API
// server's own webhook authenticator and authorizer do, so a scheduler's
// lookups do not each cost two API calls; a revoked grant takes effect
// within the cache's TTL.
type KubeAuth struct {
	kube kubernetes.Interface
	ttl  time.Duration

	mu      sync.Mutex
	tokens  map[[sha256.Size]byte]cachedReview
	reviews map[string]cachedAccess
}

type cachedReview struct {
	user    authnv1.UserInfo
	ok      bool
	expires time.Time
}

type cachedAccess struct {
	allowed bool
	expires time.Time
}

// maxCached bounds each cache: past it, the cache starts over.
const maxCached = 10_000

// NewKubeAuth checks callers against the API server kube reaches,
// caching answers for ttl.
func NewKubeAuth(kube kubernetes.Interface, ttl time.Duration) *KubeAuth {
	return &KubeAuth{kube: kube, ttl: ttl, tokens: map[[sha256.Size]byte]cachedReview{}, reviews: map[string]cachedAccess{}}
}

// Authenticate reviews the token with the API server.
func (k *KubeAuth) Authenticate(ctx context.Context, token string) (Caller, error) {
	key := sha256.Sum256([]byte(token))
	now := time.Now()
	k.mu.Lock()
	r, hit := k.tokens[key]
	k.mu.Unlock()
	if !hit || now.After(r.expires) {
		review, err := k.kube.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
		if err != nil {
			klog.ErrorS(err, "A TokenReview failed: refusing the call")
			return Caller{}, status.Error(codes.Unavailable, "cannot check the token with the API server now; retry")
		}
		r = cachedReview{user: review.Status.User, ok: review.Status.Authenticated, expires: now.Add(k.ttl)}
		k.mu.Lock()
		if len(k.tokens) >= maxCached {
			clear(k.tokens)
		}
		k.tokens[key] = r
		k.mu.Unlock()
	}
	if !r.ok {
		return Caller{}, status.Error(codes.Unauthenticated, "the API server does not accept the bearer token")
	}
	user := r.user
	return Caller{User: user.Username, may: func(ctx context.Context, verb, resource, namespace string) bool {
		return k.allowed(ctx, user, verb, resource, namespace)
	}}, nil
}

// allowed asks the API server whether user may do verb on resource in
// namespace. A review that fails refuses.
func (k *KubeAuth) allowed(ctx context.Context, user authnv1.UserInfo, verb, resource, namespace string) bool {
	key := strings.Join([]string{user.UID, user.Username, strings.Join(user.Groups, ","), verb, resource, namespace}, "\x00")
	now := time.Now()
	k.mu.Lock()
	a, hit := k.reviews[key]
	k.mu.Unlock()
	if hit && now.Before(a.expires) {
		return a.allowed
	}
	extra := map[string]authzv1.ExtraValue{}
	for name, v := range user.Extra {
		extra[name] = authzv1.ExtraValue(v)
	}
	sar, err := k.kube.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
		User: user.Username, Groups: user.Groups, UID: user.UID, Extra: extra,
		ResourceAttributes: &authzv1.ResourceAttributes{Group: APIGroup, Resource: resource, Verb: verb, Namespace: namespace},
	}}, metav1.CreateOptions{})
	if err != nil {
		klog.ErrorS(err, "A SubjectAccessReview failed: refusing", "user", user.Username, "verb", verb, "resource", resource, "namespace", namespace)
		return false
	}
	k.mu.Lock()
	if len(k.reviews) >= maxCached {
		clear(k.reviews)
	}
	k.reviews[key] = cachedAccess{allowed: sar.Status.Allowed, expires: now.Add(k.ttl)}
	k.mu.Unlock()
	return sar.Status.Allowed
}
