package node

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A whole index whose copy failed is left alone for indexCopyRetry, then
// tried again; failures that old are forgotten, not kept for ever.
func TestIndexCopyFailures(t *testing.T) {
	var f indexCopyFailures
	now := time.Now()
	require.False(t, f.recent("a", now))
	f.note("a", now)
	require.True(t, f.recent("a", now.Add(indexCopyRetry-time.Second)))
	require.False(t, f.recent("a", now.Add(indexCopyRetry)))
	f.note("b", now.Add(indexCopyRetry))
	require.Len(t, f.at, 1, "a's failure, old enough to retry, is forgotten")
	require.True(t, f.recent("b", now.Add(indexCopyRetry)))
}
