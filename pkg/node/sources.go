package node

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/pull"
	"github.com/concourse/cowvol/pkg/volume"
)

// sources.go: what a publish or a reader of a whole volume needs of the
// node's pulls (package pull): the gates of whether to pull at all, and the
// Notifier the puller tells what it made.

// ensureSource makes sure a publish's source is here, pulling it from a
// peer if the node lacks it; v and err are the source as awaitCapture last
// read it. It returns once the source is here (or the node has it in some
// state the publish will answer for), or with the pull's progress after
// the configured wait.
func (e *Engine) ensureSource(r PublishRequest, v cache.Volume, err error) error {
	if e.puller == nil {
		return nil
	}
	pulling := err == nil && v.BeingPulled()
	if !pulling && !errors.Is(err, cache.ErrNotFound) {
		return nil // here, in a state the publish answers for
	}
	if _, err := e.store.GetView(r.VolumeID); err == nil {
		return nil // published already: a repeat needs no source
	}
	return e.puller.Ensure(context.Background(), r.Pod.Namespace, r.Source, r.Pod, r.ReadProfile)
}

// visibleHere reads volume r as namespace sees it on this node: one held
// here that namespace may not read is, to it, not here.
func (e *Engine) visibleHere(r volume.Ref, namespace string) (cache.Volume, error) {
	v, err := e.store.Get(r)
	if err == nil && !v.ReadableBy(namespace) {
		err = hiddenHere(r, namespace)
	}
	return v, err
}

// awaitCapture waits, up to the engine's captureWait, while a publish's
// source is a step's output on this node still being captured, and
// returns the source as it last read it. A CI engine creates the next
// step the moment the last one's containers end, a moment before the
// kubelet tears its volumes down and the capture runs; answering that
// publish Unavailable would cost the step the kubelet's retry backoff,
// which doubles to two minutes. A source no step has finished yet (its
// step still runs) is waited for as long, and then answered as before.
func (e *Engine) awaitCapture(r PublishRequest) (cache.Volume, error) {
	deadline := time.Now().Add(e.captureWait)
	for {
		v, err := e.visibleHere(r.Source, r.Pod.Namespace)
		if err != nil || v.State != volume.StateCreating || !time.Now().Before(deadline) {
			return v, err
		}
		select {
		case <-e.bgCtx.Done():
			return v, err
		case <-time.After(captureWaitPoll):
		}
	}
}

// captureWaitPoll is how often awaitCapture reads the source's state.
const captureWaitPoll = 50 * time.Millisecond

// Fetch brings a volume namespace may read here for a reader that needs
// need of it rather than a step's view of it (the image registry), pulled
// from a peer if the node lacks it: whole, or, for NeedTree where pulls are
// lazy, its tree, its data filled as files are opened and streamed behind.
// It returns once the volume is here as need says, or with ErrPulling and
// the pull's progress after the configured wait or when ctx ends (the pull
// goes on; asking again joins it). A volume no peer holds for namespace
// fails wrapping cache.ErrNotFound.
func (e *Engine) Fetch(ctx context.Context, namespace string, r volume.Ref, need volume.Need) error {
	if e.puller == nil {
		return cache.NotVisible(r, namespace)
	}
	v, err := e.visibleHere(r, namespace)
	switch {
	case err == nil && v.State == volume.StateFilling && need == volume.NeedWhole:
		return fmt.Errorf("%s is arriving lazily from a peer; retry: %w", r, pull.ErrPulling)
	case err == nil && !v.BeingPulled():
		return nil // here, in a state the reader answers for
	case err != nil && !errors.Is(err, cache.ErrNotFound):
		return err
	}
	if need == volume.NeedTree {
		return e.puller.Ensure(ctx, namespace, r, volume.Pod{}, "")
	}
	return e.puller.EnsureWhole(ctx, namespace, r)
}

// KeepCopy has a ready volume pulled here whole, in the background, to be
// kept as a copy (the controller asks, for a volume that asked to be on
// more nodes than hold it). Idempotent: a copy here, or on its way, is
// left as it is.
func (e *Engine) KeepCopy(r volume.Ref) error {
	if e.puller == nil {
		return cache.NotVisible(r, r.Namespace)
	}
	v, err := e.store.Get(r)
	switch {
	case err == nil && !v.BeingPulled():
		return nil // here in some state (a filling one's fill makes it whole)
	case err != nil && !errors.Is(err, cache.ErrNotFound):
		return err
	}
	e.puller.StartWhole(r.Namespace, r) // or join the pull on its way
	return nil
}

// hiddenHere is what a volume held here that namespace may not read is to
// it: one that is not here. It goes the way a missing one does, asking the
// peers (who hold it for namespace no more than this node does), so that
// neither the answer nor its time tells another namespace's volumes from
// none.
func hiddenHere(r volume.Ref, namespace string) error {
	return cache.NotVisible(r, namespace)
}

// pullNotifier is what the node's puller tells the engine (and an
// upload's receiver: origin, the node vouches for what it commits).
type pullNotifier struct {
	e      *Engine
	origin bool
}

func (e *Engine) notifier() pullNotifier { return pullNotifier{e: e} }

// Event puts an event on a pod that asked for a pull.
func (n pullNotifier) Event(pod volume.Pod, eventType, reason, message string) {
	n.e.events.Event(pod, eventType, reason, message)
}

// Committed wakes the sync round for a layer whose data is not on disk yet,
// and settles what its arrival changes (as a capture's does).
func (n pullNotifier) Committed(vol cache.Volume, synced bool) {
	if !synced {
		n.e.kick(n.e.syncer)
	}
	n.e.goBackground(func() { n.e.afterCapture(vol, n.origin) })
}

// FillEnded wakes the reaper (a filled or failed layer may free data) and
// the index copier (a volume ready as its whole index is made a plain
// layer once no view mounts it, and the steps may all have left), and
// keeps a filled layer's stub tree, as a capture's is kept, for the peers
// that pull it from here.
func (n pullNotifier) FillEnded(r volume.Ref) {
	n.e.kick(n.e.reaper)
	v, err := n.e.store.Get(r)
	if err != nil || v.State != volume.StateReady {
		return
	}
	n.e.kick(n.e.indexCopier)
	n.e.goBackground(func() { _ = n.e.sumLayer(v, false) })
}
