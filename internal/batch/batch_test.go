package batch

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Every item reaches apply once, in the order added, in batches of the
// size asked for (the last shorter), all of them by the time Close
// returns, though batches are used again; a second Close does nothing.
func TestWorker(t *testing.T) {
	for _, tc := range []struct {
		name  string
		items int
		want  []int // batch sizes
	}{
		{"none", 0, nil},
		{"less than a batch", 3, []int{3}},
		{"a batch exactly", 4, []int{4}},
		{"batches and a rest", 10, []int{4, 4, 2}},
		{"more batches than are held at once", 50, []int{4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []int
			var sizes []int
			w := Start(4, func(b []int) {
				sizes = append(sizes, len(b))
				got = append(got, b...)
			})
			var want []int
			for i := range tc.items {
				w.Add(i)
				want = append(want, i)
			}
			w.Close()
			w.Close()
			require.Equal(t, want, got)
			require.Equal(t, tc.want, sizes)
		})
	}
}
