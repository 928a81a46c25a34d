package owners

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// liveObjects is the API server's answer for each kind: the UIDs that
// exist, or an error for a kind it cannot list.
type liveObjects struct {
	uids   map[Kind][]string
	fail   map[Kind]error
	listed []Kind
}

func (l *liveObjects) Live(_ context.Context, k Kind) (map[string]bool, error) {
	l.listed = append(l.listed, k)
	if err := l.fail[k]; err != nil {
		return nil, err
	}
	live := map[string]bool{}
	for _, uid := range l.uids[k] {
		live[uid] = true
	}
	return live, nil
}

// toldEvents records the owners whose volumes were destroyed, with them.
type toldEvents map[string][]string

func (e toldEvents) OwnerGone(namespace string, o volume.Owner, destroyed []volume.Ref) {
	for _, r := range destroyed {
		e[namespace+" "+o.String()] = append(e[namespace+" "+o.String()], r.Handle)
	}
}

const (
	uidA = "00000000-0000-4000-8000-00000000000a"
	uidB = "00000000-0000-4000-8000-00000000000b"
	uidC = "00000000-0000-4000-8000-00000000000c"
	uidD = "00000000-0000-4000-8000-00000000000d"
)

var (
	workflows = Kind{Group: "argoproj.io", Kind: "Workflow"}
	jobs      = Kind{Group: "batch", Kind: "Job"}
	taskRuns  = Kind{Group: "tekton.dev", Kind: "TaskRun"}
)

func owned(ns, handle, state string, o volume.Owner, pinned bool) fleet.Held {
	var props []fleet.Property
	for k, v := range o.Properties() {
		props = append(props, fleet.Property{Key: k, Value: v})
	}
	props = append(props, fleet.Property{Key: "job", Value: "unit"})
	return fleet.Held{Ref: volume.Ref{Namespace: ns, Handle: handle}, State: volume.State(state), SizeBytes: 1,
		Properties: props, Pinned: pinned}
}

// A sweep destroys, on every node, the ready and failed volumes whose
// owner is gone (deleted, or made again under another UID), with one
// listing per kind of owner; it keeps those whose owner lives, those
// pinned, those still being captured, those without an owner, and those
// whose kind the API server cannot list.
func TestSweep(t *testing.T) {
	now := time.Now()
	v := fleet.NewView(time.Minute, time.Hour)
	gone := volume.Owner{Group: "argoproj.io", Kind: "Workflow", Name: "build-1", UID: uidA}
	live := volume.Owner{Group: "argoproj.io", Kind: "Workflow", Name: "build-2", UID: uidB}
	remade := volume.Owner{Group: "batch", Kind: "Job", Name: "nightly", UID: uidC}
	unlistable := volume.Owner{Group: "tekton.dev", Kind: "TaskRun", Name: "tr", UID: uidD}
	report := func(node string, held ...fleet.Held) {
		_, err := v.Report(fleet.Report{NodeID: node, StoreID: node, Revision: 1, Full: true, Upserts: held}, now)
		require.NoError(t, err)
	}
	report("a", owned("ci", "b1-produce", "ready", gone, false), owned("ci", "b1-flaky", "failed", gone, false),
		owned("ci", "b1-kept", "ready", gone, true), owned("ci", "b1-running", "creating", gone, false),
		owned("ci", "b2-produce", "ready", live, false), owned("ci", "nightly", "ready", remade, false),
		owned("ci", "tr-out", "ready", unlistable, false),
		fleet.Held{Ref: volume.Ref{Namespace: "ci", Handle: "resource-cache"}, State: volume.StateReady, SizeBytes: 1})
	report("b", owned("ci", "b1-produce", "ready", gone, false))

	objects := &liveObjects{
		uids: map[Kind][]string{workflows: {uidB}, jobs: {"00000000-0000-4000-8000-0000000000ff"}},
		fail: map[Kind]error{taskRuns: errors.New(`taskruns.tekton.dev is forbidden`)},
	}
	m := NewMetrics()
	told := toldEvents{}
	c := New(v, objects, told, m)
	c.scan = 2 // several walks
	n, err := c.Sweep(context.Background())
	require.NoError(t, err)
	require.Equal(t, 3, n)
	require.ElementsMatch(t, []Kind{workflows, jobs, taskRuns}, objects.listed, "one listing per kind")

	heartbeat := func(node string) fleet.Answer {
		ans, err := v.Report(fleet.Report{NodeID: node, StoreID: node, Revision: 1, BaseRevision: 1}, now)
		require.NoError(t, err)
		slices.SortFunc(ans.DestroyOwned, func(a, b fleet.OwnedDestroy) int { return strings.Compare(a.Ref.String(), b.Ref.String()) })
		return ans
	}
	asked := func(uid string, handles ...string) (out []fleet.OwnedDestroy) {
		for _, h := range handles {
			out = append(out, fleet.OwnedDestroy{Ref: volume.Ref{Namespace: "ci", Handle: h}, OwnerUID: uid})
		}
		return out
	}
	// Every node holding a volume is asked, once, to destroy it if its own
	// record names the owner: the view's word on an owner is the last
	// reporter's, which each holder checks against its own.
	require.Equal(t, asked(uidA, "b1-produce"), heartbeat("b").DestroyOwned, "every node holding it is asked")
	ansA := heartbeat("a")
	require.Empty(t, ansA.Destroy, "no destroy on the view's word alone")
	require.Equal(t, append(asked(uidA, "b1-flaky", "b1-produce"), asked(uidC, "nightly")...), ansA.DestroyOwned)
	require.Empty(t, heartbeat("a").DestroyOwned, "said once: the next sweep says it again")

	present := func() []string {
		var out []string
		for _, e := range must(v.Volumes("", 0, now)) {
			out = append(out, e.Ref.Handle)
		}
		return out
	}
	// The nodes destroyed them and report so.
	report("a", owned("ci", "b1-kept", "ready", gone, true), owned("ci", "b1-running", "creating", gone, false),
		owned("ci", "b2-produce", "ready", live, false), owned("ci", "tr-out", "ready", unlistable, false),
		fleet.Held{Ref: volume.Ref{Namespace: "ci", Handle: "resource-cache"}, State: volume.StateReady, SizeBytes: 1})
	report("b")
	require.Equal(t, []string{"b1-kept", "b2-produce", "resource-cache", "tr-out"}, present())

	for _, handles := range told {
		slices.Sort(handles)
	}
	require.Equal(t, toldEvents{"ci Workflow.argoproj.io/build-1": {"b1-flaky", "b1-produce"}, "ci Job.batch/nightly": {"nightly"}}, told,
		"an Event for each owner gone, naming its volumes")
	require.Equal(t, 2.0, testutil.ToFloat64(m.checks.WithLabelValues("gone")))
	require.Equal(t, 1.0, testutil.ToFloat64(m.checks.WithLabelValues("present")))
	require.Equal(t, 1.0, testutil.ToFloat64(m.checks.WithLabelValues("unknown")))
	require.Equal(t, 3.0, testutil.ToFloat64(m.destroyed))

	// The capture that was running ends: the next sweep takes it.
	report("a", owned("ci", "b1-running", "ready", gone, false))
	objects.listed = nil
	n, err = c.Sweep(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, asked(uidA, "b1-running"), heartbeat("a").DestroyOwned)
	require.NotContains(t, objects.listed, jobs, "a kind no volume names any more is not listed")
}

func must[T any](v T, _ bool) T { return v }
