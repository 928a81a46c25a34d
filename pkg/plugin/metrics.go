package plugin

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// metrics are the plugin's Prometheus metrics, in a registry of its own so
// that several drivers can live in one test process: RPC latency here, and
// whatever the node engine registers.
type metrics struct {
	registry *prometheus.Registry
	rpc      *prometheus.HistogramVec
}

func newMetrics() *metrics {
	m := &metrics{
		registry: prometheus.NewRegistry(),
		rpc: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "cowvol_rpc_duration_seconds",
			Help:    "CSI RPC latency by method and gRPC code.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 12),
		}, []string{"method", "code"}),
	}
	m.registry.MustRegister(m.rpc,
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
