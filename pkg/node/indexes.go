package node

import (
	"errors"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/volume"
)

// indexes.go: the volumes pulled as indexes and now whole
// (pull.WholeIndexes) are ready as their index mounts: recovery mounts them
// again before any view is settled, and the copier makes each a plain
// layer in the background once no view mounts it, one at a time, never
// while the disk is over its high watermark (the copy needs room the
// index frees only after it).

// indexCopyDelay is how long the copier waits after a kick (a step's
// volume gone, a fill ended): the next step of a build often mounts the
// same input moments later, and reads it best with no copy under way.
const indexCopyDelay = 5 * time.Second

// indexCopyRetry is how long a whole index whose copy failed is left as it
// is before another try: each try writes a whole layer.
const indexCopyRetry = 10 * time.Minute

// indexCopyFailures are the layers whose copy failed, and when.
type indexCopyFailures struct {
	mu sync.Mutex
	at map[string]time.Time
}

// recent says whether data's copy failed less than indexCopyRetry ago.
func (f *indexCopyFailures) recent(data string, now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	at, ok := f.at[data]
	return ok && now.Sub(at) < indexCopyRetry
}

// note records data's copy failing at now, and forgets failures old
// enough to be tried again (of layers since destroyed, or copied).
func (f *indexCopyFailures) note(data string, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.at == nil {
		f.at = map[string]time.Time{}
	}
	for d, at := range f.at {
		if now.Sub(at) >= indexCopyRetry {
			delete(f.at, d)
		}
	}
	f.at[data] = now
}

// copyIdleIndexes makes each whole index no view mounts a plain layer,
// then has the indexes it replaced pruned.
func (e *Engine) copyIdleIndexes() {
	copied := 0
	for _, v := range e.indexes.Idle() {
		if over, _ := e.pressureNow(); over || e.bgCtx.Err() != nil {
			break
		}
		if e.copyIndex(v) {
			copied++
		}
	}
	if copied > 0 {
		e.tidy()
	}
}

// copyIndex makes v's whole index a plain layer, holding v meanwhile (a
// destroy waits for it), and says whether it did.
func (e *Engine) copyIndex(v cache.Volume) bool {
	data := e.store.DataPath(v)
	now := time.Now()
	if e.indexCopyFailures.recent(data, now) {
		return false
	}
	release := e.store.Hold(v.Ref(), cache.HoldStream)
	defer release()
	cur, err := e.store.Get(v.Ref())
	if err != nil || cur.State != volume.StateReady || cur.Layer != v.Layer {
		return false // destroyed or changed since it was listed
	}
	stats, err := e.indexes.MakePlain(e.bgCtx, cur)
	switch {
	case err == nil:
	case e.bgCtx.Err() != nil, errors.Is(err, cache.ErrUnusable):
		return false
	default:
		e.metrics.indexCopies.WithLabelValues("error").Inc()
		e.indexCopyFailures.note(data, now)
		klog.ErrorS(err, "Making a whole index a plain layer failed; the volume stays ready as its index, and is tried again later",
			"volume", v.Ref(), "retryIn", indexCopyRetry)
		return false
	}
	e.metrics.indexCopies.WithLabelValues("ok").Inc()
	klog.InfoS("Made a whole index a plain layer", "volume", v.Ref(), "files", stats.Files, "cloned", stats.Cloned, "copied", stats.Copied,
		"duration", time.Since(now))
	return true
}
