package overlay

import (
	"context"
	"fmt"
	"path"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
)

// VisibleFiles is the table of the regular files an overlay of layers (top
// first) shows, each with its sum in the table of the layer that provides
// it (tables[i] is layers[i]'s own): what a copy of the merged chain would
// hold, computed from the names of the layers above the lowest, without
// a mount or a read of any file's data.
//
// It merges as the kernel does with the options cowvol mounts with (no
// redirects, no metacopy): in a layer above, a whiteout hides the path,
// a dir hides a file below at its path and merges with a dir, and a file,
// a symlink or any other non-dir, or an opaque dir, hides everything
// beneath its path. Xattr whiteouts are not looked for: the kernel makes
// none in the upper dirs of cowvol's mounts, and a step cannot write
// trusted.overlay.* through one.
func VisibleFiles(ctx context.Context, layers []string, tables []*filesum.Table) (*filesum.Table, error) {
	if len(layers) != len(tables) || len(layers) == 0 {
		return nil, fmt.Errorf("%d layers and %d tables", len(layers), len(tables))
	}
	// taken are the paths a layer above has an entry at (a whiteout
	// too); covered are those beneath which it hides everything.
	taken, covered := map[string]struct{}{}, map[string]struct{}{}
	var out filesum.TableBuilder
	for i, table := range tables {
		for p, sum := range table.All() {
			if hidden(p, taken, covered) {
				continue
			}
			out.Add(p, sum)
		}
		if i == len(tables)-1 {
			break // nothing lies beneath the lowest
		}
		if _, all := covered[""]; all {
			break
		}
		if err := namesOf(ctx, layers[i], taken, covered); err != nil {
			return nil, err
		}
	}
	return out.Table(), nil
}

// hidden says whether a layer's file at p is hidden by the layers above.
func hidden(p string, taken, covered map[string]struct{}) bool {
	if _, ok := taken[p]; ok {
		return true
	}
	if len(covered) == 0 {
		return false
	}
	for dir := p; ; {
		if dir = path.Dir(dir); dir == "." {
			dir = ""
		}
		if _, ok := covered[dir]; ok {
			return true
		}
		if dir == "" {
			return false
		}
	}
}

// namesOf adds what the layer at dir hides beneath it to taken and covered.
func namesOf(ctx context.Context, dir string, taken, covered map[string]struct{}) error {
	root, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("reading layer %s: %w", dir, err)
	}
	defer unix.Close(root)
	var marker [1]byte
	if n, err := unix.Fgetxattr(root, opaqueXattr, marker[:]); err == nil && n == 1 && marker[0] == 'y' {
		covered[""] = struct{}{}
	}
	return fdtree.Walk(root, fdtree.Visitor{Visit: func(e *fdtree.Entry) (bool, error) {
		if err := ctx.Err(); err != nil {
			return false, err
		}
		p := strings.Clone(e.Path)
		taken[p] = struct{}{}
		if !e.IsDir() {
			covered[p] = struct{}{} // a whiteout, a file, a link: nothing of p shows from below
			return false, nil
		}
		n, err := fdtree.GetXattr(e.Parent, e.Name, opaqueXattr, marker[:])
		if err == nil && n == 1 && marker[0] == 'y' {
			covered[p] = struct{}{}
		}
		return true, nil
	}})
}
