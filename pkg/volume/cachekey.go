package volume

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
)

// A cache volume (the cache attribute) is a writable copy-on-write view of
// the current version of a key of the pod's namespace, which becomes the
// key's new current version when the step succeeds (docs/caches.md). A
// key's versions are cached volumes of the namespace, with handles of
// their own under CacheHandlePrefix, which a step may not name.
const (
	// AttrCache names the key: go-build/linux-amd64.
	AttrCache = "cache"
	// AttrCachePromote says when the step's view becomes the key's
	// current version: CachePromoteOnSuccess (the default) or
	// CachePromoteAlways (Concourse's task caches).
	AttrCachePromote      = "cachePromote"
	CachePromoteOnSuccess = "success"
	CachePromoteAlways    = "always"
	// AttrCacheMaxSize caps a version: a promotion whose version would
	// hold more is refused, and the key keeps the version it had.
	AttrCacheMaxSize = "cacheMaxSize"
	// AttrCacheFrom says which version a step forks: CacheFromFleet (the
	// default) the newest any node holds, pulled if this node lacks it;
	// CacheFromNode this node's own at once if it has one, however old.
	AttrCacheFrom  = "cacheFrom"
	CacheFromFleet = "fleet"
	CacheFromNode  = "node"
	// CacheHandlePrefix starts every cache version's handle.
	CacheHandlePrefix = "cache."
	// PropertyCacheKey is the key a cache version belongs to;
	// PropertyCachePromotedAt (RFC 3339, UTC) and PropertyCachePromotedBy
	// (the pod) say when it became its key's current version, and whose
	// step's view it was. A version never promoted has neither.
	PropertyCacheKey        = ReservedPropertyPrefix + "cache-key"
	PropertyCachePromotedAt = ReservedPropertyPrefix + "cache-promoted-at"
	PropertyCachePromotedBy = ReservedPropertyPrefix + "cache-promoted-by"
)

// Cache is what a cache volume asks for, as its view records it.
type Cache struct {
	Key string `json:"key"`
	// PromoteAlways: the view becomes the key's current version however
	// the step ends, not only when it succeeds.
	PromoteAlways bool `json:"promoteAlways,omitempty"`
	// MaxBytes refuses a promotion whose version would hold more (0: no
	// cap).
	MaxBytes int64 `json:"maxBytes,omitempty"`
	// FromNode: the step forks this node's own version where it has one,
	// not a newer one from another node.
	FromNode bool `json:"fromNode,omitempty"`
}

// CacheRef names a cache key of a namespace.
type CacheRef struct{ Namespace, Key string }

// MaxCacheKey is the longest key.
const MaxCacheKey = 253

var cacheKeyRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/-]{0,252}$`)

// ValidateCacheKey checks a cache key: 1-253 characters of A-Z a-z 0-9 .
// _ / -, starting with a letter or digit.
func ValidateCacheKey(key string) error {
	if !cacheKeyRE.MatchString(key) {
		return fmt.Errorf("cache key %s is invalid: want 1-%d characters of A-Z a-z 0-9 . _ / -, starting with a letter or digit", Quote(key), MaxCacheKey)
	}
	return nil
}

// IsCacheHandle says whether a handle is a cache version's: a step names
// a cache by its key, never a version by its handle.
func IsCacheHandle(h string) bool { return strings.HasPrefix(h, CacheHandlePrefix) }

// CacheKeyHash names a key in handles: the first 96 bits of its SHA-256,
// in hex. Keys are longer than handles may be and hold slashes.
func CacheKeyHash(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:12])
}

// NewCacheHandle is a handle for a new version of key: its hash and 64
// random bits, unique across the fleet, so that two nodes never make two
// versions under one handle.
func NewCacheHandle(key string) (string, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return CacheHandlePrefix + CacheKeyHash(key) + "." + hex.EncodeToString(b[:]), nil
}

// IsCacheHandleOf says whether h is a handle of a version of key.
func IsCacheHandleOf(h, key string) bool {
	return strings.HasPrefix(h, CacheHandlePrefix+CacheKeyHash(key)+".")
}
