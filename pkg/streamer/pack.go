package streamer

import (
	"archive/tar"
	"bufio"
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/bufpool"
	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
)

// Pack writes the tree at root to w as a tar stream, encoded with enc, its
// regular files as shape says. Device nodes other than whiteouts and
// sockets cannot be moved: Pack refuses them, saying which.
func Pack(ctx context.Context, root string, w io.Writer, enc Encoding, shape Shape) (Summary, error) {
	return PackFirst(ctx, LayerFiles{Dir: root}, nil, w, enc, shape, Inline{})
}

// PackFirst is Pack with the regular files first (relative to root) at the
// start, in that order, and not again where the walk finds them: how a
// lazy puller gets first what steps read first. A name that is not a
// regular file below root is skipped: the order is a hint. Its files may
// come before their dirs: it is for Files, not Unpack. A StubTar carries
// the small files inline says whole; another shape leaves out those a stub
// tree carried (inline.Through).
//
// Where layer has sums, every regular file's entry of a SparseTar or a
// StubTar carries its sum, and a file that has none in them fails the
// stream: the sums are the layer's, computed from it.
func PackFirst(ctx context.Context, layer LayerFiles, first []string, w io.Writer, enc Encoding, shape Shape, inline Inline) (Summary, error) {
	return pack(layer, w, enc, shape, func(pk *packer, rootFd int, _ func() error) error {
		pk.inline, pk.inlineLeft = inline, inline.Budget
		var rootSt unix.Stat_t // the root too: its owner, mode and xattrs are the volume's
		if err := unix.Fstat(rootFd, &rootSt); err != nil {
			return err
		}
		if err := pk.entry(rootFd, ".", ".", &rootSt); err != nil {
			return err
		}
		sent := make(map[string]bool, len(first))
		for _, name := range first {
			if err := ctx.Err(); err != nil {
				return err
			}
			if sent[name] {
				continue
			}
			// Its other names, if it has any, follow as links to it.
			err := pk.file(rootFd, name, false)
			if errors.Is(err, ErrNoPath) || errors.Is(err, ErrWrongKind) {
				continue
			}
			if err != nil {
				return err
			}
			sent[name] = true
		}
		// Walked from descriptors: a tree of any depth goes, however
		// long its paths. What was sent first (regular files only) is
		// not even stat'ed again.
		return fdtree.Walk(rootFd, fdtree.Visitor{Visit: func(e *fdtree.Entry) (bool, error) {
			if err := ctx.Err(); err != nil {
				return false, err
			}
			if pk.carriedInline(e) {
				return false, nil
			}
			return true, pk.entry(e.Parent, e.Name, e.Path, &e.Stat)
		}, Omit: func(path string) bool { return sent[path] }})
	})
}

// PackFiles writes the regular files names (relative to root) to w as
// Pack does with shape (SparseTar or DataTar), and nothing else: what a
// lazy puller reads ahead. Each is opened beneath root with no symlink
// followed; a name that is not a regular file there fails it (ErrNoPath,
// ErrWrongKind).
func PackFiles(ctx context.Context, layer LayerFiles, names []string, w io.Writer, enc Encoding, shape Shape) (Summary, error) {
	return pack(layer, w, enc, shape, func(pk *packer, rootFd int, flush func() error) error {
		for i, name := range names {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := pk.file(rootFd, name, true); err != nil {
				return err
			}
			if i == 0 {
				// A reader waits for the first: it goes now, not once
				// the buffers are full.
				if err := pk.drain(0); err != nil {
					return err
				}
				if err := flush(); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// file writes the entry of the regular file rel below the dir open as
// root: whole, never as a link to a name sent before, if whole is set.
func (pk *packer) file(root int, rel string, whole bool) error {
	dir, err := pk.dirOf(root, rel)
	if err != nil {
		return err
	}
	st, err := regularIn(dir, rel)
	if err != nil {
		return err
	}
	if whole {
		st.Nlink = 1
	}
	return pk.entry(dir, path.Base(rel), rel, &st)
}

// dirOf is the dir of rel below root, opened as openDirBeneath does, or
// kept from the file before: files named one after another (a read order,
// a read-ahead) are mostly in one dir, and a path walk each cost the
// sender a third more CPU than walking the tree.
func (pk *packer) dirOf(root int, rel string) (int, error) {
	want := path.Dir(rel)
	if pk.dir >= 0 && pk.dirPath == want {
		return pk.dir, nil
	}
	fd, err := openDirBeneath(root, rel)
	if err != nil {
		return -1, err
	}
	pk.closeDir()
	pk.dir, pk.dirPath = fd, want
	return fd, nil
}

func (pk *packer) closeDir() {
	if pk.dir >= 0 {
		unix.Close(pk.dir)
		pk.dir = -1
	}
}

// regularBeneath finds the regular file rel below the dir open as root,
// following no symlink on the way, and returns its dir, open (the caller
// closes it), and its stat. Nothing there is ErrNoPath; anything but a
// regular file, ErrWrongKind.
func regularBeneath(root int, rel string) (dir int, st unix.Stat_t, err error) {
	if dir, err = openDirBeneath(root, rel); err != nil {
		return -1, st, err
	}
	if st, err = regularIn(dir, rel); err != nil {
		unix.Close(dir)
		return -1, st, err
	}
	return dir, st, nil
}

// openDirBeneath opens the dir of rel below the dir open as root,
// following no symlink on the way (missing: ErrNoPath).
func openDirBeneath(root int, rel string) (int, error) {
	dir, err := fdtree.OpenBeneath(root, path.Dir(rel))
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV) {
		return -1, fmt.Errorf("%s: %w", rel, ErrNoPath)
	}
	return dir, err
}

// regularIn stats rel's last component in dir, its dir: nothing there is
// ErrNoPath; anything but a regular file, ErrWrongKind.
func regularIn(dir int, rel string) (unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dir, path.Base(rel), &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return st, fmt.Errorf("%s: %w", rel, ErrNoPath)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return st, fmt.Errorf("%s is not a regular file: %w", rel, ErrWrongKind)
	}
	return st, nil
}

// pack writes the entries add writes as a tar stream encoded with enc,
// its regular files as shape says; flush sends what add wrote so far.
func pack(layer LayerFiles, w io.Writer, enc Encoding, shape Shape, add func(pk *packer, rootFd int, flush func() error) error) (Summary, error) {
	// Buffered: a tar writes 512-byte headers, and a socket write each
	// would cost more than the file.
	bw, releaseBuffer := fromPool[*bufio.Writer](&bufWriters, w)
	defer releaseBuffer()
	ew, release, err := enc.writer(bw)
	if err != nil {
		return Summary{}, err
	}
	defer release() // before bw goes back: a stopping encoder may still write to it
	buf := bufpool.Get(streamBuffer)
	defer bufpool.Put(buf)
	c := newCounter(layer.swarm)
	pk := &packer{tw: newTarWriter(io.MultiWriter(ew, c)), seen: map[[2]uint64]string{}, shape: shape, buf: buf, dir: -1, sums: layer.Sums, find: layer.Sums.Finder()}
	defer pk.closeDir()
	defer pk.discard()
	rootFd, err := unix.Open(layer.Dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return Summary{}, err
	}
	defer unix.Close(rootFd)
	flush := func() error {
		if err := pk.tw.Flush(); err != nil {
			return err
		}
		if f, ok := ew.(interface{ Flush() error }); ok {
			if err := f.Flush(); err != nil {
				return err
			}
		}
		return bw.Flush()
	}
	err = add(pk, rootFd, flush)
	if err == nil {
		err = pk.drain(0)
	}
	if err == nil {
		err = pk.tw.Close()
	}
	if err == nil {
		err = ew.Close()
	}
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		return Summary{}, err
	}
	return c.summary(pk.entries), nil
}

// streamBuffer is what each end buffers of a stream.
const streamBuffer = 256 << 10

// packer writes a tree's entries.
type packer struct {
	tw    *tarWriter
	seen  map[[2]uint64]string // first names of files with several links
	shape Shape
	buf   []byte // one copy buffer for every file
	// dir is the dir of the last file named (-1: none), at dirPath.
	dir     int
	dirPath string
	// ahead are the entries made and not written yet, in order, whose
	// files' data the kernel reads meanwhile; aheadBytes is their data.
	ahead      []aheadEntry
	aheadBytes int64
	// inline is which small files a StubTar carries whole (inlineLeft:
	// what its budget has left, -1 once a file did not fit), or, in
	// another shape, which ones a stub tree carried.
	inline     Inline
	inlineLeft int64
	entries    int64 // made so far
	// sums are the layer's files' (nil: none go with them).
	sums *filesum.Table
	find *filesum.Finder // of sums
}

// inlines says whether a StubTar carries the regular file of size bytes
// the walk is at whole, and takes it from the budget.
func (pk *packer) inlines(size int64) bool {
	if size <= 0 || size > pk.inline.Max || pk.inlineLeft < 0 {
		return false
	}
	if size > pk.inlineLeft {
		pk.inlineLeft = -1 // none after it: see Inline
		return false
	}
	pk.inlineLeft -= size
	return true
}

// carriedInline says whether e is a regular file a stub tree carried whole
// (see Inline), which a stream of the rest of the layer's data leaves out.
func (pk *packer) carriedInline(e *fdtree.Entry) bool {
	in := pk.inline
	return pk.shape != StubTar && in.Through != "" && e.Stat.Mode&unix.S_IFMT == unix.S_IFREG &&
		e.Stat.Size > 0 && e.Stat.Size <= in.Max && walkCompare(e.Path, in.Through) <= 0
}

// walkCompare orders paths as fdtree.Walk meets them: component by
// component, each dir's names in byte order, a dir before what is in it.
func walkCompare(a, b string) int {
	for {
		ha, ra, moreA := strings.Cut(a, "/")
		hb, rb, moreB := strings.Cut(b, "/")
		if c := strings.Compare(ha, hb); c != 0 {
			return c
		}
		if !moreA || !moreB {
			return cmp.Compare(len(ra), len(rb))
		}
		a, b = ra, rb
	}
}

// An aheadEntry is an entry made, its file (if it has data) open and asked
// to be read into the page cache, and not written yet.
type aheadEntry struct {
	hdr      *tar.Header
	name     string
	file     fdtree.File // -1: no data
	segments [][2]int64  // where its data is (nil: all of it)
	size     int64       // the file's, holes and all
	sum      filesum.Sum // the layer's sum of it, if summed
	summed   bool
}

// The entries a packer keeps ahead of the one it writes: a tree's files
// read one after the other wait for the disk once each (a small file is
// one request), and with their reads asked for in advance they are in
// memory by the time they are written. Bounded in files (descriptors held)
// and bytes (page cache taken ahead of the wire).
const (
	aheadFiles = 64
	aheadBytes = 8 << 20
)

// entry writes the entry base of the directory open as dir, named name in
// the archive, whose stat is st: it is made now, its data read ahead, and
// written once the entries ahead of it exceed their bounds (or at drain).
func (pk *packer) entry(dir int, base, name string, st *unix.Stat_t) error {
	if pk.shape == DataTar && !pk.carriesData(st) {
		return nil
	}
	e, err := pk.make(dir, base, name, st)
	if err != nil {
		return err
	}
	pk.entries++
	if e.file >= 0 {
		// A hint: where the kernel cannot, the reads wait as they would.
		_ = unix.Fadvise(int(e.file), 0, st.Size, unix.FADV_WILLNEED)
		pk.aheadBytes += e.hdr.Size
	}
	pk.ahead = append(pk.ahead, e)
	for len(pk.ahead) > aheadFiles || pk.aheadBytes > aheadBytes {
		if err := pk.writeFirst(); err != nil {
			return err
		}
	}
	return nil
}

// drain writes the entries made until at most n are left.
func (pk *packer) drain(n int) error {
	for len(pk.ahead) > n {
		if err := pk.writeFirst(); err != nil {
			return err
		}
	}
	return nil
}

// discard lets go of the entries made and not written (the stream failed).
func (pk *packer) discard() {
	for _, e := range pk.ahead {
		if e.file >= 0 {
			unix.Close(int(e.file))
		}
	}
	pk.ahead, pk.aheadBytes = nil, 0
}

// writeFirst writes the first entry made and not written.
func (pk *packer) writeFirst() error {
	e := pk.ahead[0]
	pk.ahead[0] = aheadEntry{}
	pk.ahead = pk.ahead[1:]
	if e.file >= 0 {
		defer unix.Close(int(e.file))
		pk.aheadBytes -= e.hdr.Size
	}
	return pk.write(e)
}

// carriesData says whether a DataTar has an entry for the file whose stat
// is st: a regular file with data, met under none of its names before.
func (pk *packer) carriesData(st *unix.Stat_t) bool {
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size == 0 {
		return false
	}
	_, seen := pk.seen[[2]uint64{st.Dev, st.Ino}]
	return !seen || st.Nlink <= 1 // as make tells a link from a file
}

// make makes the entry base of the directory open as dir, named name in
// the archive, whose stat is st: its header, and its file opened if its
// data goes.
func (pk *packer) make(dir int, base, name string, st *unix.Stat_t) (aheadEntry, error) {
	hdr := &tar.Header{Name: name, Format: tar.FormatPAX}
	e := aheadEntry{hdr: hdr, name: name, file: -1}
	if pk.shape != DataTar { // a DataTar's entries are names and data: the stub tree carried the rest
		hdr.Mode, hdr.Uid, hdr.Gid, hdr.ModTime = int64(st.Mode&0o7777), int(st.Uid), int(st.Gid), time.Unix(st.Mtim.Unix())
		xattrs, err := fdtree.Xattrs(dir, base)
		if err != nil {
			return e, fmt.Errorf("%s: %w", name, err)
		}
		if len(xattrs) > 0 {
			hdr.PAXRecords = map[string]string{}
			for k, v := range xattrs {
				hdr.PAXRecords[paxXattr+k] = v
			}
		}
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		hdr.Typeflag, hdr.Name = tar.TypeDir, name+"/"
	case unix.S_IFLNK:
		target, err := fdtree.Readlink(dir, base)
		if err != nil {
			return e, fmt.Errorf("%s: %w", name, err)
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
	case unix.S_IFREG:
		key := [2]uint64{st.Dev, st.Ino}
		if first, ok := pk.seen[key]; ok && st.Nlink > 1 {
			hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
			break
		}
		if st.Nlink > 1 {
			pk.seen[key] = name
		}
		hdr.Typeflag, hdr.Size = tar.TypeReg, st.Size
		// (Looked up as the walk meets it, where the finder is quick;
		// write checks what it sends against it.)
		e.sum, e.summed = pk.find.Sum(name)
		if pk.sums != nil && (pk.shape == SparseTar || pk.shape == StubTar) {
			if !e.summed {
				return e, fmt.Errorf("%s has no sum among the layer's (%d): they are not this layer's", name, pk.sums.Len())
			}
			if hdr.PAXRecords == nil {
				hdr.PAXRecords = map[string]string{}
			}
			hdr.PAXRecords[paxSum] = e.sum.String()
		}
		if pk.shape == StubTar && !pk.inlines(st.Size) {
			if st.Size > 0 {
				if hdr.PAXRecords == nil {
					hdr.PAXRecords = map[string]string{}
				}
				hdr.PAXRecords[paxHoles], hdr.Size = formatHoles(st.Size, nil)
			}
			break // no data: the file is not even opened
		}
		fd, err := unix.Openat(dir, base, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return e, fmt.Errorf("%s: %w", name, err)
		}
		file := fdtree.File(fd)
		if pk.shape != PlainTar && st.Blocks*512 < st.Size {
			if e.segments, err = dataSegments(file, st.Size); err != nil {
				unix.Close(fd)
				return e, fmt.Errorf("%s: %w", name, err)
			}
			if e.segments != nil {
				if hdr.PAXRecords == nil {
					hdr.PAXRecords = map[string]string{}
				}
				hdr.PAXRecords[paxHoles], hdr.Size = formatHoles(st.Size, e.segments)
			}
		}
		e.file, e.size = file, st.Size
	case unix.S_IFCHR:
		if st.Rdev != 0 {
			return e, fmt.Errorf("%s is a device node (%d:%d): only whiteouts (0:0) can be moved", name, unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		hdr.Typeflag = tar.TypeChar
	case unix.S_IFIFO:
		hdr.Typeflag = tar.TypeFifo
	default:
		return e, fmt.Errorf("%s is a %s: it cannot be moved", name, fs.FileMode(st.Mode).Type())
	}
	return e, nil
}

// write writes e's header, and its data if it has any.
func (pk *packer) write(e aheadEntry) error {
	if err := pk.tw.WriteHeader(e.hdr); err != nil {
		return fmt.Errorf("%s: %w", e.name, err)
	}
	if e.file < 0 {
		return nil
	}
	segments := e.segments
	if segments == nil {
		segments = [][2]int64{{0, e.hdr.Size}}
	}
	// What is sent is checked against the layer's sum as it goes: a
	// holder whose disk rotted learns it here (the puller refuses the
	// bytes anyway).
	var h hash.Hash
	want, check := e.sum, e.summed
	if check {
		h = sha256.New()
	}
	var at int64
	for _, s := range segments {
		to := io.Writer(pk.tw)
		if check {
			writeZeros(h, s[0]-at)
			to = io.MultiWriter(pk.tw, h)
		}
		if n, err := io.CopyBuffer(to, io.NewSectionReader(e.file, s[0], s[1]), pk.buf); err != nil {
			return fmt.Errorf("%s: %w", e.name, err)
		} else if n != s[1] {
			return fmt.Errorf("%s changed while it was read", e.name)
		}
		at = s[0] + s[1]
	}
	if check {
		writeZeros(h, e.size-at)
		if filesum.Sum(h.Sum(nil)) != want {
			return fmt.Errorf("%w: %s: %w", ErrRotten, e.name, filesum.ErrMismatch)
		}
	}
	return nil
}

// ErrRotten says a holder's copy of a layer is not what it was captured
// with: its disk changed it since.
var ErrRotten = errors.New("this node's copy of the layer is not what it was captured with")

// zeros is what writeZeros writes from, never written to: one on its stack
// escaped to the heap, 8 KiB made for every file a holder sent.
var zeros [4096]byte

// writeZeros writes n zeros to w (a hole's, into a sum).
func writeZeros(w io.Writer, n int64) {
	for n > 0 {
		k := min(n, int64(len(zeros)))
		_, _ = w.Write(zeros[:k])
		n -= k
	}
}
