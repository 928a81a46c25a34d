package locality

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics count the webhook's reviews and what they cost.
type Metrics struct {
	reviews  *prometheus.CounterVec
	duration prometheus.Histogram
}

// NewMetrics makes the webhook's metrics.
func NewMetrics() *Metrics {
	return &Metrics{
		reviews: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_controller_locality_reviews_total",
			Help: "Pods the locality webhook reviewed, by result: preferred (given node preferences), no_inputs (names no cowvol source, cache or image), bound (has a node of its own), no_holders (no live node holds an input or a version of a cache it names), not_ready (a follower, or a view still settling), ignored (not a pod's create, or unreadable), bad_request.",
		}, []string{"result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "cowvol_controller_locality_review_duration_seconds",
			Help:    "Time the locality webhook took to answer a review, from its request to its answer written.",
			Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1},
		}),
	}
}

func (m *Metrics) observe(result string, start time.Time) {
	if m == nil {
		return
	}
	m.reviews.WithLabelValues(result).Inc()
	m.duration.Observe(time.Since(start).Seconds())
}

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.reviews, m.duration}
}
