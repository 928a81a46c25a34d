package controller

import (
	"context"
	"crypto/sha256"
	"strings"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/concourse/cowvol/internal/ttlcache"
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
	kube    kubernetes.Interface
	tokens  *ttlcache.Cache[[sha256.Size]byte, cachedReview]
	reviews *ttlcache.Cache[string, bool]
}

type cachedReview struct {
	user authnv1.UserInfo
	ok   bool
}

// maxCached bounds each cache: past it, the least recently used answer goes.
const maxCached = 10_000

// NewKubeAuth checks callers against the API server kube reaches,
// caching answers for ttl.
func NewKubeAuth(kube kubernetes.Interface, ttl time.Duration) *KubeAuth {
	return &KubeAuth{kube: kube, tokens: ttlcache.New[[sha256.Size]byte, cachedReview](ttl, maxCached),
		reviews: ttlcache.New[string, bool](ttl, maxCached)}
}

// Authenticate reviews the token with the API server.
func (k *KubeAuth) Authenticate(ctx context.Context, token string) (Caller, error) {
	key := sha256.Sum256([]byte(token))
	now := time.Now()
	r, hit := k.tokens.Get(key, now)
	if !hit {
		review, err := k.kube.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
		if err != nil {
			klog.ErrorS(err, "A TokenReview failed: refusing the call")
			return Caller{}, status.Error(codes.Unavailable, "cannot check the token with the API server now; retry")
		}
		r = cachedReview{user: review.Status.User, ok: review.Status.Authenticated}
		k.tokens.Put(key, r, now)
	}
	if !r.ok {
		return Caller{}, status.Error(codes.Unauthenticated, "the API server does not accept the bearer token")
	}
	user := r.user
	return Caller{User: user.Username, Node: boundNode(user), nodeBound: true, may: func(ctx context.Context, verb, resource, namespace string) bool {
		return k.allowed(ctx, user, verb, resource, namespace)
	}}, nil
}

// The extra fields the API server puts in a review of a ServiceAccount
// token bound to a pod: the pod's name, and its node's.
const (
	extraPodName  = "authentication.kubernetes.io/pod-name"
	extraNodeName = "authentication.kubernetes.io/node-name"
)

// boundNode is the node a reviewed user proves to be: the node of the pod a
// ServiceAccount token is bound to (a node plugin's own projected token),
// or "" for any other token, which speaks for no node.
func boundNode(user authnv1.UserInfo) string {
	if !strings.HasPrefix(user.Username, "system:serviceaccount:") || len(user.Extra[extraPodName]) != 1 {
		return ""
	}
	if nodes := user.Extra[extraNodeName]; len(nodes) == 1 {
		return nodes[0]
	}
	return ""
}

// allowed asks the API server whether user may do verb on resource in
// namespace. A review that fails refuses.
func (k *KubeAuth) allowed(ctx context.Context, user authnv1.UserInfo, verb, resource, namespace string) bool {
	key := strings.Join([]string{user.UID, user.Username, strings.Join(user.Groups, ","), verb, resource, namespace}, "\x00")
	now := time.Now()
	if allowed, hit := k.reviews.Get(key, now); hit {
		return allowed
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
	k.reviews.Put(key, sar.Status.Allowed, now)
	return sar.Status.Allowed
}
