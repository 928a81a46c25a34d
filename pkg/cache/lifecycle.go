package cache

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/concourse/cowvol/pkg/volume"
)

// This file is the one place that says how a cached volume lives: what
// moves it between states (apply), what holds its data (Holders, recorded
// and live), and what its state, lease and holds allow (mountable,
// servable, reapable, evictable, expired). The store's transactions and the
// node's pipelines ask here, so a new state or a new kind of hold changes
// this file and its table tests, not every caller.
//
//	reserve (a view, a pull) ─▶ creating ─commit─────────▶ ready ─fail─▶ failed
//	                               └──commit-filling─▶ filling ─filled─▶ ready
//	                                                     └──fail──▶ failed
//	destroy: ready, failed ─▶ destroying ─(nothing holds it)─▶ reaped
//	         creating, filling: hidden now, destroying when committed or filled
//
// The answers live with the metadata, not in package node, because each
// must hold inside the bbolt transaction that acts on it.

// Event is what moves a cached volume from one state to another.
type Event string

const (
	// EventCommit: what reserved the volume made all its data (a capture,
	// an eager pull).
	EventCommit Event = "commit"
	// EventCommitFilling: a lazy pull made the volume's tree, its files
	// still without data, which a filler then brings.
	EventCommitFilling Event = "commit-filling"
	// EventFilled: the filler wrote the last of the data.
	EventFilled Event = "filled"
	// EventFail: the data is damaged or missing, or can no longer be
	// completed.
	EventFail Event = "fail"
	// EventDestroy: the volume is hidden at once; its data goes once
	// nothing holds it.
	EventDestroy Event = "destroy"
)

var errUnknownEvent = errors.New("unknown event")

// apply moves v by ev. Commits name the lease that made the volume and are
// refused (ErrExists) from anyone else: a reservation is its owner's. A
// volume destroyed while it was being made or filled stays in that state,
// hidden, so that its maker can finish (its children may need the data),
// and then goes straight to destroying.
func (v *Volume) apply(ev Event, by Lease) error {
	switch ev {
	case EventCommit, EventCommitFilling:
		if !v.ReservedBy(by) {
			return fmt.Errorf("volume %s is %s and not reserved by %s %s: %w", v.Ref(), v.State, by.Kind, by.ID, ErrExists)
		}
		v.State, v.Lease = volume.StateReady, Lease{}
		if ev == EventCommitFilling {
			v.State = volume.StateFilling
		} else if v.DestroyOnCommit {
			v.State = volume.StateDestroying
		}
	case EventFilled:
		if v.State != volume.StateFilling {
			return fmt.Errorf("volume %s is %s, not filling: %w", v.Ref(), v.State, ErrUnusable)
		}
		v.State = volume.StateReady
		if v.DestroyOnCommit {
			v.State = volume.StateDestroying
		}
	case EventFail:
		switch v.State {
		case volume.StateReady, volume.StateFilling:
			v.State = volume.StateFailed
		case volume.StateCreating:
			// A reservation is aborted by its owner, never failed: the
			// owner would commit over the mark.
			return fmt.Errorf("volume %s is still being made: %w", v.Ref(), ErrNotReady)
		}
	case EventDestroy:
		switch v.State {
		case volume.StateCreating, volume.StateFilling:
			v.DestroyOnCommit = true
		case volume.StateReady, volume.StateFailed:
			v.State = volume.StateDestroying
		}
	default:
		return fmt.Errorf("volume %s: %w %q", v.Ref(), errUnknownEvent, ev)
	}
	return nil
}

// ReservedBy says whether v is being made by the owner of lease l.
func (v Volume) ReservedBy(l Lease) bool { return v.State == volume.StateCreating && v.Lease == l }

// BeingPulled says whether v is being made by a pull from a peer (which a
// publish waits for rather than answering NotFound).
func (v Volume) BeingPulled() bool {
	return v.State == volume.StateCreating && v.Lease.Kind == LeasePull
}

// Hidden says whether lookups by name must answer as if v were gone:
// destroyed, or destroyed while it was being made or filled.
func (v Volume) Hidden() bool { return v.State == volume.StateDestroying || v.DestroyOnCommit }

// ReadableAs says whether a reader for namespace (a read of its files, a
// new container's rootfs, a peer's pull for a pod) may have v, with as
// much of its data here as need asks: one it may read, present, and not
// destroyed. Every lookup that answers "not held here" otherwise asks this
// one question, so a volume destroyed while it fills is gone to all of
// them alike, as it is to a step's publish (mountable).
func (v Volume) ReadableAs(namespace string, need volume.Need) bool {
	return need.Present(v.State) && v.ReadableBy(namespace) && !v.Hidden()
}

// mountable says whether a pod of namespace may publish a step volume from
// v, and if not, why: the same NotFound for a volume it may not see and
// for one that is not there.
func (v Volume) mountable(namespace string) error {
	switch {
	case !v.ReadableBy(namespace) || v.Hidden():
		return NotVisible(v.Ref(), namespace)
	case v.State == volume.StateCreating:
		return fmt.Errorf("source volume %q is still being captured: %w", v.Handle, ErrNotReady)
	case v.State != volume.StateReady && v.State != volume.StateFilling:
		return fmt.Errorf("source volume %q is %s: %w", v.Handle, v.State, ErrUnusable)
	}
	return nil
}

// layerMountable says whether v's data may be mounted as a layer of a
// step volume, top saying it is the source itself. A destroyed volume
// below the top still holds data for the volumes built on it.
func (v Volume) layerMountable(top bool) bool {
	switch v.State {
	case volume.StateReady, volume.StateFilling:
		return true
	case volume.StateDestroying:
		return !top
	}
	return false
}

// layerComplete says whether all of v's data is here to be read as a
// layer of a chain, top saying it is the volume asked for: what copying a
// chain out (to a peer, a download, a flatten) needs.
func (v Volume) layerComplete(top bool) bool {
	return v.State == volume.StateReady || (!top && v.State == volume.StateDestroying)
}

// Servable says whether v's own layer may be streamed to a peer: all of its
// data is here. A destroyed volume is served only while others are built
// on it (a puller of those needs it).
func (v Volume) Servable(h Holders) bool {
	return v.State == volume.StateReady || (v.State == volume.StateDestroying && len(h.Children) > 0)
}

// Advertised is the state others (peers, the controller) are told: a
// filling volume is, for them, still being made.
func (v Volume) Advertised() volume.State {
	if v.State == volume.StateFilling {
		return volume.StateCreating
	}
	return v.State
}

// reapable says whether v's data may be freed now.
func (v Volume) reapable(h Holders) bool { return v.State == volume.StateDestroying && h.Empty() }

// evictable says whether eviction may take v at now: all here (or failed),
// unpinned, and held by nothing.
func (v Volume) evictable(h Holders, now time.Time) bool {
	return (v.State == volume.StateReady || v.State == volume.StateFailed) && !v.Pin.Active(now) && h.Empty()
}

// expired says whether v's TTL ran out at now with no pin protecting it.
func (v Volume) expired(now time.Time) bool {
	return v.TTL > 0 && v.State == volume.StateReady && !v.Pin.Active(now) && now.Sub(v.LastUsed) > v.TTL
}

// expiresAt is when v's TTL runs out unless it is used again: its last use
// plus its TTL, or the end of its pin if that is later. A volume without a
// TTL, not ready, or pinned for good never does.
func (v Volume) expiresAt() (time.Time, bool) {
	if v.TTL <= 0 || v.State != volume.StateReady || (v.Pin.Pinned && v.Pin.Until.IsZero()) {
		return time.Time{}, false
	}
	at := v.LastUsed.Add(v.TTL)
	if v.Pin.Pinned && v.Pin.Until.After(at) {
		at = v.Pin.Until
	}
	return at, true
}

// recovered says what a restarted plugin does with v, given the step
// volumes recorded: keep it, drop its reservation (its owner is gone and
// it was never visible), or fail it (its filler died with the process, so
// its data can no longer be completed as it was promised).
func (v Volume) recovered(liveViews map[string]bool) recovery {
	switch v.State {
	case volume.StateCreating:
		if v.Lease.Kind == LeaseView && liveViews[v.Lease.ID] {
			return recoveryKeep
		}
		return recoveryDrop // a pull died with its process; an unknown owner cannot finish
	case volume.StateFilling:
		return recoveryFail
	}
	return recoveryKeep
}

type recovery int

const (
	recoveryKeep recovery = iota
	recoveryDrop
	recoveryFail
)

// HoldKind names a hold that lives in the running plugin's memory only: it
// ends with the process, so it is never recorded.
type HoldKind string

const (
	// HoldStream: a layer being streamed to a peer.
	HoldStream HoldKind = "stream"
	// HoldFill: a filler writing the volume's data.
	HoldFill HoldKind = "fill"
)

// Holders are what keep a volume's data: step volumes whose chain it is in,
// the container runtime's snapshots that run a step image on it, and
// volumes whose layer is a diff over it (recorded), and the running
// plugin's streams and fillers (live).
type Holders struct {
	Views    []string     `json:"views,omitempty"`
	Images   []string     `json:"images,omitempty"`
	Children []volume.Ref `json:"children,omitempty"`
	Streams  int          `json:"streams,omitempty"`
	Fillers  int          `json:"fillers,omitempty"`
}

// Empty says nothing holds the data.
func (h Holders) Empty() bool {
	return len(h.Views) == 0 && len(h.Images) == 0 && len(h.Children) == 0 && h.Streams == 0 && h.Fillers == 0
}

// liveHolds counts the live holds by volume and kind.
type liveHolds struct {
	mu    sync.Mutex
	count map[volume.Ref]map[HoldKind]int
}

func (l *liveHolds) hold(r volume.Ref, kind HoldKind) (release func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.count == nil {
		l.count = map[volume.Ref]map[HoldKind]int{}
	}
	if l.count[r] == nil {
		l.count[r] = map[HoldKind]int{}
	}
	l.count[r][kind]++
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.count[r][kind]--; l.count[r][kind] == 0 {
				delete(l.count[r], kind)
			}
			if len(l.count[r]) == 0 {
				delete(l.count, r)
			}
		})
	}
}

// any says whether anything of this process holds r.
func (l *liveHolds) any(r volume.Ref) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.count[r]) > 0
}

// refs lists the volumes held now.
func (l *liveHolds) refs() []volume.Ref {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Collect(maps.Keys(l.count))
}

// add puts r's live holds into h.
func (l *liveHolds) add(r volume.Ref, h *Holders) {
	l.mu.Lock()
	defer l.mu.Unlock()
	h.Streams, h.Fillers = l.count[r][HoldStream], l.count[r][HoldFill]
}

// Hold keeps r's data (neither freed nor pruned) until release, for work of
// this process. Take it before checking that the volume may be used: the
// reaper checks holds after states, so a volume found usable under a hold
// cannot be freed under it.
func (s *Store) Hold(r volume.Ref, kind HoldKind) (release func()) { return s.live.hold(r, kind) }
