package controller

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/types/known/durationpb"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
)

// reportMethod is the one call FullReports admits.
const reportMethod = "/cowvol.controller.v1.Registry/Report"

// FullReports admits a bounded number of nodes' whole inventories at once
// and turns the rest away, each told when to try again. A new leader asks
// every node for its inventory at the same moment; gRPC reads a call's
// whole message before any handler or interceptor runs, so without this
// 1,000 nodes' inventories (a few MiB each, decoded) would be in memory at
// once however the handler limits itself. Its Tap runs before the read, on
// the header a node sets on a full report (controllerv1.ReportKindHeader).
//
// A slot is held until the call ends, or for at most holdFor: a caller
// that sends its header and then stalls (any client can, before it is
// authenticated) gives its slot back after that.
type FullReports struct {
	slots      chan struct{}
	retryAfter time.Duration
	holdFor    time.Duration
	counted    *prometheus.CounterVec
}

// Defaults of FullReports: turned-away nodes try again after about
// fullReportRetry (each draws a time around it); a slot is held at most
// fullReportHold.
const (
	fullReportRetry = 2 * time.Second
	fullReportHold  = 30 * time.Second
)

// NewFullReports admits at most atOnce full reports at once.
func NewFullReports(atOnce int) *FullReports {
	return &FullReports{slots: make(chan struct{}, atOnce), retryAfter: fullReportRetry, holdFor: fullReportHold,
		counted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cowvol_controller_full_reports_total",
			Help: "Nodes' reports of their whole inventory, by whether the controller read them at once (admitted) or, with as many being read already, told the node to send it again later (deferred).",
		}, []string{"result"})}
}

// Collectors are the metrics to register.
func (f *FullReports) Collectors() []prometheus.Collector { return []prometheus.Collector{f.counted} }

// Tap is a grpc.InTapHandle: it runs on the transport's reader before the
// call's message is read, so it must not block.
func (f *FullReports) Tap(ctx context.Context, info *tap.Info) (context.Context, error) {
	if info.FullMethodName != reportMethod || !isFullReport(info) {
		return ctx, nil
	}
	select {
	case f.slots <- struct{}{}:
	default:
		f.counted.WithLabelValues("deferred").Inc()
		return ctx, Deferred(len(f.slots), f.retryAfter)
	}
	f.counted.WithLabelValues("admitted").Inc()
	var once sync.Once
	release := func() { once.Do(func() { <-f.slots }) }
	timer := time.AfterFunc(f.holdFor, release)
	// The stream's context ends with the call, however it ends (answered,
	// cancelled, its connection gone).
	context.AfterFunc(ctx, func() { timer.Stop(); release() })
	return ctx, nil
}

func isFullReport(info *tap.Info) bool {
	for _, v := range info.Header.Get(controllerv1.ReportKindHeader) {
		if v == controllerv1.ReportKindFull {
			return true
		}
	}
	return false
}

// Deferred is the answer to a full report turned away: ResourceExhausted,
// with the time to try again as a RetryInfo (client.RetryAfter reads it).
func Deferred(reading int, after time.Duration) error {
	st := status.New(codes.ResourceExhausted, fmt.Sprintf(
		"the controller is reading %d nodes' whole inventories: send yours again in about %s", reading, after))
	if with, err := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(after)}); err == nil {
		st = with
	}
	return st.Err()
}
