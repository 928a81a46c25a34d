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
	pod, err := podOf(vc)
	if err != nil {
		return volumeRequest{}, err
	}
	p := contextParse{r: volumeRequest{Scope: volume.ScopeNamespace, Pod: pod}}
	for k, v := range vc {
		if err := p.attr(k, v); err != nil {
			return p.r, err
		}
	}
	return p.r, p.check()
}

// podOf is the pod the kubelet says the volume is published for.
func podOf(vc map[string]string) (volume.Pod, error) {
	if vc[volume.KeyEphemeral] != "true" {
		return volume.Pod{}, noPodInfo(volume.KeyEphemeral + `: "true"`)
	}
	for _, k := range []string{volume.KeyPodNamespace, volume.KeyPodName, volume.KeyPodUID} {
		if vc[k] == "" {
			return volume.Pod{}, noPodInfo(k)
		}
	}
	pod := volume.Pod{Name: vc[volume.KeyPodName], Namespace: vc[volume.KeyPodNamespace], UID: vc[volume.KeyPodUID]}
	if err := pod.Validate(); err != nil {
		return volume.Pod{}, invalid("the kubelet's pod info is malformed: %v", err)
	}
	return pod, nil
}

// contextParse is a volume context being parsed: the request so far, and
// what the checks across attributes need to know of how it was asked.
type contextParse struct {
	r                  volumeRequest
	scopeSet, cacheSet bool
	sourceNS           string
}

// attr parses attribute k of value v into the request, or refuses it.
func (p *contextParse) attr(k, v string) error {
	if kubeletKeys[k] {
		return nil
	}
	if key, ok := strings.CutPrefix(k, AttrPropertyPrefix); ok {
		if err := volume.ValidateUserProperty(key, v); err != nil {
			return invalid("%v", err)
		}
		if p.r.Properties == nil {
			p.r.Properties = map[string]string{}
		}
		p.r.Properties[key] = v
		return nil
	}
	parse, ok := attrParsers[k]
	if !ok {
		return invalid("unknown volume attribute %s: known attributes are %s", volume.Quote(k), knownKeys)
	}
	return parse(p, v)
}

// attrParsers parse each attribute a step pod may set (but the
// property.<key> ones) into the request, refusing a malformed value.
var attrParsers = map[string]func(p *contextParse, v string) error{
	AttrSource:          checkedBy(AttrSource, volume.ValidateHandle, func(p *contextParse, v string) { p.r.Source.Handle = v }),
	AttrSourceNamespace: checkedBy(AttrSourceNamespace, volume.ValidateNamespace, func(p *contextParse, v string) { p.sourceNS = v }),
	AttrCapture:         checkedBy(AttrCapture, volume.ValidateHandle, func(p *contextParse, v string) { p.r.Capture = v }),
	AttrScope: func(p *contextParse, v string) error {
		sc, err := volume.ParseScope(v)
		if err != nil {
			return invalid("attribute %v", err)
		}
		p.r.Scope, p.scopeSet = sc, true
		return nil
	},
	AttrTTL: func(p *contextParse, v string) error {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return invalid("attribute ttl %s is invalid: want a positive duration such as 72h", volume.Quote(v))
		}
		p.r.TTL = d
		return nil
	},
	AttrCopies: func(p *contextParse, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > volume.MaxCopies {
			return invalid("attribute copies %s is invalid: want 1 to %d nodes", volume.Quote(v), volume.MaxCopies)
		}
		p.r.Copies = n
		return nil
	},
	AttrOwner: func(p *contextParse, v string) error {
		if v != volume.OwnerController {
			return invalid("attribute owner %s is invalid: want %s (the object that controls the pod)", volume.Quote(v), volume.OwnerController)
		}
		p.r.OwnedByController = true
		return nil
	},
	AttrReadProfile: checkedBy(AttrReadProfile, volume.ValidateReadProfile, func(p *contextParse, v string) { p.r.ReadProfile = v }),
	AttrCache:       checkedBy(AttrCache, volume.ValidateCacheKey, func(p *contextParse, v string) { p.r.Cache.Key = v }),
	AttrCachePromote: cacheChoice(AttrCachePromote, word{volume.CachePromoteOnSuccess, " (the default)"}, word{volume.CachePromoteAlways, ""},
		func(p *contextParse) { p.r.Cache.PromoteAlways = true }),
	AttrCacheFrom: cacheChoice(AttrCacheFrom, word{volume.CacheFromFleet, " (the default: the newest version any node holds)"},
		word{volume.CacheFromNode, " (this node's own, at once, where it has one)"}, func(p *contextParse) { p.r.Cache.FromNode = true }),
	AttrCacheMaxSize: positiveQuantity(AttrCacheMaxSize, "20Gi", func(p *contextParse, n int64) { p.r.Cache.MaxBytes, p.cacheSet = n, true }),
	AttrSizeLimit:    positiveQuantity(AttrSizeLimit, "10Gi", func(p *contextParse, n int64) { p.r.SizeLimit = n }),
}

// checkedBy parses attribute attr, set as it is once validate accepts it.
func checkedBy(attr string, validate func(string) error, set func(p *contextParse, v string)) func(*contextParse, string) error {
	return func(p *contextParse, v string) error {
		if err := validate(v); err != nil {
			return invalid("attribute %s: %v", attr, err)
		}
		set(p, v)
		return nil
	}
}

// word is one value an attribute may take, and what it means, said in a
// refusal.
type word struct{ is, means string }

// cacheChoice parses a cache attribute that is one of two words: the
// default (which sets nothing), or the other, which set records.
func cacheChoice(attr string, byDefault, other word, set func(p *contextParse)) func(*contextParse, string) error {
	return func(p *contextParse, v string) error {
		switch v {
		case byDefault.is:
		case other.is:
			set(p)
		default:
			return invalid("attribute %s %s is invalid: want %s%s or %s%s", attr, volume.Quote(v),
				byDefault.is, byDefault.means, other.is, other.means)
		}
		p.cacheSet = true
		return nil
	}
}

// positiveQuantity parses attribute attr, a positive quantity of bytes
// such as example.
func positiveQuantity(attr, example string, set func(p *contextParse, n int64)) func(*contextParse, string) error {
	return func(p *contextParse, v string) error {
		q, err := resource.ParseQuantity(v)
		if err != nil || q.Sign() <= 0 {
			return invalid("attribute %s %s is invalid: want a positive quantity such as %s", attr, volume.Quote(v), example)
		}
		set(p, q.Value())
		return nil
	}
}

// knownKeys lists, for a refusal, the attributes a step pod may set, in
// the order a pod's author meets them (the volumes' docs): every key of
// attrParsers, and the properties (TestEveryAttributeHasItsParser).
var knownKeys = strings.Join([]string{AttrSource, AttrSourceNamespace, AttrCapture, AttrScope, AttrSizeLimit, AttrTTL, AttrCopies,
	AttrOwner, AttrReadProfile, AttrPropertyPrefix + "<key>", AttrCache, AttrCachePromote, AttrCacheMaxSize, AttrCacheFrom}, ", ")

// check checks the parsed attributes against each other, and says the
// source's namespace.
func (p *contextParse) check() error {
	r := &p.r
	if len(r.Properties) > volume.MaxProperties {
		return invalid("%d properties given: at most %d", len(r.Properties), volume.MaxProperties)
	}
	if err := validateCache(*r, p.scopeSet, p.cacheSet, p.sourceNS); err != nil {
		return err
	}
	if r.Capture == "" && r.Cache.Key == "" && (p.scopeSet || r.Properties != nil || r.TTL != 0 || r.Copies != 0 || r.OwnedByController) {
		return invalid("attributes scope, ttl, copies, owner and property.* describe a captured volume: they need capture")
	}
	if r.ReadProfile != "" && r.Source.IsZero() {
		return invalid("attribute readProfile names the order the step reads its source in: it needs source")
	}
	if p.sourceNS != "" && r.Source.IsZero() {
		return invalid("attribute sourceNamespace names the namespace of source: it needs source")
	}
	if !r.Source.IsZero() {
		r.Source.Namespace = r.Pod.Namespace
		if p.sourceNS != "" {
			r.Source.Namespace = p.sourceNS
		}
	}
	if volume.IsCacheHandle(r.Source.Handle) || volume.IsCacheHandle(r.Capture) {
		return invalid("handles starting %s are a cache's versions: a step names a cache by its key (attribute cache)",
			volume.Quote(volume.CacheHandlePrefix))
	}
	if r.Capture != "" && r.Source == (volume.Ref{Namespace: r.Pod.Namespace, Handle: r.Capture}) {
		return invalid("capture handle %q equals the source: a cached volume is immutable", r.Capture)
	}
	return nil
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
