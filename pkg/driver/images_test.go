package driver

import (
	"testing"

	"github.com/containerd/containerd/v2/pkg/filters"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
