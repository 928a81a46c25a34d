// Package ttlcache keeps answers for a while: what an API server said of a
// token or a grant, asked again only once the answer is older than the
// cache's TTL. It bounds its size by forgetting the least recently used
// answer when full, so that a flood of new keys (random tokens) costs the
// answers in use nothing but their place in line. It owns nothing but its
// map and list.
package ttlcache

import (
	"container/list"
	"sync"
	"time"
)

// Cache maps keys to values kept for a TTL each.
type Cache[K comparable, V any] struct {
	ttl time.Duration
	max int

	mu      sync.Mutex
	entries map[K]*list.Element
	// used holds *entry, the most recently used first.
	used *list.List
}

type entry[K comparable, V any] struct {
	key     K
	value   V
	expires time.Time
}

// New keeps up to max answers, each for ttl.
func New[K comparable, V any](ttl time.Duration, max int) *Cache[K, V] {
	return &Cache[K, V]{ttl: ttl, max: max, entries: map[K]*list.Element{}, used: list.New()}
}

// Get answers the value kept for k, if it is younger than the TTL at now.
func (c *Cache[K, V]) Get(k K, now time.Time) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.entries[k]
	if !ok || now.After(el.Value.(*entry[K, V]).expires) {
		var zero V
		return zero, false
	}
	c.used.MoveToFront(el)
	return el.Value.(*entry[K, V]).value, true
}

// Put keeps v for k from now, forgetting the least recently used answer
// if the cache is full.
func (c *Cache[K, V]) Put(k K, v V, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.entries[k]; ok {
		e := el.Value.(*entry[K, V])
		e.value, e.expires = v, now.Add(c.ttl)
		c.used.MoveToFront(el)
		return
	}
	if c.used.Len() >= c.max {
		last := c.used.Back()
		delete(c.entries, last.Value.(*entry[K, V]).key)
		c.used.Remove(last)
	}
	c.entries[k] = c.used.PushFront(&entry[K, V]{key: k, value: v, expires: now.Add(c.ttl)})
}
