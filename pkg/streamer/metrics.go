package streamer

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics count what a node's peer server sent and its pulls received.
type Metrics struct {
	layers   *prometheus.CounterVec
	sentWire *prometheus.CounterVec
}

// NewMetrics makes the streamer's metrics.
func NewMetrics() *Metrics {
	return &Metrics{
		layers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_peer_layers_served_total",
			Help: "Layers streamed to pulling peers, by encoding and result.",
		}, []string{"encoding", "result"}),
		sentWire: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_peer_sent_bytes_total",
			Help: "Bytes sent to pulling peers on the wire (after encoding), by encoding.",
		}, []string{"encoding"}),
	}
}

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.layers, m.sentWire}
}

func (m *Metrics) served(enc Encoding, sent int64, err error) {
	if m == nil {
		return
	}
	result := "ok"
	if err != nil {
		result = "error"
	}
	m.layers.WithLabelValues(string(enc), result).Inc()
	m.sentWire.WithLabelValues(string(enc)).Add(float64(sent))
}
