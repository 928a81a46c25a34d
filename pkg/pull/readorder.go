package pull

import (
	"maps"
	"slices"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/volume"
)

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
	if !fl.layer.Recording() {
		return // every record is fresh: what was reached is only what readers waited for
	}
	reached := fl.layer.Reached()
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
	}
}

// readOrder is the order recorded under the read profiles of namespace, one
// after the other.
func (pl *Puller) readOrder(namespace string, profiles []string) []string {
	var order []string
	for _, name := range profiles {
		order = append(order, pl.store.ReadOrder(namespace, name)...)
	}
	return order
}
