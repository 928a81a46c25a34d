package node

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/pull"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// OpenVolume opens a read of a ready volume for a peer: all of its data
// is here.
func (h peerHolder) OpenVolume(namespace string, r volume.Ref, path string, format streamer.Format) (streamer.Reading, error) {
	return h.e.OpenVolume(namespace, r, path, format, volume.NeedWhole)
}

// OpenVolume opens a read of a volume namespace may read, present as need
// says, as its pods see it: its chain merged (a read-only overlay, mounted
// in staging for the read, where the chain has more than one layer), the
// path resolved inside it (symlinks and ".." included, never out of it).
// Every volume of the chain is held until the read is closed. A read of a
// volume still filling waits for each file's data as it opens it.
func (e *Engine) OpenVolume(namespace string, r volume.Ref, path string, format streamer.Format, need volume.Need) (streamer.Reading, error) {
	if _, err := e.readable(namespace, r, need); err != nil {
		return streamer.Reading{}, err
	}
	_, dirs, release, err := e.holdChain(r, need)
	if err != nil {
		return streamer.Reading{}, err
	}
	cleanup := []func(){release}
	closeAll := func() {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
	}
	root := dirs[0]
	if len(dirs) > 1 {
		work, err := os.MkdirTemp(e.store.StagingDir(), "read-")
		if err != nil {
			closeAll()
			return streamer.Reading{}, err
		}
		merged := filepath.Join(work, "merged")
		cleanup = append(cleanup, func() {
			if err := overlay.RemoveTree(work); err != nil {
				klog.ErrorS(err, "Removing a read's staging", "dir", work)
			}
		})
		if err := os.Mkdir(merged, 0o700); err != nil {
			closeAll()
			return streamer.Reading{}, err
		}
		if err := e.mounter.Overlay(merged, dirs, "", "", overlay.Attrs{ReadOnly: true}); err != nil {
			closeAll()
			return streamer.Reading{}, err
		}
		cleanup = append(cleanup, func() {
			if err := e.mounter.Unmount(merged); err != nil {
				klog.ErrorS(err, "Unmounting a read's merge; recovery will", "path", merged)
			}
		})
		root = merged
	}
	rd, err := openInside(root, path, format)
	if err != nil {
		closeAll()
		return streamer.Reading{}, fmt.Errorf("volume %s: %w", r, err)
	}
	if format == streamer.FormatTar && rd.Size < 0 {
		rd.Size = chainSize(e, r)
	}
	inner := rd.Close
	rd.Close = func() {
		inner()
		closeAll()
	}
	return rd, nil
}

// readable is a volume namespace may read, present as need says; any
// other fails as one the node does not hold.
func (e *Engine) readable(namespace string, r volume.Ref, need volume.Need) (cache.Volume, error) {
	v, err := e.store.Get(r)
	if errors.Is(err, cache.ErrNotFound) || (err == nil && !v.ReadableAs(namespace, need)) {
		return cache.Volume{}, notHeld(r, namespace)
	}
	return v, err
}

// VolumeVersion names the content of a volume namespace may read, present
// as need says: the same for as long as it is the same volume (a ready
// volume never changes, and a filling one becomes ready as it was pulled;
// one destroyed and made again under its handle is another).
func (e *Engine) VolumeVersion(namespace string, r volume.Ref, need volume.Need) (string, error) {
	v, err := e.readable(namespace, r, need)
	if err != nil {
		return "", err
	}
	return versionOf(r, v), nil
}

func versionOf(r volume.Ref, v cache.Volume) string {
	return r.String() + "@" + strconv.FormatInt(v.CreatedAt.UnixNano(), 10)
}

// chainSize is what a volume's chain holds on disk, as measured (-1 if a
// layer is not measured yet).
func chainSize(e *Engine, r volume.Ref) int64 {
	var total int64
	for cur := r; !cur.IsZero(); {
		v, err := e.store.Get(cur)
		if err != nil || v.SizeBytes < 0 {
			return -1
		}
		total += v.SizeBytes
		cur = v.Base
	}
	return total
}

// openInside opens path beneath root as a chroot would resolve it, and
// checks it is what the format reads.
func openInside(root, path string, format streamer.Format) (streamer.Reading, error) {
	rootFd, err := unix.Open(root, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return streamer.Reading{}, err
	}
	defer unix.Close(rootFd)
	rel := strings.TrimLeft(path, "/")
	if rel == "" {
		rel = "."
	}
	fd, err := unix.Openat2(rootFd, rel, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOCTTY | unix.O_NONBLOCK,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	})
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
		return streamer.Reading{}, fmt.Errorf("%s: %w", volume.Quote(path), streamer.ErrNoPath)
	}
	if err != nil {
		return streamer.Reading{}, fmt.Errorf("%s: %w", volume.Quote(path), err)
	}
	f := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		f.Close()
		return streamer.Reading{}, err
	}
	switch kind := st.Mode & unix.S_IFMT; {
	case format == streamer.FormatFile && kind == unix.S_IFREG:
		return streamer.Reading{File: f, Size: st.Size, Close: func() { f.Close() }}, nil
	case format == streamer.FormatTar && kind == unix.S_IFDIR:
		// The tree is walked through the descriptor: what the path
		// resolved to, whatever its name said.
		return streamer.Reading{Dir: fmt.Sprintf("/proc/self/fd/%d/.", fd), Size: -1, Close: func() { f.Close() }}, nil
	}
	f.Close()
	return streamer.Reading{}, fmt.Errorf("%s is not a %s: %w", volume.Quote(path),
		map[streamer.Format]string{streamer.FormatFile: "regular file (read it as a tar)", streamer.FormatTar: "directory (read it as a file)"}[format],
		streamer.ErrWrongKind)
}

// Receive makes an uploaded tree a cached volume of this node.
func (h peerHolder) Receive(l streamer.Layer, fill func(dir string) (streamer.Summary, error)) error {
	_, err := pull.Receive(h.e.store, h.e.backend.Kind(), l, volume.Digests{}, cache.NewPullID(), func(tree, _ string) (streamer.Summary, error) { return fill(tree) },
		pull.CommitPulled(h.e.store, pullNotifier{e: h.e, origin: true}, l), pull.SyncBefore)
	switch {
	case errors.Is(err, cache.ErrExists):
		return fmt.Errorf("%w: %w", streamer.ErrExists, err)
	case errors.Is(err, cache.ErrBackoff):
		return fmt.Errorf("%w: %w", streamer.ErrRetry, err)
	}
	return err
}
