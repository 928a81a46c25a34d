// Package owners collects the cached volumes whose owner is gone. A volume
// captured with owner: controller records the object that controlled its
// step's pod (an Argo Workflow, a Tekton TaskRun, a Job); once the API
// server says that object no longer exists, or exists under another UID
// (deleted and made again), the controller destroys the volume on every
// node, as Kubernetes' garbage collector deletes an object's dependents.
//
// It reads the fleet's view and asks the API server through Objects; it
// never touches a node's store or the view's internals, and it destroys
// nothing on an answer that is not a definite "gone".
package owners

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// Objects answers which owners still exist.
type Objects interface {
	// Live lists the UIDs of every object of a kind that exists now (a
	// read as recent as the API server's store). An error says it could
	// not tell (a kind the API server does not serve, no permission, no
	// answer).
	Live(ctx context.Context, k Kind) (map[string]bool, error)
}

// Kind is an owner's API group and kind.
type Kind struct{ Group, Kind string }

// Events tell, where an operator looks (the namespace's Events), that an
// owner's volumes were destroyed.
type Events interface {
	OwnerGone(namespace string, o volume.Owner, destroyed []volume.Ref)
}

// View is what the collector needs of the fleet's view.
type View interface {
	Owned(after string, scan int, now time.Time) ([]fleet.Owned, string)
	DestroyIfOwned(refs []volume.Ref, ownerUID string) []fleet.VolumeNodes
}

// Collector destroys the volumes whose owner is gone.
type Collector struct {
	view    View
	objects Objects
	events  Events
	metrics *Metrics
	// scan is how many of the view's volumes a sweep walks under its
	// lock at once.
	scan int
}

// New makes a collector over view, asking objects and telling events.
func New(view View, objects Objects, events Events, metrics *Metrics) *Collector {
	return &Collector{view: view, objects: objects, events: events, metrics: metrics, scan: 10000}
}

// ownedBy is an owner, in the namespace of the volumes it owns (its pod's).
type ownedBy struct {
	namespace string
	owner     volume.Owner
}

// Sweep checks the owner of every owned volume the live nodes hold, with
// one listing of each kind of owner, and destroys the volumes of those that
// are gone. A volume still being captured, or pinned, is left for a later
// sweep (a pin keeps a volume whatever happens to its owner, as it does
// past its TTL). It says how many volumes it destroyed.
//
// The view is read before the owners are listed: an owner of a volume the
// view holds existed before the listing began (its pod's publish read it),
// so one missing from the listing is gone, not yet to come.
func (c *Collector) Sweep(ctx context.Context) (int, error) {
	owned := map[Kind]map[ownedBy][]volume.Ref{}
	for after := ""; ; {
		page, next := c.view.Owned(after, c.scan, time.Now())
		for _, vol := range page {
			if vol.Pinned || vol.State == volume.StateCreating {
				continue
			}
			k := Kind{Group: vol.Owner.Group, Kind: vol.Owner.Kind}
			if owned[k] == nil {
				owned[k] = map[ownedBy][]volume.Ref{}
			}
			by := ownedBy{namespace: vol.Ref.Namespace, owner: vol.Owner}
			owned[k][by] = append(owned[k][by], vol.Ref)
		}
		if next == "" {
			break
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		after = next
	}
	destroyed := 0
	for k, owners := range owned {
		live, err := c.objects.Live(ctx, k)
		if err != nil {
			if ctx.Err() != nil {
				return destroyed, ctx.Err()
			}
			c.metrics.checked("unknown", len(owners))
			klog.V(2).InfoS("Cannot list the owners of cached volumes: keeping the volumes", "group", k.Group, "kind", k.Kind,
				"owners", len(owners), "err", err)
			continue
		}
		for by, refs := range owners {
			o := by.owner
			if live[o.UID] {
				c.metrics.checked("present", 1)
				continue
			}
			c.metrics.checked("gone", 1)
			c.view.DestroyIfOwned(refs, o.UID)
			destroyed += len(refs)
			c.metrics.destroyed.Add(float64(len(refs)))
			klog.InfoS("The owner of cached volumes is gone: destroying them on every node", "namespace", by.namespace,
				"owner", o.String(), "uid", o.UID, "volumes", refs)
			c.events.OwnerGone(by.namespace, o, refs)
		}
	}
	return destroyed, nil
}

// Run sweeps every interval until ctx ends.
func (c *Collector) Run(ctx context.Context, every time.Duration) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if _, err := c.Sweep(ctx); err != nil && !errors.Is(err, context.Canceled) {
			klog.ErrorS(err, "Collecting the cached volumes whose owner is gone")
		}
	}
}

// Metrics count the owners checked and the volumes destroyed.
type Metrics struct {
	checks    *prometheus.CounterVec
	destroyed prometheus.Counter
}

// NewMetrics makes the collector's metrics.
func NewMetrics() *Metrics {
	return &Metrics{
		checks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_controller_owner_checks_total",
			Help: "Owners of cached volumes (owner: controller) the controller asked the API server about, by result: present, gone (their volumes were destroyed), unknown (the API server could not tell: the volumes are kept).",
		}, []string{"result"}),
		destroyed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cowvol_controller_owner_volumes_destroyed_total",
			Help: "Cached volumes the controller destroyed because their owner was gone.",
		}),
	}
}

// checked counts n owners checked with result.
func (m *Metrics) checked(result string, n int) { m.checks.WithLabelValues(result).Add(float64(n)) }

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.checks, m.destroyed}
}
