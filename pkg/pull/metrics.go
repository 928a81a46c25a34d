package pull

import "github.com/prometheus/client_golang/prometheus"

// Metrics count the node's pulls and fills; the node registers them
// whether or not it pulls, so that a dashboard finds them at zero.
type Metrics struct {
	pulls     *prometheus.CounterVec
	pulled    prometheus.Counter
	fills     *prometheus.CounterVec
	fillBytes prometheus.Counter
	orders    *prometheus.CounterVec
	swarm     *prometheus.CounterVec
	corrupt   *prometheus.CounterVec
	vouches   *prometheus.CounterVec
}

// NewMetrics makes the pulls' metrics.
func NewMetrics() *Metrics {
	return &Metrics{
		pulls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_pulls_total", Help: "Pulls of a source this node lacked from peers, by result (ok, failed, not_found).",
		}, []string{"result"}),
		pulled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cowvol_pulled_layers_total", Help: "Layers pulled from peers into the node cache.",
		}),
		fills: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_lazy_fills_total", Help: "Lazily pulled layers whose data finished arriving, by result (ok, failed).",
		}, []string{"result"}),
		fillBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cowvol_lazy_fill_bytes_total", Help: "File data fetched from peers into lazily pulled layers.",
		}),
		orders: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_lazy_read_orders_total",
			Help: "Read profiles lazy pulls named, by where their read order came from: this node's record (local), the order another node shared through the controller (fleet), or none.",
		}, []string{"source"}),
		swarm: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_swarm_pulls_total",
			Help: "Layer streams (whole layers, stub trees, lazy layers' data) pulled as a member of their swarm, by where they came from: the holder (the swarm's first member), a relay (the member before), or relay_failed (the relay failed; pulled again from the holder).",
		}, []string{"from"}),
		corrupt: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_pull_corrupt_total",
			Help: "Files and layers peers sent that were not what their volume was captured with (their sums, or the wire's checksum of a file fetched alone), caught before any reader saw them, by where they came from: the stream of a lazy layer (stream, from its holder or a relay), a file fetched alone from a holder (holder), or a layer or stub tree pulled whole (layer: the pull moves to the next holder).",
		}, []string{"from"}),
		vouches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_pull_vouch_checks_total",
			Help: "Layers pulled whole or as stub trees, by how their files' table compared with the digests the node that made the volume vouches for it with: matched, mismatched (the pull moves to the next holder), or unknown (none known yet: the capture is seconds old, its maker runs an older plugin, or static --peers).",
		}, []string{"result"}),
	}
}

func (m *Metrics) swarmPull(from string) { m.swarm.WithLabelValues(from).Inc() }

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.pulls, m.pulled, m.fills, m.fillBytes, m.orders, m.swarm, m.corrupt, m.vouches}
}
