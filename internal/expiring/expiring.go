// Package expiring keeps values handed out for a while (a pull's grant,
// an image minted for one pull), each owned by a tenant (the namespace it
// was handed to), within a bound per owner and one in all: one owner's
// burst pushes out its own oldest, never another's. Every value lives the
// same time, so the oldest is always the first to expire. It owns nothing
// but its maps and lists.
package expiring

import (
	"container/list"
	"sync"
	"time"
)

// Set maps keys to values, several keys to one value where a value is put
// under several (an image's blobs).
type Set[K comparable, V any] struct {
	ttl           time.Duration
	perOwner, max int

	mu      sync.Mutex
	byKey   map[K]*list.Element
	byOwner map[string]*list.List // of *item, oldest first
	all     *list.List            // of *item, oldest first
}

type item[K comparable, V any] struct {
	owner   string
	keys    []K
	value   V
	expires time.Time
	// inAll and inOwner are the item's elements in all and in its
	// owner's list.
	inAll, inOwner *list.Element
}

// New keeps each value for ttl, at most perOwner of one owner's and max
// in all.
func New[K comparable, V any](ttl time.Duration, perOwner, max int) *Set[K, V] {
	return &Set[K, V]{ttl: ttl, perOwner: perOwner, max: max, byKey: map[K]*list.Element{}, byOwner: map[string]*list.List{}, all: list.New()}
}

// Put keeps v for owner under keys (one or more) from now, dropping owner's oldest
// value if it holds perOwner, and the oldest of all if the set holds max.
func (s *Set[K, V]) Put(owner string, keys []K, v V, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dropExpired(now)
	for _, k := range keys {
		if e, ok := s.byKey[k]; ok {
			s.remove(e)
		}
	}
	if mine := s.byOwner[owner]; mine != nil && mine.Len() >= s.perOwner {
		s.remove(mine.Front().Value.(*item[K, V]).inAll)
	}
	if s.all.Len() >= s.max {
		s.remove(s.all.Front())
	}
	it := &item[K, V]{owner: owner, keys: keys, value: v, expires: now.Add(s.ttl)}
	mine := s.byOwner[owner]
	if mine == nil {
		mine = list.New()
		s.byOwner[owner] = mine
	}
	it.inOwner = mine.PushBack(it)
	it.inAll = s.all.PushBack(it)
	for _, k := range keys {
		s.byKey[k] = it.inAll
	}
}

// Get answers the value kept under k, unexpired at now.
func (s *Set[K, V]) Get(k K, now time.Time) (V, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.get(k, now)
}

// Take answers the value kept under k, unexpired at now, if keep says it
// is the one, and forgets it (under every key it was put under).
func (s *Set[K, V]) Take(k K, now time.Time, keep func(V) bool) (V, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.get(k, now)
	if !ok || !keep(v) {
		var zero V
		return zero, false
	}
	s.remove(s.byKey[k])
	return v, true
}

func (s *Set[K, V]) get(k K, now time.Time) (V, bool) {
	e, ok := s.byKey[k]
	if !ok || now.After(e.Value.(*item[K, V]).expires) {
		var zero V
		return zero, false
	}
	return e.Value.(*item[K, V]).value, true
}

// dropExpired forgets the values expired at now: the oldest first.
func (s *Set[K, V]) dropExpired(now time.Time) {
	for e := s.all.Front(); e != nil && now.After(e.Value.(*item[K, V]).expires); e = s.all.Front() {
		s.remove(e)
	}
}

// remove forgets the item of e, an element of all.
func (s *Set[K, V]) remove(e *list.Element) {
	it := e.Value.(*item[K, V])
	s.all.Remove(e)
	for _, k := range it.keys {
		if s.byKey[k] == e {
			delete(s.byKey, k)
		}
	}
	mine := s.byOwner[it.owner]
	mine.Remove(it.inOwner)
	if mine.Len() == 0 {
		delete(s.byOwner, it.owner)
	}
}
