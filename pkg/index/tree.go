package index

import (
	"fmt"
	"io"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
)

// Tree is a layer's tree learnt entry by entry, as a puller learns it from
// its holder's metadata stream: indexed as Build indexes the layer on disk,
// the same tree gives the same image and the same blob, so that the puller
// never mounts an image another node made (a crafted image is the kernel's
// attack surface, a tree of entries is not). Entries come parents first,
// as a walk meets them; nothing else about them is trusted.
type Tree struct {
	opt Options
	top *node
	// dirs are the directories added, by name ("" the root): what a
	// child's parent is looked up in. Not every entry: a map of a
	// million paths is most of what a tree of a million files holds. A
	// hard link's target is looked up in its directory (dir.byName), a
	// name added twice found once the tree is sealed.
	dirs map[string]*node
	// files counts the regular files with data added: the extents a
	// seal lays out, made at once, not grown by doubling.
	files  int
	layout *Layout // once sealed
}

// Entry is one entry of a Tree.
type Entry struct {
	// Name is slash-separated, relative and clean.
	Name string
	// Stat holds the entry's type and permission bits (Mode), owner,
	// modification time, device and a regular file's size; its other
	// fields are unused.
	Stat   unix.Stat_t
	Xattrs map[string]string
	// Target is a symlink's.
	Target string
	// Data is a regular file's bytes, where the stream carried them
	// whole (a small file): its extent needs no fetch (Layout.Inline).
	Data []byte
	// Sum is what a regular file's bytes hash to, where known.
	Sum filesum.Sum
}

// NewTree starts a tree whose root is root (its Name unused).
func NewTree(opt Options, root Entry) (*Tree, error) {
	if root.Stat.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, fmt.Errorf("a root of mode %o, not a directory", root.Stat.Mode)
	}
	t := &Tree{opt: opt}
	t.top = t.node(root)
	t.dirs = map[string]*node{"": t.top}
	return t, nil
}

// node makes e's node, with what opt keeps of its set-ID bits and
// capabilities (as walk does from a layer on disk).
func (t *Tree) node(e Entry) *node {
	st := attrs{Mode: e.Stat.Mode, Uid: e.Stat.Uid, Gid: e.Stat.Gid, MtimSec: e.Stat.Mtim.Sec, MtimNsec: uint32(e.Stat.Mtim.Nsec),
		Size: e.Stat.Size, Rdev: e.Stat.Rdev}
	n := &node{st: st, sum: e.Sum, extent: -1}
	data := e.Data
	if e.Target != "" {
		data = []byte(e.Target)
	}
	xattrs := e.Xattrs
	if n.st.Mode&unix.S_IFMT != unix.S_IFREG {
		n.st.Size = 0 // a directory's and a symlink's are the image's
	}
	if !t.opt.KeepSetuid {
		if n.st.Mode&unix.S_IFMT == unix.S_IFREG {
			n.st.Mode &^= unix.S_ISUID | unix.S_ISGID
		}
		if _, ok := xattrs[fdtree.CapsXattr]; ok {
			xattrs = cloneWithout(xattrs, fdtree.CapsXattr)
		}
	}
	if len(xattrs) > 0 || data != nil {
		n.rare = &rare{xattrs: xattrs, data: data}
	}
	return n
}

func cloneWithout(m map[string]string, key string) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		if k != key {
			out[k] = v
		}
	}
	return out
}

// Add adds a directory, a regular file, a symlink, a fifo, a socket or a device
// (a whiteout is a character device 0:0) below a directory added before.
func (t *Tree) Add(e Entry) error {
	switch e.Stat.Mode & unix.S_IFMT {
	case unix.S_IFDIR, unix.S_IFLNK, unix.S_IFIFO, unix.S_IFCHR, unix.S_IFBLK, unix.S_IFSOCK:
		if e.Data != nil {
			return fmt.Errorf("%q: data in an entry that is not a regular file", e.Name)
		}
	case unix.S_IFREG:
		if e.Stat.Size < 0 || (e.Data != nil && int64(len(e.Data)) != e.Stat.Size) {
			return fmt.Errorf("%q: %d bytes of data for a size of %d", e.Name, len(e.Data), e.Stat.Size)
		}
	default:
		return fmt.Errorf("%q: an entry of mode %o", e.Name, e.Stat.Mode)
	}
	if e.Stat.Mode&unix.S_IFMT != unix.S_IFLNK && e.Target != "" {
		return fmt.Errorf("%q: a target for an entry that is not a symlink", e.Name)
	}
	parent, base, err := t.parent(e.Name)
	if err != nil {
		return err
	}
	n := t.node(e)
	switch n.st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		t.dirs[e.Name] = n // (a directory added twice is refused by Seal, as any name)
	case unix.S_IFREG:
		if n.st.Size > 0 {
			t.files++
		}
	}
	parent.add(base, n)
	return nil
}

// Link names the regular file added as target once more, as name.
func (t *Tree) Link(name, target string) error {
	var n *node
	if d, base, ok := splitName(target); ok && t.dirs[d] != nil {
		n = t.dirs[d].lookup(base)
	}
	if n == nil || n.st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("%q: a hard link to %q, which is not a regular file added before it", name, target)
	}
	parent, base, err := t.parent(name)
	if err != nil {
		return err
	}
	parent.add(base, n)
	return nil
}

// parent is the directory name goes in, and name's last component,
// which the directory keeps as a string of its own: the whole name, one
// the caller made, need not live as long as the tree.
func (t *Tree) parent(name string) (*node, string, error) {
	dir, base, ok := splitName(name)
	if !ok {
		return nil, "", fmt.Errorf("entry name %q", name)
	}
	parent := t.dirs[dir]
	if parent == nil {
		return nil, "", fmt.Errorf("%q: its directory was not added before it", name)
	}
	return parent, strings.Clone(base), nil
}

// splitName is a name's directory and last component, which must be a
// name a directory can hold.
func splitName(name string) (dir, base string, ok bool) {
	dir, base = "", name
	if i := strings.LastIndexByte(name, '/'); i >= 0 {
		dir, base = name[:i], name[i+1:]
	}
	ok = base != "" && base != "." && base != ".." && len(base) <= unix.NAME_MAX && strings.IndexByte(base, 0) < 0
	return dir, base, ok
}

// Seal says the tree is whole: each directory's entries are sorted, a
// name added twice to one is refused, and the blob is laid out. Nothing
// is added after it.
func (t *Tree) Seal() (*Layout, error) {
	if t.layout != nil {
		return t.layout, nil
	}
	if t.top == nil {
		return nil, fmt.Errorf("a tree written already")
	}
	layout, err := seal(t.top, t.files)
	if err != nil {
		return nil, err
	}
	t.dirs, t.layout = nil, layout
	return layout, nil
}

// Write writes the tree's image to w (sealing it first) and says where
// each regular file's data lies in the blob. A tree is written once.
func (t *Tree) Write(w io.Writer) (*Layout, error) {
	layout, err := t.Seal()
	if err != nil {
		return nil, err
	}
	top := t.top
	t.top = nil
	if err := write(w, top, layout); err != nil {
		return nil, err
	}
	return layout, nil
}
