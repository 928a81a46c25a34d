package pull

import (
	"context"
	"maps"
	"slices"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/volume"
)

// reachRecorder records the order readers reach a filling layer's files
// in: its stubs' (fill.Layer) or its index's blob's (fill.Blob).
type reachRecorder interface {
	RecordReaches()
	Recording() bool
	Reached() []string
}

// recordsReadOrder says whether a lazy pull read under profiles records
// the order its readers reach files in: where one of them has no record,
// or one older than ReadOrderRefresh.
func (pl *Puller) recordsReadOrder(namespace string, profiles ...string) bool {
	for _, name := range profiles {
		at, ok := pl.store.ReadOrderRecorded(namespace, name)
		if !ok || time.Since(at) >= pl.cfg.ReadOrderRefresh {
			return true
		}
	}
	return false
}

// recordReadOrder records the order fl's readers reached its files in,
// under each profile its readers named. Only where the readers were all of
// one namespace: a record under one namespace's name must tell nothing of
// what another's steps read.
func (pl *Puller) recordReadOrder(r volume.Ref, fl *lazyFill) {
	if !fl.reaches.Recording() {
		return // every record is fresh: what was reached is only what readers waited for
	}
	reached := fl.reaches.Reached()
	pl.lazy.mu.Lock()
	var namespace string
	for ns := range fl.namespaces {
		namespace = ns
	}
	mixed, profiles := len(fl.namespaces) > 1, slices.Sorted(maps.Keys(fl.profiles))
	pl.lazy.mu.Unlock()
	if len(reached) == 0 || len(profiles) == 0 {
		return
	}
	if mixed {
		klog.V(2).InfoS("Not recording the read order of a layer pods of several namespaces read", "volume", r)
		return
	}
	for _, name := range profiles {
		if err := pl.store.RecordReadOrder(namespace, name, reached); err != nil {
			klog.ErrorS(err, "Recording a read order", "volume", r, "namespace", namespace, "readProfile", name)
			continue
		}
		klog.V(2).InfoS("Recorded a read order", "volume", r, "namespace", namespace, "readProfile", name, "files", len(reached))
		pl.shareReadOrder(namespace, name)
	}
}

// shareTimeout bounds one exchange of a read order with the fleet: an
// order is a hint, never worth waiting for.
const shareTimeout = 2 * time.Second

// shareReadOrder leaves the order this node keeps for namespace under name
// (what it recorded, merged with what it had) where other nodes find it.
func (pl *Puller) shareReadOrder(namespace, name string) {
	if pl.cfg.ReadOrders == nil {
		return
	}
	files := pl.store.ReadOrder(namespace, name)
	pl.goBackground(func() {
		ctx, cancel := context.WithTimeout(pl.ctx, shareTimeout)
		defer cancel()
		if err := pl.cfg.ReadOrders.Share(ctx, namespace, name, files); err != nil {
			klog.InfoS("Sharing a read order with the fleet failed; other nodes' first pulls under it read unordered", "namespace", namespace,
				"readProfile", name, "err", err)
		}
	})
}

// readOrder is the order recorded under the read profiles of namespace, one
// after the other: this node's record, or else the one another node shared
// (kept here from then on).
func (pl *Puller) readOrder(namespace string, profiles []string) []string {
	var order []string
	for _, name := range profiles {
		files, source := pl.store.ReadOrder(namespace, name), "local"
		if len(files) == 0 {
			files, source = pl.fleetReadOrder(namespace, name), "fleet"
		}
		if len(files) == 0 {
			source = "none"
		}
		pl.metrics.orders.WithLabelValues(source).Inc()
		order = append(order, files...)
	}
	return order
}

// fleetReadOrder is the order another node shared for namespace under
// name (none: nil), recorded here as this node's.
func (pl *Puller) fleetReadOrder(namespace, name string) []string {
	if pl.cfg.ReadOrders == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(pl.ctx, shareTimeout)
	defer cancel()
	files, from, err := pl.cfg.ReadOrders.Find(ctx, namespace, name)
	if err != nil {
		klog.InfoS("Finding a read order another node shared failed; reading unordered", "namespace", namespace, "readProfile", name, "err", err)
		return nil
	}
	if len(files) == 0 {
		return nil
	}
	if err := pl.store.RecordReadOrder(namespace, name, files); err != nil {
		klog.ErrorS(err, "Keeping a read order another node shared", "namespace", namespace, "readProfile", name)
	}
	klog.V(2).InfoS("Reading in the order another node's steps did", "namespace", namespace, "readProfile", name, "node", from, "files", len(files))
	return files
}
