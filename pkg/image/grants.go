package image

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/concourse/cowvol/internal/expiring"
)

// PullGrants are the remote layers the node's registry handed to pulls
// just now. A remote layer's digest is a MAC of who reads which volume
// and of one pull's nonce, so it names that pull alone, and the
// snapshotter takes it (Redeem) once, within the grants' lifetime: a
// digest or annotation learned anywhere (a log, a shared manifest, another
// namespace's pull) names nothing a runtime can mount.
type PullGrants struct {
	key LayerKey
	now func() time.Time
	// issued are the grants by their layer's digest, owned by their
	// readers.
	issued *expiring.Set[digest.Digest, RemoteLayer]
}

// A reader may hold at most grantsPerReader grants outstanding (past it,
// its oldest go first), and the node at most maxGrants: one namespace's
// burst of pulls never pushes out another's grant.
const (
	grantsPerReader = 512
	maxGrants       = 16384
)

// ErrNoGrant says a remote layer was not handed to a pull that may still
// take it.
var ErrNoGrant = errors.New("no pull was handed this remote layer just now")

// NewPullGrants mints remote layers under key, each to be taken within ttl.
func NewPullGrants(key LayerKey, ttl time.Duration) *PullGrants {
	return &PullGrants{key: key, now: time.Now, issued: expiring.New[digest.Digest, RemoteLayer](ttl, grantsPerReader, maxGrants)}
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
	g.issued.Put(reader, []digest.Digest{d}, l, g.now())
	return l, d, nil
}

// Redeem takes the grant of the remote layer l with digest d: it must be
// the key's, handed to a pull, unexpired and not taken before.
func (g *PullGrants) Redeem(l RemoteLayer, d digest.Digest) error {
	if l.Pull == "" || !g.key.Valid(l, d) {
		return ErrNoGrant
	}
	if _, ok := g.issued.Take(d, g.now(), func(issued RemoteLayer) bool { return issued == l }); !ok {
		return ErrNoGrant
	}
	return nil
}

// Pending says whether d is a remote layer's digest handed to a pull that
// has not yet taken it.
func (g *PullGrants) Pending(d digest.Digest) bool {
	_, ok := g.issued.Get(d, g.now())
	return ok
}
