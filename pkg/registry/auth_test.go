package registry

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/concourse/cowvol/pkg/registry/credential"
	"github.com/concourse/cowvol/pkg/volume"
)

// countedVolumes counts the look-ups a request makes: one refused for
// who asks must make none, so that its answer and its time are those of
// a volume that is not there.
type countedVolumes struct {
	dirVolumes
	lookups *atomic.Int64
}

func (v countedVolumes) Version(ns string, r volume.Ref, need volume.Need) (string, error) {
	v.lookups.Add(1)
	return v.dirVolumes.Version(ns, r, need)
}

// jwtOf is a token shaped as the kubelet's are (a JWT whose claims name
// credential.Audience and an expiry to come), which reviewingAPI knows as
// name: the registry looks at a token's shape before it asks for a review.
func jwtOf(name string) string {
	claims, _ := json.Marshal(map[string]any{"aud": []string{credential.Audience}, "exp": time.Now().Add(time.Hour).Unix(), "sub": name})
	enc := base64.RawURLEncoding
	return enc.EncodeToString([]byte(`{"alg":"RS256"}`)) + "." + enc.EncodeToString(claims) + ".signature"
}

// nameOf is the name jwtOf gave a token ("" for another token).
func nameOf(token string) string {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return ""
	}
	b, _ := base64.RawURLEncoding.DecodeString(parts[1])
	var claims struct{ Sub string }
	_ = json.Unmarshal(b, &claims)
	return claims.Sub
}

// reviewingAPI is an API server's TokenReviews as the kubelet's tokens
// meet them: jwtOf("token-of-<ns>") is a token of namespace ns's pod on node-a
// for credential.Audience; a few others are what the registry must refuse; and the
// API server can be down, which only a fake can be on cue.
func reviewingAPI(down *atomic.Bool) *fake.Clientset {
	kube := fake.NewSimpleClientset()
	kube.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if down.Load() {
			return true, nil, errors.New("connection refused")
		}
		tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		bound := map[string]authnv1.ExtraValue{extraPodName: {"step"}, extraNodeName: {"node-a"}}
		name := nameOf(tr.Spec.Token)
		ns, ok := strings.CutPrefix(name, "token-of-")
		audiences := tr.Spec.Audiences
		switch name {
		case "token-of-another-node":
			ns, ok, bound[extraNodeName] = "ci", true, authnv1.ExtraValue{"node-b"}
		case "token-bound-to-no-pod":
			ns, ok, bound = "ci", true, nil
		case "token-for-the-api-server":
			ns, ok, audiences = "ci", true, []string{"https://kubernetes.default.svc"}
		}
		tr.Status = authnv1.TokenReviewStatus{Authenticated: ok, Audiences: audiences,
			User: authnv1.UserInfo{Username: "system:serviceaccount:" + ns + ":default", Extra: bound}}
		return true, tr, nil
	})
	return kube
}

// TestPullsProveTheirNamespace: every request proves its pod's namespace
// before anything is looked up; a repository is served to its reader's
// namespace alone, and to any other exactly as one that does not exist.
func TestPullsProveTheirNamespace(t *testing.T) {
	dir := rootfsDir(t)
	var down atomic.Bool
	var lookups atomic.Int64
	auth := NewTokenReviews(reviewingAPI(&down), "node-a", time.Minute)
	required := httptest.NewServer(New(countedVolumes{dirVolumes{dir: dir}, &lookups}, NewMetrics(), Options{Mode: AuthRequired, Auth: auth}))
	defer required.Close()
	grace := httptest.NewServer(New(countedVolumes{dirVolumes{dir: dir}, &lookups}, NewMetrics(), Options{Mode: AuthGrace, Auth: auth}))
	defer grace.Close()
	as := func(token string) func(*http.Request) {
		return func(r *http.Request) {
			if token != "" {
				r.SetBasicAuth(credential.User, jwtOf(token))
			}
		}
	}

	tests := []struct {
		name       string
		srv        *httptest.Server
		path       string
		auth       func(*http.Request)
		wantCode   int
		wantLookup bool
		// sameAs is a path whose answer this one's must equal, with the
		// repository's name in it replaced.
		sameAs string
	}{
		{name: "the base, no credential", srv: required, path: "/v2/", auth: as(""), wantCode: 401},
		{name: "the base, a credential", srv: required, path: "/v2/", auth: as("token-of-other"), wantCode: 200},
		{name: "own image", srv: required, path: "/v2/ci/img/manifests/latest", auth: as("token-of-ci"), wantCode: 200, wantLookup: true},
		{name: "no credential", srv: required, path: "/v2/ci/img/manifests/latest", auth: as(""), wantCode: 401, sameAs: "/v2/ci/nothing/manifests/latest"},
		{name: "no credential, a blob", srv: required, path: "/v2/ci/img/blobs/sha256:" + strings.Repeat("0", 64), auth: as(""), wantCode: 401},
		{name: "a credential of no pod", srv: required, path: "/v2/ci/img/manifests/latest", auth: func(r *http.Request) { r.SetBasicAuth(credential.User, "not-a-token") }, wantCode: 401},
		{name: "another user name", srv: required, path: "/v2/ci/img/manifests/latest",
			auth: func(r *http.Request) { r.SetBasicAuth("admin", jwtOf("token-of-ci")) }, wantCode: 401},
		{name: "a token of a pod on another node", srv: required, path: "/v2/ci/img/manifests/latest", auth: as("token-of-another-node"), wantCode: 401},
		{name: "a token bound to no pod", srv: required, path: "/v2/ci/img/manifests/latest", auth: as("token-bound-to-no-pod"), wantCode: 401},
		{name: "a token for another audience", srv: required, path: "/v2/ci/img/manifests/latest", auth: as("token-for-the-api-server"), wantCode: 401},
		{name: "another namespace", srv: required, path: "/v2/ci/img/manifests/latest", auth: as("token-of-other"), wantCode: 404,
			sameAs: "/v2/ci/nothing/manifests/latest"},
		{name: "another namespace, by digest", srv: required, path: "/v2/ci/img/manifests/sha256:" + strings.Repeat("1", 64),
			auth: as("token-of-other"), wantCode: 404, sameAs: "/v2/ci/nothing/manifests/sha256:" + strings.Repeat("1", 64)},
		{name: "another namespace, a blob", srv: required, path: "/v2/ci/img/blobs/sha256:" + strings.Repeat("1", 64),
			auth: as("token-of-other"), wantCode: 404, sameAs: "/v2/ci/nothing/blobs/sha256:" + strings.Repeat("1", 64)},
		{name: "another namespace, as reader of an unshared volume", srv: required, path: "/v2/other/ci/img/manifests/latest",
			auth: as("token-of-other"), wantCode: 404, wantLookup: true, sameAs: "/v2/other/ci/nothing/manifests/latest"},
		{name: "grace, no credential", srv: grace, path: "/v2/ci/img/manifests/latest", auth: as(""), wantCode: 200, wantLookup: true},
		{name: "grace, another namespace's credential", srv: grace, path: "/v2/ci/img/manifests/latest", auth: as("token-of-other"), wantCode: 404},
	}
	answer := func(srv *httptest.Server, path string, auth func(*http.Request)) (int, string, http.Header) {
		req, err := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		require.NoError(t, err)
		auth(req)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(body), resp.Header
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := lookups.Load()
			code, body, h := answer(tt.srv, tt.path, tt.auth)
			assert.Equal(t, tt.wantCode, code, body)
			assert.Equal(t, tt.wantLookup, lookups.Load() > before, "looked a volume up")
			if code == 401 {
				assert.Equal(t, `Basic realm="cowvol image registry"`, h.Get("WWW-Authenticate"))
			}
			if tt.sameAs != "" {
				code2, body2, _ := answer(tt.srv, tt.sameAs, tt.auth)
				assert.Equal(t, code, code2)
				assert.Equal(t, body, strings.ReplaceAll(body2, "nothing", "img"))
			}
		})
	}

	// An API server that cannot review refuses, and says to retry.
	down.Store(true)
	code, _, _ := answer(required, "/v2/ci/img/manifests/latest", as("token-of-ci-unseen"))
	assert.Equal(t, http.StatusServiceUnavailable, code)
	down.Store(false)
}

// TestCredentialsCounted: the counts the node's check reads tell pulls
// with credentials from pulls without.
func TestCredentialsCounted(t *testing.T) {
	var down atomic.Bool
	s := New(dirVolumes{dir: rootfsDir(t)}, NewMetrics(), Options{Mode: AuthRequired, Auth: NewTokenReviews(reviewingAPI(&down), "node-a", time.Minute)})
	srv := httptest.NewServer(s)
	defer srv.Close()
	get(t, srv, "/v2/ci/img/manifests/latest", "")
	get(t, srv, "/v2/ci/img/manifests/latest", "ci")
	get(t, srv, "/v2/ci/img/manifests/latest", "ci")
	get(t, srv, "/v2/", "")
	anon, authed := s.Credentials()
	assert.Equal(t, uint64(1), anon)
	assert.Equal(t, uint64(2), authed)
}

// A flood of made-up tokens costs the API server a bounded number of
// reviews, and the answer kept for a live pod's token stays: 20,000 that
// are no JWT for the audience cost none, 20,000 shaped as one cost at most
// the limiter's burst and rate, and the live pod's pulls go on answered
// from the cache.
func TestTokenReviewsBounded(t *testing.T) {
	kube := fake.NewSimpleClientset()
	var reviews atomic.Int64
	kube.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		reviews.Add(1)
		tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		live := nameOf(tr.Spec.Token) == "live"
		tr.Status = authnv1.TokenReviewStatus{Authenticated: live, Audiences: tr.Spec.Audiences, User: authnv1.UserInfo{
			Username: "system:serviceaccount:ci:default", Extra: map[string]authnv1.ExtraValue{extraPodName: {"step"}, extraNodeName: {"node-a"}}}}
		return true, tr, nil
	})
	auth := NewTokenReviews(kube, "node-a", time.Minute)
	ctx := context.Background()
	live := jwtOf("live") // one token: jwtOf's expiry moves with the clock
	ns, err := auth.Namespace(ctx, credential.User, live)
	require.NoError(t, err)
	require.Equal(t, "ci", ns)

	start := time.Now()
	refused, later := 0, 0
	for i := range 20_000 {
		_, err := auth.Namespace(ctx, credential.User, fmt.Sprintf("random-%d", i))
		require.ErrorIs(t, err, ErrUnauthenticated)
		switch _, err := auth.Namespace(ctx, credential.User, jwtOf(fmt.Sprintf("forged-%d", i))); {
		case errors.Is(err, ErrUnauthenticated):
			refused++
		case errors.Is(err, errTooManyReviews):
			later++
		default:
			t.Fatalf("a forged token: %v", err)
		}
		if i%1000 == 0 {
			_, err := auth.Namespace(ctx, credential.User, live)
			require.NoError(t, err, "the live pod's token after %d made-up ones", 2*i)
		}
	}
	elapsed := time.Since(start).Seconds()
	bound := int64(reviewBurst + reviewRate*elapsed + 2)
	t.Logf("40,000 made-up tokens in %.2f s: %d reviews, %d forged ones told to come back", elapsed, reviews.Load(), later)
	require.LessOrEqual(t, reviews.Load(), bound, "reviews in %.1f s", elapsed)
	require.Greater(t, later, 0, "forged tokens past the rate are told to come back")
	require.Equal(t, reviews.Load()-1, int64(refused), "every review was of a forged token but the live one's first")
}
