// Package snapshotter is cowvol's containerd snapshotter, served as a
// proxy plugin on a unix socket: it lets the node's runtime run a step
// image straight on a cached volume's layers, so that starting a container
// from a 10 GiB image volume costs what one from 10 MiB does.
//
// It is containerd's own overlay snapshotter for every snapshot, but one:
// when the unpacker prepares a layer that the node's registry handed to a
// pull just now as a remote layer (package image: the rootfs/ of a
// rootfs-format image volume, its digest the node key's MAC of who reads
// which volume for which pull), it takes the pull's grant, commits an
// empty snapshot in its place and answers that it exists, so the layer is
// never fetched. A remote layer's annotation or digest found anywhere else
// (another image, a replay of the same pull) mounts nothing. The mounts of every snapshot built on it then
// stack the volume's own layer dirs (their rootfs/) where that empty dir
// would be. Each such snapshot holds the volume through Volumes (the node
// engine, recorded in its metadata) until the runtime removes it: a
// volume a container runs on is neither evicted nor freed.
//
// It owns the snapshotter's root dir and nothing of the cache: volumes are
// reached through Volumes alone, and only ever read.
package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/plugins/snapshots/overlay"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/image"
	"github.com/concourse/cowvol/pkg/volume"
)

// Volumes are the node's cached volumes, as the snapshotter holds them.
type Volumes interface {
	// ImageRootfs holds, for holder, the volume namespace reads as an
	// image if it is still of version, and returns the dirs, top first,
	// that stack into its rootfs/.
	ImageRootfs(holder, namespace string, r volume.Ref, version string) ([]string, error)
	// ReleaseImage ends holder's holds.
	ReleaseImage(holder string) error
	// ImageHolders lists the holders that hold volumes.
	ImageHolders() []string
}

// Labels the snapshotter keeps on the snapshot standing in for a remote
// layer. Only it sets them: containerd passes a manifest's annotations on
// as labels only under containerd.io/snapshot/.
const (
	labelRemote = "cowvol.concourse-ci.org/remote-layer" // the verified image.RemoteLayer
	labelDir    = "cowvol.concourse-ci.org/empty-dir"    // the dir mounts name in its place
)

// Snapshotter is containerd's overlay snapshotter with remote layers.
type Snapshotter struct {
	cleaner
	grants *image.PullGrants
	vols   Volumes
}

// cleaner is a snapshotter that frees removed snapshots' dirs on demand,
// as containerd's overlay snapshotter does.
type cleaner interface {
	snapshots.Snapshotter
	snapshots.Cleaner
}

// New opens the snapshotter rooted at root (made if missing), mounting the
// remote layers grants hand out. Volumes held for snapshots the runtime
// removed while no snapshotter ran are released.
func New(ctx context.Context, root string, grants *image.PullGrants, vols Volumes) (*Snapshotter, error) {
	sn, err := overlay.NewSnapshotter(root)
	if err != nil {
		return nil, err
	}
	inner, ok := sn.(cleaner)
	if !ok {
		sn.Close()
		return nil, errors.New("containerd's overlay snapshotter has no Cleanup")
	}
	s := &Snapshotter{cleaner: inner, grants: grants, vols: vols}
	for _, holder := range vols.ImageHolders() {
		if _, err := inner.Stat(ctx, holder); !errdefs.IsNotFound(err) {
			continue
		}
		if err := vols.ReleaseImage(holder); err != nil {
			inner.Close()
			return nil, err
		}
		klog.InfoS("Released the volumes of a step image snapshot the runtime no longer has", "snapshot", holder)
	}
	return s, nil
}

// Prepare makes an active snapshot; for a remote layer, the snapshot that
// stands in for it, answering AlreadyExists.
func (s *Snapshotter) Prepare(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	var info snapshots.Info
	for _, o := range opts {
		if err := o(&info); err != nil {
			return nil, err
		}
	}
	if value, ok := info.Labels[image.RemoteLayerAnnotation]; ok {
		return nil, s.prepareRemote(ctx, key, parent, value, info.Labels)
	}
	return s.create(ctx, key, parent, s.cleaner.Prepare, opts)
}

// View makes a read-only snapshot.
func (s *Snapshotter) View(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	return s.create(ctx, key, parent, s.cleaner.View, opts)
}

// create makes a snapshot over parent; over a remote layer, it holds the
// volume first (recorded before containerd's record, so that a crash
// between leaves a hold New drops, never a snapshot without one).
func (s *Snapshotter) create(ctx context.Context, key, parent string,
	makeSnapshot func(context.Context, string, string, ...snapshots.Opt) ([]mount.Mount, error), opts []snapshots.Opt) ([]mount.Mount, error) {
	// A key in use keeps its holds: this call must not touch them.
	if err := s.unused(ctx, key); err != nil {
		return nil, err
	}
	remotes, err := s.remoteAncestors(ctx, parent)
	if err != nil {
		return nil, err
	}
	dirs, err := s.hold(key, remotes)
	if err != nil {
		return nil, errors.Join(err, s.vols.ReleaseImage(key))
	}
	mounts, err := makeSnapshot(ctx, key, parent, opts...)
	if err != nil {
		if len(remotes) > 0 {
			err = errors.Join(err, s.vols.ReleaseImage(key))
		}
		return nil, err
	}
	return stack(mounts, dirs), nil
}

// Mounts says how to mount a snapshot.
func (s *Snapshotter) Mounts(ctx context.Context, key string) ([]mount.Mount, error) {
	info, err := s.cleaner.Stat(ctx, key)
	if err != nil {
		return nil, err
	}
	remotes, err := s.remoteAncestors(ctx, info.Parent)
	if err != nil {
		return nil, err
	}
	// Holding again under the same key answers the same dirs.
	dirs, err := s.hold(key, remotes)
	if err != nil {
		return nil, err
	}
	mounts, err := s.cleaner.Mounts(ctx, key)
	if err != nil {
		return nil, err
	}
	return stack(mounts, dirs), nil
}

// Commit turns an active snapshot into a committed one, which keeps its
// holds under its new name.
func (s *Snapshotter) Commit(ctx context.Context, name, key string, opts ...snapshots.Opt) error {
	info, err := s.cleaner.Stat(ctx, key)
	if err != nil {
		return err
	}
	if err := s.unused(ctx, name); err != nil {
		return err
	}
	remotes, err := s.remoteAncestors(ctx, info.Parent)
	if err != nil {
		return err
	}
	if _, err := s.hold(name, remotes); err != nil {
		return errors.Join(err, s.vols.ReleaseImage(name))
	}
	if err := s.cleaner.Commit(ctx, name, key, opts...); err != nil {
		if len(remotes) > 0 {
			err = errors.Join(err, s.vols.ReleaseImage(name))
		}
		return err
	}
	return s.vols.ReleaseImage(key)
}

// unused fails with AlreadyExists if a snapshot has the key.
func (s *Snapshotter) unused(ctx context.Context, key string) error {
	_, err := s.cleaner.Stat(ctx, key)
	switch {
	case err == nil:
		return fmt.Errorf("snapshot %s: %w", key, errdefs.ErrAlreadyExists)
	case errdefs.IsNotFound(err):
		return nil
	}
	return err
}

// Remove removes a snapshot and ends its holds.
func (s *Snapshotter) Remove(ctx context.Context, key string) error {
	if err := s.cleaner.Remove(ctx, key); err != nil {
		return err
	}
	return s.vols.ReleaseImage(key)
}

// prepareRemote commits the snapshot standing in for a remote layer and
// answers AlreadyExists; anything it cannot vouch for fails, so that the
// unpacker never fetches (a remote layer's blob does not exist).
func (s *Snapshotter) prepareRemote(ctx context.Context, key, parent, value string, labels map[string]string) error {
	target := labels[snapshots.LabelSnapshotRef]
	layer, ref, err := image.ParseRemoteLayer(value)
	if err != nil {
		return fmt.Errorf("%w: %v", errdefs.ErrInvalidArgument, err)
	}
	// A remote layer is an image's only layer: its chain ID is its
	// digest. It is the grant of one pull, taken once.
	if parent != "" || s.grants.Redeem(layer, digest.Digest(target)) != nil {
		return fmt.Errorf("layer %s for %s was not handed to this pull by this node's image registry: %w", target, ref, errdefs.ErrPermissionDenied)
	}
	// The volume must still be there for its reader; nothing holds it
	// until a container's snapshot does.
	if _, err := s.vols.ImageRootfs(key, layer.Reader, ref, layer.Version); err != nil {
		return fmt.Errorf("step image %s: %w", ref, err)
	}
	if err := s.vols.ReleaseImage(key); err != nil {
		return err
	}
	kept := map[string]string{snapshots.LabelSnapshotRef: target, labelRemote: value}
	mounts, err := s.cleaner.Prepare(ctx, key, "", snapshots.WithLabels(kept))
	if err != nil {
		return err
	}
	if len(mounts) != 1 || mounts[0].Type != "bind" {
		return errors.Join(fmt.Errorf("an empty snapshot mounts as %v, not one bind mount", mounts), s.cleaner.Remove(ctx, key))
	}
	kept[labelDir] = mounts[0].Source
	if err := s.cleaner.Commit(ctx, remoteName(digest.Digest(target)), key, snapshots.WithLabels(kept)); err != nil {
		return err
	}
	klog.V(2).InfoS("A step image's layer is a volume's rootfs", "volume", ref, "reader", layer.Reader, "chainID", target)
	return fmt.Errorf("remote layer %s: %w", target, errdefs.ErrAlreadyExists)
}

// remoteName is the name of the snapshot standing in for a remote layer.
func remoteName(d digest.Digest) string { return "cowvol-remote-layer " + d.String() }

// IsRemoteLayer says whether d is the chain ID of a remote layer's
// snapshot: the runtime finds it by that digest, whatever image names it.
func (s *Snapshotter) IsRemoteLayer(ctx context.Context, d digest.Digest) (bool, error) {
	_, err := s.cleaner.Stat(ctx, remoteName(d))
	if errdefs.IsNotFound(err) {
		return false, nil
	}
	return err == nil, err
}

// remote is a remote layer a snapshot is built on.
type remote struct {
	layer image.RemoteLayer
	ref   volume.Ref
	dir   string // the empty dir mounts name in its place
}

// remoteAncestors finds the remote layers among parent and its ancestors.
func (s *Snapshotter) remoteAncestors(ctx context.Context, parent string) ([]remote, error) {
	var out []remote
	for p := parent; p != ""; {
		info, err := s.cleaner.Stat(ctx, p)
		if err != nil {
			return nil, err
		}
		if value, ok := info.Labels[labelRemote]; ok {
			layer, ref, err := image.ParseRemoteLayer(value)
			if err != nil {
				return nil, err
			}
			if info.Labels[labelDir] == "" {
				return nil, fmt.Errorf("remote layer %s has no %s label", p, labelDir)
			}
			out = append(out, remote{layer: layer, ref: ref, dir: info.Labels[labelDir]})
		}
		p = info.Parent
	}
	return out, nil
}

// hold holds, for holder, the volumes of the remote layers, and says which
// dirs stand in each one's place. A holder that held them already keeps
// them, whatever befell the volumes since.
func (s *Snapshotter) hold(holder string, remotes []remote) (map[string][]string, error) {
	if len(remotes) == 0 {
		return nil, nil
	}
	dirs := map[string][]string{}
	for _, r := range remotes {
		d, err := s.vols.ImageRootfs(holder, r.layer.Reader, r.ref, r.layer.Version)
		if err != nil {
			return nil, fmt.Errorf("step image %s: %w", r.ref, err)
		}
		dirs[r.dir] = d
	}
	return dirs, nil
}

// stack puts each remote layer's dirs where mounts name its empty dir.
func stack(mounts []mount.Mount, dirs map[string][]string) []mount.Mount {
	if len(dirs) == 0 {
		return mounts
	}
	out := make([]mount.Mount, 0, len(mounts))
	for _, m := range mounts {
		switch m.Type {
		case "bind":
			d, ok := dirs[m.Source]
			if !ok {
				break
			}
			// A view of the remote layer alone: the volume's dirs,
			// read-only.
			if len(d) == 1 {
				m.Source = d[0]
				break
			}
			m = mount.Mount{Type: "overlay", Source: "overlay", Options: []string{"ro", "lowerdir=" + strings.Join(d, ":")}}
		case "overlay":
			opts := make([]string, len(m.Options))
			for i, o := range m.Options {
				if lowers, ok := strings.CutPrefix(o, "lowerdir="); ok {
					var stacked []string
					for _, l := range strings.Split(lowers, ":") {
						if d, ok := dirs[l]; ok {
							stacked = append(stacked, d...)
						} else {
							stacked = append(stacked, l)
						}
					}
					o = "lowerdir=" + strings.Join(stacked, ":")
				}
				opts[i] = o
			}
			m.Options = opts
		}
		out = append(out, m)
	}
	return out
}
