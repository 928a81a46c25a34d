package image

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
)

// PullGrants are the remote layers the node's registry handed to pulls
// just now. A remote layer's digest is a MAC of who reads which volume
// and of one pull's nonce, so it names that pull alone, and the
// snapshotter takes it (Redeem) once, within the grants' lifetime: a
// digest or annotation learned anywhere (a log, a shared manifest, another
// namespace's pull) names nothing a runtime can mount.
type PullGrants struct {
	key LayerKey
	ttl time.Duration
	now func() time.Time

	mu     sync.Mutex
	issued map[digest.Digest]pullGrant // by the layer's digest
}

type pullGrant struct {
	layer   RemoteLayer
	expires time.Time
}

// maxGrants bounds the grants outstanding: past it, the oldest go first.
const maxGrants = 4096

// ErrNoGrant says a remote layer was not handed to a pull that may still
// take it.
var ErrNoGrant = errors.New("no pull was handed this remote layer just now")

// NewPullGrants mints remote layers under key, each to be taken within ttl.
func NewPullGrants(key LayerKey, ttl time.Duration) *PullGrants {
	return &PullGrants{key: key, ttl: ttl, now: time.Now, issued: map[digest.Digest]pullGrant{}}
}

// Issue mints the remote layer of reader's pull of a volume's version,
// with its digest.
func (g *PullGrants) Issue(reader, version string) (RemoteLayer, digest.Digest, error) {
	var nonce [16]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return RemoteLayer{}, "", err
	}
	l := RemoteLayer{Reader: reader, Version: version, Pull: hex.EncodeToString(nonce[:])}
	d := g.key.Digest(l)
	now := g.now()
	g.mu.Lock()
	defer g.mu.Unlock()
	g.dropExpired(now)
	if len(g.issued) >= maxGrants {
		var oldest digest.Digest
		for d, gr := range g.issued {
			if oldest == "" || gr.expires.Before(g.issued[oldest].expires) {
				oldest = d
			}
		}
		delete(g.issued, oldest)
	}
	g.issued[d] = pullGrant{layer: l, expires: now.Add(g.ttl)}
	return l, d, nil
}

// Redeem takes the grant of the remote layer l with digest d: it must be
// the key's, handed to a pull, unexpired and not taken before.
func (g *PullGrants) Redeem(l RemoteLayer, d digest.Digest) error {
	if l.Pull == "" || !g.key.Valid(l, d) {
		return ErrNoGrant
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	gr, ok := g.issued[d]
	if !ok || gr.layer != l || g.now().After(gr.expires) {
		return ErrNoGrant
	}
	delete(g.issued, d)
	return nil
}

// Pending says whether d is a remote layer's digest handed to a pull that
// has not yet taken it.
func (g *PullGrants) Pending(d digest.Digest) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	gr, ok := g.issued[d]
	return ok && !g.now().After(gr.expires)
}

func (g *PullGrants) dropExpired(now time.Time) {
	for d, gr := range g.issued {
		if now.After(gr.expires) {
			delete(g.issued, d)
		}
	}
}
