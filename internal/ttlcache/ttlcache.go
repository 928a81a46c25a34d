// Package ttlcache keeps answers for a while: what an API server said of a
// token or a grant, asked again only once the answer is older than the
// cache's TTL. It bounds its size by starting over when full, which costs
// only asking again. It owns nothing but its map.
package ttlcache

import (
	"sync"
	"time"
)

// Cache maps keys to values kept for a TTL each.
type Cache[K comparable, V any] struct {
	ttl time.Duration
	max int

	mu      sync.Mutex
	entries map[K]entry[V]
}

type entry[V any] struct {
	value   V
	expires time.Time
}

// New keeps up to max answers, each for ttl.
func New[K comparable, V any](ttl time.Duration, max int) *Cache[K, V] {
	return &Cache[K, V]{ttl: ttl, max: max, entries: map[K]entry[V]{}}
}

// Get answers the value kept for k, if it is younger than the TTL at now.
func (c *Cache[K, V]) Get(k K, now time.Time) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[k]
	if !ok || now.After(e.expires) {
		var zero V
		return zero, false
	}
	return e.value, true
}

// Put keeps v for k from now.
func (c *Cache[K, V]) Put(k K, v V, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.entries) >= c.max {
		clear(c.entries)
	}
	c.entries[k] = entry[V]{value: v, expires: now.Add(c.ttl)}
}
