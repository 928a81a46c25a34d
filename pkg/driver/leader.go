package driver

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"
)

// LeaderElection configures the controller replicas' election through a
// coordination.k8s.io Lease: one replica leads and serves the APIs, the
// others answer Unavailable naming the leader (and say they are not ready,
// so a Service sends callers to the leader only).
type LeaderElection struct {
	Enabled bool
	// Namespace and Name of the Lease; Identity is this replica's (its
	// pod's name).
	Namespace, Name, Identity string
	// LeaseDuration, RenewDeadline and RetryPeriod are client-go's.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
}

func (le *LeaderElection) validate(mode Mode) []error {
	if !le.Enabled {
		return nil
	}
	var errs []error
	if mode == ModeNode {
		errs = append(errs, errors.New("--leader-election is the controller's: use --mode=controller"))
	}
	if mode == ModeAll {
		errs = append(errs, errors.New("--leader-election needs --mode=controller: every node plugin must serve, leader or not"))
	}
	if le.Namespace == "" || le.Name == "" || le.Identity == "" {
		errs = append(errs, errors.New("--leader-election needs the Lease's namespace and name and this replica's identity (POD_NAMESPACE and POD_NAME in a pod)"))
	}
	if !(0 < le.RetryPeriod && le.RetryPeriod < le.RenewDeadline && le.RenewDeadline < le.LeaseDuration) {
		errs = append(errs, fmt.Errorf("leader election: want retry period (%s) < renew deadline (%s) < lease duration (%s)",
			le.RetryPeriod, le.RenewDeadline, le.LeaseDuration))
	}
	return errs
}

// leadership is what this replica knows of the election.
type leadership struct {
	// leading: this replica serves. Without an election it always does.
	leading atomic.Bool
	// leader is the identity the Lease names ("" until known).
	leader atomic.Value
	self   string
}

func (l *leadership) current() string {
	s, _ := l.leader.Load().(string)
	return s
}

// interceptor refuses every call to a method under prefix while this
// replica does not lead, naming the leader: the caller retries, and a
// Service sends it to the leader.
func (l *leadership) interceptor(prefix string) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if strings.HasPrefix(info.FullMethod, prefix) {
			if err := l.refuse(); err != nil {
				return nil, err
			}
		}
		return handler(ctx, req)
	}
}

// streamInterceptor is interceptor for streaming calls.
func (l *leadership) streamInterceptor(prefix string) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if strings.HasPrefix(info.FullMethod, prefix) {
			if err := l.refuse(); err != nil {
				return err
			}
		}
		return handler(srv, ss)
	}
}

func (l *leadership) refuse() error {
	if !l.leading.Load() {
		leader := l.current()
		if leader == "" {
			leader = "none yet"
		}
		return status.Errorf(codes.Unavailable, "this controller replica (%s) does not lead: the leader is %s; retry", l.self, leader)
	}
	return nil
}

// ready answers a readiness probe: ready while this replica leads.
func (l *leadership) ready(w http.ResponseWriter, _ *http.Request) {
	if !l.leading.Load() {
		http.Error(w, "not the leader: "+l.current(), http.StatusServiceUnavailable)
		return
	}
	_, _ = w.Write([]byte("ok\n"))
}

// elect runs the election until ctx ends. While leading, lead runs; when
// leadership is lost elect returns an error at once, and the process exits
// (its pod restarts as a follower, with nothing left of the old view).
func (l *leadership) elect(ctx context.Context, kube kubernetes.Interface, le LeaderElection, lead func(context.Context)) error {
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: le.Namespace, Name: le.Name},
		Client:     kube.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: le.Identity},
	}
	lost := make(chan struct{})
	elector, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock: lock, LeaseDuration: le.LeaseDuration, RenewDeadline: le.RenewDeadline, RetryPeriod: le.RetryPeriod,
		ReleaseOnCancel: true, Name: le.Name,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				klog.InfoS("Leading: serving the controller's APIs", "lease", le.Namespace+"/"+le.Name, "identity", le.Identity)
				l.leading.Store(true)
				lead(ctx)
			},
			OnStoppedLeading: func() {
				l.leading.Store(false)
				close(lost)
			},
			OnNewLeader: func(identity string) {
				l.leader.Store(identity)
				if identity != le.Identity {
					klog.InfoS("Another replica leads: answering Unavailable", "leader", identity, "identity", le.Identity)
				}
			},
		},
	})
	if err != nil {
		return fmt.Errorf("leader election: %w", err)
	}
	go elector.Run(ctx)
	select {
	case <-lost:
		if ctx.Err() != nil {
			return nil // stopping: the Lease was released
		}
		return errors.New("lost the controller's leadership: exiting so that the pod restarts as a follower")
	case <-ctx.Done():
		<-lost // the elector releases the Lease on its way out
		return nil
	}
}
