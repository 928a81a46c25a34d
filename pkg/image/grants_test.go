package image

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPullGrants: a remote layer is taken once, as it was handed out,
// within the grants' lifetime; each pull is handed one of its own.
func TestPullGrants(t *testing.T) {
	key, err := LoadLayerKey(filepath.Join(t.TempDir(), "key"))
	require.NoError(t, err)
	other, err := LoadLayerKey(filepath.Join(t.TempDir(), "key"))
	require.NoError(t, err)
	now := time.Now()
	g := NewPullGrants(key, time.Minute)
	g.now = func() time.Time { return now }

	l, d, err := g.Issue("ci", "ci/img@1")
	require.NoError(t, err)
	l2, d2, err := g.Issue("ci", "ci/img@1")
	require.NoError(t, err)
	assert.NotEqual(t, d, d2)
	assert.NotEqual(t, l.Pull, l2.Pull)
	parsed, _, err := ParseRemoteLayer(l.String())
	require.NoError(t, err)
	assert.Equal(t, l, parsed)

	tests := []struct {
		name  string
		layer RemoteLayer
		d     string
	}{
		{"another reader", RemoteLayer{Reader: "other", Version: l.Version, Pull: l.Pull}, string(d)},
		{"another version", RemoteLayer{Reader: "ci", Version: "ci/img@2", Pull: l.Pull}, string(d)},
		{"another pull's digest", l, string(d2)},
		{"no pull", RemoteLayer{Reader: "ci", Version: l.Version}, string(key.Digest(RemoteLayer{Reader: "ci", Version: l.Version}))},
		{"another key's digest", l, string(other.Digest(l))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.ErrorIs(t, g.Redeem(tt.layer, digest.Digest(tt.d)), ErrNoGrant)
		})
	}
	assert.True(t, g.Pending(d))
	require.NoError(t, g.Redeem(l, d))
	assert.False(t, g.Pending(d))
	assert.ErrorIs(t, g.Redeem(l, d), ErrNoGrant, "a replay")

	now = now.Add(2 * time.Minute)
	assert.False(t, g.Pending(d2), "expired")
	assert.ErrorIs(t, g.Redeem(l2, d2), ErrNoGrant, "expired")
}

// TestParseRemoteLayer: the labels of snapshots made before layers were
// bound to pulls still parse; a pull that is not a nonce does not.
func TestParseRemoteLayer(t *testing.T) {
	l, ref, err := ParseRemoteLayer("ci team/img@5")
	require.NoError(t, err)
	assert.Equal(t, RemoteLayer{Reader: "ci", Version: "team/img@5"}, l)
	assert.Equal(t, "team", ref.Namespace)
	for _, bad := range []string{"ci", "ci team/img", "ci team/img@5 not-a-nonce", "ci team/img@5 " + string(make([]byte, 32)), "Ci team/img@5", "ci team/img@5 a b"} {
		_, _, err := ParseRemoteLayer(bad)
		assert.Error(t, err, bad)
	}
}

// One namespace's burst of pulls pushes out its own oldest grants, never
// another's: B's grant, handed out first, is still taken after A was
// handed far more than a reader may hold.
func TestPullGrantsPerReader(t *testing.T) {
	key, err := LoadLayerKey(filepath.Join(t.TempDir(), "key"))
	require.NoError(t, err)
	g := NewPullGrants(key, time.Minute)
	lb, db, err := g.Issue("team-b", "team-b/img@1")
	require.NoError(t, err)
	var first digest.Digest
	for i := range maxGrants + 1 {
		_, d, err := g.Issue("team-a", "team-a/img@1")
		require.NoError(t, err)
		if i == 0 {
			first = d
		}
	}
	assert.False(t, g.Pending(first), "A's oldest went")
	require.NoError(t, g.Redeem(lb, db), "B's grant survived A's burst")
}
