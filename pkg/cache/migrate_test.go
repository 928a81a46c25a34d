package cache

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

// schema0 writes a state dir as the schema 0 plugin left it: volumes keyed
// by handle with data under layers/<handle>, one of them without a
// namespace, and a live view over a chain.
func schema0(t *testing.T, dir string) {
	t.Helper()
	db, err := bolt.Open(filepath.Join(dir, "meta.db"), 0o600, nil)
	require.NoError(t, err)
	defer db.Close()
	put := func(b *bolt.Bucket, k string, v any) {
		raw, err := json.Marshal(v)
		require.NoError(t, err)
		require.NoError(t, b.Put([]byte(k), raw))
	}
	require.NoError(t, db.Update(func(tx *bolt.Tx) error {
		vols, _ := tx.CreateBucket(volumesBucket)
		views, _ := tx.CreateBucket(viewsBucket)
		_, _ = tx.CreateBucket(metaBucket)
		put(vols, "res", map[string]any{"handle": "res", "layer": "l1", "state": "ready", "namespace": "ci", "scope": "cluster", "synced": true})
		put(vols, "out", map[string]any{"handle": "out", "parent": "res", "base": "res", "layer": "l2", "state": "ready", "namespace": "other", "scope": "namespace", "synced": true})
		put(vols, "anon", map[string]any{"handle": "anon", "layer": "l3", "state": "ready", "scope": "namespace", "synced": true})
		put(views, "csi-1", map[string]any{"volumeID": "csi-1", "target": "/t", "source": "out", "pins": []string{"out", "res"},
			"lowers": []string{filepath.Join(dir, "layers/out/l2"), filepath.Join(dir, "layers/res/l1")}, "state": "published",
			"pod": map[string]string{"namespace": "other"}})
		return nil
	}))
	for _, d := range []string{"layers/res/l1", "layers/out/l2", "layers/anon/l3"} {
		require.NoError(t, os.MkdirAll(filepath.Join(dir, d), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, d, "data"), []byte(d), 0o644))
	}
}

func checkMigrated(t *testing.T, s *Store) {
	t.Helper()
	out, err := s.Get(ref("other", "out"))
	require.NoError(t, err)
	require.Equal(t, ref("ci", "res"), out.Parent)
	require.Equal(t, ref("ci", "res"), out.Base)
	data, err := os.ReadFile(filepath.Join(s.DataPath(out), "data"))
	require.NoError(t, err)
	require.Equal(t, "layers/out/l2", string(data), "the data moved with its volume")
	anon, err := s.Get(ref(unownedNamespace, "anon"))
	require.NoError(t, err, "a volume without a namespace is kept, owned by no pod")
	_, err = os.Stat(s.DataPath(anon))
	require.NoError(t, err)
	view, err := s.GetView("csi-1")
	require.NoError(t, err)
	require.Equal(t, ref("other", "out"), view.Source)
	require.Equal(t, []volume.Ref{ref("other", "out"), ref("ci", "res")}, view.Pins)
	dirs, err := s.Chain(ref("other", "out"))
	require.NoError(t, err)
	require.Equal(t, dirs, view.Lowers, "the view's lowers follow the move")
	require.Equal(t, Holders{Views: []string{"csi-1"}, Children: []volume.Ref{ref("other", "out")}}, s.Holders(ref("ci", "res")),
		"the indexes are built")
	rep, err := s.Recover(os.RemoveAll, false)
	require.NoError(t, err)
	require.Equal(t, 3, rep.Ready)
	require.Zero(t, rep.RemovedOrphans)
	_, err = os.Stat(filepath.Join(s.Dir(), "layers"))
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestMigrateFromSchema0(t *testing.T) {
	dir := t.TempDir()
	schema0(t, dir)
	s, err := Open(dir)
	require.NoError(t, err)
	checkMigrated(t, s)
	require.NoError(t, s.Close())
	s, err = Open(dir)
	require.NoError(t, err, "a migrated store opens as it is")
	checkMigrated(t, s)
	require.NoError(t, s.Close())
}

// A migration cut short after some data moved (before the metadata
// transaction) completes on the next start.
func TestMigrationCutShortCompletes(t *testing.T) {
	dir := t.TempDir()
	schema0(t, dir)
	require.NoError(t, moveDir(filepath.Join(dir, "layers", "res"), filepath.Join(dir, "volumes", "ci", "res")))
	s, err := Open(dir)
	require.NoError(t, err)
	defer s.Close()
	checkMigrated(t, s)
}

func TestNewerSchemaIsRefused(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	require.NoError(t, err)
	require.NoError(t, s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(metaBucket).Put(schemaKey, []byte("99")) }))
	require.NoError(t, s.Close())
	_, err = Open(dir)
	require.ErrorContains(t, err, "newer")
}
