package cache

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/concourse/cowvol/pkg/volume"
)

// Read orders: the order in which steps opened the files of a lazily
// pulled source, recorded per namespace under a name the pod gave (its
// readProfile attribute), so that the next lazy pull under that name
// fetches in that order. A hint only: a record that does not decode, or
// names files a layer lacks, costs nothing but the order.

var readOrdersBucket = []byte("readOrders")

// Bounds: a record is at most MaxReadOrderFiles paths, and at most
// MaxReadOrderBytes of them (volume's bounds: it travels in one request to
// a peer or the controller); the node keeps at most MaxReadOrders records,
// the least recently recorded going first.
const (
	MaxReadOrderFiles = volume.MaxReadOrderFiles
	MaxReadOrderBytes = volume.MaxReadOrderBytes
	MaxReadOrders     = 1000
)

type readOrder struct {
	Recorded time.Time `json:"recorded"`
	Files    []string  `json:"files"`
}

func readOrderKey(namespace, name string) []byte { return indexKey(namespace, name) }

// ReadOrder is the order recorded for namespace under name (none: nil).
func (s *Store) ReadOrder(namespace, name string) []string {
	var rec readOrder
	_ = s.db.View(func(tx *bolt.Tx) error {
		if raw := tx.Bucket(readOrdersBucket).Get(readOrderKey(namespace, name)); raw != nil {
			_ = json.Unmarshal(raw, &rec)
		}
		return nil
	})
	return rec.Files
}

// ReadOrderRecorded says when the order for namespace under name was last
// recorded (false: none, or a record that does not decode). It decodes the
// record's time only, not its up to 50,000 paths.
func (s *Store) ReadOrderRecorded(namespace, name string) (time.Time, bool) {
	var at time.Time
	var ok bool
	_ = s.db.View(func(tx *bolt.Tx) error {
		raw := tx.Bucket(readOrdersBucket).Get(readOrderKey(namespace, name))
		if raw == nil {
			return nil
		}
		d := json.NewDecoder(bytes.NewReader(raw))
		if tok, err := d.Token(); err != nil || tok != json.Delim('{') {
			return nil
		}
		for d.More() {
			key, err := d.Token()
			if err != nil {
				return nil
			}
			if key == "recorded" {
				ok = d.Decode(&at) == nil
				return nil
			}
			var skip json.RawMessage
			if d.Decode(&skip) != nil {
				return nil
			}
		}
		return nil
	})
	return at, ok
}

// RecordReadOrder records that steps of namespace opened files in this
// order, under name. The files of the order recorded before that were not
// opened this time follow them (a step that reads less this time keeps the
// rest of what it read before, behind), within the bounds.
func (s *Store) RecordReadOrder(namespace, name string, files []string) error {
	if len(files) == 0 {
		return nil
	}
	return s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(readOrdersBucket)
		k := readOrderKey(namespace, name)
		var old readOrder
		if raw := b.Get(k); raw != nil {
			_ = json.Unmarshal(raw, &old)
		}
		rec := readOrder{Recorded: time.Now().UTC(), Files: boundOrder(files, old.Files)}
		raw, err := json.Marshal(rec)
		if err != nil {
			return err
		}
		if err := b.Put(k, raw); err != nil {
			return err
		}
		return pruneReadOrders(b)
	})
}

// boundOrder is files then the rest of older, each path once, within the
// bounds of a record.
func boundOrder(files, older []string) []string {
	out := make([]string, 0, min(len(files)+len(older), MaxReadOrderFiles))
	seen := make(map[string]bool, cap(out))
	size := 0
	for _, f := range slices.Concat(files, older) {
		if seen[f] {
			continue
		}
		if len(out) == MaxReadOrderFiles || size+len(f)+1 > MaxReadOrderBytes {
			break
		}
		seen[f] = true
		size += len(f) + 1
		out = append(out, f)
	}
	return out
}

// pruneReadOrders drops the least recently recorded orders beyond
// MaxReadOrders (and any that does not decode).
func pruneReadOrders(b *bolt.Bucket) error {
	if b.Stats().KeyN <= MaxReadOrders {
		return nil
	}
	type aged struct {
		key []byte
		at  time.Time
	}
	var all []aged
	err := b.ForEach(func(k, v []byte) error {
		var rec readOrder
		if json.Unmarshal(v, &rec) != nil {
			rec.Recorded = time.Time{}
		}
		all = append(all, aged{key: slices.Clone(k), at: rec.Recorded})
		return nil
	})
	if err != nil {
		return err
	}
	slices.SortFunc(all, func(a, b aged) int { return a.at.Compare(b.at) })
	for _, a := range all[:len(all)-MaxReadOrders] {
		if err := b.Delete(a.key); err != nil {
			return fmt.Errorf("dropping an old read order: %w", err)
		}
	}
	return nil
}
