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

// storeCollector reports the node cache's contents at scrape time.
type storeCollector struct {
	store                *cache.Store
	volumes, bytes, view *prometheus.Desc
}

func (m *metrics) watchStore(s *cache.Store) {
	m.registry.MustRegister(&storeCollector{
		store:   s,
		volumes: prometheus.NewDesc("cowvol_cached_volumes", "Cached volumes on this node, by state.", []string{"state"}, nil),
		bytes:   prometheus.NewDesc("cowvol_cached_bytes", "Bytes held by ready cached volumes' own layers.", nil, nil),
		view:    prometheus.NewDesc("cowvol_step_volumes", "Step volumes published on this node, by state.", []string{"state"}, nil),
	})
}

func (c *storeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.volumes
	ch <- c.bytes
	ch <- c.view
}

func (c *storeCollector) Collect(ch chan<- prometheus.Metric) {
	vols, err := c.store.List()
	if err != nil {
		klog.ErrorS(err, "Listing volumes for metrics")
		return
	}
	byState := map[cache.State]int{}
	var ready int64
	for _, v := range vols {
		byState[v.State]++
		if v.State == cache.StateReady && v.SizeBytes > 0 {
			ready += v.SizeBytes
		}
	}
	for _, st := range []cache.State{cache.StateCreating, cache.StateReady, cache.StateFailed, cache.StateDestroying} {
		ch <- prometheus.MustNewConstMetric(c.volumes, prometheus.GaugeValue, float64(byState[st]), string(st))
	}
	ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.GaugeValue, float64(ready))
	views, err := c.store.ListViews()
	if err != nil {
		klog.ErrorS(err, "Listing step volumes for metrics")
		return
	}
	byView := map[cache.ViewState]int{}
	for _, v := range views {
		byView[v.State]++
	}
	for _, st := range []cache.ViewState{cache.ViewPublishing, cache.ViewPublished, cache.ViewCapturing} {
		ch <- prometheus.MustNewConstMetric(c.view, prometheus.GaugeValue, float64(byView[st]), string(st))
	}
}
