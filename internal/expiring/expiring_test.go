package expiring

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// One owner's burst pushes out its own oldest values, never another's; the
// bound in all pushes out the oldest of all; values expire; a value put
// under several keys is taken under any and gone under all.
func TestSet(t *testing.T) {
	now := time.Now()
	s := New[string, int](time.Minute, 3, 5)
	s.Put("b", []string{"b0"}, 100, now)
	for i := range 1000 {
		s.Put("a", []string{fmt.Sprint("a", i)}, i, now)
	}
	v, ok := s.Get("b0", now)
	require.True(t, ok, "another owner's value survives a burst")
	require.Equal(t, 100, v)
	for i, want := range map[int]bool{996: false, 997: true, 998: true, 999: true} {
		_, ok := s.Get(fmt.Sprint("a", i), now)
		require.Equal(t, want, ok, "a%d", i)
	}
	require.Equal(t, 4, kept(s))

	s.Put("c", []string{"c0"}, 1, now)
	s.Put("d", []string{"d0"}, 1, now)
	require.Equal(t, 5, kept(s), "at most 5 in all")
	_, ok = s.Get("b0", now)
	require.False(t, ok, "the oldest of all went first")

	s.Put("e", []string{"e0", "e1"}, 7, now)
	_, ok = s.Take("e1", now, func(v int) bool { return v == 8 })
	require.False(t, ok, "not the one asked for: kept")
	v, ok = s.Take("e1", now, func(v int) bool { return v == 7 })
	require.True(t, ok)
	require.Equal(t, 7, v)
	_, ok = s.Get("e0", now)
	require.False(t, ok, "taken under every key")

	_, ok = s.Get("a999", now.Add(2*time.Minute))
	require.False(t, ok, "expired")
	s.Put("f", []string{"f0"}, 1, now.Add(2*time.Minute))
	require.Equal(t, 1, kept(s), "the expired are forgotten")
}

// kept is how many values s holds, expired ones included until the next
// Put: what it costs in memory.
func kept[K comparable, V any](s *Set[K, V]) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.all.Len()
}
