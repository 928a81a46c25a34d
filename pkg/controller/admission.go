package controller

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// FullReports admits a bounded number of nodes' whole inventories at once
// and turns the rest away, each told when to try again. A new leader asks
// every node for its inventory at the same moment; gRPC reads a call's
// whole message before any handler or interceptor runs, so without this
// 1,000 nodes' inventories (a few MiB each, decoded) would be in memory at
// once.
//
// Nodes ask before they send: the controller answers a heartbeat that
// must be followed by the whole inventory with room kept for it for
// grantFor (Grant), or with how long to wait before asking again. Take is
// the gate, by what a report is: a whole inventory in one message (at most
// controllerv1.MaxMessage, read before the gate), and any report in parts
// before its first part is read. A report with room kept for its node, or
// with room free, is applied; others are answered ResourceExhausted with a
// RetryInfo (asking first costs a heartbeat).
//
// A slot is held until the report is applied, or for at most holdFor: a
// node that starts a report in parts and then stalls gives its slot back
// after that.
type FullReports struct {
	mu     sync.Mutex
	atOnce int
	// reading counts the inventories being read; granted, the nodes room
	// is kept for, until when.
	reading    int
	granted    map[string]time.Time
	retryAfter time.Duration
	holdFor    time.Duration
	grantFor   time.Duration
	counted    *prometheus.CounterVec
}

// Defaults of FullReports: turned-away nodes try again after about
// fullReportRetry (each draws a time around it); a slot is held at most
// fullReportHold, and kept for a node told to send for fullReportGrant.
const (
	fullReportRetry = 2 * time.Second
	fullReportHold  = 30 * time.Second
	fullReportGrant = 5 * time.Second
)

// NewFullReports admits at most atOnce full reports at once.
func NewFullReports(atOnce int) *FullReports {
	return &FullReports{atOnce: atOnce, granted: map[string]time.Time{},
		retryAfter: fullReportRetry, holdFor: fullReportHold, grantFor: fullReportGrant,
		counted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_controller_full_reports_total",
			Help: "Nodes' whole inventories, by what the controller did: read one (admitted), turned one away unread, with as many being read already (deferred), or told a node that asked for room to ask again later (told_to_wait).",
		}, []string{"result"})}
}

// Collectors are the metrics to register.
func (f *FullReports) Collectors() []prometheus.Collector { return []prometheus.Collector{f.counted} }

// Grant says how long node should wait before it asks again for room to
// send its whole inventory: 0 if it may send it now, room being kept for
// it.
func (f *FullReports) Grant(node string, now time.Time) time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.expire(now)
	if _, ok := f.granted[node]; ok {
		return 0
	}
	if f.reading+len(f.granted) >= f.atOnce {
		f.counted.WithLabelValues("told_to_wait").Inc()
		return f.retryAfter
	}
	f.granted[node] = now.Add(f.grantFor)
	return 0
}

// expire forgets room kept for nodes that did not come. The caller holds
// the lock.
func (f *FullReports) expire(now time.Time) {
	for node, until := range f.granted {
		if now.After(until) {
			delete(f.granted, node)
		}
	}
}

// Take takes room for node's whole inventory (or a report in parts): the
// room kept for it, or room free. It answers Deferred when there is none;
// release gives the room back once the report is applied, or after
// holdFor if that takes longer.
func (f *FullReports) Take(node string, now time.Time) (release func(), err error) {
	if !f.admit(node, now) {
		f.counted.WithLabelValues("deferred").Inc()
		return nil, Deferred(f.atOnce, f.retryAfter)
	}
	f.counted.WithLabelValues("admitted").Inc()
	var once sync.Once
	free := func() {
		once.Do(func() {
			f.mu.Lock()
			f.reading--
			f.mu.Unlock()
		})
	}
	timer := time.AfterFunc(f.holdFor, free)
	return func() { timer.Stop(); free() }, nil
}

// admit takes a slot for node's inventory: the room kept for it, or room
// free.
func (f *FullReports) admit(node string, now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.expire(now)
	if _, ok := f.granted[node]; ok && node != "" {
		delete(f.granted, node)
	} else if f.reading+len(f.granted) >= f.atOnce {
		return false
	}
	f.reading++
	return true
}

// incomingHeader is the first value of a call's metadata key.
func incomingHeader(ctx context.Context, key string) string {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

// Deferred is the answer to a full report turned away: ResourceExhausted,
// with the time to try again as a RetryInfo (client.RetryAfter reads it).
func Deferred(reading int, after time.Duration) error {
	return retryLater(fmt.Sprintf("the controller is reading %d nodes' whole inventories: send yours again in about %s", reading, after), after)
}

// retryLater is ResourceExhausted with a RetryInfo of after.
func retryLater(msg string, after time.Duration) error {
	st := status.New(codes.ResourceExhausted, msg)
	if with, err := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(after)}); err == nil {
		st = with
	}
	return st.Err()
}

// Messages bounds the messages the controller holds at once, whoever sends
// them. A call takes a slot before gRPC reads its message (Tap); a unary
// call gives it back once its message is read (Interceptor), a stream
// when it ends (a stream reads one message at a time). A call past them
// is turned away having cost its headers: ResourceExhausted with a
// RetryInfo. Every message is at most controllerv1.MaxMessage, so at most
// atOnce × MaxMessage bytes of messages are in memory, however many
// connections and calls authenticated callers open.
type Messages struct {
	slots      chan struct{}
	retryAfter time.Duration
	turnedAway prometheus.Counter
}

// MessagesAtOnce is how many calls' messages the controller reads at once:
// a lookup's slot is held while its message arrives (microseconds), a
// stream's while it lasts (uploads and reads through the controller,
// reports in parts, which FullReports admits a few at a time).
const MessagesAtOnce = 32

// NewMessages holds at most atOnce calls' messages at once.
func NewMessages(atOnce int) *Messages {
	return &Messages{slots: make(chan struct{}, atOnce), retryAfter: time.Second,
		turnedAway: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cowvol_controller_calls_turned_away_total",
			Help: "Calls the controller turned away before reading their message, with as many messages being read as it holds at once (they are told to retry).",
		})}
}

// Collectors are the metrics to register.
func (m *Messages) Collectors() []prometheus.Collector { return []prometheus.Collector{m.turnedAway} }

type readKey struct{}

// take takes a slot for the call of ctx, given back when the call ends at
// the latest.
func (m *Messages) take(ctx context.Context) (context.Context, error) {
	select {
	case m.slots <- struct{}{}:
	default:
		m.turnedAway.Inc()
		return nil, retryLater(fmt.Sprintf("the controller is reading %d calls' messages: call again in about %s", cap(m.slots), m.retryAfter), m.retryAfter)
	}
	var once sync.Once
	release := func() { once.Do(func() { <-m.slots }) }
	context.AfterFunc(ctx, release)
	return context.WithValue(ctx, readKey{}, release), nil
}

// messageRead gives back a unary call's slot: its message is read.
func messageRead(ctx context.Context) {
	if release, ok := ctx.Value(readKey{}).(func()); ok {
		release()
	}
}
