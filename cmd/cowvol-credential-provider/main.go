// Command cowvol-credential-provider is the kubelet's image credential
// provider (an exec plugin, KEP-2133, with ServiceAccount tokens, KEP-4412)
// for the node's cowvol image registry. The kubelet runs it for each pull
// of an image its config matches (the registry's loopback address), with
// the pod's ServiceAccount token for the audience cowvol-image-registry on
// stdin; it answers that token as the pull's credential, which the
// registry reviews with the API server to learn the pod's namespace. It
// holds no secret and reaches nothing: what it answers is what it was
// given.
//
// `cowvol-credential-provider install DIR` copies the binary into DIR
// (the kubelet's --image-credential-provider-bin-dir), as the node
// DaemonSet's init container does.
package main

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/concourse/cowvol/pkg/registry/credential"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// Name is the provider's name: its binary's, and the one the kubelet's
// CredentialProviderConfig gives it.
const Name = "cowvol-credential-provider"

func main() {
	if len(os.Args) == 3 && os.Args[1] == "install" {
		if err := install(os.Args[2]); err != nil {
			fmt.Fprintln(os.Stderr, Name+":", err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) == 2 && os.Args[1] == "--version" {
		fmt.Println(Name, version)
		return
	}
	if err := provide(os.Stdin, os.Stdout, time.Now()); err != nil {
		fmt.Fprintln(os.Stderr, Name+":", err)
		os.Exit(1)
	}
}

// The kubelet's exec credential provider API, v1: only the fields this
// provider reads and writes.
const apiVersion = "credentialprovider.kubelet.k8s.io/v1"

type request struct {
	APIVersion          string `json:"apiVersion"`
	Kind                string `json:"kind"`
	Image               string `json:"image"`
	ServiceAccountToken string `json:"serviceAccountToken,omitempty"`
}

type authConfig struct {
	Username string `json:"username"`
	Password string `json:"password"`
}

type response struct {
	APIVersion    string                `json:"apiVersion"`
	Kind          string                `json:"kind"`
	CacheKeyType  string                `json:"cacheKeyType"`
	CacheDuration string                `json:"cacheDuration"`
	Auth          map[string]authConfig `json:"auth,omitempty"`
}

// maxRequest bounds what is read from the kubelet.
const maxRequest = 1 << 20

// cacheMargin is how long before its token expires the kubelet stops
// using a credential, so that a pull never carries a token that lapses
// mid-pull.
const cacheMargin = time.Minute

// provide answers the kubelet's request on in with the pull's credential
// on out: the pod's token for the image's registry, kept by the kubelet
// until shortly before the token expires. A request without a token (a
// pod without a ServiceAccount, or a kubelet not configured to pass one)
// gets no credential, and the registry refuses the pull.
func provide(in io.Reader, out io.Writer, now time.Time) error {
	raw, err := io.ReadAll(io.LimitReader(in, maxRequest+1))
	if err != nil {
		return err
	}
	if len(raw) > maxRequest {
		return fmt.Errorf("the request is over %d bytes", maxRequest)
	}
	var req request
	if err := json.Unmarshal(raw, &req); err != nil {
		return fmt.Errorf("the kubelet's request: %w", err)
	}
	if req.APIVersion != apiVersion || req.Kind != "CredentialProviderRequest" {
		return fmt.Errorf("the kubelet sent a %s %s: want %s CredentialProviderRequest (apiVersion in the kubelet's CredentialProviderConfig)",
			req.Kind, req.APIVersion, apiVersion)
	}
	host, _, ok := strings.Cut(req.Image, "/")
	if !ok || host == "" {
		return fmt.Errorf("image %q names no registry", req.Image)
	}
	resp := response{APIVersion: apiVersion, Kind: "CredentialProviderResponse", CacheKeyType: "Image", CacheDuration: "0s"}
	switch {
	case !loopback(host):
		// The node's registry listens on loopback alone: a pod's token
		// goes nowhere else, whatever the kubelet's config matches.
		fmt.Fprintf(os.Stderr, "%s: %s is no registry on this node's loopback: no credential\n", Name, req.Image)
	case req.ServiceAccountToken == "":
		fmt.Fprintf(os.Stderr, "%s: no ServiceAccount token for %s: set tokenAttributes.serviceAccountTokenAudience: %s in the kubelet's CredentialProviderConfig\n",
			Name, req.Image, credential.Audience)
	default:
		resp.Auth = map[string]authConfig{host: {Username: credential.User, Password: req.ServiceAccountToken}}
		resp.CacheDuration = cacheFor(req.ServiceAccountToken, now).String()
	}
	return json.NewEncoder(out).Encode(resp)
}

// loopback says whether a registry host (host or host:port) is this
// node's loopback: localhost, 127.0.0.0/8 or ::1.
func loopback(host string) bool {
	name := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		name = h
	}
	if name == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(strings.Trim(name, "[]"))
	return err == nil && ip.IsLoopback()
}

// cacheFor is how long the kubelet may keep a credential of token: until
// cacheMargin before it expires (its exp claim, read and not verified:
// the registry verifies), or not at all if that cannot be told.
func cacheFor(token string, now time.Time) time.Duration {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return 0
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return 0
	}
	var claims struct {
		Exp int64 `json:"exp"`
	}
	if json.Unmarshal(payload, &claims) != nil || claims.Exp == 0 {
		return 0
	}
	d := time.Unix(claims.Exp, 0).Sub(now) - cacheMargin
	if d < 0 {
		return 0
	}
	return d.Truncate(time.Second)
}

// install copies this binary into dir as Name, atomically: a kubelet that
// runs it meanwhile runs the old one or the new one, whole.
func install(dir string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	src, err := os.Open(self)
	if err != nil {
		return err
	}
	defer src.Close()
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return fmt.Errorf("%s is not a dir: mount the kubelet's --image-credential-provider-bin-dir there", dir)
	}
	tmp, err := os.CreateTemp(dir, "."+Name+"-*")
	if err != nil {
		return err
	}
	_, err = io.Copy(tmp, src)
	err = errors.Join(err, tmp.Chmod(0o755), tmp.Sync(), tmp.Close())
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(dir, Name))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return err
	}
	fmt.Printf("installed %s %s in %s\n", Name, version, dir)
	return nil
}
