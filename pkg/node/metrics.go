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
	// indexCopies are whole indexes made plain layers (indexes.go).
	indexCopies *prometheus.CounterVec
	evictions   *prometheus.CounterVec
	destroys    *prometheus.CounterVec
	reclaimed   prometheus.Counter
	rotten      prometheus.Counter
	overHigh    prometheus.Gauge
	disk        *prometheus.GaugeVec
	info        prometheus.Gauge
	node        *nodeCollector
	// Cache volumes' (caches.go).
	cacheForks      *prometheus.CounterVec
	cachePromotions prometheus.Counter
	cacheDiscards   *prometheus.CounterVec
	cacheRefusals   *prometheus.CounterVec
	// cacheLookupErrors counts forks that could not ask the fleet.
	cacheLookupErrors prometheus.Counter
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
		indexCopies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_index_copies_total",
			Help: "Volumes pulled as indexes, ready as their index mounts, made plain layers once no step mounted them, by result.",
		}, []string{"result"}),
		evictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_evictions_total", Help: "Cached volumes the node destroyed on its own, by reason (watermark, ttl, failed).",
		}, []string{"reason"}),
		destroys: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_destroys_total", Help: "Destroyed volumes whose data was freed, by result.",
		}, []string{"result"}),
		reclaimed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cowvol_reclaimed_bytes_total", Help: "Bytes freed by destroying cached volumes (as measured at capture).",
		}),
		rotten: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cowvol_rotten_volumes_total",
			Help: "Cached volumes whose bytes on this node's disk were found, as a peer was sent them, not to be what they were captured with: each is marked failed and served no more.",
		}),
		overHigh: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "cowvol_over_high_watermark", Help: "1 while the state dir is over its high watermark and captures are refused.",
		}),
		disk: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "cowvol_state_dir", Help: "The state dir's filesystem, as last measured: bytes and inodes, used and free.",
		}, []string{"resource", "kind"}),
		info: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "cowvol_node_info",
			Help:        "The node plugin's COW backend and how it enforces size limits (always 1).",
			ConstLabels: prometheus.Labels{"backend": backend, "size_limits": limits},
		}),
		cacheForks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_cache_forks_total",
			Help: "Cache volumes published, by the version they forked: local (the key's current version here), pulled (the fleet's newest, newer than this node's, pulled from the node that made it) or none (the key has none: an empty volume).",
		}, []string{"found"}),
		cachePromotions: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cowvol_cache_promotions_total", Help: "Cache volumes whose step's view became their key's current version.",
		}),
		cacheDiscards: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_cache_discards_total",
			Help: "Cache volumes whose step's view was discarded and the key kept its version, by reason (failed, not-started, result-unknown, reboot, input-incomplete).",
		}, []string{"reason"}),
		cacheRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_cache_promotions_refused_total",
			Help: "Cache versions captured but not made current, by reason (over-cap: over the volume's cacheMaxSize; cleared: the key was cleared while the step ran).",
		}, []string{"reason"}),
		cacheLookupErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cowvol_cache_lookup_errors_total",
			Help: "Cache volumes published without the fleet's word on their key's newest version (the controller did not answer in time): each forked this node's own.",
		}),
		node: &nodeCollector{
			engine:     e,
			volumes:    prometheus.NewDesc("cowvol_cached_volumes", "Cached volumes on this node, by state.", []string{"state"}, nil),
			bytes:      prometheus.NewDesc("cowvol_cached_bytes", "Bytes held by ready cached volumes' own layers.", nil, nil),
			view:       prometheus.NewDesc("cowvol_step_volumes", "Step volumes published on this node, by state.", []string{"state"}, nil),
			quarantd:   prometheus.NewDesc("cowvol_quarantined_step_volumes", "Step volumes recovery could not settle, retried in the background.", nil, nil),
			cacheBytes: prometheus.NewDesc("cowvol_cache_bytes", "Bytes held by ready cache versions' own layers, every key's.", nil, nil),
			cacheKeys:  prometheus.NewDesc("cowvol_cache_keys", "Cache keys with a current version on this node.", nil, nil),
		},
	}
	m.info.Set(1)
	return m
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.captures, m.flattens, m.indexCopies, m.evictions, m.destroys, m.reclaimed, m.rotten, m.overHigh, m.disk, m.info, m.node,
		m.cacheForks, m.cachePromotions, m.cacheDiscards, m.cacheRefusals, m.cacheLookupErrors}
}

func (m *metrics) setDisk(d diskFill) {
	m.disk.WithLabelValues("bytes", "used").Set(float64(d.usedBytes))
	m.disk.WithLabelValues("bytes", "free").Set(float64(d.freeBytes))
	m.disk.WithLabelValues("inodes", "used").Set(float64(d.usedInodes))
	m.disk.WithLabelValues("inodes", "free").Set(float64(d.freeInodes))
}

// nodeCollector reports the node cache's contents and the engine's state at
// scrape time.
type nodeCollector struct {
	engine                         *Engine
	volumes, bytes, view, quarantd *prometheus.Desc
	cacheBytes, cacheKeys          *prometheus.Desc
}

func (c *nodeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.volumes
	ch <- c.bytes
	ch <- c.view
	ch <- c.quarantd
	ch <- c.cacheBytes
	ch <- c.cacheKeys
}

func (c *nodeCollector) Collect(ch chan<- prometheus.Metric) {
	byState := map[volume.State]int{}
	var ready, cached int64
	for _, v := range c.engine.store.List() {
		byState[v.State]++
		if v.State == volume.StateReady && v.SizeBytes > 0 {
			ready += v.SizeBytes
			if v.Properties[volume.PropertyCacheKey] != "" {
				cached += v.SizeBytes
			}
		}
	}
	for _, st := range []volume.State{volume.StateCreating, volume.StateFilling, volume.StateReady, volume.StateFailed, volume.StateDestroying} {
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
	ch <- prometheus.MustNewConstMetric(c.cacheBytes, prometheus.GaugeValue, float64(cached))
	keys := 0
	for _, k := range c.engine.store.Caches("") {
		if k.Current != "" {
			keys++
		}
	}
	ch <- prometheus.MustNewConstMetric(c.cacheKeys, prometheus.GaugeValue, float64(keys))
}
