package node

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/volume"
)

// metrics are the engine's Prometheus metrics; the caller registers them.
type metrics struct {
	captures *prometheus.CounterVec
	flattens *prometheus.CounterVec
	info     prometheus.Gauge
	node     *nodeCollector
}

func newMetrics(e *Engine, backend string) *metrics {
	limits := "off"
	if e.limiter != nil {
		limits = e.limiter.Mechanism()
	}
	m := &metrics{
		captures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_captures_total", Help: "Step volumes captured into the node cache, by result.",
		}, []string{"result"}),
		flattens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_flattens_total", Help: "Deep layer chains flattened into a root layer, by result.",
		}, []string{"result"}),
		info: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "cowvol_node_info",
			Help:        "The node plugin's COW backend and how it enforces size limits (always 1).",
			ConstLabels: prometheus.Labels{"backend": backend, "size_limits": limits},
		}),
		node: &nodeCollector{
			engine:   e,
			volumes:  prometheus.NewDesc("cowvol_cached_volumes", "Cached volumes on this node, by state.", []string{"state"}, nil),
			bytes:    prometheus.NewDesc("cowvol_cached_bytes", "Bytes held by ready cached volumes' own layers.", nil, nil),
			view:     prometheus.NewDesc("cowvol_step_volumes", "Step volumes published on this node, by state.", []string{"state"}, nil),
			quarantd: prometheus.NewDesc("cowvol_quarantined_step_volumes", "Step volumes recovery could not settle, retried in the background.", nil, nil),
		},
	}
	m.info.Set(1)
	return m
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.captures, m.flattens, m.info, m.node}
}

// nodeCollector reports the node cache's contents and the engine's state at
// scrape time.
type nodeCollector struct {
	engine                         *Engine
	volumes, bytes, view, quarantd *prometheus.Desc
}

func (c *nodeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.volumes
	ch <- c.bytes
	ch <- c.view
	ch <- c.quarantd
}

func (c *nodeCollector) Collect(ch chan<- prometheus.Metric) {
	byState := map[volume.State]int{}
	var ready int64
	for _, v := range c.engine.store.List() {
		byState[v.State]++
		if v.State == volume.StateReady && v.SizeBytes > 0 {
			ready += v.SizeBytes
		}
	}
	for _, st := range []volume.State{volume.StateCreating, volume.StateReady, volume.StateFailed, volume.StateDestroying} {
		ch <- prometheus.MustNewConstMetric(c.volumes, prometheus.GaugeValue, float64(byState[st]), string(st))
	}
	ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.GaugeValue, float64(ready))
	byView := map[cache.ViewState]int{}
	for _, v := range c.engine.store.ListViews() {
		byView[v.State]++
	}
	for _, st := range []cache.ViewState{cache.ViewPublishing, cache.ViewPublished, cache.ViewCapturing} {
		ch <- prometheus.MustNewConstMetric(c.view, prometheus.GaugeValue, float64(byView[st]), string(st))
	}
	ch <- prometheus.MustNewConstMetric(c.quarantd, prometheus.GaugeValue, float64(c.engine.quarantine.size()))
}
