package streamer

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics count what a node's peer server sent and its pulls received.
type Metrics struct {
	layers   *prometheus.CounterVec
	sentWire *prometheus.CounterVec
	joins    *prometheus.CounterVec
	relays   *prometheus.CounterVec
	stubs    *prometheus.CounterVec
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
		joins: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_swarm_joins_total",
			Help: "Pullers that joined a layer's swarm here, its holder, by what they pull from: holder (the first) or relay (the member before).",
		}, []string{"from"}),
		relays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_swarm_relayed_layers_total",
			Help: "Layer streams this node relayed, as it pulled them, to the next member of their swarm, by result (ok, error); their bytes count in cowvol_peer_sent_bytes_total.",
		}, []string{"result"}),
		stubs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_peer_stub_trees_served_total",
			Help: "Stub trees (what lazy and index pulls publish from) streamed to pulling peers, by source: kept (made once, beside the layer) or walked (packed from the layer as asked); and by form: tar (a lazy pull's) or records (an index pull's).",
		}, []string{"source", "form"}),
	}
}

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.layers, m.sentWire, m.joins, m.relays, m.stubs}
}

// result is a served stream's result label.
func result(err error) string {
	if err != nil {
		return "error"
	}
	return "ok"
}

func (m *Metrics) served(enc Encoding, sent int64, err error) {
	if m == nil {
		return
	}
	m.layers.WithLabelValues(string(enc), result(err)).Inc()
	m.sentWire.WithLabelValues(string(enc)).Add(float64(sent))
}

func (m *Metrics) joined(j joined) {
	if m == nil {
		return
	}
	from := "relay"
	if j.up.addr == "" {
		from = "holder"
	}
	m.joins.WithLabelValues(from).Inc()
}

func (m *Metrics) relayed(enc Encoding, sent int64, err error) {
	if m == nil {
		return
	}
	m.relays.WithLabelValues(result(err)).Inc()
	m.sentWire.WithLabelValues(string(enc)).Add(float64(sent))
}

func (m *Metrics) stubTree(kept bool, shape Shape) {
	if m == nil {
		return
	}
	source, form := "walked", "tar"
	if kept {
		source = "kept"
	}
	if shape == StubRecords {
		form = "records"
	}
	m.stubs.WithLabelValues(source, form).Inc()
}
