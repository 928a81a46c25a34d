package bufpool

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestClasses(t *testing.T) {
	tests := []struct {
		name       string
		n, wantCap int
		wantPooled bool
	}{
		{"empty", 0, 4 << 10, true},
		{"one byte", 1, 4 << 10, true},
		{"a page", 4 << 10, 4 << 10, true},
		{"a page and a byte", 4<<10 + 1, 8 << 10, true},
		{"a MiB", 1 << 20, 1 << 20, true},
		{"a MiB and a byte", 1<<20 + 1, 2 << 20, true},
		{"the largest pooled", 2 << 20, 2 << 20, true},
		{"past it", 2<<20 + 1, 2<<20 + 1, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := Get(tc.n)
			require.Len(t, b, tc.n)
			require.Equal(t, tc.wantCap, cap(b))
			c, _ := class(cap(b))
			require.Equal(t, tc.wantPooled, c >= 0)
			Put(b)
		})
	}
}

// A slice given back is lent again, with its length set anew; one not
// from the pool is not taken.
func TestReuse(t *testing.T) {
	b := Get(5000)
	Put(b)
	again := Get(6000)
	require.Len(t, again, 6000)
	require.Equal(t, 8<<10, cap(again))
	Put(again)
	Put(make([]byte, 5000)) // cap 5000: not a class size, dropped
	for range 100 {
		require.Equal(t, 8<<10, cap(Get(7000)))
	}
}
