package driver

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/volume"
)

// metrics are the plugin's Prometheus metrics, in a registry of its own so
// that several drivers can live in one test process.
type metrics struct {
	registry *prometheus.Registry
	rpc      *prometheus.HistogramVec
	captures *prometheus.CounterVec
	flattens *prometheus.CounterVec
}

func newMetrics() *metrics {
	m := &metrics{
		registry: prometheus.NewRegistry(),
		rpc: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "cowvol_rpc_duration_seconds",
			Help:    "CSI RPC latency by method and gRPC code.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 12),
		}, []string{"method", "code"}),
		captures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_captures_total", Help: "Step volumes captured into the node cache, by result.",
		}, []string{"result"}),
		flattens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_flattens_total", Help: "Deep layer chains flattened into a root layer, by result.",
		}, []string{"result"}),
	}
	m.registry.MustRegister(m.rpc, m.captures, m.flattens,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// interceptor times and logs every RPC.
func (m *metrics) interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := handler(ctx, req)
	code := status.Code(err)
	m.rpc.WithLabelValues(info.FullMethod, code.String()).Observe(time.Since(start).Seconds())
	if err != nil {
		klog.V(2).InfoS("RPC failed", "method", info.FullMethod, "code", code, "err", err, "duration", time.Since(start))
	} else {
		klog.V(4).InfoS("RPC done", "method", info.FullMethod, "duration", time.Since(start))
	}
	return resp, err
}

// nodeCollector reports the node cache's contents and the node service's
// state at scrape time.
type nodeCollector struct {
	node                           *nodeService
	volumes, bytes, view, quarantd *prometheus.Desc
}

func (m *metrics) watchNode(n *nodeService, backend string) {
	limits := "off"
	if n.limiter != nil {
		limits = n.limiter.Mechanism()
	}
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "cowvol_node_info",
		Help:        "The node plugin's COW backend and how it enforces size limits (always 1).",
		ConstLabels: prometheus.Labels{"backend": backend, "size_limits": limits},
	})
	info.Set(1)
	m.registry.MustRegister(info, &nodeCollector{
		node:     n,
		volumes:  prometheus.NewDesc("cowvol_cached_volumes", "Cached volumes on this node, by state.", []string{"state"}, nil),
		bytes:    prometheus.NewDesc("cowvol_cached_bytes", "Bytes held by ready cached volumes' own layers.", nil, nil),
		view:     prometheus.NewDesc("cowvol_step_volumes", "Step volumes published on this node, by state.", []string{"state"}, nil),
		quarantd: prometheus.NewDesc("cowvol_quarantined_step_volumes", "Step volumes recovery could not settle, retried in the background.", nil, nil),
	})
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
	for _, v := range c.node.store.List() {
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
	for _, v := range c.node.store.ListViews() {
		byView[v.State]++
	}
	for _, st := range []cache.ViewState{cache.ViewPublishing, cache.ViewPublished, cache.ViewCapturing} {
		ch <- prometheus.MustNewConstMetric(c.view, prometheus.GaugeValue, float64(byView[st]), string(st))
	}
	ch <- prometheus.MustNewConstMetric(c.quarantd, prometheus.GaugeValue, float64(c.node.quarantine.size()))
}
