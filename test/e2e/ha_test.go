//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/pkg/client"
)

// replica is one controller replica in the HA scenario.
type replica struct {
	name, api, metrics string
	p                  *plugintest.Plugin
	cache              *client.Client
}

// The HA scenario's Lease timings, short so that a takeover is quick.
const (
	haLeaseDuration = 4 * time.Second
	haRenewDeadline = 3 * time.Second
	haRetryPeriod   = 500 * time.Millisecond
)

func (c *cluster) startReplica(name string) *replica {
	r := &replica{name: name, api: fmt.Sprintf("127.0.0.1:%d", plugintest.FreePort(c.T)), metrics: fmt.Sprintf("127.0.0.1:%d", plugintest.FreePort(c.T))}
	r.p = plugintest.Start(c.T, plugintest.Config{Mode: "controller", Args: []string{
		"--api-address=" + r.api, "--metrics-address=" + r.metrics, "--kubeconfig=" + c.Kubeconfig, "--node-id=" + name,
		"--leader-election", "--leader-election-namespace=cowvol", "--leader-election-lease=cowvol-controller-e2e",
		"--leader-election-identity=" + name, "--leader-election-lease-duration=" + haLeaseDuration.String(),
		"--leader-election-renew-deadline=" + haRenewDeadline.String(), "--leader-election-retry-period=" + haRetryPeriod.String(),
	}})
	var err error
	r.cache, err = client.Dial(client.Options{Address: r.api})
	require.NoError(c.T, err)
	c.T.Cleanup(func() { r.cache.Close() })
	return r
}

// ready is the replica's readiness probe: 200 while it leads.
func (r *replica) ready() int {
	resp, err := http.Get("http://" + r.metrics + "/readyz")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

func (r *replica) serves() error {
	_, err := r.cache.Nodes(context.Background())
	return err
}

func (c *cluster) leaseHolder() string {
	out, _ := c.Kubectl("", "get", "lease", "-n", "cowvol", "cowvol-controller-e2e", "-o", "jsonpath={.spec.holderIdentity}")
	return strings.TrimSpace(out)
}

// controllerHA: two replicas elect one leader through a Lease on the API
// server. The follower answers Unavailable naming the leader and is not
// ready; SIGKILL the leader and the follower takes over within the lease
// duration; a leader frozen past its lease loses it, and on waking exits
// instead of serving on.
func (c *cluster) controllerHA() {
	t := c.T
	a := c.startReplica("ctl-a")
	c.Until("ctl-a to lead", 30*time.Second, func() bool { return c.leaseHolder() == "ctl-a" && a.ready() == http.StatusOK })
	b := c.startReplica("ctl-b")
	c.Until("ctl-b to learn who leads", 30*time.Second, func() bool {
		err := b.serves()
		return status.Code(err) == codes.Unavailable && strings.Contains(err.Error(), "the leader is ctl-a")
	})
	require.Equal(t, http.StatusServiceUnavailable, b.ready(), "a follower is not ready: a Service sends callers to the leader")
	require.NoError(t, a.serves())

	killed := time.Now()
	a.p.Kill()
	c.Until("ctl-b to take over", 30*time.Second, func() bool { return b.serves() == nil })
	takeover := time.Since(killed)
	require.Equal(t, "ctl-b", c.leaseHolder())
	require.Equal(t, http.StatusOK, b.ready())
	report(t, fmt.Sprintf("controller HA: the leader SIGKILLed, the follower served %s later (lease duration %s)\n",
		takeover.Round(100*time.Millisecond), haLeaseDuration))

	// ctl-a comes back as a follower; then ctl-b freezes past its lease.
	a.p.Restart()
	c.Until("the restarted ctl-a to follow ctl-b", 30*time.Second, func() bool {
		err := a.serves()
		return status.Code(err) == codes.Unavailable && strings.Contains(err.Error(), "the leader is ctl-b")
	})
	require.NoError(t, syscall.Kill(b.p.PID(), syscall.SIGSTOP))
	c.Until("ctl-a to take over from the frozen ctl-b", 30*time.Second, func() bool { return a.serves() == nil })
	require.NoError(t, syscall.Kill(b.p.PID(), syscall.SIGCONT))
	require.NoError(t, b.p.Wait(30*time.Second), "a replica that lost its lease exits")
	require.Contains(t, b.p.Log(), "lost the controller's leadership")
	require.Equal(t, "ctl-a", c.leaseHolder())
	a.p.Stop()
}
