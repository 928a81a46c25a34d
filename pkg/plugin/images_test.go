package plugin

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/filters"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/registry"
)

// TestImagesUnder: the filter containerd is asked with parses, and names
// the registry's images only.
func TestImagesUnder(t *testing.T) {
	f, err := filters.Parse(imagesUnder("127.0.0.1:7444/"))
	require.NoError(t, err)
	for name, want := range map[string]bool{
		"127.0.0.1:7444/ci/img:latest":   true,
		"127.0.0.1:7444/ci/img@sha256:0": true,
		"127.0.0.1:74445/ci/img:latest":  false,
		"127.0.0.2:7444/ci/img:latest":   false,
		"127x0.0.1:7444/ci/img:latest":   false,
		"docker.io/127.0.0.1:7444/x":     false,
	} {
		assert.Equal(t, want, f.Match(filters.AdapterFunc(func(fieldpath []string) (string, bool) {
			if len(fieldpath) == 1 && fieldpath[0] == "name" {
				return name, true
			}
			return "", false
		})), name)
	}
}

// nodeEvents records the Events said on the Node.
type nodeEvents struct {
	node.NoEvents
	mu      sync.Mutex
	reasons []string
}

func (e *nodeEvents) NodeEvent(_, reason, _ string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.reasons = append(e.reasons, reason)
}

func (e *nodeEvents) said() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.reasons)
}

// TestCheckPullCredentials: a period in which the runtime asked for
// manifests without credentials and never with one is said on the Node,
// once until pulls carry credentials again; a runtime that is challenged
// and then sends its credential is not.
func TestCheckPullCredentials(t *testing.T) {
	reg := registry.New(nil, registry.NewMetrics(), registry.Options{Mode: registry.AuthRequired})
	srv := httptest.NewServer(reg)
	defer srv.Close()
	events := &nodeEvents{}
	d := &Driver{opts: Options{Images: ImageOptions{RegistryAddress: "127.0.0.1:7444", RegistryAuth: registry.AuthRequired}}, podEvents: events}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const period = 50 * time.Millisecond
	go d.checkPullCredentials(ctx, reg, period)
	pull := func() {
		resp, err := http.Get(srv.URL + "/v2/ci/img/manifests/latest")
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	}
	pull()
	require.Eventually(t, func() bool { return len(events.said()) == 1 }, 5*time.Second, period/5)
	assert.Equal(t, []string{"ImagePullsWithoutCredentials"}, events.said())
	// Still none: not said again.
	pull()
	time.Sleep(4 * period)
	assert.Len(t, events.said(), 1)
}
