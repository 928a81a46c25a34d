// Package report is the node's half of the report protocol: the reporter
// that keeps the controller's view of this node current (the whole
// inventory, then the changes since the revision the controller
// acknowledged; heartbeats; asking for room before a whole inventory; a
// report too big for one message in parts) and does what the controller
// asks in its answers (destroy, pin, copy). The controller's half is
// pkg/controller (server.go, admission.go, reportwire.go). It reads the
// node engine and calls the controller's Registry; it owns no state but
// what it last sent.
package report

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"
	"k8s.io/klog/v2"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/volume"
)

// A node looks for changes to report every reportEvery, reports at least
// every heartbeatEvery (its heartbeat, which also fetches what schedulers
// asked of it), and sends its whole inventory about every resyncEvery as a
// safety net (see resyncAfter).
const (
	reportEvery    = time.Second
	heartbeatEvery = 2 * time.Second
	resyncEvery    = 5 * time.Minute
)

// Reporter keeps the controller's view of this node current: the whole
// inventory first, then what changed since the revision the controller
// acknowledged, computed against what it was last sent. A heartbeat with
// no change since then reads no volume: an idle node with 10,000 volumes
// costs next to nothing.
type Reporter struct {
	engine *node.Engine
	client controllerv1.RegistryClient
	nodeID string
	// peerAddress is where peers pull the node's volumes from.
	peerAddress string
	reports     *prometheus.CounterVec
	sent        map[volume.Ref]*controllerv1.VolumeSummary
	acked       uint64
	needFull    bool
	lastSent    time.Time
	// nextFull is when the next safety-net inventory is due.
	nextFull time.Time
	// fullNotBefore is when the controller, busy reading other nodes'
	// inventories, said to ask again for room to send this one; askFirst,
	// that the node asks (with a heartbeat) before it sends it.
	fullNotBefore time.Time
	askFirst      bool
}

// What a report carried, as cowvol_node_reports_total counts them.
const (
	reportFull      = "full"
	reportChanges   = "changes"
	reportHeartbeat = "heartbeat"
	// A whole inventory the controller turned away, busy reading others.
	reportFullDeferred = "full_deferred"
)

// New reports engine's cache as node nodeID to the controller's Registry
// through c, counting in m; peerAddress is where peers pull the node's
// volumes from ("" for nowhere).
func New(engine *node.Engine, c controllerv1.RegistryClient, nodeID, peerAddress string, m *Metrics) *Reporter {
	return &Reporter{engine: engine, client: c, nodeID: nodeID, peerAddress: peerAddress, reports: m.reports}
}

// Metrics count the reports; a node registers them whether or not it
// reports, so that a dashboard finds them at zero.
type Metrics struct{ reports *prometheus.CounterVec }

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector { return []prometheus.Collector{m.reports} }

// NewMetrics makes the reports' metrics.
func NewMetrics() *Metrics {
	return &Metrics{reports: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "cowvol_node_reports_total",
		Help: "Reports the node sent the controller, by what they carried: its whole inventory (full), what changed since the last acknowledged one (changes), or nothing but how full it is (heartbeat, which reads no volume); full_deferred counts whole inventories the controller turned away, busy reading others, and took later.",
	}, []string{"kind"})}
}

// Run reports until ctx ends, every second, retrying what fails.
func (r *Reporter) Run(ctx context.Context) {
	r.needFull = true
	tick := time.NewTicker(reportEvery)
	defer tick.Stop()
	failing := false
	for {
		err := r.round(ctx)
		switch {
		case err != nil && !failing:
			klog.ErrorS(err, "Reporting to the controller; retrying every second")
		case err == nil && failing:
			klog.InfoS("Reporting to the controller again")
		}
		failing = err != nil
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// round sends one report if there is anything to say (or a heartbeat is
// due), and the whole inventory if the controller asks for it.
func (r *Reporter) round(ctx context.Context) error {
	for range 2 {
		// The revision is read before the inventory: a change made
		// between the two is sent now and again (as nothing new) next
		// round, never lost.
		rev := r.engine.Revision()
		now := time.Now()
		kind := reportHeartbeat
		waited := !now.Before(r.fullNotBefore)
		switch {
		case (r.needFull || now.After(r.nextFull)) && waited && !r.askFirst:
			kind = reportFull
		case rev != r.acked && !r.needFull:
			// (A controller that asked for the whole inventory has no
			// base for changes.)
			kind = reportChanges
		case r.askFirst && waited:
			// A heartbeat asks for room for the whole inventory.
		case now.Sub(r.lastSent) < heartbeatEvery-reportEvery/2:
			// (Half a tick short: lastSent is when the last answer came,
			// a little after its tick, and the heartbeat is due on the
			// tick heartbeatEvery after that one, not the next.)
			return nil
		}
		full, err := r.engine.Fullness()
		if err != nil {
			return err
		}
		req := &controllerv1.ReportRequest{NodeId: r.nodeID, StoreId: r.engine.StoreID(), Revision: rev, Full: kind == reportFull,
			BaseRevision: r.acked, OverHighWatermark: full.OverHighWatermark, StepVolumes: int32(full.StepVolumes),
			BytesFree:   max(0, full.BytesTotal*int64(full.Watermarks.High)/100-(full.BytesTotal-full.BytesFree)),
			PeerAddress: r.peerAddress, PullMode: r.engine.PullLabel()}
		// Every field of a volume's summary changes only with the store's
		// revision: with none since the acknowledged one, what was sent
		// is what the node holds.
		inv := r.sent
		if kind != reportHeartbeat {
			if inv, err = r.inventory(); err != nil {
				return err
			}
		}
		switch kind {
		case reportFull:
			for _, s := range inv {
				req.Upserts = append(req.Upserts, s)
			}
		case reportChanges:
			req.Upserts, req.Deletes = diff(r.sent, inv)
		}
		callCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		resp, err := client.SendReport(callCtx, r.client, req)
		cancel()
		if after, busy := client.RetryAfter(err); busy {
			// Flow control, not a failure: heartbeats (and changes, to a
			// controller that has the base) go on meanwhile; changes too
			// big for one message wait for the next round.
			if kind == reportFull {
				r.deferFull(after)
				r.reports.WithLabelValues(reportFullDeferred).Inc()
			}
			klog.V(2).InfoS("The controller deferred this node's report", "kind", kind, "retryAfter", after)
			return nil
		}
		if err != nil {
			return err
		}
		r.reports.WithLabelValues(kind).Inc()
		r.lastSent = time.Now()
		if resp.GetResync() {
			r.needFull = true
			if after := resp.GetFullReportAfter().AsDuration(); after > 0 {
				r.deferFull(after)
				return nil
			}
			r.askFirst = false
			continue // room is kept for it now
		}
		r.askFirst = false
		r.obey(resp)
		r.engine.RefuseCaptures(resp.GetRefuseCaptures())
		r.engine.LimitCopies(int(resp.GetMaxCopies()), resp.GetCopiesSpent())
		r.sent, r.acked = inv, rev
		if kind == reportFull {
			r.needFull, r.nextFull = false, r.lastSent.Add(resyncAfter())
		}
		return nil
	}
	return nil
}

// deferFull waits about after (drawn around it, so that the nodes turned
// away together do not come back together), then asks for room before it
// sends the whole inventory.
func (r *Reporter) deferFull(after time.Duration) {
	r.fullNotBefore, r.askFirst = time.Now().Add(after/2+rand.N(after+1)), true
}

// resyncAfter is how long after a whole inventory the next is due: a
// random time between half and one and a half resyncEvery, drawn anew
// each time. A fleet that sent its inventories at once (a new leader asks
// every node for one) would otherwise send them at once every resyncEvery
// for good: 1,000 nodes' inventories in the same second.
func resyncAfter() time.Duration { return resyncEvery/2 + rand.N(resyncEvery) }

// obey does what schedulers asked of the node through the controller. Each
// is idempotent: the controller repeats it until the node's reports show it
// done.
func (r *Reporter) obey(resp *controllerv1.ReportResponse) {
	eachNamed(resp.GetDestroy(), "destroy", func(ref volume.Ref) error { return r.engine.Destroy(ref) })
	eachNamed(resp.GetCopy(), "copy", r.engine.KeepCopy)
	for _, d := range resp.GetDestroyOwned() {
		ref := volume.Ref{Namespace: d.GetRef().GetNamespace(), Handle: d.GetRef().GetHandle()}
		if err := ref.Validate(); err != nil {
			klog.ErrorS(err, "The controller named a malformed volume", "asked", "destroy if owned")
			continue
		}
		switch did, err := r.engine.DestroyIfOwned(ref, d.GetOwnerUid()); {
		case err != nil:
			klog.ErrorS(err, "Destroying a volume whose owner is gone", "volume", ref)
		case !did:
			klog.V(2).InfoS("The controller's owner sweep named a volume this node does not hold as that owner's: keeping it",
				"volume", ref, "ownerUID", d.GetOwnerUid())
		}
	}
	for _, p := range resp.GetPins() {
		ref := volume.Ref{Namespace: p.GetRef().GetNamespace(), Handle: p.GetRef().GetHandle()}
		var err error
		switch {
		case ref.Validate() != nil:
			err = ref.Validate()
		case p.GetUnpin():
			_, err = r.engine.Unpin(ref)
		case p.GetUntil() != nil:
			_, err = r.engine.Pin(ref, p.GetUntil().AsTime())
		default:
			_, err = r.engine.Pin(ref, time.Time{})
		}
		if err != nil {
			klog.ErrorS(err, "Pinning a volume as the controller asked", "volume", ref, "unpin", p.GetUnpin())
		}
	}
}

// eachNamed does to each volume the controller named what it asked
// (destroy, copy), logging a malformed name or a failure.
func eachNamed(refs []*controllerv1.VolumeRef, asked string, do func(volume.Ref) error) {
	for _, c := range refs {
		ref := volume.Ref{Namespace: c.GetNamespace(), Handle: c.GetHandle()}
		if err := ref.Validate(); err != nil {
			klog.ErrorS(err, "The controller named a malformed volume", "asked", asked)
			continue
		}
		if err := do(ref); err != nil {
			klog.ErrorS(err, "Doing what the controller asked", "asked", asked, "volume", ref)
		}
	}
}

// inventoryPage is how many volumes the reporter reads from the engine at
// a time, as the node API's largest page.
const inventoryPage = 5000

// inventory is every cached volume the node holds (destroyed ones are gone
// as far as anyone else is concerned).
func (r *Reporter) inventory() (map[volume.Ref]*controllerv1.VolumeSummary, error) {
	inv := map[volume.Ref]*controllerv1.VolumeSummary{}
	after := ""
	for {
		vols, next, _, err := r.engine.Volumes(node.Query{After: after, Limit: inventoryPage})
		if err != nil {
			return nil, err
		}
		for _, v := range vols {
			inv[v.Ref()] = &controllerv1.VolumeSummary{
				Ref: controllerv1.RefOf(v.Ref()), State: string(v.Advertised()), SizeBytes: v.SizeBytes,
				Parent: controllerv1.RefOf(v.Parent), Base: controllerv1.RefOf(v.Base), Scope: string(v.Scope), Properties: client.Properties(v.Properties),
				StepVolumes: int32(len(v.Holders.Views)), Pinned: v.Pin.Pinned, Copies: int32(v.Copies),
			}
			if d := v.Vouch; d.Known() {
				s := inv[v.Ref()]
				s.LayerDigest, s.ViewDigest, s.FirstHand = d.Layer[:], d.View[:], d.FirstHand
			}
		}
		if after = next; after == "" {
			return inv, nil
		}
	}
}

// diff is what changed from sent to now.
func diff(sent, now map[volume.Ref]*controllerv1.VolumeSummary) (upserts []*controllerv1.VolumeSummary, deletes []*controllerv1.VolumeRef) {
	for r, s := range now {
		if old, ok := sent[r]; !ok || !proto.Equal(old, s) {
			upserts = append(upserts, s)
		}
	}
	for r := range sent {
		if _, ok := now[r]; !ok {
			deletes = append(deletes, controllerv1.RefOf(r))
		}
	}
	return upserts, deletes
}
