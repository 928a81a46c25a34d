package fleet

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

func order(ns, name string, at time.Time, files ...string) *controllerv1.ReadOrder {
	return &controllerv1.ReadOrder{Namespace: ns, Name: name, Files: files, Recorded: timestamppb.New(at), NodeId: "node-a"}
}

func TestShareReadOrderRefusesWhatANodeNeverRecords(t *testing.T) {
	now := time.Now()
	many := make([]string, volume.MaxReadOrderFiles+1)
	for i := range many {
		many[i] = "f"
	}
	for _, tt := range []struct {
		name  string
		order *controllerv1.ReadOrder
	}{
		{"no namespace", order("", "job", now, "a")},
		{"a namespace that is no DNS label", order("CI", "job", now, "a")},
		{"no profile", order("ci", "", now, "a")},
		{"a profile with a space", order("ci", "my job", now, "a")},
		{"no files", order("ci", "job", now)},
		{"an empty name", order("ci", "job", now, "a", "")},
		{"a NUL in a name", order("ci", "job", now, "a\x00b")},
		{"a name past PATH_MAX", order("ci", "job", now, strings.Repeat("x", 4097))},
		{"too many files", order("ci", "job", now, many...)},
		{"too many bytes of names", order("ci", "job", now, slicesOf(strings.Repeat("x", 4000), 300)...)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := NewReadOrders(64 << 20)
			require.ErrorIs(t, r.Share(tt.order), ErrInvalid)
			n, _ := r.Held()
			assert.Zero(t, n)
		})
	}
}

func slicesOf(s string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = s
	}
	return out
}

// The newest order under a name wins, whichever arrives last; one
// namespace's name never answers for another's; past their bound, the
// least recently used orders go.
func TestReadOrdersKeepTheNewestWithinTheirBound(t *testing.T) {
	now := time.Now()
	r := NewReadOrders(64 << 20)
	require.NoError(t, r.Share(order("ci", "job", now, "b", "a")))
	require.NoError(t, r.Share(order("ci", "job", now.Add(-time.Minute), "old")), "an older order is no error")
	got, ok := r.Get("ci", "job")
	require.True(t, ok)
	assert.Equal(t, []string{"b", "a"}, got.GetFiles(), "the older order arriving later does not replace the newer")
	require.NoError(t, r.Share(order("ci", "job", now.Add(time.Minute), "c")))
	got, _ = r.Get("ci", "job")
	assert.Equal(t, []string{"c"}, got.GetFiles())
	_, ok = r.Get("other", "job")
	assert.False(t, ok, "another namespace's profile of the same name")

	// Each order of 100 bytes of names (and their separators): three fit
	// in 350 bytes; a fourth pushes out the least recently used.
	r = NewReadOrders(350)
	name := strings.Repeat("x", 99)
	for _, job := range []string{"j1", "j2", "j3"} {
		require.NoError(t, r.Share(order("ci", job, now, name)))
	}
	_, ok = r.Get("ci", "j1") // j1 used: j2 is now the least recently
	require.True(t, ok)
	require.NoError(t, r.Share(order("ci", "j4", now, name)))
	_, ok = r.Get("ci", "j2")
	assert.False(t, ok, "the least recently used went")
	for _, job := range []string{"j1", "j3", "j4"} {
		_, ok = r.Get("ci", job)
		assert.True(t, ok, job)
	}
	n, bytes := r.Held()
	assert.Equal(t, 3, n)
	assert.Equal(t, int64(300), bytes)

	r = NewReadOrders(0)
	require.NoError(t, r.Share(order("ci", "j", now, "a")))
	n, _ = r.Held()
	assert.Zero(t, n, "a bound of 0 keeps none")
}
