package plugin

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
)

// LeaderElection configures the controller replicas' election through a
// coordination.k8s.io Lease: one replica leads and serves the APIs, the
// others answer Unavailable naming the leader.
//
// A Service sends callers to the leader one of two ways. With LabelPod,
// the leader labels its pod LeaderLabel=true and the Service selects that
// label; every serving replica is ready, so a Deployment's rolling update
// and a drain's PodDisruptionBudget count the followers (were readiness
// leading, neither could ever take the leader's pod: the new pods cannot
// lead, so never turn ready, while it lives). Without LabelPod, only the
// leader is ready, for a Service that selects by readiness alone.
type LeaderElection struct {
	Enabled bool
	// Namespace and Name of the Lease; Identity is this replica's (its
	// pod's name).
	Namespace, Name, Identity string
	// LabelPod: Identity is this replica's pod in Namespace, which it
	// labels while it leads.
	LabelPod bool
	// LeaseDuration, RenewDeadline and RetryPeriod are client-go's.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
}

// LeaderLabel is the label the leading replica's pod carries (with
// LabelPod): the controller's Service selects it.
const LeaderLabel = "cowvol.concourse-ci.org/leader"

// AddFlags registers leader election's flags (controller mode).
func (le *LeaderElection) AddFlags(fs *flag.FlagSet) {
	fs.BoolVar(&le.Enabled, "leader-election", le.Enabled,
		"elect one serving replica through a Lease; the others answer Unavailable naming the leader, and are not ready (but see --leader-election-label-pod)")
	fs.StringVar(&le.Namespace, "leader-election-namespace", le.Namespace, "the Lease's namespace (default $POD_NAMESPACE)")
	fs.StringVar(&le.Name, "leader-election-lease", le.Name, "the Lease's name")
	fs.StringVar(&le.Identity, "leader-election-identity", le.Identity,
		"this replica's name in the Lease (default $POD_NAME, else the host name)")
	fs.BoolVar(&le.LabelPod, "leader-election-label-pod", le.LabelPod,
		"the identity is this replica's pod: label it "+LeaderLabel+"=true while leading, for a Service that selects the leader by it; followers are ready too")
	fs.DurationVar(&le.LeaseDuration, "leader-election-lease-duration", le.LeaseDuration, "how long followers wait before taking over a silent leader's Lease")
	fs.DurationVar(&le.RenewDeadline, "leader-election-renew-deadline", le.RenewDeadline, "how long the leader tries to renew before it gives up leading (and exits)")
	fs.DurationVar(&le.RetryPeriod, "leader-election-retry-period", le.RetryPeriod, "how often replicas try to acquire or renew the Lease")
}

// validate checks the election's options; enabled, it is for a
// controller-mode plugin alone (every node plugin must serve, leader or
// not), which is the only mode whose command line has its flags.
func (le LeaderElection) validate(mode Mode) []error {
	if !le.Enabled {
		if le.LabelPod {
			return []error{errors.New("--leader-election-label-pod labels the leader's pod: it needs --leader-election")}
		}
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
	// followersReady: a follower is ready too (LabelPod).
	followersReady bool
	// unsettled, if set, names the nodes whose whole inventory the view
	// of a replica that began to lead a moment ago still lacks: the Cache
	// API waits for them (see View.AwaitReports), but for ListNodes, which
	// says where each node stands.
	unsettled func() []string
	// awaitNodes, if set, tells the view which nodes to wait for before
	// this replica serves as the leader.
	awaitNodes func(context.Context)
	// callers, if set, are the API's connections: while this replica
	// does not lead, the one a refused call came on is closed.
	callers *callerConns
}

// cacheMethods are the Cache API's; its ListNodes answers while the view
// settles.
var cacheMethods = "/" + controllerv1.Cache_ServiceDesc.ServiceName + "/"

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
			if err := l.refuse(info.FullMethod); err != nil {
				l.sendOn(ctx)
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
			if err := l.refuse(info.FullMethod); err != nil {
				l.sendOn(ss.Context())
				return err
			}
		}
		return handler(srv, ss)
	}
}

// sendOn has a caller this follower refused reach the leader: the
// connection its call came on is closed (callerConns says why). A leader
// whose view still settles keeps its callers.
func (l *leadership) sendOn(ctx context.Context) {
	if l.callers != nil && !l.leading.Load() {
		l.callers.closeSoon(ctx)
	}
}

// refuse answers Unavailable to a call of method while this replica does
// not lead, or while its view still settles.
func (l *leadership) refuse(method string) error {
	if !l.leading.Load() {
		leader := l.current()
		if leader == "" {
			leader = "none yet"
		}
		return status.Errorf(codes.Unavailable, "this controller replica (%s) does not lead: the leader is %s; retry", l.self, leader)
	}
	if l.unsettled == nil || !strings.HasPrefix(method, cacheMethods) || method == controllerv1.Cache_ListNodes_FullMethodName {
		return nil
	}
	if nodes := l.unsettled(); len(nodes) > 0 {
		return status.Errorf(codes.Unavailable, "this controller replica (%s) began to lead a moment ago and has not yet had the whole inventory of %d node(s) (%s): "+
			"until it has, its view lacks their volumes; retry", l.self, len(nodes), strings.Join(nodes[:min(3, len(nodes))], ", "))
	}
	return nil
}

// ready answers a readiness probe: ready while this replica leads, or
// while it serves where followers are ready too.
func (l *leadership) ready(w http.ResponseWriter, _ *http.Request) {
	if !l.leading.Load() && !l.followersReady {
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
	label := func(context.Context, bool) {}
	if le.LabelPod {
		label = podLabeller(kube, le.Namespace, le.Identity)
		// A pod restarted after leading still says so: not any more
		// (tried for a while, not forever: a replica that cannot label
		// its pod still serves when it leads).
		unlabelCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		label(unlabelCtx, false)
		cancel()
	}
	lost := make(chan struct{})
	elector, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock: lock, LeaseDuration: le.LeaseDuration, RenewDeadline: le.RenewDeadline, RetryPeriod: le.RetryPeriod,
		ReleaseOnCancel: true, Name: le.Name,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				klog.InfoS("Leading: serving the controller's APIs", "lease", le.Namespace+"/"+le.Name, "identity", le.Identity)
				if l.awaitNodes != nil {
					l.awaitNodes(ctx)
				}
				l.leading.Store(true)
				go label(ctx, true)
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

// podLabeller sets or removes LeaderLabel on the replica's pod, retrying
// until it is done or ctx ends. A pod that does not exist (the identity
// names none) is said once and left.
func podLabeller(kube kubernetes.Interface, namespace, pod string) func(ctx context.Context, leading bool) {
	return func(ctx context.Context, leading bool) {
		value := "null"
		if leading {
			value = `"true"`
		}
		patch := []byte(fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, LeaderLabel, value))
		for {
			_, err := kube.CoreV1().Pods(namespace).Patch(ctx, pod, types.MergePatchType, patch, metav1.PatchOptions{})
			switch {
			case err == nil:
				klog.InfoS("Labelled this replica's pod", "pod", namespace+"/"+pod, "label", LeaderLabel, "leading", leading)
				return
			case apierrors.IsNotFound(err):
				klog.ErrorS(err, "This replica's identity names no pod: the Service cannot select it as the leader", "pod", namespace+"/"+pod)
				return
			}
			klog.ErrorS(err, "Labelling this replica's pod; retrying", "pod", namespace+"/"+pod, "leading", leading)
			select {
			case <-ctx.Done():
				return
			case <-time.After(2 * time.Second):
			}
		}
	}
}
