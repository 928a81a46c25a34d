package driver

import (
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/concourse/cowvol/pkg/volume"
)

// Volume attributes a step pod may set (defined with the shared types). The
// pod's author controls every one of them: none is trusted.
const (
	AttrSource          = volume.AttrSource
	AttrSourceNamespace = volume.AttrSourceNamespace
	AttrCapture         = volume.AttrCapture
	AttrScope           = volume.AttrScope
	AttrSizeLimit       = volume.AttrSizeLimit
	AttrTTL             = volume.AttrTTL
	AttrCopies          = volume.AttrCopies
	AttrPropertyPrefix  = volume.AttrPropertyPrefix
	AttrReadProfile     = volume.AttrReadProfile
	AttrOwner           = volume.AttrOwner
	AttrCache           = volume.AttrCache
	AttrCachePromote    = volume.AttrCachePromote
	AttrCacheMaxSize    = volume.AttrCacheMaxSize
	AttrCacheFrom       = volume.AttrCacheFrom
)

var kubeletKeys = map[string]bool{
	volume.KeyEphemeral: true, volume.KeyPodName: true, volume.KeyPodNamespace: true, volume.KeyPodUID: true,
	volume.KeyServiceAccount: true, volume.KeySATokens: true,
}

const knownKeys = "source, sourceNamespace, capture, scope, sizeLimit, ttl, copies, owner, readProfile, property.<key>, cache, cachePromote, cacheMaxSize, cacheFrom"

// Limits on caller-chosen strings.
const (
	maxIDLen   = 1024
	maxPathLen = 4096
)

// volumeRequest is a validated NodePublishVolume request.
type volumeRequest struct {
	Source    volume.Ref
	Capture   string
	Scope     volume.Scope
	SizeLimit int64 // bytes; 0: none asked for
	TTL       time.Duration
	// Copies is how many nodes should hold the captured volume (0: the
	// node's default).
	Copies     int
	Properties map[string]string
	Pod        volume.Pod
	ReadOnly   bool
	// ReadProfile names the order the step reads its source in.
	ReadProfile string
	// OwnedByController: the captured volume belongs to the object that
	// controls the pod.
	OwnedByController bool
	// Cache is the cache the volume is a view of (Key empty: none).
	Cache volume.Cache
}

func invalid(format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, format, args...)
}

// noPodInfo answers a publish the kubelet did not vouch for: without the
// pod's identity from the kubelet, nothing says which namespace may own or
// read what, so nothing is served.
func noPodInfo(missing string) error {
	return status.Errorf(codes.FailedPrecondition, "the volume context lacks %s: cowvol serves only inline volumes "+
		"published by the kubelet with the pod's identity; its CSIDriver object must have podInfoOnMount: true "+
		"and volumeLifecycleModes: [Ephemeral]", missing)
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
		return invalid("%s %s must be absolute and clean (no .., no trailing slash)", what, volume.Quote(p))
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
		return false, invalid("mount flags are not supported: cowvol mounts are overlay or bind mounts it configures itself (nodev, nosuid)")
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

// parseVolumeContext validates an inline volume's context strictly: the
// kubelet's pod identity must be there and well formed, and an unknown
// attribute is a typo that would otherwise silently change what the step
// gets.
func parseVolumeContext(vc map[string]string) (volumeRequest, error) {
	if vc[volume.KeyEphemeral] != "true" {
		return volumeRequest{}, noPodInfo(volume.KeyEphemeral + `: "true"`)
	}
	for _, k := range []string{volume.KeyPodNamespace, volume.KeyPodName, volume.KeyPodUID} {
		if vc[k] == "" {
			return volumeRequest{}, noPodInfo(k)
		}
	}
	r := volumeRequest{
		Scope: volume.ScopeNamespace,
		Pod:   volume.Pod{Name: vc[volume.KeyPodName], Namespace: vc[volume.KeyPodNamespace], UID: vc[volume.KeyPodUID]},
	}
	if err := r.Pod.Validate(); err != nil {
		return r, invalid("the kubelet's pod info is malformed: %v", err)
	}
	scopeSet, cacheSet := false, false
	sourceNS := ""
	for k, v := range vc {
		switch {
		case kubeletKeys[k]:
		case k == AttrSource:
			if err := volume.ValidateHandle(v); err != nil {
				return r, invalid("attribute source: %v", err)
			}
			r.Source.Handle = v
		case k == AttrSourceNamespace:
			if err := volume.ValidateNamespace(v); err != nil {
				return r, invalid("attribute sourceNamespace: %v", err)
			}
			sourceNS = v
		case k == AttrCapture:
			if err := volume.ValidateHandle(v); err != nil {
				return r, invalid("attribute capture: %v", err)
			}
			r.Capture = v
		case k == AttrScope:
			sc, err := volume.ParseScope(v)
			if err != nil {
				return r, invalid("attribute %v", err)
			}
			r.Scope, scopeSet = sc, true
		case k == AttrTTL:
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return r, invalid("attribute ttl %s is invalid: want a positive duration such as 72h", volume.Quote(v))
			}
			r.TTL = d
		case k == AttrCopies:
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > volume.MaxCopies {
				return r, invalid("attribute copies %s is invalid: want 1 to %d nodes", volume.Quote(v), volume.MaxCopies)
			}
			r.Copies = n
		case k == AttrOwner:
			if v != volume.OwnerController {
				return r, invalid("attribute owner %s is invalid: want %s (the object that controls the pod)", volume.Quote(v), volume.OwnerController)
			}
			r.OwnedByController = true
		case k == AttrReadProfile:
			if err := volume.ValidateReadProfile(v); err != nil {
				return r, invalid("attribute readProfile: %v", err)
			}
			r.ReadProfile = v
		case k == AttrCache:
			if err := volume.ValidateCacheKey(v); err != nil {
				return r, invalid("attribute cache: %v", err)
			}
			r.Cache.Key = v
		case k == AttrCachePromote:
			switch v {
			case volume.CachePromoteOnSuccess:
			case volume.CachePromoteAlways:
				r.Cache.PromoteAlways = true
			default:
				return r, invalid("attribute cachePromote %s is invalid: want %s (the default) or %s", volume.Quote(v),
					volume.CachePromoteOnSuccess, volume.CachePromoteAlways)
			}
			cacheSet = true
		case k == AttrCacheFrom:
			switch v {
			case volume.CacheFromFleet:
			case volume.CacheFromNode:
				r.Cache.FromNode = true
			default:
				return r, invalid("attribute cacheFrom %s is invalid: want %s (the default: the newest version any node holds) or %s "+
					"(this node's own, at once, where it has one)", volume.Quote(v), volume.CacheFromFleet, volume.CacheFromNode)
			}
			cacheSet = true
		case k == AttrCacheMaxSize:
			q, err := resource.ParseQuantity(v)
			if err != nil || q.Sign() <= 0 {
				return r, invalid("attribute cacheMaxSize %s is invalid: want a positive quantity such as 20Gi", volume.Quote(v))
			}
			r.Cache.MaxBytes, cacheSet = q.Value(), true
		case k == AttrSizeLimit:
			q, err := resource.ParseQuantity(v)
			if err != nil || q.Sign() <= 0 {
				return r, invalid("attribute sizeLimit %s is invalid: want a positive quantity such as 10Gi", volume.Quote(v))
			}
			r.SizeLimit = q.Value()
		case strings.HasPrefix(k, AttrPropertyPrefix):
			key := strings.TrimPrefix(k, AttrPropertyPrefix)
			if err := volume.ValidateUserProperty(key, v); err != nil {
				return r, invalid("%v", err)
			}
			if r.Properties == nil {
				r.Properties = map[string]string{}
			}
			r.Properties[key] = v
		default:
			return r, invalid("unknown volume attribute %s: known attributes are %s", volume.Quote(k), knownKeys)
		}
	}
	if len(r.Properties) > volume.MaxProperties {
		return r, invalid("%d properties given: at most %d", len(r.Properties), volume.MaxProperties)
	}
	if err := validateCache(r, scopeSet, cacheSet, sourceNS); err != nil {
		return r, err
	}
	if r.Capture == "" && r.Cache.Key == "" && (scopeSet || r.Properties != nil || r.TTL != 0 || r.Copies != 0 || r.OwnedByController) {
		return r, invalid("attributes scope, ttl, copies, owner and property.* describe a captured volume: they need capture")
	}
	if r.ReadProfile != "" && r.Source.IsZero() {
		return r, invalid("attribute readProfile names the order the step reads its source in: it needs source")
	}
	if sourceNS != "" && r.Source.IsZero() {
		return r, invalid("attribute sourceNamespace names the namespace of source: it needs source")
	}
	if !r.Source.IsZero() {
		r.Source.Namespace = r.Pod.Namespace
		if sourceNS != "" {
			r.Source.Namespace = sourceNS
		}
	}
	if volume.IsCacheHandle(r.Source.Handle) || volume.IsCacheHandle(r.Capture) {
		return r, invalid("handles starting %s are a cache's versions: a step names a cache by its key (attribute cache)",
			volume.Quote(volume.CacheHandlePrefix))
	}
	if r.Capture != "" && r.Source == (volume.Ref{Namespace: r.Pod.Namespace, Handle: r.Capture}) {
		return r, invalid("capture handle %q equals the source: a cached volume is immutable", r.Capture)
	}
	return r, nil
}

// validateCache checks a cache volume's attributes against the others: its
// source and capture are the key's versions, which cowvol chooses.
func validateCache(r volumeRequest, scopeSet, cacheSet bool, sourceNS string) error {
	if r.Cache.Key == "" {
		if cacheSet {
			return invalid("attributes cachePromote, cacheMaxSize and cacheFrom describe a cache volume: they need cache")
		}
		return nil
	}
	if !r.Source.IsZero() || r.Capture != "" || sourceNS != "" || scopeSet || r.Copies != 0 || r.OwnedByController ||
		r.Properties != nil || r.ReadProfile != "" {
		return invalid("attribute cache takes the key's current version as the step's volume and makes the step's view " +
			"its next one: source, sourceNamespace, capture, scope, copies, owner, readProfile and property.* do not go with it " +
			"(ttl, sizeLimit, cachePromote, cacheMaxSize and cacheFrom do)")
	}
	return nil
}
