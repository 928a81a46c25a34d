package registry

import (
	"context"
	"crypto/sha256"
	"errors"
	"slices"
	"strings"
	"time"

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
type TokenReviews struct {
	kube kubernetes.Interface
	node string
	// The namespace each token proved ("": none), by its hash.
	reviews *ttlcache.Cache[[sha256.Size]byte, string]
}

// reviewTimeout bounds a TokenReview.
const reviewTimeout = 10 * time.Second

// maxReviews bounds the answers kept: past it, they start over.
const maxReviews = 10_000

// NewTokenReviews reviews tokens with the API server kube reaches, for
// pods on node, keeping answers for ttl.
func NewTokenReviews(kube kubernetes.Interface, node string, ttl time.Duration) *TokenReviews {
	return &TokenReviews{kube: kube, node: node, reviews: ttlcache.New[[sha256.Size]byte, string](ttl, maxReviews)}
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
