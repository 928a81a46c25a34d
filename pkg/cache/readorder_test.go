package cache

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"
)

func TestRecordReadOrder(t *testing.T) {
	tests := []struct {
		name   string
		before [][]string // recorded first, in turn
		files  []string
		want   []string
	}{
		{"first record", nil, []string{"b", "a"}, []string{"b", "a"}},
		{"nothing read records nothing", [][]string{{"a"}}, nil, []string{"a"}},
		{"what was read before and not now follows", [][]string{{"a", "b", "c"}}, []string{"c", "d"}, []string{"c", "d", "a", "b"}},
		{"each path once", nil, []string{"a", "b", "a"}, []string{"a", "b"}},
		{"bounded in paths", [][]string{names("old", MaxReadOrderFiles)}, []string{"new"},
			append([]string{"new"}, names("old", MaxReadOrderFiles-1)...)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := openStore(t)
			for _, b := range tt.before {
				require.NoError(t, s.RecordReadOrder("ci", "main/unit/repo", b))
			}
			require.NoError(t, s.RecordReadOrder("ci", "main/unit/repo", tt.files))
			require.Equal(t, tt.want, s.ReadOrder("ci", "main/unit/repo"))
		})
	}
}

func TestReadOrdersAreBounded(t *testing.T) {
	s := openStore(t)
	long := strings.Repeat("x", 1000)
	require.NoError(t, s.RecordReadOrder("ci", "big", names(long, 2000)))
	got := s.ReadOrder("ci", "big")
	size := 0
	for _, f := range got {
		size += len(f) + 1
	}
	require.LessOrEqual(t, size, MaxReadOrderBytes)
	require.Greater(t, size, MaxReadOrderBytes-1100, "filled to the bound")

	require.Nil(t, s.ReadOrder("other", "big"), "another namespace's name is another record")

	for i := range MaxReadOrders + 5 {
		require.NoError(t, s.RecordReadOrder("ci", fmt.Sprintf("job-%d", i), []string{"f"}))
	}
	n := 0
	require.NoError(t, s.db.View(func(tx *bolt.Tx) error { n = tx.Bucket(readOrdersBucket).Stats().KeyN; return nil }))
	require.Equal(t, MaxReadOrders, n)
	require.Nil(t, s.ReadOrder("ci", "big"), "the least recently recorded went first")
	require.Equal(t, []string{"f"}, s.ReadOrder("ci", fmt.Sprintf("job-%d", MaxReadOrders+4)))
}

// A record that does not decode is no order, and is replaced.
func TestReadOrderUndecodable(t *testing.T) {
	s := openStore(t)
	require.NoError(t, s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(readOrdersBucket).Put(readOrderKey("ci", "j"), []byte("{garbage"))
	}))
	require.Nil(t, s.ReadOrder("ci", "j"))
	require.NoError(t, s.RecordReadOrder("ci", "j", []string{"a"}))
	require.Equal(t, []string{"a"}, s.ReadOrder("ci", "j"))
}

// ReadOrderRecorded says when a record was made, without decoding its
// paths, wherever its time is among its fields; no record, or one that
// does not decode, has none.
func TestReadOrderRecorded(t *testing.T) {
	s := openStore(t)
	before := time.Now()
	require.NoError(t, s.RecordReadOrder("ci", "j", names("f", 1000)))
	at, ok := s.ReadOrderRecorded("ci", "j")
	require.True(t, ok)
	require.False(t, at.Before(before.Truncate(time.Second)), "recorded at %v, after %v", at, before)
	require.WithinDuration(t, time.Now(), at, time.Minute)

	for _, tc := range []struct {
		name, raw string
		ok        bool
	}{
		{"its time after its paths", `{"files":["a","b"],"recorded":"2026-01-02T03:04:05Z"}`, true},
		{"garbage", "{garbage", false},
		{"no time", `{"files":["a"]}`, false},
		{"a time that is no time", `{"recorded":7}`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, s.db.Update(func(tx *bolt.Tx) error {
				return tx.Bucket(readOrdersBucket).Put(readOrderKey("ci", tc.name), []byte(tc.raw))
			}))
			at, ok := s.ReadOrderRecorded("ci", tc.name)
			require.Equal(t, tc.ok, ok)
			if ok {
				require.Equal(t, time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), at.UTC())
			}
		})
	}
	_, ok = s.ReadOrderRecorded("ci", "none")
	require.False(t, ok, "no record")
}

func names(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s/%d", prefix, i)
	}
	return out
}
