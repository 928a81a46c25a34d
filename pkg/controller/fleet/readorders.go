package fleet

import (
	"container/list"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/timestamppb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// ReadOrders keeps the read orders nodes share, so that a node's first
// lazy pull under a read profile reads in the order another node's steps
// did: the newest per (namespace, name), in memory only (a new leader
// learns them again as nodes record them), the least recently used going
// first once they hold more than their bytes' bound.
type ReadOrders struct {
	mu    sync.Mutex
	limit int64
	bytes int64
	// lru holds *sharedOrder, most recently used first.
	lru   *list.List
	byKey map[readOrderKey]*list.Element
	descs readOrderDescs
}

type readOrderKey struct{ namespace, name string }

type sharedOrder struct {
	key      readOrderKey
	files    []string
	recorded time.Time
	nodeID   string
	bytes    int64
}

// NewReadOrders keeps read orders within limit bytes of names.
func NewReadOrders(limit int64) *ReadOrders {
	return &ReadOrders{limit: limit, lru: list.New(), byKey: map[readOrderKey]*list.Element{}, descs: newReadOrderDescs()}
}

// maxFilePath bounds one name in an order (PATH_MAX).
const maxFilePath = 4096

// parseReadOrder checks a shared order: its namespace and profile valid,
// its names within the bounds a node records, each a path inside a volume.
func parseReadOrder(o *controllerv1.ReadOrder) (*sharedOrder, error) {
	if err := volume.ValidateNamespace(o.GetNamespace()); err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	if err := volume.ValidateReadProfile(o.GetName()); err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	files := o.GetFiles()
	if len(files) == 0 || len(files) > volume.MaxReadOrderFiles {
		return nil, fmt.Errorf("a read order of %d files: want 1 to %d: %w", len(files), volume.MaxReadOrderFiles, ErrInvalid)
	}
	var size int64
	for _, f := range files {
		if f == "" || len(f) > maxFilePath || strings.IndexByte(f, 0) >= 0 {
			return nil, fmt.Errorf("a read order names %s: want a path of 1 to %d bytes: %w", volume.Quote(f), maxFilePath, ErrInvalid)
		}
		size += int64(len(f)) + 1
	}
	if size > volume.MaxReadOrderBytes+volume.MaxReadOrderFiles {
		return nil, fmt.Errorf("a read order of %d bytes of names: at most %d: %w", size, volume.MaxReadOrderBytes, ErrInvalid)
	}
	return &sharedOrder{key: readOrderKey{o.GetNamespace(), o.GetName()}, files: files,
		recorded: o.GetRecorded().AsTime(), nodeID: o.GetNodeId(), bytes: size}, nil
}

// Share keeps o unless a newer order is kept under its name.
func (r *ReadOrders) Share(o *controllerv1.ReadOrder) error {
	so, err := parseReadOrder(o)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if el, ok := r.byKey[so.key]; ok {
		old := el.Value.(*sharedOrder)
		if old.recorded.After(so.recorded) {
			return nil
		}
		r.remove(el)
	}
	r.byKey[so.key] = r.lru.PushFront(so)
	r.bytes += so.bytes
	for r.bytes > r.limit && r.lru.Len() > 0 {
		r.remove(r.lru.Back())
	}
	return nil
}

func (r *ReadOrders) remove(el *list.Element) {
	so := el.Value.(*sharedOrder)
	r.lru.Remove(el)
	delete(r.byKey, so.key)
	r.bytes -= so.bytes
}

// Get is the order kept for namespace under name, if any.
func (r *ReadOrders) Get(namespace, name string) (*controllerv1.ReadOrder, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	el, ok := r.byKey[readOrderKey{namespace, name}]
	if !ok {
		return nil, false
	}
	r.lru.MoveToFront(el)
	so := el.Value.(*sharedOrder)
	return &controllerv1.ReadOrder{Namespace: namespace, Name: name, Files: so.files,
		Recorded: timestamppb.New(so.recorded), NodeId: so.nodeID}, true
}

// Held is how many orders are kept, and their bytes of names.
func (r *ReadOrders) Held() (orders int, bytes int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lru.Len(), r.bytes
}

// readOrderDescs describe the kept orders' metrics, measured at scrape
// time.
type readOrderDescs struct{ orders, bytes *prometheus.Desc }

func newReadOrderDescs() readOrderDescs {
	return readOrderDescs{
		orders: prometheus.NewDesc("cowvol_controller_read_orders", "Read orders the controller keeps for nodes' first lazy pulls.", nil, nil),
		bytes:  prometheus.NewDesc("cowvol_controller_read_order_bytes", "Bytes of file names the kept read orders take (bounded by --read-orders-memory).", nil, nil),
	}
}

func (r *ReadOrders) Describe(ch chan<- *prometheus.Desc) {
	ch <- r.descs.orders
	ch <- r.descs.bytes
}

func (r *ReadOrders) Collect(ch chan<- prometheus.Metric) {
	n, bytes := r.Held()
	ch <- prometheus.MustNewConstMetric(r.descs.orders, prometheus.GaugeValue, float64(n))
	ch <- prometheus.MustNewConstMetric(r.descs.bytes, prometheus.GaugeValue, float64(bytes))
}
