package pull

import (
	"errors"
	"fmt"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/fill"
	"github.com/concourse/cowvol/pkg/overlay"
	"github.com/concourse/cowvol/pkg/volume"
)

// Mode is how a node pulls the sources it lacks.
type Mode string

const (
	// Auto: lazily where the node supports it, else eagerly.
	Auto Mode = "auto"
	// Lazy: a source's tree arrives first, its files as stubs, and the
	// step starts; each file's data arrives when it is first opened, the
	// rest behind it.
	Lazy Mode = "lazy"
	// Eager: all of a source's data arrives before the step starts.
	Eager Mode = "eager"
)

// ParseMode checks a --pull-mode value.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case Auto, Lazy, Eager:
		return m, nil
	}
	return "", fmt.Errorf("pull mode %q: want auto, lazy or eager", s)
}

// ChooseMode decides how a node whose views are made by backend, on
// stateDir, pulls the sources it lacks when asked, and says why: lazily
// only where views read through to the layers (the overlay backend: a
// clone or a snapshot of a stub would hold its holes) and the kernel and
// the state dir's filesystem have fanotify pre-content events. It opens
// nothing; asked lazy where that cannot work, it fails.
func ChooseMode(asked Mode, backend overlay.Kind, stateDir string) (Mode, string, error) {
	if asked == Eager {
		return Eager, "--pull-mode=eager", nil
	}
	why := ""
	if backend != overlay.KindOverlay {
		why = fmt.Sprintf("the %s backend's views copy their layers (a clone or a snapshot of a stub holds its holes)", backend)
	} else if err := fill.Supported(stateDir); err != nil {
		why = err.Error()
	}
	if why == "" {
		return Lazy, "fanotify pre-content events hold readers of stub files under " + stateDir, nil
	}
	if asked == Lazy {
		return "", "", fmt.Errorf("--pull-mode=lazy: %s", why)
	}
	return Eager, why, nil
}

// openLazy opens the fanotify group a lazy pull's readers wait in, where
// the mode chosen is lazy; a group that cannot be opened makes an auto
// node eager (and fails one asked to be lazy). It records the mode in
// force and why.
func (pl *Puller) openLazy(asked, mode Mode, why, stateDir string) error {
	pl.mode, pl.why = mode, why
	if mode != Lazy {
		return nil
	}
	g, err := pl.openGroup(stateDir)
	if err != nil {
		if asked == Lazy {
			return fmt.Errorf("--pull-mode=lazy: %w", err)
		}
		pl.mode, pl.why = Eager, err.Error()
		return nil
	}
	pl.lazy = &lazyPulls{group: g, layers: map[volume.Ref]*lazyFill{}}
	var form string
	pl.lazy.index, form = chooseIndex(pl.cfg.Index, func() error { return IndexSupported(stateDir) })
	pl.why += form
	return nil
}

// chooseIndex says whether lazy pulls mount indexes (asked for, and probe
// finds the node can) or make stub trees, and what the pull mode's reason
// says of it ("" where indexes were not asked for).
func chooseIndex(asked bool, probe func() error) (bool, string) {
	if !asked {
		return false, ""
	}
	if err := probe(); err != nil {
		klog.InfoS("Lazy pulls make stub trees: the node cannot mount a layer's index", "reason", err.Error())
		return false, "; as stub trees, not indexes: " + err.Error()
	}
	return true, "; as indexes mounted file-backed (EROFS), not stub trees"
}

// keeperWait is how long a starting plugin tries to reach its fill keeper
// (the pod's sidecar starts first, but may be slow to listen).
const keeperWait = 10 * time.Second

// openGroup opens the fanotify group, kept by the fill keeper where there
// is one. A keeper that cannot be reached leaves the group unkept, said in
// the log and in the mode's why: a node that pulls is worth more than one
// that refuses to start.
func (pl *Puller) openGroup(stateDir string) (*fill.Group, error) {
	if pl.cfg.FillKeeper == "" {
		return fill.Open(stateDir, pl.cfg.Wait)
	}
	kept := fill.Kept{Socket: pl.cfg.FillKeeper, Unfinished: pl.unfinishedLayers}
	deadline := time.Now().Add(keeperWait)
	for {
		g, err := fill.OpenKept(stateDir, pl.cfg.Wait, kept)
		if err == nil || !errors.Is(err, fill.ErrNoKeeper) {
			return g, err
		}
		if time.Now().After(deadline) {
			klog.ErrorS(err, "Lazy fills are not kept across restarts of the plugin: a restart lets the readers of files not filled yet read holes")
			pl.why += "; not kept across restarts: " + err.Error()
			return fill.Open(stateDir, pl.cfg.Wait)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// unfinishedLayers are the data dirs of the volumes not known whole, and
// the index dirs beside them: a previous plugin's lazy fills left stubs or
// blobs in them that no one will fill (recovery fails a volume that was
// filling).
func (pl *Puller) unfinishedLayers() []string {
	var dirs []string
	for _, v := range pl.store.List() {
		if v.State != volume.StateReady && v.Layer != "" {
			dirs = append(dirs, pl.store.DataPath(v), cache.IndexDir(pl.store.DataPath(v)))
		}
	}
	return dirs
}
