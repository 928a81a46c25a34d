// Package scheduler is a CI scheduler's loop as a user of cowvol writes
// one: it runs a build's steps the way Concourse's ATC runs a plan, through
// the Cache API (pkg/client) and the Kubernetes API alone. Each step is
// placed (Place ranks the nodes by the bytes of its inputs they hold), run
// as a pod whose inputs and output are cowvol inline volumes and which
// prefers the ranked nodes in order (kube-scheduler binds it), waited for,
// and run again on another node if it fails; its output is captured by
// the node it ran on, and the next step finds it by handle wherever it
// is. Each attempt captures its output under a handle of its own (a failed
// attempt's is destroyed), and later steps name the one that succeeded, as
// the ATC records the volume of the attempt that won. Pin and Destroy are
// what a CI's garbage collection calls.
//
// It is an example: it owns the pods it makes (labelled with the build)
// and nothing of cowvol's.
package scheduler

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/volume"
)

// Driver is cowvol's CSI driver name, which step pods' volumes name.
const Driver = "cowvol.concourse-ci.org"

// Step is one step of a build: a script that reads its inputs (earlier
// steps' outputs by name, or any volume of the namespace by handle,
// read-only at /in/<name>) and leaves its output in /out, captured as
// Output.
type Step struct {
	Name   string   `json:"name"`
	Inputs []string `json:"inputs,omitempty"`
	Output string   `json:"output,omitempty"`
	Script string   `json:"script"`
	// Node pins the step to a node (a nodeSelector), whatever Place says.
	Node string `json:"node,omitempty"`
	// Caches are mounted at their paths as cowvol caches: each a fork of
	// its key's last good version, kept as the next one if the step
	// succeeds (docs/caches.md), as Concourse's task caches.
	Caches []StepCache `json:"caches,omitempty"`
}

// StepCache is a cache a step mounts: Key, of the runner's namespace, at
// Path.
type StepCache struct {
	Path string `json:"path"`
	Key  string `json:"key"`
}

// Runner runs builds' steps as pods of Namespace.
type Runner struct {
	Kube  kubernetes.Interface
	Cache *client.Client
	// Namespace the step pods run in; Image they run; ServiceAccount
	// they run as ("": the namespace's default).
	Namespace, Image, ServiceAccount string
	// Attempts is how many times a step runs before the build fails
	// (0: 3), each away from the nodes earlier attempts failed on (see
	// avoiding); Timeout bounds each attempt (0: 10 minutes).
	Attempts int
	Timeout  time.Duration
	// KeepFor pins each step's output that long once it is captured (0:
	// not pinned), as an ATC keeps a running build's volumes: disk
	// pressure on its node does not evict what later steps read. A CI's
	// GC destroys or unpins them when the build is done.
	KeepFor time.Duration
	// Logf, if set, is told what happens.
	Logf func(format string, args ...any)
}

// Result is what became of a step.
type Result struct {
	Step string
	// Node ran the step's last attempt; Ranked is what Place said for it.
	Node     string
	Ranked   []string
	Attempts int
	// Handle is the volume its output was captured as.
	Handle string
	// Log is the step's output.
	Log string
	// Failures are the attempts that failed, in order.
	Failures []Failure
}

// Failure is an attempt of a step that failed: on which node, why, and
// what it printed (as far as its pod's log could be read).
type Failure struct {
	Node string
	Err  error
	Log  string
}

// Run runs the steps of build in order, each once its inputs exist.
func (r *Runner) Run(ctx context.Context, build string, steps []Step) ([]Result, error) {
	var results []Result
	made := map[string]string{} // outputs' handles, by name
	for _, s := range steps {
		inputs := make([]string, len(s.Inputs))
		for i, in := range s.Inputs {
			inputs[i] = cmp.Or(made[in], in)
		}
		res, err := r.RunStep(ctx, build, s, inputs)
		results = append(results, res)
		if err != nil {
			return results, fmt.Errorf("build %s: step %s: %w", build, s.Name, err)
		}
		if s.Output != "" {
			made[s.Output] = res.Handle
		}
	}
	return results, nil
}

// RunStep places and runs one step on the volumes inputs (its Inputs'
// handles), retrying it on other nodes.
func (r *Runner) RunStep(ctx context.Context, build string, s Step, inputs []string) (Result, error) {
	res := Result{Step: s.Name}
	attempts := r.Attempts
	if attempts <= 0 {
		attempts = 3
	}
	var failed []string
	var errs []error
	for res.Attempts < attempts {
		res.Attempts++
		ranked, err := r.place(ctx, inputs, s.Caches)
		if err != nil {
			return res, err
		}
		res.Ranked = ranked
		res.Handle = ""
		if s.Output != "" {
			res.Handle = fmt.Sprintf("%s-%s-%s-%d", build, s.Name, s.Output, res.Attempts)
		}
		pod := r.pod(build, s, inputs, res.Handle, res.Attempts, ranked, failed)
		node, log, err := r.attempt(ctx, pod)
		res.Node, res.Log = node, log
		if err == nil && res.Handle != "" {
			err = r.waitHeld(ctx, pod.Name, res.Handle)
		}
		if err == nil && res.Handle != "" && r.KeepFor > 0 {
			err = r.keep(ctx, res.Handle)
		}
		if err == nil {
			return res, nil
		}
		r.logf("Step %s of build %s failed on node %q (attempt %d): %v", s.Name, build, node, res.Attempts, err)
		res.Failures = append(res.Failures, Failure{Node: node, Err: err, Log: log})
		errs = append(errs, fmt.Errorf("attempt %d on %q: %w", res.Attempts, node, err))
		if node != "" {
			failed = append(failed, node)
		}
		if res.Handle != "" {
			// What the failed attempt left is nobody's input.
			if err := r.Destroy(ctx, res.Handle); err != nil {
				r.logf("Destroying the output of a failed attempt, %s: %v", res.Handle, err)
			}
		}
	}
	return res, errors.Join(errs...)
}

// unavailableFor is how long a step waits out a controller that answers
// Unavailable (its leader moving: a new one leads within the Lease's
// duration) before the build fails.
const unavailableFor = time.Minute

// place ranks the nodes for a step's inputs and caches (each cache counts
// as its key's newest version).
func (r *Runner) place(ctx context.Context, inputs []string, caches []StepCache) ([]string, error) {
	keys := make([]volume.CacheRef, len(caches))
	for i, c := range caches {
		keys[i] = volume.CacheRef{Namespace: r.Namespace, Key: c.Key}
	}
	var ranked []string
	err := r.waitingOutUnavailable(ctx, "placing", func() error {
		nodes, err := r.Cache.PlaceStep(ctx, client.PreferredNodes, r.refs(inputs), keys)
		ranked = make([]string, len(nodes))
		for i, n := range nodes {
			ranked[i] = n.NodeId
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return ranked, nil
}

// keep pins a step's output for KeepFor.
func (r *Runner) keep(ctx context.Context, handle string) error {
	return r.Pin(ctx, time.Now().Add(r.KeepFor), handle)
}

// waitingOutUnavailable calls the Cache API until it answers other than
// Unavailable, for up to unavailableFor.
func (r *Runner) waitingOutUnavailable(ctx context.Context, what string, call func() error) error {
	deadline := time.Now().Add(unavailableFor)
	for {
		err := call()
		if err == nil {
			return nil
		}
		if status.Code(err) != codes.Unavailable || time.Now().After(deadline) {
			return fmt.Errorf("%s: %w", what, err)
		}
		r.logf("%s: the controller is unavailable, retrying: %v", what, err)
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %w", what, ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// pod is a step's pod for one attempt: it prefers the ranked nodes in
// order and may not run on the nodes avoiding names.
func (r *Runner) pod(build string, s Step, inputs []string, output string, attempt int, ranked, failed []string) *corev1.Pod {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%s-%d", build, s.Name, attempt), Namespace: r.Namespace,
			Labels: map[string]string{"cowvol.concourse-ci.org/build": build, "cowvol.concourse-ci.org/step": s.Name}},
		Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever, ServiceAccountName: r.ServiceAccount,
			AutomountServiceAccountToken: new(false), TerminationGracePeriodSeconds: new(int64(1)),
			Containers: []corev1.Container{{Name: "step", Image: r.Image, ImagePullPolicy: corev1.PullIfNotPresent,
				Command: []string{"/bin/sh", "-c", s.Script}}},
		},
	}
	c := &pod.Spec.Containers[0]
	for i, h := range inputs {
		name := fmt.Sprintf("in-%d", i)
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
			Driver: Driver, ReadOnly: new(true), VolumeAttributes: map[string]string{"source": h}}}})
		c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: name, MountPath: "/in/" + s.Inputs[i], ReadOnly: true})
	}
	if output != "" {
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: "out", VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
			Driver: Driver, VolumeAttributes: map[string]string{"capture": output}}}})
		c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: "out", MountPath: "/out"})
	}
	for i, cache := range s.Caches {
		name := fmt.Sprintf("cache-%d", i)
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
			Driver: Driver, VolumeAttributes: map[string]string{"cache": cache.Key}}}})
		c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: name, MountPath: cache.Path})
	}
	if s.Node != "" {
		pod.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": s.Node}
	}
	affinity := &corev1.NodeAffinity{}
	for i, n := range ranked {
		// Most preferred first, the weights halving: kube-scheduler's
		// other scores only break ties among equally ranked nodes.
		affinity.PreferredDuringSchedulingIgnoredDuringExecution = append(affinity.PreferredDuringSchedulingIgnoredDuringExecution,
			corev1.PreferredSchedulingTerm{Weight: max(int32(100>>i), 1), Preference: hostIn(corev1.NodeSelectorOpIn, n)})
	}
	if avoid := avoiding(s, ranked, failed); len(avoid) > 0 {
		affinity.RequiredDuringSchedulingIgnoredDuringExecution = &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{hostIn(corev1.NodeSelectorOpNotIn, avoid...)}}
	}
	pod.Spec.Affinity = &corev1.Affinity{NodeAffinity: affinity}
	return pod
}

// avoiding is where an attempt may not run: the nodes earlier attempts
// failed on, or, once they are all the ranked nodes, the last of them (a
// step that failed everywhere runs again rather than wait for a node that
// is not there); nowhere for a pinned step, which runs on its node or not
// at all.
func avoiding(s Step, ranked, failed []string) []string {
	if s.Node != "" || len(failed) == 0 {
		return nil
	}
	for _, n := range ranked {
		if !slices.Contains(failed, n) {
			return failed
		}
	}
	return failed[len(failed)-1:]
}

func hostIn(op corev1.NodeSelectorOperator, nodes ...string) corev1.NodeSelectorTerm {
	return corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{
		{Key: "kubernetes.io/hostname", Operator: op, Values: nodes}}}
}

// attempt runs a pod to its end, answering the node it ran on and its
// log; it fails if the pod fails, or does not end within the timeout (the
// pod is then deleted). A finished pod is deleted, so that its output is
// captured at once.
func (r *Runner) attempt(ctx context.Context, pod *corev1.Pod) (node, log string, err error) {
	timeout := r.Timeout
	if timeout <= 0 {
		timeout = 10 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	pods := r.Kube.CoreV1().Pods(r.Namespace)
	if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return "", "", fmt.Errorf("creating pod %s: %w", pod.Name, err)
	}
	defer func() {
		// The pod goes either way: its volumes are unpublished and the
		// output captured. Not the attempt's context: it may have ended.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if err := pods.Delete(dctx, pod.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			r.logf("Deleting pod %s: %v", pod.Name, err)
		}
	}()
	r.logf("Step pod %s created", pod.Name)
	for {
		p, err := pods.Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return node, "", fmt.Errorf("pod %s: %w", pod.Name, err)
		}
		node = p.Spec.NodeName
		switch p.Status.Phase {
		case corev1.PodSucceeded, corev1.PodFailed:
			log, lerr := r.podLog(ctx, pod.Name)
			if p.Status.Phase == corev1.PodFailed {
				return node, log, fmt.Errorf("pod %s failed: %s", pod.Name, failure(p))
			}
			return node, log, lerr
		}
		select {
		case <-ctx.Done():
			return node, "", fmt.Errorf("pod %s did not end: %w", pod.Name, ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// failure says why a failed pod failed: its status's message, or how its
// step container ended.
func failure(p *corev1.Pod) string {
	if p.Status.Message != "" {
		return p.Status.Message
	}
	for _, c := range p.Status.ContainerStatuses {
		if t := c.State.Terminated; t != nil {
			why := fmt.Sprintf("container %s exited %d (%s)", c.Name, t.ExitCode, t.Reason)
			if t.Message != "" {
				why += ": " + t.Message
			}
			return why
		}
	}
	return "no container status"
}

// podLog reads a pod's log (its first MiB) through its node's kubelet,
// trying for up to logFor: a kubelet restarting answers nothing for a few
// seconds, and the step's work is not lost for it.
func (r *Runner) podLog(ctx context.Context, name string) (string, error) {
	deadline := time.Now().Add(logFor)
	for {
		log, err := r.readLog(ctx, name)
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return log, err
		}
		r.logf("Reading pod %s's log, retrying: %v", name, err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

const logFor = 30 * time.Second

func (r *Runner) readLog(ctx context.Context, name string) (string, error) {
	rc, err := r.Kube.CoreV1().Pods(r.Namespace).GetLogs(name, &corev1.PodLogOptions{}).Stream(ctx)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, 1<<20))
	return string(b), err
}

// waitHeld waits until the controller lists a node holding handle (the
// node reports its capture within its heartbeat), or the node says it did
// not capture it (an Event on the step's pod: say, an input could not be
// read whole).
func (r *Runner) waitHeld(ctx context.Context, pod, handle string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for {
		locs, err := r.Cache.LookupFirst(ctx, 1, volume.Ref{Namespace: r.Namespace, Handle: handle})
		if err == nil && len(locs) == 1 && len(locs[0].Nodes) > 0 {
			return nil
		}
		if why := r.notCaptured(ctx, pod); why != "" {
			return fmt.Errorf("output %s was not captured: %s", handle, why)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("output %s was not captured: %w", handle, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// notCaptured is why the node said it did not capture a pod's output (""
// if it said nothing).
func (r *Runner) notCaptured(ctx context.Context, pod string) string {
	events, err := r.Kube.CoreV1().Events(r.Namespace).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=Pod,involvedObject.name=" + pod + ",reason=CaptureSkipped"})
	if err != nil || len(events.Items) == 0 {
		return ""
	}
	return events.Items[0].Message
}

// Pin keeps outputs (a CI's resource caches) until then on every node
// holding them; Destroy ends them everywhere. Both wait out a moving
// leader, as Place does.
func (r *Runner) Pin(ctx context.Context, until time.Time, handles ...string) error {
	return r.waitingOutUnavailable(ctx, "pinning", func() error {
		_, err := r.Cache.Pin(ctx, until, r.refs(handles)...)
		return err
	})
}

// Destroy destroys outputs on every node holding them, and waits until
// none does. The controller tells the nodes it knows to hold them, in
// answer to their next reports: a leader that took over a moment ago may
// not know every node's volumes yet, and a request the nodes had not yet
// carried out when the leader moved is lost with it, so the request is
// made again every destroyRecheck until the outputs are gone (for up to
// two minutes).
func (r *Runner) Destroy(ctx context.Context, handles ...string) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		err := r.waitingOutUnavailable(ctx, "destroying", func() error {
			_, err := r.Cache.Destroy(ctx, r.refs(handles)...)
			return err
		})
		if err != nil {
			return err
		}
		for again := time.Now().Add(destroyRecheck); time.Now().Before(again); {
			if r.gone(ctx, handles) {
				return nil
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("destroying: %w", ctx.Err())
			case <-time.After(250 * time.Millisecond):
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("destroying %v: still held after two minutes", handles)
		}
		r.logf("Destroying %v: still held; asking again", handles)
	}
}

// Reconcile is a pass of a CI's garbage collection over what the nodes
// hold, as Concourse's GC compares its workers' volumes with its database:
// every volume of the runner's namespace that a node holds, in any state,
// stalled nodes included, and that keep does not claim is destroyed. A
// destroy lost when the controller's leader moved, or a node back after a
// long silence with volumes destroyed meanwhile, leaves volumes that no
// build owns; a pass finds them. It answers the handles it destroyed.
func (r *Runner) Reconcile(ctx context.Context, keep func(handle string) bool) ([]string, error) {
	var nodes []*controllerv1.NodeStatus
	err := r.waitingOutUnavailable(ctx, "listing the nodes", func() (err error) {
		nodes, err = r.Cache.Nodes(ctx)
		return err
	})
	if err != nil {
		return nil, err
	}
	doomed := map[string]bool{}
	for _, n := range nodes {
		var vols []*controllerv1.VolumeLocation
		err := r.waitingOutUnavailable(ctx, "listing node "+n.GetNodeId()+"'s volumes", func() (err error) {
			vols, err = r.Cache.List(ctx, &controllerv1.ListVolumesRequest{Namespace: r.Namespace, NodeId: n.GetNodeId()})
			return err
		})
		if err != nil {
			return nil, err
		}
		for _, v := range vols {
			if h := v.GetRef().GetHandle(); !keep(h) {
				doomed[h] = true
			}
		}
	}
	if len(doomed) == 0 {
		return nil, nil
	}
	handles := slices.Sorted(maps.Keys(doomed))
	r.logf("Garbage collection: destroying %d volumes no build owns: %v", len(handles), handles)
	return handles, r.waitingOutUnavailable(ctx, "destroying", func() error {
		_, err := r.Cache.Destroy(ctx, r.refs(handles)...)
		return err
	})
}

// destroyRecheck is how long a destroy waits for its outputs to go
// before it is asked again (a node reports every few seconds).
var destroyRecheck = 10 * time.Second

// gone says whether no live node holds any of handles.
func (r *Runner) gone(ctx context.Context, handles []string) bool {
	locs, err := r.Cache.LookupFirst(ctx, 1, r.refs(handles)...)
	if err != nil {
		return false
	}
	for _, l := range locs {
		if len(l.Nodes) > 0 {
			return false
		}
	}
	return true
}

func (r *Runner) refs(handles []string) []volume.Ref {
	refs := make([]volume.Ref, len(handles))
	for i, h := range handles {
		refs[i] = volume.Ref{Namespace: r.Namespace, Handle: h}
	}
	return refs
}

func (r *Runner) logf(format string, args ...any) {
	if r.Logf != nil {
		r.Logf(format, args...)
	}
}
