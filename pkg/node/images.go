package node

import (
	"errors"
	"fmt"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/volume"
)

// ImageRootfs holds, for the container runtime's snapshot holder, the
// volume namespace reads as a step image, if it is still the content
// version named, and returns the dirs, top first, whose overlay is the
// image's root filesystem (the rootfs/ of registry-image's rootfs
// format). The hold is recorded: it outlives this process, and the volume
// is neither evicted nor freed (a destroy hides it at once) until
// ReleaseImage. A volume namespace may not read, or of another version,
// fails as one the node does not hold.
func (e *Engine) ImageRootfs(holder, namespace string, r volume.Ref, version string) ([]string, error) {
	chain, err := e.store.HoldImage(holder, r, func(v cache.Volume) error {
		// A container may start on a volume still filling, as a step's
		// view may: reads wait for the data they touch.
		if !v.ReadableAs(namespace, volume.NeedTree) || versionOf(r, v) != version {
			return notHeld(r, namespace)
		}
		return nil
	})
	if errors.Is(err, cache.ErrNotFound) {
		return nil, notHeld(r, namespace)
	}
	if err != nil {
		return nil, err
	}
	dirs, err := overlay.SubdirLayers(chain, "rootfs")
	if err != nil {
		return nil, errors.Join(fmt.Errorf("volume %s holds no image root filesystem: %w", r, err), e.ReleaseImage(holder))
	}
	return dirs, nil
}

// ReleaseImage ends the holds of the runtime's snapshot holder.
func (e *Engine) ReleaseImage(holder string) error {
	if err := e.store.ReleaseImage(holder); err != nil {
		return err
	}
	e.kick(e.reaper) // a destroy may have waited for the image to go
	return nil
}

// ImageHolders lists the runtime's snapshots that hold volumes, for the
// snapshotter to drop those the runtime no longer has.
func (e *Engine) ImageHolders() []string { return e.store.ImageHolders() }
