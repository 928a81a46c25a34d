package pull

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// swarm_member.go: the swarm's member half (how a pull joins a swarm,
// relays its copy to the next member, and checks what a relay sent against
// the holder's digest). The holder's half, the swarm registry and the relay
// server, is in pkg/streamer/swarm_holder.go.

// RelayGrace is how long this node keeps its copy of a stream it pulled as
// a swarm's member for the member after it, which has not asked for it yet
// (it joined just before this node's pull ended).
const RelayGrace = time.Minute

// DefaultSwarmMinBytes is the smallest layer whose streams a pull joins a
// swarm for: below it, the holder's link is not what a pull waits for.
const DefaultSwarmMinBytes = 64 << 20

// relays are this node's copies of the streams it is pulling as swarm
// members, by the token it joined with, for the member after it.
type relays struct {
	mu      sync.Mutex
	byToken map[string]*relayed
}

// relayed is one copy, and whom it may be served to: what the node pulled
// it for (a namespace's pod using top, whose chain holds layer).
type relayed struct {
	spool      *streamer.Spool
	layer, top streamer.Layer
}

// Relay answers a peer's ask for this node's copy of the stream of r's
// layer, joined under token, for a pod of namespace that uses it via via:
// only a volume namespace may read, or one in the chain of via, which it
// may read, as a holder answers (streamer.ErrNotHeld alike for none and
// for one it may not read).
func (pl *Puller) Relay(namespace string, r, via volume.Ref, token string) (*streamer.Spool, error) {
	pl.relays.mu.Lock()
	rel := pl.relays.byToken[token]
	pl.relays.mu.Unlock()
	if rel == nil || rel.layer.Ref != r {
		return nil, streamer.ErrNotHeld
	}
	if !rel.layer.ReadableBy(namespace) && (via != rel.top.Ref || !rel.top.ReadableBy(namespace)) {
		return nil, streamer.ErrNotHeld
	}
	return rel.spool, nil
}

// errRelayFailed: the swarm's member before this node did not deliver.
var errRelayFailed = errors.New("pulling from the swarm's member before this node failed")

// swarmMember is this node's part in the swarm of a stream it pulls.
type swarmMember struct {
	swarm string
	// upNode is the node serving at upAddr, as it proved itself to the
	// holder ("" where peers prove no node).
	upNode, upAddr, upToken string // empty: the holder is the source
	spool                   *streamer.Spool
}

// swarmPull is one attempt at a stream: from the client given, as sw says;
// it hands what arrived to done (before it commits anything), which checks
// it where it came from a relay and ends the copy relayed on.
type swarmPull func(from *streamer.Client, sw streamer.Swarmed, done func(streamer.Summary) error) error

// inSwarm pulls stream s of layer l (of top's chain) with run: in the
// stream's swarm where the node joins one (it serves peers, and the layer
// is at least SwarmMinBytes), from the member before it, relaying what
// arrives to the member after; else, or if that fails and retry says so,
// from holder. A pull that fails once ctx is done (its fill ended, or the
// plugin stops) is not the relay's failure: it is neither counted as one
// nor retried.
func (pl *Puller) inSwarm(ctx context.Context, holder *streamer.Client, s streamer.LayerStream, top, l streamer.Layer, retry bool, run swarmPull) error {
	m := pl.joinSwarm(holder, s, top, l)
	if m.spool != nil {
		defer m.spool.Retire(RelayGrace)
	}
	if m.upAddr != "" {
		err := pl.pullFromRelay(ctx, holder, s, m, run)
		switch {
		case err == nil:
			pl.metrics.swarmPull("relay")
			return nil
		case local(err) || errors.Is(err, cache.ErrExists) || ctx.Err() != nil:
			return err // the holder would not do better
		}
		pl.metrics.swarmPull("relay_failed")
		// The member after this one was relayed a stream that stops
		// here: it goes to the holder too.
		m.spool.Fail(err)
		if !retry {
			return fmt.Errorf("%w: %s: %w", errRelayFailed, m.upAddr, err)
		}
		klog.ErrorS(err, "Pulling a layer's stream from the swarm's member before this node failed; pulling it from its holder",
			"volume", l.Ref, "relay", m.upAddr)
		m = swarmMember{}
	} else if m.spool != nil {
		pl.metrics.swarmPull("holder")
	}
	return run(holder, streamer.Swarmed{Swarm: m.swarm, Spool: m.spool}, func(sum streamer.Summary) error {
		if m.spool != nil {
			m.spool.End(sum)
		}
		return nil
	})
}

// swarms says whether this node pulls l's streams as a member of their
// swarms: it serves peers, and l is at least SwarmMinBytes.
func (pl *Puller) swarms(l streamer.Layer) bool {
	return pl.cfg.RelayAddress != "" && pl.cfg.SwarmMinBytes > 0 && l.SizeBytes >= pl.cfg.SwarmMinBytes
}

// joinSwarm makes this node a member of the swarm of stream s at the
// layer's holder, if the layer is large enough and the node serves peers:
// a copy of the stream to relay, and the source to pull from. The zero
// member (no swarm) pulls from the holder as before.
func (pl *Puller) joinSwarm(holder *streamer.Client, s streamer.LayerStream, top, l streamer.Layer) swarmMember {
	if !pl.swarms(l) {
		return swarmMember{}
	}
	token := streamer.NewRelayToken()
	spool, err := streamer.NewSpool(pl.store.StagingDir(), s.Encoding, func() {
		pl.relays.mu.Lock()
		delete(pl.relays.byToken, token)
		pl.relays.mu.Unlock()
	})
	if err != nil {
		klog.ErrorS(err, "Pulling a layer's stream outside its swarm: no room to relay it", "volume", l.Ref)
		return swarmMember{}
	}
	pl.relays.mu.Lock()
	pl.relays.byToken[token] = &relayed{spool: spool, layer: l, top: top}
	pl.relays.mu.Unlock()
	ctx, cancel := context.WithTimeout(pl.ctx, pl.cfg.Wait)
	defer cancel()
	up, err := holder.JoinSwarm(ctx, s, pl.cfg.RelayAddress, token)
	if err != nil || up.Swarm == "" {
		if err != nil {
			klog.V(2).InfoS("Pulling a layer's stream outside a swarm: its holder took none", "volume", l.Ref, "err", err)
		}
		spool.Retire(0)
		return swarmMember{}
	}
	return swarmMember{swarm: up.Swarm, upNode: up.Node, upAddr: up.Address, upToken: up.Token, spool: spool}
}

// pullFromRelay runs a pull of stream s from the member before this one,
// and checks what arrived against the holder's own stream.
func (pl *Puller) pullFromRelay(ctx context.Context, holder *streamer.Client, s streamer.LayerStream, m swarmMember, run swarmPull) error {
	client, conn, err := pl.cfg.Dial(m.upNode, m.upAddr)
	if err != nil {
		return err
	}
	defer conn.Close()
	return run(client, streamer.Swarmed{RelayToken: m.upToken, Spool: m.spool}, func(sum streamer.Summary) error {
		// The member before is trusted as far as the holder's digest:
		// the first stream has ended by now (this one came after it),
		// and the wait covers a holder slow to say so.
		ctx, cancel := context.WithTimeout(ctx, pl.cfg.Wait)
		defer cancel()
		want, err := holder.SwarmDigest(ctx, s.Namespace, s.Ref, s.Via, m.swarm)
		if err != nil {
			return fmt.Errorf("asking the holder for the swarm's digest: %w", err)
		}
		if !want.Same(sum) {
			return fmt.Errorf("%w: the holder sent %d bytes (%d entries, %s), the relay %d (%d entries, %s)", streamer.ErrCorrupt,
				want.Bytes, want.Entries, want.Digest, sum.Bytes, sum.Entries, sum.Digest)
		}
		m.spool.End(sum)
		return nil
	})
}

// receiveWhole makes l's layer a ready cached volume from a stream of the
// whole layer, in its swarm where it has one.
func (pl *Puller) receiveWhole(p *pull, holder *streamer.Client, top, l streamer.Layer, want volume.Digests, progress func(int64)) (cache.Volume, error) {
	s := streamer.LayerStream{Namespace: p.key.namespace, Ref: l.Ref, Via: p.key.ref, Encoding: pl.cfg.Encoding, Shape: streamer.SparseTar}
	lim := pl.cfg.Limits
	lim.Tabled = true // the layer's sums kept as they were checked, not read back after
	var vol cache.Volume
	err := pl.inSwarm(pl.ctx, holder, s, top, l, true, func(from *streamer.Client, sw streamer.Swarmed, done func(streamer.Summary) error) (err error) {
		vol, err = Receive(pl.store, pl.kind, l, want, p.id, func(tree, _ string) (streamer.Summary, error) {
			sum, err := from.PullLayer(pl.ctx, s, sw, tree, lim, progress)
			if err == nil {
				err = pl.checkVouched(l, want, sum)
			}
			if err == nil {
				err = done(sum)
			}
			return sum, err
		}, CommitPulled(pl.store, pl.notify, l), SyncBehind)
		return err
	})
	return vol, err
}
