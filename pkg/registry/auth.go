package registry

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"time"

	"golang.org/x/time/rate"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/internal/ttlcache"
	"github.com/concourse/cowvol/pkg/registry/credential"
)

// Authenticator says which namespace a pull's credential speaks for.
type Authenticator interface {
	// Namespace answers the namespace of the pod whose credential user
	// and password are, ErrUnauthenticated if they prove none, or
	// another error if that cannot be told now.
	Namespace(ctx context.Context, user, password string) (string, error)
}

// ErrUnauthenticated says a credential proves no namespace.
var ErrUnauthenticated = errors.New("the credential proves no pod's namespace")

// Auth modes: required refuses a pull without a credential; grace serves
// it as its path says (as before pulls carried credentials), logging and
// counting it, so that nodes keep pulling while the kubelets' credential
// provider is rolled out. A credential given is checked in either.
const (
	AuthRequired = "required"
	AuthGrace    = "grace"
)

// TokenReviews authenticates pulls by their pod's ServiceAccount token,
// reviewed by the API server for credential.Audience: the token must be bound to a
// pod on this node (the kubelet asks for such a token for each pod's
// pull), and its namespace is the pod's. Answers are kept for a short
// while by the token's hash, so a burst of a pull's requests costs one
// review.
//
// Tokens no review could pass (not a JWT for credential.Audience that is
// still valid, by its unverified claims) are refused without one, and the
// reviews of the rest are rate-limited (reviewRate, reviewBurst): a flood
// of made-up tokens costs the API server a bounded number of reviews, and
// the answers kept for live pods' tokens stay (the least recently used go
// first).
type TokenReviews struct {
	kube kubernetes.Interface
	node string
	// The namespace each token proved ("": none), by its hash.
	reviews *ttlcache.Cache[[sha256.Size]byte, string]
	limit   *rate.Limiter
}

// A node's registry reviews at most reviewRate unseen tokens a second,
// reviewBurst at once: a node starts a few dozen pods a second at most.
const (
	reviewRate  = 20
	reviewBurst = 50
)

// errTooManyReviews refuses a pull for now (503: the runtime retries).
var errTooManyReviews = errors.New("too many unseen tokens to review just now")

// reviewTimeout bounds a TokenReview.
const reviewTimeout = 10 * time.Second

// maxReviews bounds the answers kept: past it, the least recently used go.
const maxReviews = 10_000

// NewTokenReviews reviews tokens with the API server kube reaches, for
// pods on node, keeping answers for ttl.
func NewTokenReviews(kube kubernetes.Interface, node string, ttl time.Duration) *TokenReviews {
	return &TokenReviews{kube: kube, node: node, reviews: ttlcache.New[[sha256.Size]byte, string](ttl, maxReviews),
		limit: rate.NewLimiter(reviewRate, reviewBurst)}
}

// Extra keys of a reviewed token bound to a pod.
const (
	extraPodName  = "authentication.kubernetes.io/pod-name"
	extraNodeName = "authentication.kubernetes.io/node-name"
)

// Namespace reviews the password as a ServiceAccount token.
func (a *TokenReviews) Namespace(ctx context.Context, user, password string) (string, error) {
	if user != credential.User || password == "" {
		return "", ErrUnauthenticated
	}
	key := sha256.Sum256([]byte(password))
	now := time.Now()
	ns, hit := a.reviews.Get(key, now)
	if !hit {
		if !mayPass(password, now) {
			return "", ErrUnauthenticated
		}
		if !a.limit.AllowN(now, 1) {
			klog.V(2).InfoS("Refusing an image pull for now: too many unseen tokens to review")
			return "", errTooManyReviews
		}
		// The review is kept for the pull's next requests: one whose
		// client hangs up (a runtime that gave up, a client that closed
		// its side) still finishes it.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), reviewTimeout)
		defer cancel()
		tr, err := a.kube.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{
			Spec: authnv1.TokenReviewSpec{Token: password, Audiences: []string{credential.Audience}}}, metav1.CreateOptions{})
		if err != nil {
			klog.ErrorS(err, "A TokenReview for an image pull failed: refusing the pull")
			return "", err
		}
		ns = a.podNamespace(tr.Status)
		a.reviews.Put(key, ns, now)
	}
	if ns == "" {
		return "", ErrUnauthenticated
	}
	return ns, nil
}

// mayPass says whether a token could pass a review for
// credential.Audience: a JWT whose claims name the audience and an expiry
// still to come. Nothing here is verified (the review does that); it only
// spares the API server reviews that cannot pass.
func mayPass(token string, now time.Time) bool {
	parts := strings.Split(token, ".")
	if len(parts) != 3 || len(parts[1]) > maxClaims {
		return false
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return false
	}
	var claims struct {
		Aud audiences `json:"aud"`
		Exp int64     `json:"exp"`
	}
	return json.Unmarshal(payload, &claims) == nil && slices.Contains(claims.Aud, credential.Audience) && now.Unix() < claims.Exp
}

// maxClaims bounds the claims of a token read before its review.
const maxClaims = 16 << 10

// audiences is a JWT's aud claim: one string, or several.
type audiences []string

func (a *audiences) UnmarshalJSON(b []byte) error {
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*a = []string{one}
		return nil
	}
	return json.Unmarshal(b, (*[]string)(a))
}

// podNamespace is the namespace a review proves: a ServiceAccount's
// token for Audience, bound to a pod on this node.
func (a *TokenReviews) podNamespace(st authnv1.TokenReviewStatus) string {
	if !st.Authenticated || !slices.Contains(st.Audiences, credential.Audience) {
		return ""
	}
	rest, ok := strings.CutPrefix(st.User.Username, "system:serviceaccount:")
	ns, _, ok2 := strings.Cut(rest, ":")
	if !ok || !ok2 || ns == "" {
		return ""
	}
	if len(st.User.Extra[extraPodName]) != 1 {
		klog.V(2).InfoS("Refusing an image pull's token that is bound to no pod", "user", st.User.Username)
		return ""
	}
	if nodes := st.User.Extra[extraNodeName]; len(nodes) != 1 || nodes[0] != a.node {
		klog.V(2).InfoS("Refusing an image pull's token bound to a pod of another node", "user", st.User.Username, "node", nodes)
		return ""
	}
	return ns
}
