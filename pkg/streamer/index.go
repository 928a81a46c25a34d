package streamer

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/pkg/filesum"
	"github.com/concourse/cowvol/pkg/index"
)

// IndexStubs reads a StubTar stream as UnpackStubs does, but makes nothing
// on disk: it learns the tree into an index.Tree, which its caller writes
// as the image it mounts, whatever the tree's file count. It checks every
// entry as an extraction does (names, xattrs, links to files before them,
// devices, the small files inline asked for and their sums), and takes
// only a packer's stream, its root first. The tree's small files carry
// their data, and its regular files their sums where lim.Summed.
func IndexStubs(ctx context.Context, r io.Reader, enc Encoding, lim Limits, inline Inline) (*index.Tree, Summary, error) {
	if lim.Strict {
		return nil, Summary{}, errors.New("a stub tree is a peer's stream, never strict")
	}
	x := &indexer{lim: lim, inline: inline}
	sum, err := readArchive(ctx, r, enc, lim, x.entry)
	if err == nil && x.tree == nil {
		err = refused("an empty stub tree")
	}
	if err == nil && lim.Summed {
		sum.Files, err = x.listing.Digest()
	}
	if err != nil {
		return nil, Summary{}, err
	}
	sum.Inlined = x.inlined
	return x.tree, sum, nil
}

// indexer learns a stub tree's entries into an index.Tree.
type indexer struct {
	tree    *index.Tree
	lim     Limits
	inline  Inline
	inlined string
	listing filesum.Listing
}

func (x *indexer) entry(hdr *tar.Header, body io.Reader) error {
	if x.tree == nil {
		if hdr.Name != rootName || hdr.Typeflag != tar.TypeDir {
			return refused("a stub tree whose first entry, %q, is not its root", hdr.Name)
		}
		root, err := x.entryOf(rootName, hdr, unix.S_IFDIR)
		if err != nil {
			return err
		}
		x.tree, err = index.NewTree(index.Options{KeepSetuid: x.lim.KeepSetuid}, root)
		return err
	}
	if hdr.Name == rootName {
		return refused("a root entry (%q) that is not the first", hdr.Name)
	}
	name, err := cleanName(hdr.Name)
	if err != nil {
		return err
	}
	var e index.Entry
	switch hdr.Typeflag {
	case tar.TypeDir:
		e, err = x.entryOf(name, hdr, unix.S_IFDIR)
	case tar.TypeReg:
		e, err = x.file(name, hdr, body)
	case tar.TypeSymlink:
		e, err = x.entryOf(name, hdr, unix.S_IFLNK)
		e.Stat.Mode, e.Target = unix.S_IFLNK|0o777, hdr.Linkname // a symlink's mode is never set
	case tar.TypeLink:
		target, err := cleanName(hdr.Linkname)
		if err != nil {
			return refused("%s: hardlink to %q", name, hdr.Linkname)
		}
		if err := x.tree.Link(name, target); err != nil {
			return refused("%v", err)
		}
		if x.lim.Summed {
			x.listing.Link(name, target)
		}
		return nil
	case tar.TypeChar:
		if hdr.Devmajor != 0 || hdr.Devminor != 0 {
			return refused("%s: device node %d:%d (only whiteouts, 0:0, are moved)", name, hdr.Devmajor, hdr.Devminor)
		}
		e, err = x.entryOf(name, hdr, unix.S_IFCHR)
	case tar.TypeFifo:
		e, err = x.entryOf(name, hdr, unix.S_IFIFO)
	default:
		return refused("%s: entry type %q", name, hdr.Typeflag)
	}
	if err != nil {
		return err
	}
	if err := x.tree.Add(e); err != nil {
		return refused("%v", err)
	}
	return nil
}

// entryOf is the entry hdr says, of type kind, named name: its mode,
// owner, time and the xattrs that travel.
func (x *indexer) entryOf(name string, hdr *tar.Header, kind uint32) (index.Entry, error) {
	if err := checkEntry(name, hdr, false); err != nil {
		return index.Entry{}, err
	}
	if hdr.Uid < 0 || hdr.Uid > math.MaxUint32 || hdr.Gid < 0 || hdr.Gid > math.MaxUint32 {
		return index.Entry{}, refused("%s: owner %d:%d", name, hdr.Uid, hdr.Gid)
	}
	e := index.Entry{Name: name}
	e.Stat.Mode = kind | uint32(hdr.Mode&0o7777)
	e.Stat.Uid, e.Stat.Gid = uint32(hdr.Uid), uint32(hdr.Gid)
	e.Stat.Mtim = fileTime(hdr)
	for k, v := range hdr.PAXRecords {
		if xattr, ok := strings.CutPrefix(k, paxXattr); ok {
			if e.Xattrs == nil {
				e.Xattrs = map[string]string{}
			}
			e.Xattrs[xattr] = v
		}
	}
	return e, nil
}

// file is the regular file hdr says: a stub (its size in its sparse map,
// no data), or a small file carried whole, checked against its sum.
func (x *indexer) file(name string, hdr *tar.Header, body io.Reader) (index.Entry, error) {
	e, err := x.entryOf(name, hdr, unix.S_IFREG)
	if err != nil {
		return e, err
	}
	if hdr.Size < 0 {
		return e, refused("%s: size %d", name, hdr.Size)
	}
	segments, size := [][2]int64{{0, hdr.Size}}, hdr.Size
	if rec, ok := hdr.PAXRecords[paxHoles]; ok {
		if size, segments, err = parseHoles(rec, hdr.Size); err != nil {
			return e, err
		}
	}
	e.Stat.Size = size
	if x.lim.Summed {
		if e.Sum, err = entrySum(name, hdr); err != nil {
			return e, err
		}
		x.listing.File(name, e.Sum)
	}
	if isStub(hdr) {
		return e, nil
	}
	// Its size, not its body's: the data is made whole here, and a sparse
	// map may say a size of terabytes over a body of a few bytes. A packer
	// inlines by size too.
	if err := x.inline.take(name, size); err != nil {
		return e, err
	}
	x.inlined = name
	e.Data = make([]byte, size) // at most inline.Max: holes read as zeros
	for _, s := range segments {
		if _, err := io.ReadFull(body, e.Data[s[0]:s[0]+s[1]]); err != nil {
			return e, fmt.Errorf("%s: %w", name, err)
		}
	}
	if x.lim.Summed {
		if err := filesum.Check(bytes.NewReader(e.Data), e.Sum); errors.Is(err, filesum.ErrMismatch) {
			return e, fmt.Errorf("%w: %s: %w", ErrCorrupt, name, err)
		}
	}
	return e, nil
}
