package streamer

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/concourse/cowvol/internal/bufpool"
	"github.com/concourse/cowvol/internal/fdtree"
	"github.com/concourse/cowvol/pkg/filesum"
)

// Unpack extracts a tar stream encoded with enc from r into dir, which must
// be an empty directory. Nothing in the archive lands outside dir: names
// are relative and clean, every parent is opened beneath dir without
// following a symlink, hardlinks name files already extracted, and the
// only device node is the whiteout. It reads the stream to its end, so that
// the summary's digest covers every byte the sender hashed.
func Unpack(ctx context.Context, r io.Reader, enc Encoding, dir string, lim Limits) (Summary, error) {
	return unpack(ctx, r, enc, dir, lim, Inline{}, nil)
}

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
	x := &extractor{root: root, copier: newCopier(), strict: lim.Strict, summed: lim.Summed,
		keepSetuid: lim.KeepSetuid, unprivileged: os.Geteuid() != 0, stub: stub, inline: inline}
	if lim.Summed && lim.Tabled && stub == nil { // (a stub's sum is not what it holds yet)
		x.table = &filesum.TableBuilder{}
	}
	x.startMakers(makersPerExtraction())
	defer x.close()
	sum, err := readArchive(ctx, r, enc, lim, x.entry)
	if err == nil {
		err = x.finish()
	}
	sum.Inlined = x.inlined
	if err == nil && x.summed {
		sum.Files, err = x.listing.Digest()
		if x.table != nil {
			sum.Table = x.table.Table()
		}
	}
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
	return readDecoded(r, enc, lim, func(in io.Reader) (int64, error) { return readTar(ctx, in, lim, entry) })
}

// readDecoded decodes r (enc), bounds it at lim.Bytes and hands it to
// read, counting what read reads of it: the stream's summary, with the
// entries read says.
func readDecoded(r io.Reader, enc Encoding, lim Limits, read func(in io.Reader) (entries int64, err error)) (Summary, error) {
	br, releaseBuffer := fromPool[*bufio.Reader](&bufReaders, r)
	defer releaseBuffer()
	dr, release, err := enc.reader(br)
	if err != nil {
		return Summary{}, err
	}
	defer release() // before br goes back
	c := newCounter(lim.Swarmed)
	limited := &limitReader{r: dr, left: lim.Bytes}
	entries, err := read(io.TeeReader(limited, c))
	if err != nil {
		return Summary{}, limited.explain(err)
	}
	return c.summary(entries), nil
}

// readTar hands each entry of the tar stream in to entry, and reads in to
// its end: the end-of-archive blocks and padding count in the digest too.
func readTar(ctx context.Context, in io.Reader, lim Limits, entry func(hdr *tar.Header, body io.Reader) error) (int64, error) {
	tr := tarStream(in, lim)
	entries, err := eachEntry(ctx, lim.Entries, tr.Next, func(hdr *tar.Header) error { return entry(hdr, tr) })
	if err != nil {
		return 0, err
	}
	_, err = io.Copy(io.Discard, in)
	return entries, err
}

// eachEntry hands each entry next reads to entry until next says io.EOF,
// refusing more than limit of them, and says how many there were.
func eachEntry[E any](ctx context.Context, limit int64, next func() (E, error), entry func(E) error) (int64, error) {
	var entries int64
	for {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		e, err := next()
		if errors.Is(err, io.EOF) {
			return entries, nil
		}
		if err != nil {
			return 0, err
		}
		if entries++; entries > limit {
			return 0, refused("more than %d entries", limit)
		}
		if err := entry(e); err != nil {
			return 0, err
		}
	}
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
	// summed: every regular file carries its sum (Limits.Summed);
	// listing gathers them, for the digest of the layer's table, and
	// table (if not nil: Limits.Tabled) by path.
	summed  bool
	listing filesum.Listing
	tableMu sync.Mutex
	table   *filesum.TableBuilder
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

// tableFile puts the regular file name in the table, if one is made, with
// the sum its bytes were checked against.
func (x *extractor) tableFile(name string, sum filesum.Sum) {
	if x.table != nil {
		x.tableMu.Lock()
		x.table.Add(name, sum)
		x.tableMu.Unlock()
	}
}

// tableLink puts the hardlink name in the table, if one is made, with
// the sum of the file target it names, made before it.
func (x *extractor) tableLink(name, target string) {
	if x.table != nil {
		x.tableMu.Lock()
		x.table.Link(name, target)
		x.tableMu.Unlock()
	}
}

// isStub says a regular file of a StubTar came with no data: a stub, not
// a small file carried whole (see Inline).
func isStub(hdr *tar.Header) bool { return hdr.Size == 0 }

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
	for rest := n; ; {
		part, more, found := strings.Cut(rest, "/")
		if part == "" || part == "." || part == ".." {
			return "", refused("entry name %q", name)
		}
		if !found {
			return n, nil
		}
		rest = more
	}
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
	if err := checkEntry(name, hdr, x.strict); err != nil {
		return err
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
			if err := x.inline.take(name, hdr.Size); err != nil {
				return err
			}
			x.inlined = name
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
		if x.summed {
			x.listing.Link(name, target)
			x.tableLink(name, target)
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

// checkEntry refuses xattrs that do not travel, or are too big, and
// what a strict stream may not carry.
func checkEntry(name string, hdr *tar.Header, strict bool) error {
	for k, v := range hdr.PAXRecords {
		if xattr, ok := strings.CutPrefix(k, paxXattr); ok {
			if err := checkXattr(name, xattr, v, strict); err != nil {
				return err
			}
		}
	}
	if strict && hdr.Typeflag == tar.TypeChar {
		return refused("%s: a whiteout (an upload is a whole tree, with nothing to white out)", name)
	}
	return nil
}

// checkXattr refuses an xattr that does not travel with a layer, or that
// a strict extraction does not take.
func checkXattr(name, xattr, value string, strict bool) error {
	if !fdtree.XattrTravels(xattr) || len(value) > 64<<10 || (strict && strings.HasPrefix(xattr, "trusted.")) {
		return refused("%s: xattr %q", name, xattr)
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
	if err := checkEntry(rootName, hdr, x.strict); err != nil {
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
	var want filesum.Sum
	if x.summed {
		var err error
		if want, err = entrySum(name, hdr); err != nil {
			return err
		}
		x.listing.File(name, want)
		x.tableFile(name, want)
	}
	// Read and written: a file whose bytes did not come in order is read
	// back for its sum.
	fd, err := unix.Openat(dirfd, base, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, uint32(hdr.Mode&0o777))
	if err != nil {
		return err
	}
	var made unix.Stat_t // the owner and mode the making gave (umask, a set-group-ID dir)
	err = unix.Fstat(fd, &made)
	stub := x.stub != nil && isStub(hdr)
	var landing *filesum.Landing
	var w io.WriterAt = fdtree.File(fd)
	if x.summed && !stub {
		landing = filesum.NewLanding(w) // the file was just made: all zeros
		w = landing
	}
	var size int64
	if err == nil {
		size, err = writeFile(fd, w, body, hdr, c)
	}
	if err == nil && landing != nil {
		// The bytes as they landed, holes and all, before the file is
		// anyone's: a wrong one fails the extraction.
		if err = landing.Check(size, want, io.NewSectionReader(fdtree.File(fd), 0, size)); errors.Is(err, filesum.ErrMismatch) {
			err = fmt.Errorf("%w: %s: %w", ErrCorrupt, name, err)
		}
	}
	if err == nil {
		err = x.fileAttrs(fd, hdr, &made) // through the descriptor: no path lookups
	}
	if err == nil && stub && size > 0 {
		_, caps := hdr.PAXRecords[paxXattr+fdtree.CapsXattr]
		caps = caps && x.setsXattr(fdtree.CapsXattr)
		err = x.stub(Stub{FD: fd, Name: name, Size: size, Place: place, Caps: caps,
			Dev: uint64(made.Dev), Ino: made.Ino, Mtime: fileTime(hdr), Sum: want})
	}
	if cerr := unix.Close(fd); err == nil {
		err = cerr
	}
	return err
}

// entrySum is the sum a layer's regular file's entry carries.
func entrySum(name string, hdr *tar.Header) (filesum.Sum, error) {
	rec, ok := hdr.PAXRecords[paxSum]
	if !ok {
		return filesum.Sum{}, refused("%s: a layer's file with no sum", name)
	}
	sum, err := filesum.Parse(rec)
	if err != nil {
		return filesum.Sum{}, refused("%s: %v", name, err)
	}
	return sum, nil
}

// writeFile writes a file's body through w, into the file open as fd: its
// data segments where the sender sent only those, each with runs of zeros
// left as holes. It returns the file's size.
func writeFile(fd int, w io.WriterAt, body io.Reader, hdr *tar.Header, c copier) (int64, error) {
	segments, size := [][2]int64{{0, hdr.Size}}, hdr.Size
	if rec, ok := hdr.PAXRecords[paxHoles]; ok {
		var err error
		if size, segments, err = parseHoles(rec, hdr.Size); err != nil {
			return 0, err
		}
	}
	var end int64 // past the last byte written
	for _, s := range segments {
		written, err := c.writeSparse(w, body, s[0], s[1])
		if err != nil {
			return 0, err
		}
		end = max(end, written)
	}
	if end == size {
		return size, nil // a truncate costs a journal transaction per file
	}
	return size, unix.Ftruncate(fd, size)
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
func (c copier) writeSparse(f io.WriterAt, r io.Reader, off, n int64) (int64, error) {
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
