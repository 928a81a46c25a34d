package driver

import (
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/concourse/cowvol/pkg/cache"
)

// Volume attributes a step pod may set.
const (
	AttrSource         = "source"
	AttrCapture        = "capture"
	AttrScope          = "scope"
	AttrPropertyPrefix = "property."
)

// Keys the kubelet adds to an inline volume's context (podInfoOnMount).
const (
	ctxEphemeral      = "csi.storage.k8s.io/ephemeral"
	ctxPodName        = "csi.storage.k8s.io/pod.name"
	ctxPodNamespace   = "csi.storage.k8s.io/pod.namespace"
	ctxPodUID         = "csi.storage.k8s.io/pod.uid"
	ctxServiceAccount = "csi.storage.k8s.io/serviceAccount.name"
	ctxSATokens       = "csi.storage.k8s.io/serviceAccount.tokens"
)

var kubeletKeys = map[string]bool{
	ctxEphemeral: true, ctxPodName: true, ctxPodNamespace: true, ctxPodUID: true,
	ctxServiceAccount: true, ctxSATokens: true,
}

const knownKeys = "source, capture, scope, property.<key>"

// Limits on caller-chosen strings. Handles name dirs on disk, so their
// charset leaves no room for path tricks: no slash, no leading dot.
const (
	maxIDLen          = 1024
	maxPathLen        = 4096
	maxProperties     = 64
	maxPropertyValue  = 4096
	handleDescription = "1-128 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"
)

var (
	handleRE      = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)
	propertyKeyRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/-]{0,252}$`)
)

// ValidateHandle checks a cached volume handle.
func ValidateHandle(h string) error {
	if !handleRE.MatchString(h) {
		return fmt.Errorf("handle %q is invalid: want %s", h, handleDescription)
	}
	return nil
}

// volumeRequest is a validated NodePublishVolume request.
type volumeRequest struct {
	Source, Capture string
	Scope           cache.Scope
	Properties      map[string]string
	Pod             cache.PodInfo
	ReadOnly        bool
}

func invalid(format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, format, args...)
}

func validateVolumeID(id string) error {
	switch {
	case id == "":
		return invalid("volume ID is required")
	case len(id) > maxIDLen || strings.ContainsRune(id, 0) || !utf8.ValidString(id):
		return invalid("volume ID is invalid: want at most %d bytes of UTF-8 without NUL", maxIDLen)
	}
	return nil
}

func validatePath(what, p string) error {
	switch {
	case p == "":
		return invalid("%s is required", what)
	case len(p) > maxPathLen || strings.ContainsRune(p, 0):
		return invalid("%s is invalid", what)
	case !filepath.IsAbs(p) || filepath.Clean(p) != p:
		return invalid("%s %q must be absolute and clean (no .., no trailing slash)", what, p)
	}
	return nil
}

// validateCapability accepts filesystem volumes on one node and says whether
// the access mode is read-only.
func validateCapability(c *csi.VolumeCapability) (readOnly bool, err error) {
	if c == nil {
		return false, invalid("volume capability is required")
	}
	if c.GetBlock() != nil {
		return false, invalid("block access is not supported: cowvol volumes are directories")
	}
	m := c.GetMount()
	if m == nil {
		return false, invalid("volume capability must have mount access type")
	}
	if len(m.GetMountFlags()) > 0 {
		return false, invalid("mount flags %q are not supported: cowvol mounts are overlay or bind mounts it configures itself", m.GetMountFlags())
	}
	switch mode := c.GetAccessMode().GetMode(); mode {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		return false, nil
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY:
		return true, nil
	default:
		return false, invalid("access mode %s is not supported: cowvol volumes live on one node", mode)
	}
}

// parseVolumeContext validates an inline volume's attributes strictly: an
// unknown key is a typo that would otherwise silently change what the step
// gets.
func parseVolumeContext(vc map[string]string) (volumeRequest, error) {
	r := volumeRequest{
		Scope: cache.ScopeNamespace,
		Pod:   cache.PodInfo{Name: vc[ctxPodName], Namespace: vc[ctxPodNamespace], UID: vc[ctxPodUID]},
	}
	scopeSet := false
	for k, v := range vc {
		switch {
		case kubeletKeys[k]:
		case k == AttrSource:
			if err := ValidateHandle(v); err != nil {
				return r, invalid("attribute source: %v", err)
			}
			r.Source = v
		case k == AttrCapture:
			if err := ValidateHandle(v); err != nil {
				return r, invalid("attribute capture: %v", err)
			}
			r.Capture = v
		case k == AttrScope:
			switch cache.Scope(v) {
			case cache.ScopeNamespace, cache.ScopeCluster:
				r.Scope, scopeSet = cache.Scope(v), true
			default:
				return r, invalid("attribute scope %q is invalid: want namespace or cluster", v)
			}
		case strings.HasPrefix(k, AttrPropertyPrefix):
			key := strings.TrimPrefix(k, AttrPropertyPrefix)
			if !propertyKeyRE.MatchString(key) {
				return r, invalid("property key %q is invalid: want 1-253 characters of A-Z a-z 0-9 . _ / -", key)
			}
			if len(v) > maxPropertyValue || !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
				return r, invalid("property %q: value must be at most %d bytes of UTF-8 without NUL", key, maxPropertyValue)
			}
			if r.Properties == nil {
				r.Properties = map[string]string{}
			}
			r.Properties[key] = v
		default:
			return r, invalid("unknown volume attribute %q: known attributes are %s", k, knownKeys)
		}
	}
	if len(r.Properties) > maxProperties {
		return r, invalid("%d properties given: at most %d", len(r.Properties), maxProperties)
	}
	if r.Capture == "" && (scopeSet || r.Properties != nil) {
		return r, invalid("attributes scope and property.* describe a captured volume: they need capture")
	}
	if r.Capture != "" && r.Capture == r.Source {
		return r, invalid("capture handle %q equals the source: a cached volume is immutable", r.Capture)
	}
	return r, nil
}
