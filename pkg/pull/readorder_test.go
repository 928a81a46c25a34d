package pull

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A lazy pull records its readers' order where one of its read profiles
// has no record, or one older than ReadOrderRefresh (0: every time): a
// fresh record is not recorded again, which would cost each of the step's
// opens a notification.
func TestRecordsReadOrder(t *testing.T) {
	store := openStore(t)
	pl := &Puller{store: store}
	require.NoError(t, store.RecordReadOrder("ci", "fresh", []string{"a"}))
	time.Sleep(5 * time.Millisecond)
	tests := []struct {
		name     string
		refresh  time.Duration
		profiles []string
		want     bool
	}{
		{"no record", time.Hour, []string{"none"}, true},
		{"a fresh record", time.Hour, []string{"fresh"}, false},
		{"a record older than the refresh", time.Millisecond, []string{"fresh"}, true},
		{"a refresh of 0: every time", 0, []string{"fresh"}, true},
		{"one of the profiles has no record", time.Hour, []string{"fresh", "none"}, true},
		{"another namespace's record is not this one's", time.Hour, nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pl.cfg.ReadOrderRefresh = tc.refresh
			ns, profiles := "ci", tc.profiles
			if profiles == nil {
				ns, profiles = "other", []string{"fresh"}
			}
			require.Equal(t, tc.want, pl.recordsReadOrder(ns, profiles...))
		})
	}
}
