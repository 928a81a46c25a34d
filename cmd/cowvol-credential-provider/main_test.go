package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/registry/credential"
)

// jwt is a token whose claims say it expires at exp (unsigned: the
// provider reads, the registry verifies).
func jwt(exp time.Time) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256"}`)) + "." + enc([]byte(fmt.Sprintf(`{"exp":%d,"aud":["cowvol-image-registry"]}`, exp.Unix()))) + ".c2ln"
}

func TestProvide(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	token := jwt(now.Add(10 * time.Minute))
	req := func(apiVersion, kind, image, token string) string {
		b, _ := json.Marshal(map[string]string{"apiVersion": apiVersion, "kind": kind, "image": image, "serviceAccountToken": token})
		return string(b)
	}
	tests := []struct {
		name      string
		in        string
		wantErr   string
		wantAuth  map[string]authConfig
		wantCache string
	}{
		{name: "a pod's token", in: req(apiVersion, "CredentialProviderRequest", "127.0.0.1:7444/ci/img:latest", token),
			wantAuth: map[string]authConfig{"127.0.0.1:7444": {Username: credential.User, Password: token}}, wantCache: "9m0s"},
		{name: "a token about to expire is not kept", in: req(apiVersion, "CredentialProviderRequest", "localhost:7444/ci/img", jwt(now.Add(30*time.Second))),
			wantAuth: map[string]authConfig{"localhost:7444": {Username: credential.User, Password: jwt(now.Add(30 * time.Second))}}, wantCache: "0s"},
		{name: "a token whose expiry cannot be read is not kept", in: req(apiVersion, "CredentialProviderRequest", "127.0.0.1:7444/ci/img", "opaque"),
			wantAuth: map[string]authConfig{"127.0.0.1:7444": {Username: credential.User, Password: "opaque"}}, wantCache: "0s"},
		{name: "another host: no credential", in: req(apiVersion, "CredentialProviderRequest", "registry.example.com/x", token), wantCache: "0s"},
		{name: "a host that names loopback in a subdomain: no credential", in: req(apiVersion, "CredentialProviderRequest", "127.0.0.1.example.com:7444/x", token), wantCache: "0s"},
		{name: "IPv6 loopback", in: req(apiVersion, "CredentialProviderRequest", "[::1]:7444/ci/img", token),
			wantAuth: map[string]authConfig{"[::1]:7444": {Username: credential.User, Password: token}}, wantCache: "9m0s"},
		{name: "no token: no credential", in: req(apiVersion, "CredentialProviderRequest", "127.0.0.1:7444/ci/img", ""), wantCache: "0s"},
		{name: "another API version", in: req("credentialprovider.kubelet.k8s.io/v1beta1", "CredentialProviderRequest", "127.0.0.1:7444/ci/img", token),
			wantErr: "want credentialprovider.kubelet.k8s.io/v1"},
		{name: "another kind", in: req(apiVersion, "Pod", "127.0.0.1:7444/ci/img", token), wantErr: "CredentialProviderRequest"},
		{name: "an image with no registry", in: req(apiVersion, "CredentialProviderRequest", "busybox", token), wantErr: "names no registry"},
		{name: "not JSON", in: "{", wantErr: "the kubelet's request"},
		{name: "too large", in: strings.Repeat(" ", maxRequest+1), wantErr: "over"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			err := provide(strings.NewReader(tt.in), &out, now)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				assert.Empty(t, out.String())
				return
			}
			require.NoError(t, err)
			var resp response
			require.NoError(t, json.Unmarshal(out.Bytes(), &resp))
			assert.Equal(t, apiVersion, resp.APIVersion)
			assert.Equal(t, "CredentialProviderResponse", resp.Kind)
			assert.Equal(t, "Image", resp.CacheKeyType)
			assert.Equal(t, tt.wantCache, resp.CacheDuration)
			assert.Equal(t, tt.wantAuth, resp.Auth)
		})
	}
}

// TestAsTheKubeletRunsIt: the built binary, installed into a bin dir as
// the DaemonSet's init container does, run there with a request on stdin.
func TestAsTheKubeletRunsIt(t *testing.T) {
	build := filepath.Join(t.TempDir(), Name)
	out, err := exec.Command("go", "build", "-o", build, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	binDir := t.TempDir()
	out, err = exec.Command(build, "install", binDir).CombinedOutput()
	require.NoError(t, err, "%s", out)
	st, err := os.Stat(filepath.Join(binDir, Name))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o755), st.Mode().Perm())
	entries, err := os.ReadDir(binDir)
	require.NoError(t, err)
	assert.Len(t, entries, 1, "no temp file left")
	_, err = exec.Command(build, "install", filepath.Join(binDir, "missing")).CombinedOutput()
	assert.Error(t, err)

	token := jwt(time.Now().Add(time.Hour))
	cmd := exec.Command(filepath.Join(binDir, Name))
	cmd.Stdin = strings.NewReader(`{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderRequest",` +
		`"image":"127.0.0.1:7444/ci/img:cowvol","serviceAccountToken":"` + token + `"}`)
	stdout, err := cmd.Output()
	require.NoError(t, err)
	var resp response
	require.NoError(t, json.Unmarshal(stdout, &resp))
	assert.Equal(t, token, resp.Auth["127.0.0.1:7444"].Password)
	d, err := time.ParseDuration(resp.CacheDuration)
	require.NoError(t, err)
	assert.InDelta(t, (59 * time.Minute).Seconds(), d.Seconds(), 5)
}
