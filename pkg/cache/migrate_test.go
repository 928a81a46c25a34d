package cache

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

// putFunc records v as JSON under k.
type putFunc func(b *bolt.Bucket, k string, v any)

// writeStore writes a metadata file in dir as an older plugin left it:
// write fills its volumes, views and meta buckets.
func writeStore(t *testing.T, dir string, write func(put putFunc, vols, views, meta *bolt.Bucket) error) {
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
		meta, _ := tx.CreateBucket(metaBucket)
		return write(put, vols, views, meta)
	}))
}

// schema0 writes a state dir as the schema 0 plugin left it: volumes keyed
// by handle with data under layers/<handle>, one of them without a
// namespace, and a live view over a chain.
func schema0(t *testing.T, dir string) {
	writeStore(t, dir, func(put putFunc, vols, views, _ *bolt.Bucket) error {
		put(vols, "res", map[string]any{"handle": "res", "layer": "l1", "state": "ready", "namespace": "ci", "scope": "cluster", "synced": true})
		put(vols, "out", map[string]any{"handle": "out", "parent": "res", "base": "res", "layer": "l2", "state": "ready", "namespace": "other", "scope": "namespace", "synced": true})
		put(vols, "anon", map[string]any{"handle": "anon", "layer": "l3", "state": "ready", "scope": "namespace", "synced": true})
		put(views, "csi-1", map[string]any{"volumeID": "csi-1", "target": "/t", "source": "out", "pins": []string{"out", "res"},
			"lowers": []string{filepath.Join(dir, "layers/out/l2"), filepath.Join(dir, "layers/res/l1")}, "state": "published",
			"pod": map[string]string{"namespace": "other"}})
		return nil
	})
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

// A plugin older than its store refuses it, saying why, and leaves it as
// it is for the plugin that wrote it.
func TestNewerSchemaIsRefused(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	require.NoError(t, err)
	require.NoError(t, s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(metaBucket).Put(schemaKey, []byte("99")) }))
	require.NoError(t, s.Close())
	_, err = Open(dir)
	require.ErrorContains(t, err, `metadata schema "99" is newer than this plugin understands (it knows up to `+schemaVersion+")")
	require.Equal(t, "99", schemaOf(t, dir), "the refused store is untouched")
}

func schemaOf(t *testing.T, dir string) string {
	t.Helper()
	db, err := bolt.Open(filepath.Join(dir, "meta.db"), 0o600, nil)
	require.NoError(t, err)
	defer db.Close()
	var v string
	require.NoError(t, db.View(func(tx *bolt.Tx) error { v = string(tx.Bucket(metaBucket).Get(schemaKey)); return nil }))
	return v
}

// The migrations are ordered, one per schema, and a fresh store is written
// at the last one's.
func TestMigrationsAreOrdered(t *testing.T) {
	for i, m := range migrations {
		require.Equal(t, strconv.Itoa(i+1), m.schema, "migration %d", i)
		require.NotEmpty(t, m.what)
	}
	dir := t.TempDir()
	s, err := Open(dir)
	require.NoError(t, err)
	require.NoError(t, s.Close())
	require.Equal(t, schemaVersion, schemaOf(t, dir))
}

// schema1 writes a state dir as the first schema 1 plugin left it: volumes
// keyed by namespace/handle, a creating one naming its step volume as its
// owner (before leases), and no children or pins index.
func schema1(t *testing.T, dir string) {
	writeStore(t, dir, func(put putFunc, vols, views, meta *bolt.Bucket) error {
		put(vols, "ci/res", map[string]any{"namespace": "ci", "handle": "res", "layer": "l1", "state": "ready", "scope": "namespace", "synced": true})
		put(vols, "ci/out", map[string]any{"namespace": "ci", "handle": "out", "parent": map[string]string{"namespace": "ci", "handle": "res"},
			"base": map[string]string{"namespace": "ci", "handle": "res"}, "layer": "l2", "state": "ready", "scope": "namespace", "synced": true})
		put(vols, "ci/next", map[string]any{"namespace": "ci", "handle": "next", "layer": "l3", "state": "creating", "scope": "namespace", "owner": "csi-2"})
		put(views, "csi-1", map[string]any{"volumeID": "csi-1", "target": "/t1", "source": map[string]string{"namespace": "ci", "handle": "out"},
			"pins": []map[string]string{{"namespace": "ci", "handle": "out"}, {"namespace": "ci", "handle": "res"}}, "state": "published",
			"pod": map[string]string{"namespace": "ci"}})
		put(views, "csi-2", map[string]any{"volumeID": "csi-2", "target": "/t2", "capture": "next", "state": "published",
			"pod": map[string]string{"namespace": "ci"}})
		return meta.Put(schemaKey, []byte("1"))
	})
	for _, d := range []string{"volumes/ci/res/l1", "volumes/ci/out/l2"} {
		require.NoError(t, os.MkdirAll(filepath.Join(dir, d), 0o755))
	}
}

func TestMigrateFromSchema1(t *testing.T) {
	dir := t.TempDir()
	schema1(t, dir)
	for range 2 { // and a migrated store opens as it is
		s, err := Open(dir)
		require.NoError(t, err)
		next, err := s.Get(ref("ci", "next"))
		require.NoError(t, err)
		require.Equal(t, viewLease("csi-2"), next.Lease, "the owner became the lease that recovery keeps while its step volume lives")
		require.Equal(t, Holders{Views: []string{"csi-1"}, Children: []volume.Ref{ref("ci", "out")}}, s.Holders(ref("ci", "res")),
			"the indexes are built: the base under a child and the source under a step are held")
		require.NoError(t, s.Close())
		require.Equal(t, schemaVersion, schemaOf(t, dir))
	}
}

// Each migration commits its own schema: a store stopped between two
// migrations goes on from the one it reached.
func TestMigrationStoppedBetweenSchemas(t *testing.T) {
	dir := t.TempDir()
	schema0(t, dir)
	s, err := Open(dir)
	require.NoError(t, err)
	require.NoError(t, s.Close())
	// Back to schema 1, as if the plugin had stopped after migrateTo1.
	db, err := bolt.Open(filepath.Join(dir, "meta.db"), 0o600, nil)
	require.NoError(t, err)
	require.NoError(t, db.Update(func(tx *bolt.Tx) error {
		return errors.Join(tx.DeleteBucket(childrenBucket), tx.DeleteBucket(pinsBucket), putSchema(tx, "1"))
	}))
	require.NoError(t, db.Close())
	s, err = Open(dir)
	require.NoError(t, err)
	checkMigrated(t, s)
	require.NoError(t, s.Close())
	require.Equal(t, schemaVersion, schemaOf(t, dir))
}

// A record that does not decode keeps no store from migrating: it stays as
// it is, never served, and everything else migrates.
func TestMigrationGoesPastABadRecord(t *testing.T) {
	dir := t.TempDir()
	schema1(t, dir)
	db, err := bolt.Open(filepath.Join(dir, "meta.db"), 0o600, nil)
	require.NoError(t, err)
	require.NoError(t, db.Update(func(tx *bolt.Tx) error {
		return errors.Join(tx.Bucket(volumesBucket).Put([]byte("ci/garbage"), []byte("{not json")),
			tx.Bucket(viewsBucket).Put([]byte("csi-garbage"), []byte{0xff}))
	}))
	require.NoError(t, db.Close())
	s, err := Open(dir)
	require.NoError(t, err)
	next, err := s.Get(ref("ci", "next"))
	require.NoError(t, err)
	require.Equal(t, viewLease("csi-2"), next.Lease)
	require.Len(t, s.BadRecords(), 2, "the bad records are kept and reported")
	require.NoError(t, s.Close())
	require.Equal(t, schemaVersion, schemaOf(t, dir))
}
