package ttlcache

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestCache(t *testing.T) {
	now := time.Now()
	c := New[string, int](time.Minute, 2)
	_, ok := c.Get("a", now)
	assert.False(t, ok)
	c.Put("a", 1, now)
	v, ok := c.Get("a", now.Add(59*time.Second))
	assert.True(t, ok)
	assert.Equal(t, 1, v)
	_, ok = c.Get("a", now.Add(61*time.Second))
	assert.False(t, ok, "older than the TTL")
	c.Put("a", 2, now.Add(61*time.Second))
	v, ok = c.Get("a", now.Add(62*time.Second))
	assert.True(t, ok, "put again: kept anew")
	assert.Equal(t, 2, v)
}

// A flood of new keys pushes out the answers least recently used, never
// one in use: the cache never starts over.
func TestCacheForgetsTheLeastRecentlyUsed(t *testing.T) {
	now := time.Now()
	c := New[string, int](time.Minute, 100)
	c.Put("live", 1, now)
	for i := range 10_000 {
		c.Put(fmt.Sprint("flood-", i), i, now)
		if i%50 == 0 {
			_, ok := c.Get("live", now)
			assert.True(t, ok, "the answer in use, after %d new keys", i)
		}
	}
	_, ok := c.Get("flood-9899", now)
	assert.False(t, ok, "the least recently used went")
	v, ok := c.Get("flood-9999", now)
	assert.True(t, ok)
	assert.Equal(t, 9999, v)
}
