package report

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A fleet whose nodes sent their whole inventories at once (to a new
// leader) sends the next ones spread over a resync interval, not again
// at once: at most a few dozen of 1,000 nodes in any 10 s.
func TestResyncsSpread(t *testing.T) {
	const nodes, window = 1000, 10 * time.Second
	perWindow := map[time.Duration]int{}
	for range nodes {
		d := resyncAfter()
		require.GreaterOrEqual(t, d, resyncEvery/2)
		require.Less(t, d, 3*resyncEvery/2)
		perWindow[d/window]++
	}
	for w, n := range perWindow {
		require.LessOrEqual(t, n, 80, "%d of %d nodes resync in the 10 s from %s", n, nodes, w*window)
	}
}
