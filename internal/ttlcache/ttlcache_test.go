package ttlcache

import (
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
	c.Put("b", 2, now)
	c.Put("c", 3, now)
	_, ok = c.Get("a", now)
	assert.False(t, ok, "full: started over")
	v, _ = c.Get("c", now)
	assert.Equal(t, 3, v)
}
