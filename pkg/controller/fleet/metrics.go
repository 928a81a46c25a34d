package fleet

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/concourse/cowvol/pkg/volume"
)

// Metrics are the controller's view in numbers, computed at scrape time,
// and what schedulers asked of it.
type Metrics struct {
	view                  *View
	nodes, volumes, bytes *prometheus.Desc
	reportAge             *prometheus.Desc
	lackingCopies, spent  *prometheus.Desc
	Commands              *prometheus.CounterVec
}

// NewMetrics describes the view's metrics; register them with Collectors.
func NewMetrics(v *View) *Metrics {
	return &Metrics{
		view:      v,
		nodes:     prometheus.NewDesc("cowvol_controller_nodes", "Nodes the controller knows, by state.", []string{"state"}, nil),
		volumes:   prometheus.NewDesc("cowvol_controller_volumes", "Cached volumes live nodes report, by state (counted once per node holding them).", []string{"state"}, nil),
		bytes:     prometheus.NewDesc("cowvol_controller_volume_bytes", "Bytes of the cached volumes live nodes report.", nil, nil),
		reportAge: prometheus.NewDesc("cowvol_controller_report_age_seconds", "Time since each node's last report.", []string{"node"}, nil),
		lackingCopies: prometheus.NewDesc("cowvol_controller_volumes_lacking_copies",
			"Volumes held ready on fewer nodes than their copies were granted (being copied, or fitting on no node: looked at again after a back-off).", nil, nil),
		spent: prometheus.NewDesc("cowvol_controller_copy_budget_spent_namespaces",
			"Namespaces whose budget of extra copies (--namespace-copies) is spent: their captures may ask for no more than one node.", nil, nil),
		Commands: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_controller_requests_total", Help: "What schedulers asked of the nodes through the controller, by kind (destroy, pin, unpin, land, retire, resume).",
		}, []string{"kind"}),
	}
}

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector { return []prometheus.Collector{m, m.Commands} }

func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- m.nodes
	ch <- m.volumes
	ch <- m.bytes
	ch <- m.reportAge
	ch <- m.lackingCopies
	ch <- m.spent
}

func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	v := m.view
	v.mu.RLock()
	defer v.mu.RUnlock()
	byState := map[string]int{NodeRunning: 0, NodeLanding: 0, NodeLanded: 0, NodeRetiring: 0, NodeStalled: 0}
	vols := map[string]int{}
	var bytes int64
	for _, n := range v.nodes {
		byState[v.state(n, now)]++
		ch <- prometheus.MustNewConstMetric(m.reportAge, prometheus.GaugeValue, now.Sub(n.lastReport).Seconds(), n.id)
		if !v.live(n, now) {
			continue
		}
		for st, c := range n.states {
			vols[stateCode(st).String()] += int(c)
		}
		bytes += n.bytes
	}
	for st, c := range byState {
		ch <- prometheus.MustNewConstMetric(m.nodes, prometheus.GaugeValue, float64(c), st)
	}
	for _, st := range []volume.State{volume.StateCreating, volume.StateReady, volume.StateFailed} {
		ch <- prometheus.MustNewConstMetric(m.volumes, prometheus.GaugeValue, float64(vols[string(st)]), string(st))
	}
	ch <- prometheus.MustNewConstMetric(m.bytes, prometheus.GaugeValue, float64(bytes))
	ch <- prometheus.MustNewConstMetric(m.lackingCopies, prometheus.GaugeValue, float64(len(v.lacking)))
	spent := 0
	for _, used := range v.copyUse {
		if used >= v.copyLimits.PerNamespace {
			spent++
		}
	}
	ch <- prometheus.MustNewConstMetric(m.spent, prometheus.GaugeValue, float64(spent))
}
