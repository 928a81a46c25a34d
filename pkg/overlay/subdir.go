package overlay

import (
	"errors"
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// SubdirLayers says which dirs, top first, stack into what the merged
// chain shows at the top-level entry name: each layer's own name dir,
// down to the first layer that hides everything below it there (an
// opaque dir, a whiteout, or something that is not a dir). An overlay of
// the result (or the one dir, if one) shows exactly what an overlay of
// the chain shows under name, so a subtree of a cached volume can be
// mounted without mounting the volume. Layers without name are passed
// over. No layer having it fails with an error wrapping fs.ErrNotExist.
func SubdirLayers(chain []string, name string) ([]string, error) {
	if name == "" || name == "." || name == ".." || filepath.Base(name) != name {
		return nil, fmt.Errorf("%q is not a top-level entry", name)
	}
	var dirs []string
	for _, layer := range chain {
		p := filepath.Join(layer, name)
		var st unix.Stat_t
		err := unix.Lstat(p, &st)
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			// A whiteout, or a file or link put in the dir's place:
			// nothing of name shows from below.
			break
		}
		dirs = append(dirs, p)
		if opaque(p) {
			break
		}
	}
	if len(dirs) == 0 {
		return nil, fmt.Errorf("no layer has a dir %s: %w", name, unix.ENOENT)
	}
	return dirs, nil
}

// opaqueXattr marks an upper dir that hides the dirs of its name below.
const opaqueXattr = "trusted.overlay.opaque"

// opaque says whether an upper dir hides the dirs of the same name below
// it ("x" marks a dir holding xattr whiteouts, which is not opaque).
func opaque(dir string) bool {
	var buf [1]byte
	n, err := unix.Lgetxattr(dir, opaqueXattr, buf[:])
	return err == nil && n == 1 && buf[0] == 'y'
}
