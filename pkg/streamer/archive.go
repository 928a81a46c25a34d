// Package streamer moves cached volumes between nodes. This part owns the
// wire format: a tar stream that keeps what an overlay layer needs
// (whiteouts as 0/0 character devices, trusted.overlay.* and other
// xattrs, hardlinks, owners, modes, times, holes), an encoding per link,
// a digest and a size over the tar bytes, and an extractor that lets
// nothing in a crafted archive land outside its directory. It reads and
// writes trees it is given; it never touches the node's cache metadata.
package streamer

import (
	"archive/tar"
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cespare/xxhash/v2"
	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/bufpool"
	"github.com/concourse/cowvol/internal/fdtree"
)

// xattrPrefixes are the extended attributes that travel: the overlay's own
// (whiteouts, opaque dirs, redirects), users', and file capabilities (which
// a nosuid mount disarms). Others (SELinux labels, ACLs) belong to the
// node, not the volume.
var xattrPrefixes = []string{"trusted.overlay.", "user.", fdtree.CapsXattr}

func xattrTravels(name string) bool {
	for _, p := range xattrPrefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

const paxXattr = "SCHILY.xattr."

// Summary is what a stream carried: the tar bytes (before encoding), their
// digest, and how many entries.
type Summary struct {
	Bytes   int64
	Entries int64
	Digest  string // "xxh64:<hex>"
	// Inlined is, for UnpackStubs, the last file the stub tree carried
	// whole (see Inline.Through); empty: none.
	Inlined string
}

// counter hashes and counts the tar bytes as they pass. The digest guards
// against corruption between the sender's reads and the receiver's writes
// (a proxy, a bad NIC, a bug); against an attacker, peers have mutual TLS.
// XXH64 runs at memory speed where SHA-256 took a quarter of both ends'
// CPU in a pull.
type counter struct {
	h *xxhash.Digest
	n int64
}

func newCounter() *counter { return &counter{h: xxhash.New()} }

func (c *counter) Write(p []byte) (int, error) {
	_, _ = c.h.Write(p)
	c.n += int64(len(p))
	return len(p), nil
}

func (c *counter) summary(entries int64) Summary {
	return Summary{Bytes: c.n, Entries: entries, Digest: fmt.Sprintf("xxh64:%016x", c.h.Sum64())}
}

// paxHoles is cowvol's own PAX record for a sparse file: its size and the
// data segments ("size offset:length ..."), the body carrying only those.
// Go's archive/tar writes no sparse format, and a hole of gigabytes
// should not cross the wire as zeros. Only cowvol reads it: Pack leaves it
// out (holes travel as zeros) when the tar is for anyone else.
const paxHoles = "COWVOL.holes"

// maxSegments bounds a sparse file's segment list (a PAX record stays well
// under the 1 MiB readers accept); a file more fragmented than that
// travels with its zeros.
const maxSegments = 20_000

// Shape is what a packed tar carries of regular files.
type Shape int

const (
	// PlainTar: every byte, holes as zeros; any tar reader reads it.
	PlainTar Shape = iota
	// SparseTar: sparse files as their data segments only, for Unpack (a
	// plain tar reader would misread them).
	SparseTar
	// StubTar: no data at all, each file a sparse map with no segment, so
	// that Unpack makes it the right size with nothing in it: the stubs a
	// lazy pull fills as they are read.
	StubTar
	// DataTar: only the regular files with data, each once (a file's
	// other names are left out), as SparseTar carries them but with their
	// names and sizes alone: no dirs, links or empty files, no owners,
	// modes, times or xattrs. What fills a lazy pull's stubs (Files), which
	// have all that already; the holder reads and sends no more.
	DataTar
)

// Inline is which small regular files travel whole. In a StubTar: those
// of at most Max bytes, in the walk's order, until one would take their
// data over Budget bytes; from that file on, none (so that they are all
// the small files up to the last one carried). Their puller has them
// complete at once, and a file that small costs less to send than to
// stub and fill. In a stream of the rest of the layer's data: Through is
// the last file the stub tree carried, and the files it carried (those of
// at most Max bytes the walk meets up to Through) are left out.
type Inline struct {
	Max, Budget int64
	Through     string
}

// The bounds of Inline a holder takes: the data a stub tree carries stays
// a small part of it, so that a lazy publish stays flat in the size.
const (
	MaxInlineFile   = 64 << 10
	MaxInlineBudget = 64 << 20
)

// Check says whether a puller's Inline is within bounds.
func (in Inline) Check() error {
	if in.Max < 0 || in.Max > MaxInlineFile || in.Budget < 0 || in.Budget > MaxInlineBudget {
		return fmt.Errorf("inlining files of at most %d bytes, %d in all: want at most %d and %d", in.Max, in.Budget, MaxInlineFile, MaxInlineBudget)
	}
	return nil
}

// Pack writes the tree at root to w as a tar stream, encoded with enc, its
// regular files as shape says. Device nodes other than whiteouts and
// sockets cannot be moved: Pack refuses them, saying which.
func Pack(ctx context.Context, root string, w io.Writer, enc Encoding, shape Shape) (Summary, error) {
	return PackFirst(ctx, root, nil, w, enc, shape, Inline{})
}

// PackFirst is Pack with the regular files first (relative to root) at the
// start, in that order, and not again where the walk finds them: how a
// lazy puller gets first what steps read first. A name that is not a
// regular file below root is skipped: the order is a hint. Its files may
// come before their dirs: it is for Files, not Unpack. A StubTar carries
// the small files inline says whole; another shape leaves out those a stub
// tree carried (inline.Through).
func PackFirst(ctx context.Context, root string, first []string, w io.Writer, enc Encoding, shape Shape, inline Inline) (Summary, error) {
	return pack(root, w, enc, shape, func(pk *packer, rootFd int, _ func() error) error {
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
func PackFiles(ctx context.Context, root string, names []string, w io.Writer, enc Encoding, shape Shape) (Summary, error) {
	return pack(root, w, enc, shape, func(pk *packer, rootFd int, flush func() error) error {
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
func pack(root string, w io.Writer, enc Encoding, shape Shape, add func(pk *packer, rootFd int, flush func() error) error) (Summary, error) {
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
	c := newCounter()
	pk := &packer{tw: newTarWriter(io.MultiWriter(ew, c)), seen: map[[2]uint64]string{}, shape: shape, buf: buf, dir: -1}
	defer pk.closeDir()
	defer pk.discard()
	rootFd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
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
		xattrs, err := readXattrs(dir, base)
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
		e.file = file
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
	for _, s := range segments {
		if n, err := io.CopyBuffer(pk.tw, io.NewSectionReader(e.file, s[0], s[1]), pk.buf); err != nil {
			return fmt.Errorf("%s: %w", e.name, err)
		} else if n != s[1] {
			return fmt.Errorf("%s changed while it was read", e.name)
		}
	}
	return nil
}

// dataSegments are where a sparse file holds data (SEEK_DATA, SEEK_HOLE),
// or nil to send it whole: too fragmented, or the filesystem cannot say.
func dataSegments(f fdtree.File, size int64) ([][2]int64, error) {
	fd := int(f)
	var out [][2]int64
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole from here
		}
		if err != nil {
			return nil, nil //nolint:nilerr // no SEEK_DATA: send it whole
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return nil, nil //nolint:nilerr
		}
		hole = min(hole, size)
		if out = append(out, [2]int64{data, hole - data}); len(out) > maxSegments {
			return nil, nil
		}
		off = hole
	}
	return out, nil
}

func formatHoles(size int64, segments [][2]int64) (string, int64) {
	var b strings.Builder
	b.WriteString(strconv.FormatInt(size, 10))
	var data int64
	for _, s := range segments {
		fmt.Fprintf(&b, " %d:%d", s[0], s[1])
		data += s[1]
	}
	return b.String(), data
}

// parseHoles reads a paxHoles record, checking that its segments are in
// order, apart, within the file, and add up to the body's size.
func parseHoles(rec string, body int64) (int64, [][2]int64, error) {
	fields := strings.Fields(rec)
	if len(fields) == 0 || len(fields) > maxSegments+1 {
		return 0, nil, refused("sparse map %q", rec)
	}
	size, err := strconv.ParseInt(fields[0], 10, 64)
	if err != nil || size < 0 {
		return 0, nil, refused("sparse map size %q", fields[0])
	}
	var segments [][2]int64
	var end, data int64
	for _, f := range fields[1:] {
		o, l, ok := strings.Cut(f, ":")
		off, err1 := strconv.ParseInt(o, 10, 64)
		n, err2 := strconv.ParseInt(l, 10, 64)
		if !ok || err1 != nil || err2 != nil || off < end || n < 0 || off > size || n > size-off {
			return 0, nil, refused("sparse map segment %q", f)
		}
		segments = append(segments, [2]int64{off, n})
		end, data = off+n, data+n
	}
	if data != body {
		return 0, nil, refused("sparse map holds %d bytes, the entry %d", data, body)
	}
	return size, segments, nil
}

// readXattrs are the xattrs that travel of base, in the dir open as dir.
func readXattrs(dir int, base string) (map[string]string, error) {
	size, err := fdtree.ListXattrs(dir, base, nil)
	if err != nil || size == 0 {
		if errors.Is(err, unix.ENOTSUP) {
			err = nil
		}
		return nil, err
	}
	buf := make([]byte, size)
	if size, err = fdtree.ListXattrs(dir, base, buf); err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:size]), "\x00"), "\x00") {
		if !xattrTravels(name) {
			continue
		}
		vsize, err := fdtree.GetXattr(dir, base, name, nil)
		if err != nil {
			return nil, err
		}
		val := make([]byte, vsize)
		if vsize, err = fdtree.GetXattr(dir, base, name, val); err != nil {
			return nil, err
		}
		out[name] = string(val[:vsize])
	}
	return out, nil
}

// Limits bound what an extraction accepts.
type Limits struct {
	// Bytes bounds the tar stream (after decoding); Entries, its entries.
	Bytes, Entries int64
	// Strict refuses what only cowvol's own layers carry, whiteouts and
	// trusted.* xattrs: an archive from outside the cluster (an upload)
	// must not steer the overlay the volume is mounted with. It takes
	// any tar a tool writes; a stream that is not Strict, only what a
	// packer writes (see tarReader).
	Strict bool
	// KeepSetuid keeps regular files' setuid and setgid bits and file
	// capabilities (--allow-setuid). Otherwise the bits are cleared and
	// the capabilities not set, as a capture clears both: runtimes do not
	// pass a volume's nosuid into the container.
	KeepSetuid bool
}

// DefaultLimits are generous for CI volumes and fatal to a decompression
// bomb.
var DefaultLimits = Limits{Bytes: 1 << 40, Entries: 10_000_000}

// ErrRefused marks an archive that tried something no volume needs: an
// entry outside the directory, a device node, a link that escapes, a limit
// passed.
var ErrRefused = errors.New("archive refused")

func refused(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrRefused, fmt.Sprintf(format, args...))
}

// Unpack extracts a tar stream encoded with enc from r into dir, which must
// be an empty directory. Nothing in the archive lands outside dir: names
// are relative and clean, every parent is opened beneath dir without
// following a symlink, hardlinks name files already extracted, and the
// only device node is the whiteout. It reads the stream to its end, so that
// the summary's digest covers every byte the sender hashed.
func Unpack(ctx context.Context, r io.Reader, enc Encoding, dir string, lim Limits) (Summary, error) {
	return unpack(ctx, r, enc, dir, lim, Inline{}, nil)
}

// A Stub is a regular file with a size that an extraction of a StubTar
// stream made (no data yet), its attributes set.
type Stub struct {
	FD   int // open while the StubFunc call lasts
	Name string
	Size int64
	// Place is its place among the stream's regular files (0 first),
	// which is its place in a stream of the tree's data from the same
	// holder (Pack walks a tree in one order).
	Place int
	// Caps says its entry carried file capabilities (security.capability),
	// which a write into the file drops: without, it has none.
	Caps bool
	// Dev and Ino are the file's, and Mtime what its access and
	// modification times were set to: what a stub's filler needs of it,
	// with no stat of its own.
	Dev, Ino uint64
	Mtime    unix.Timespec
}

// StubFunc is told of each Stub as it is made. It may be called from
// several goroutines at once, in any order; an error ends the extraction.
type StubFunc func(Stub) error

// UnpackStubs extracts a StubTar stream as Unpack does, and hands each stub
// to stub as it is made: whoever fills the stubs takes them without a walk
// of the tree and a second open of each. The small files inline asked for
// come whole, and are not stubs; more data than it asked for is refused.
// The summary names the last of them.
func UnpackStubs(ctx context.Context, r io.Reader, enc Encoding, dir string, lim Limits, inline Inline, stub StubFunc) (Summary, error) {
	return unpack(ctx, r, enc, dir, lim, inline, stub)
}

func unpack(ctx context.Context, r io.Reader, enc Encoding, dir string, lim Limits, inline Inline, stub StubFunc) (Summary, error) {
	root, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return Summary{}, err
	}
	defer unix.Close(root)
	x := &extractor{root: root, copier: newCopier(), strict: lim.Strict,
		keepSetuid: lim.KeepSetuid, unprivileged: os.Geteuid() != 0, stub: stub, inline: inline}
	x.startMakers(makersPerExtraction())
	defer x.close()
	sum, err := readArchive(ctx, r, enc, lim, x.entry)
	if err == nil {
		err = x.finish()
	}
	sum.Inlined = x.inlined
	if err != nil {
		return Summary{}, err
	}
	return sum, nil
}

// Files reads a tar stream packed by Pack from r and calls file for each
// regular file with data in it: its name (relative, clean), its size, and
// write, which writes its data into w at its offsets (holes left alone).
// A file whose write is not called is skipped. It reads the stream to its
// end, as Unpack does, for the summary's digest.
func Files(ctx context.Context, r io.Reader, enc Encoding, lim Limits, file func(name string, size int64, write func(w io.WriterAt) error) error) (Summary, error) {
	buf := bufpool.Get(streamBuffer)
	defer bufpool.Put(buf)
	return readArchive(ctx, r, enc, lim, func(hdr *tar.Header, body io.Reader) error {
		if hdr.Typeflag != tar.TypeReg {
			return nil
		}
		name, err := cleanName(hdr.Name)
		if err != nil {
			return err
		}
		segments, size := [][2]int64{{0, hdr.Size}}, hdr.Size
		if rec, ok := hdr.PAXRecords[paxHoles]; ok {
			if size, segments, err = parseHoles(rec, hdr.Size); err != nil {
				return err
			}
		}
		if hdr.Size == 0 {
			return nil
		}
		return file(name, size, func(w io.WriterAt) error {
			for _, seg := range segments {
				if _, err := io.CopyBuffer(io.NewOffsetWriter(w, seg[0]), io.LimitReader(body, seg[1]), buf); err != nil {
					return err
				}
			}
			return nil
		})
	})
}

// readArchive reads a tar stream encoded with enc from r to its end,
// within lim, handing each entry to entry.
func readArchive(ctx context.Context, r io.Reader, enc Encoding, lim Limits, entry func(hdr *tar.Header, body io.Reader) error) (Summary, error) {
	br, releaseBuffer := fromPool[*bufio.Reader](&bufReaders, r)
	defer releaseBuffer()
	dr, release, err := enc.reader(br)
	if err != nil {
		return Summary{}, err
	}
	defer release() // before br goes back
	c := newCounter()
	limited := &limitReader{r: dr, left: lim.Bytes}
	tr := tarStream(io.TeeReader(limited, c), lim)
	var entries int64
	for {
		if err := ctx.Err(); err != nil {
			return Summary{}, err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return Summary{}, limited.explain(err)
		}
		if entries++; entries > lim.Entries {
			return Summary{}, refused("more than %d entries", lim.Entries)
		}
		if err := entry(hdr, tr); err != nil {
			return Summary{}, limited.explain(err)
		}
	}
	// The end-of-archive blocks and padding count in the digest too.
	if _, err := io.Copy(io.Discard, io.TeeReader(limited, c)); err != nil {
		return Summary{}, limited.explain(err)
	}
	return c.summary(entries), nil
}

// tarStream reads the entries of a tar stream: an upload's, which any tar
// tool may have written, with archive/tar; a peer's, which a packer wrote,
// with tarReader.
func tarStream(r io.Reader, lim Limits) interface {
	Next() (*tar.Header, error)
	io.Reader
} {
	if lim.Strict {
		return tar.NewReader(r)
	}
	return newTarReader(r)
}

// limitReader fails a stream longer than its limit.
type limitReader struct {
	r    io.Reader
	left int64
}

var errTooLong = errors.New("stream too long")

func (l *limitReader) Read(p []byte) (int, error) {
	if l.left <= 0 {
		// At the limit: fine if the stream ends here.
		var probe [1]byte
		if n, err := l.r.Read(probe[:]); n == 0 && errors.Is(err, io.EOF) {
			return 0, io.EOF
		}
		return 0, errTooLong
	}
	if int64(len(p)) > l.left {
		p = p[:l.left]
	}
	n, err := l.r.Read(p)
	l.left -= int64(n)
	return n, err
}

func (l *limitReader) explain(err error) error {
	if errors.Is(err, errTooLong) {
		return refused("the stream passed its size limit")
	}
	return err
}

// extractor creates entries beneath root, by file descriptor.
type extractor struct {
	root int
	// dirs get their times once everything in them is made.
	dirs []*tar.Header
	// copier copies the files the extractor makes itself.
	copier copier
	// The parent of the last entry stays open: entries come dir by dir.
	cachedDir string
	cached    *openDir
	// rootHdr is the root entry, if the archive had one; made says an
	// entry other than the root was, after which none may come.
	rootHdr    *tar.Header
	made       bool
	strict     bool
	keepSetuid bool
	// unprivileged: extracting as a user (kubectl cowvol cp), who keeps
	// the files and sets only user.* xattrs.
	unprivileged bool
	// makers make small files in parallel (nil: the extractor makes
	// every file itself).
	makers *fileMakers
	// stub, if not nil, is handed each regular file with a size, and
	// regulars counts the regular files read so far (see StubFunc).
	stub     StubFunc
	regulars int
	// inlined is the last regular file of a stub tree that came whole,
	// and inline what it asked for (see Inline).
	inlined string
	inline  Inline
}

// isStub says a regular file of a StubTar came with no data: a stub, not
// a small file carried whole (see Inline).
func isStub(hdr *tar.Header) bool { return hdr.Size == 0 }

// takeInline notes the regular file name of a stub tree that came whole
// with size bytes, within what was asked for.
func (x *extractor) takeInline(name string, size int64) error {
	if size > x.inline.Max || size > x.inline.Budget {
		return refused("%s: %d bytes of data in a stub tree, which asked for files of at most %d, %d in all", name, size, x.inline.Max, x.inline.Budget)
	}
	x.inline.Budget -= size
	x.inlined = name
	return nil
}

// close stops the makers and lets go of the cached parent.
func (x *extractor) close() {
	x.makers.stop()
	if x.cached != nil {
		x.cached.release()
		x.cached = nil
	}
}

// openDir is a dir entries are made in, open; it is closed when the
// extractor's cache and the files being made in it have all let go.
type openDir struct {
	fd   int
	refs atomic.Int32
}

func newOpenDir(fd int) *openDir {
	d := &openDir{fd: fd}
	d.refs.Store(1)
	return d
}

func (d *openDir) hold() *openDir { d.refs.Add(1); return d }

func (d *openDir) release() {
	if d.refs.Add(-1) == 0 {
		unix.Close(d.fd)
	}
}

// copier is one file-maker's copy buffer and the hole to compare with.
type copier struct{ buf, zero []byte }

func newCopier() copier { return copier{buf: make([]byte, holeBlock), zero: make([]byte, holeBlock)} }

// Parallel extraction: the archive is read in order, but making a file
// (create, size, owner, mode, times: a journal transaction each) costs
// more than reading its entry, and files in different dirs (and much of
// the work on files in one dir) go in parallel. Dirs, links and the rest
// are made in order by the reader; regular files whose data is small
// enough to hold are made by makers, the data read into memory first.
const (
	// parallelFileMax is the most data a file made by a maker holds.
	parallelFileMax = 128 << 10
	// maxFileMakers bounds the makers.
	maxFileMakers = 8
)

// makersPerExtraction is how many makers an extraction starts: one per
// CPU.
func makersPerExtraction() int { return min(runtime.GOMAXPROCS(0), maxFileMakers) }

// fileJob is a regular file for a maker to make in dir: its header and
// the data of its segments, in order.
type fileJob struct {
	dir        *openDir
	base, name string
	place      int // among the stream's regular files
	hdr        *tar.Header
	data       []byte
}

type fileMakers struct {
	jobs    chan fileJob
	running sync.WaitGroup // makers
	pending sync.WaitGroup // jobs sent, not made yet
	mu      sync.Mutex
	err     error // the first failure
}

// startMakers starts n makers (none for fewer than two: the extractor
// makes files itself).
func (x *extractor) startMakers(n int) {
	if n < 2 {
		return
	}
	m := &fileMakers{jobs: make(chan fileJob, 4*n)}
	for range n {
		m.running.Add(1)
		go func() {
			defer m.running.Done()
			c := newCopier()
			for j := range m.jobs {
				if m.failed() == nil {
					if err := x.makeFile(j.dir.fd, j.base, j.name, j.place, j.hdr, bytes.NewReader(j.data), c); err != nil {
						m.fail(fmt.Errorf("%s: %w", j.name, err))
					}
				}
				j.dir.release()
				bufpool.Put(j.data)
				m.pending.Done()
			}
		}()
	}
	x.makers = m
}

func (m *fileMakers) fail(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err == nil {
		m.err = err
	}
}

// failed is the first maker's failure (none where no makers run).
func (m *fileMakers) failed() error {
	if m == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.err
}

// wait returns once every file sent is made, with the first failure.
func (m *fileMakers) wait() error {
	if m == nil {
		return nil
	}
	m.pending.Wait()
	return m.failed()
}

// stop ends the makers once the files sent are made.
func (m *fileMakers) stop() {
	if m == nil {
		return
	}
	close(m.jobs)
	m.running.Wait()
}

// maxNameLen bounds an entry's name. Names may run past PATH_MAX (a deep
// tree's do: entries are made from descriptors), not without end.
const maxNameLen = 64 << 10

// cleanName checks an entry's name: relative, clean, no "..", no NUL.
func cleanName(name string) (string, error) {
	n := strings.TrimSuffix(name, "/")
	if n == "" || n == "." || strings.HasPrefix(n, "/") || strings.ContainsRune(n, 0) || len(n) > maxNameLen {
		return "", refused("entry name %q", name)
	}
	for _, part := range strings.Split(n, "/") {
		if part == "" || part == "." || part == ".." {
			return "", refused("entry name %q", name)
		}
	}
	return n, nil
}

// parent is the directory holding name, opened beneath root as
// openParent does, and the last component; it stays the extractor's (a
// maker holds it for the file it makes).
func (x *extractor) parent(name string) (*openDir, string, error) {
	dir, base := filepath.Split(name)
	if x.cached != nil && dir == x.cachedDir {
		return x.cached, base, nil
	}
	fd, base, err := x.openParent(name)
	if err != nil {
		return nil, "", err
	}
	if x.cached != nil {
		x.cached.release()
	}
	x.cachedDir, x.cached = dir, newOpenDir(fd)
	return x.cached, base, nil
}

// openParent opens the directory holding name, beneath root, following no
// symlink, and returns it (the caller's to close) with the last component.
func (x *extractor) openParent(name string) (int, string, error) {
	dir, base := filepath.Split(name)
	if dir == "" {
		fd, err := unix.Dup(x.root)
		return fd, base, err
	}
	fd, err := fdtree.OpenBeneath(x.root, strings.TrimSuffix(dir, "/"))
	if err != nil {
		return -1, "", refused("the parent of %q: %v (a symlink, or missing)", name, err)
	}
	return fd, base, nil
}

func (x *extractor) entry(hdr *tar.Header, body io.Reader) error {
	if hdr.Name == rootName {
		return x.rootEntry(hdr)
	}
	x.made = true
	name, err := cleanName(hdr.Name)
	if err != nil {
		return err
	}
	if err := x.checkXattrs(name, hdr); err != nil {
		return err
	}
	if x.strict && hdr.Typeflag == tar.TypeChar {
		return refused("%s: a whiteout (an upload is a whole tree, with nothing to white out)", name)
	}
	if err := x.makers.failed(); err != nil {
		return err // a maker's failure ends the extraction
	}
	dir, base, err := x.parent(name)
	if err != nil {
		return err
	}
	dirfd := dir.fd
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(dirfd, base, 0o700); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		x.dirs = append(x.dirs, hdr)
		return x.attrs(dirfd, base, hdr, false)
	case tar.TypeReg:
		if hdr.Size < 0 {
			return refused("%s: size %d", name, hdr.Size)
		}
		place := x.regulars
		x.regulars++
		if x.stub != nil && !isStub(hdr) {
			if err := x.takeInline(name, hdr.Size); err != nil {
				return err
			}
		}
		if x.makers != nil && hdr.Size <= parallelFileMax {
			data := bufpool.Get(int(hdr.Size)) // its segments' data: what the body holds
			if _, err := io.ReadFull(body, data); err != nil {
				bufpool.Put(data)
				return fmt.Errorf("%s: %w", name, err)
			}
			x.makers.pending.Add(1)
			x.makers.jobs <- fileJob{dir: dir.hold(), base: base, name: name, place: place, hdr: hdr, data: data}
			return nil
		}
		if err := x.makeFile(dirfd, base, name, place, hdr, body, x.copier); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		return nil
	case tar.TypeSymlink:
		if err := unix.Symlinkat(hdr.Linkname, dirfd, base); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	case tar.TypeLink:
		if err := x.makers.wait(); err != nil {
			return err // its target may be being made
		}
		target, err := cleanName(hdr.Linkname)
		if err != nil {
			return refused("%s: hardlink to %q", name, hdr.Linkname)
		}
		tdir, tbase, err := x.openParent(target)
		if err != nil {
			return err
		}
		defer unix.Close(tdir)
		var st unix.Stat_t
		if err := unix.Fstatat(tdir, tbase, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			return refused("%s: hardlink to %q, which is not a file extracted before it", name, hdr.Linkname)
		}
		if err := unix.Linkat(tdir, tbase, dirfd, base, 0); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		return nil // the first name's attributes are the file's
	case tar.TypeChar:
		if hdr.Devmajor != 0 || hdr.Devminor != 0 {
			return refused("%s: device node %d:%d (only whiteouts, 0:0, are moved)", name, hdr.Devmajor, hdr.Devminor)
		}
		if err := unix.Mknodat(dirfd, base, unix.S_IFCHR|0o600, 0); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	case tar.TypeFifo:
		if err := unix.Mkfifoat(dirfd, base, 0o600); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	default:
		return refused("%s: entry type %q", name, hdr.Typeflag)
	}
	return x.attrs(dirfd, base, hdr, hdr.Typeflag == tar.TypeSymlink)
}

// setsXattr says whether the extractor sets an xattr: a user sets only
// user.* ones (the others are root's to set, as only root gives files
// away), and file capabilities are set only where setuid bits are kept:
// they would give a step's non-root user what a setuid-root binary does.
func (x *extractor) setsXattr(name string) bool {
	if name == fdtree.CapsXattr && !x.keepSetuid {
		return false
	}
	return !x.unprivileged || strings.HasPrefix(name, "user.")
}

// checkXattrs refuses xattrs that do not travel, or are too big.
func (x *extractor) checkXattrs(name string, hdr *tar.Header) error {
	for k, v := range hdr.PAXRecords {
		if xattr, ok := strings.CutPrefix(k, paxXattr); ok && (!xattrTravels(xattr) || len(v) > 64<<10 ||
			(x.strict && strings.HasPrefix(xattr, "trusted."))) {
			return refused("%s: xattr %q", name, xattr)
		}
	}
	return nil
}

// rootName is the entry of the tree's root: only first, only a dir.
const rootName = "./"

// rootEntry gives the extraction dir the attributes of the tree's root.
func (x *extractor) rootEntry(hdr *tar.Header) error {
	if x.made || x.rootHdr != nil || hdr.Typeflag != tar.TypeDir {
		return refused("a root entry (%q) that is not the first, or not a dir", hdr.Name)
	}
	if err := x.checkXattrs(rootName, hdr); err != nil {
		return err
	}
	x.rootHdr = hdr
	return x.attrs(x.root, ".", hdr, false)
}

// attrs gives an entry its xattrs, owner, mode and (but for dirs, done at
// the end) times.
func (x *extractor) attrs(dirfd int, base string, hdr *tar.Header, symlink bool) error {
	path := fdtree.ProcPath(dirfd, base)
	for k, v := range hdr.PAXRecords {
		if xattr, ok := strings.CutPrefix(k, paxXattr); ok && x.setsXattr(xattr) {
			if err := unix.Lsetxattr(path, xattr, []byte(v), 0); err != nil {
				return fmt.Errorf("%s: xattr %s: %w", hdr.Name, xattr, err)
			}
		}
	}
	// As tar does for a user, an unprivileged extractor keeps the files.
	if !x.unprivileged {
		if err := unix.Fchownat(dirfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("%s: %w", hdr.Name, err)
		}
	}
	if !symlink {
		if err := unix.Fchmodat(dirfd, base, uint32(hdr.Mode&0o7777), 0); err != nil {
			return fmt.Errorf("%s: %w", hdr.Name, err)
		}
	}
	if hdr.Typeflag == tar.TypeDir {
		return nil
	}
	return setTimes(dirfd, base, hdr)
}

func setTimes(dirfd int, base string, hdr *tar.Header) error {
	ts := []unix.Timespec{fileTime(hdr), fileTime(hdr)}
	if err := unix.UtimesNanoAt(dirfd, base, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("%s: %w", hdr.Name, err)
	}
	return nil
}

// fileTime is the access and modification time an entry is given: its
// mtime (the stream carries no atime).
func fileTime(hdr *tar.Header) unix.Timespec { return unix.NsecToTimespec(hdr.ModTime.UnixNano()) }

// finish sets the directories' times, deepest first, once nothing more
// is made in them.
func (x *extractor) finish() error {
	if err := x.makers.wait(); err != nil {
		return err
	}
	for i := len(x.dirs) - 1; i >= 0; i-- {
		hdr := x.dirs[i]
		name, _ := cleanName(hdr.Name)
		dir, base, err := x.parent(name)
		if err != nil {
			return err
		}
		err = setTimes(dir.fd, base, hdr)
		if err != nil {
			return err
		}
	}
	if x.rootHdr != nil {
		return setTimes(x.root, ".", x.rootHdr)
	}
	return nil
}

// makeFile makes the regular file base (name in the archive, place among
// its regular files) in the dir open as dirfd, with its data from body,
// copied with c, and its attributes, and hands it to the stub func if
// there is one.
func (x *extractor) makeFile(dirfd int, base, name string, place int, hdr *tar.Header, body io.Reader, c copier) error {
	// Made with its permission bits (not its set-ID bits, which a write
	// clears), so that most files need no chmod after: each attribute
	// changed is a journal transaction, and a pull makes tens of
	// thousands of files. The descriptor writes whatever the mode.
	fd, err := unix.Openat(dirfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, uint32(hdr.Mode&0o777))
	if err != nil {
		return err
	}
	var made unix.Stat_t // the owner and mode the making gave (umask, a set-group-ID dir)
	err = unix.Fstat(fd, &made)
	var size int64
	if err == nil {
		size, err = writeFile(fdtree.File(fd), body, hdr, c)
	}
	if err == nil {
		err = x.fileAttrs(fd, hdr, &made) // through the descriptor: no path lookups
	}
	if err == nil && x.stub != nil && size > 0 && isStub(hdr) {
		_, caps := hdr.PAXRecords[paxXattr+fdtree.CapsXattr]
		caps = caps && x.setsXattr(fdtree.CapsXattr)
		err = x.stub(Stub{FD: fd, Name: name, Size: size, Place: place, Caps: caps,
			Dev: uint64(made.Dev), Ino: made.Ino, Mtime: fileTime(hdr)})
	}
	if cerr := unix.Close(fd); err == nil {
		err = cerr
	}
	return err
}

// writeFile writes a file's body: its data segments where the sender sent
// only those, each with runs of zeros left as holes. It returns the file's
// size.
func writeFile(f fdtree.File, body io.Reader, hdr *tar.Header, c copier) (int64, error) {
	segments, size := [][2]int64{{0, hdr.Size}}, hdr.Size
	if rec, ok := hdr.PAXRecords[paxHoles]; ok {
		var err error
		if size, segments, err = parseHoles(rec, hdr.Size); err != nil {
			return 0, err
		}
	}
	var end int64 // past the last byte written
	for _, s := range segments {
		written, err := c.writeSparse(f, body, s[0], s[1])
		if err != nil {
			return 0, err
		}
		end = max(end, written)
	}
	if end == size {
		return size, nil // a truncate costs a journal transaction per file
	}
	return size, unix.Ftruncate(int(f), size)
}

// fileAttrs gives a regular file its owner, mode, xattrs and times
// through its descriptor, changing the owner and mode only where made (the
// file as it was made) differs. The xattrs come after the owner: a chown
// drops a file's capabilities (security.capability), as a write does.
func (x *extractor) fileAttrs(fd int, hdr *tar.Header, made *unix.Stat_t) error {
	if !x.unprivileged && (made.Uid != uint32(hdr.Uid) || made.Gid != uint32(hdr.Gid)) {
		if err := unix.Fchown(fd, hdr.Uid, hdr.Gid); err != nil {
			return err
		}
	}
	mode := uint32(hdr.Mode & 0o7777)
	if !x.keepSetuid {
		mode &^= unix.S_ISUID | unix.S_ISGID
	}
	if made.Mode&0o7777 != mode {
		if err := unix.Fchmod(fd, mode); err != nil {
			return err
		}
	}
	for k, v := range hdr.PAXRecords {
		if xattr, ok := strings.CutPrefix(k, paxXattr); ok && x.setsXattr(xattr) {
			if err := unix.Fsetxattr(fd, xattr, []byte(v), 0); err != nil {
				return fmt.Errorf("xattr %s: %w", xattr, err)
			}
		}
	}
	ts := []unix.Timespec{fileTime(hdr), fileTime(hdr)}
	// utimensat(fd, NULL, ...) is futimens: x/sys names no path-less form.
	if _, _, errno := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0); errno != 0 {
		return errno
	}
	return nil
}

// holeBlock is the run of zeros written as a hole instead.
const holeBlock = 64 << 10

// writeSparse copies n bytes of r into f at off, leaving runs of zeros as
// holes: a sparse file stays sparse, whatever the sender's filesystem. It
// says where the last byte it wrote ends.
func (c copier) writeSparse(f fdtree.File, r io.Reader, off, n int64) (int64, error) {
	buf, zero := c.buf, c.zero
	var written int64
	for end := off + n; off < end; {
		got, err := io.ReadFull(r, buf[:min(int64(len(buf)), end-off)])
		if got > 0 {
			if got == holeBlock && bytes.Equal(buf[:got], zero) {
				// a hole: skip it
			} else if _, werr := f.WriteAt(buf[:got], off); werr != nil {
				return 0, werr
			} else {
				written = off + int64(got)
			}
			off += int64(got)
		}
		if err != nil {
			if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
				return 0, io.ErrUnexpectedEOF
			}
			return 0, err
		}
	}
	return written, nil
}
