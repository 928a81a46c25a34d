package fill

import (
	"cmp"
	"fmt"
	"io"
	"path"
	"slices"
	"time"

	"k8s.io/klog/v2"
)

// urgentEnded counts out a fetch a reader of the layer was held for.
func (l *Layer) urgentEnded() {
	l.g.mu.Lock()
	defer l.g.mu.Unlock()
	l.lastUrgent = time.Now()
	if l.urgent--; l.urgent == 0 && l.urgentDone != nil {
		close(l.urgentDone)
		l.urgentDone = nil
	}
}

// readersGrace is how long a layer's background fills keep waiting after
// its readers' last fetch: a reader that just missed a file away from the
// stream (see streamBringsNext) is about to miss the next one, and each of
// its fetches waits for the CPUs the background would take meanwhile
// (a scattered read of 5% of 1 GiB: 2,500 fetches).
const readersGrace = 10 * time.Millisecond

// readersFirst waits while readers of the layer are held for fetches of
// their own, and for readersGrace after the last (or until the layer is
// done for): its background fills then stop taking the link and the CPUs
// from them. A step that reads a few files of a large input, none of them
// next in the stream, would otherwise wait for each behind the stream's
// megabytes. Only the layer's own background waits: a reader of one
// namespace's input must not be able to stall the fills of another's.
func (l *Layer) readersFirst() {
	for {
		l.g.mu.Lock()
		if l.urgent == 0 {
			grace := readersGrace - time.Since(l.lastUrgent)
			l.g.mu.Unlock()
			if grace <= 0 {
				return
			}
			select {
			case <-time.After(grace):
			case <-l.ctx.Done():
				return
			}
			continue
		}
		if l.urgentDone == nil {
			l.urgentDone = make(chan struct{})
		}
		done := l.urgentDone
		l.g.mu.Unlock()
		select {
		case <-done:
		case <-l.ctx.Done():
			return
		}
	}
}

// Read-ahead: a reader of one file of a dir is often about to read the
// next ones, and one request for many files costs what one for one does.
// Each dir's window adapts, as the kernel's page read-ahead does: it
// doubles when what it brought is read, and halves when a reader misses
// while what it brought lies unread (a reader picking a few files here and
// there, for whom fetching the others is waste).
const (
	readaheadStart = 4
	readaheadFiles = 256
	readaheadBytes = 32 << 20
)

// readAhead is one dir's read-ahead window and what it brought unread.
type readAhead struct{ window, unread int }

// claimAhead claims, for f's fill, the files after f in its dir that are
// neither filled nor being filled, within the dir's window (under g.mu).
// A layer without FetchMany reads no ahead.
func (l *Layer) claimAhead(f *file) []*file {
	if l.fetchMany == nil {
		return nil
	}
	l.mu.Lock()
	dir := path.Dir(f.rel)
	siblings := l.dirs[dir]
	ra := l.ahead[dir]
	if ra == nil {
		ra = &readAhead{window: readaheadStart}
		l.ahead[dir] = ra
	} else if ra.unread >= ra.window {
		ra.window = max(1, ra.window/2)
	}
	window := ra.window
	l.mu.Unlock()
	var out []*file
	bytes := f.size
	for _, s := range siblings[f.index+1:] {
		if len(out) >= window || bytes+s.size > readaheadBytes {
			break
		}
		if !take(s, claimAhead) {
			continue
		}
		out = append(out, s)
		bytes += s.size
	}
	l.mu.Lock()
	ra.unread += len(out)
	l.mu.Unlock()
	return out
}

// reach records a reader's first open (or read) of f (under g.mu): f
// joins the order readers reach files in, and if a read-ahead claimed
// it, that dir's window grows.
func (l *Layer) reach(f *file) {
	if f.reached {
		return
	}
	f.reached = true
	if f.mark == markWatched {
		l.watch.unseen.Add(-1)
	}
	wasAhead := f.state.ahead()
	f.on(reach)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.reached = append(l.reached, f.rel)
	if !wasAhead {
		return
	}
	if ra := l.ahead[path.Dir(f.rel)]; ra != nil {
		ra.unread = max(0, ra.unread-1)
		ra.window = min(readaheadFiles, ra.window*2)
	}
}

// fillMany fills files (claimed) from one request for all of them; what
// it did not bring is fetched file by file.
func (g *Group) fillMany(files []*file) {
	l := files[0].layer
	byRel := make(map[string]*file, len(files))
	rels := make([]string, len(files))
	for i, f := range files {
		byRel[f.rel], rels[i] = f, f.rel
	}
	err := l.fetchMany(l.ctx, rels, func(rel string, write func(w io.WriterAt) error) error {
		f := byRel[rel]
		if f == nil {
			return fmt.Errorf("%s came, not asked for", rel)
		}
		delete(byRel, rel)
		var broke error
		g.fillBehind(f, f.orFetch(write, &broke))
		return broke
	})
	if err != nil && l.ctx.Err() == nil {
		klog.V(2).InfoS("A read-ahead stopped; fetching the rest file by file", "files", len(byRel), "err", err)
	}
	for _, f := range files {
		if _, left := byRel[f.rel]; left {
			g.fill(f, f.fetch)
		}
	}
}

// streamNext is how near ahead of its stream's place (in the bytes the
// stream brings first) a file must be for its reader to wait for the
// stream rather than fetch it: what a stream brings in about 10 ms.
const streamNext = 4 << 20

// streamWaitMax bounds a reader's wait for the stream: one that has not
// brought its file by then is stalled, or brings files in another order
// than the stubs' (another holder's), and the file is fetched.
const streamWaitMax = 250 * time.Millisecond

// Streaming says a stream of the whole layer is about to offer its files
// (Offer), those of order (a recorded read order) that are its stubs first
// and then the rest by their places: the order a holder packs them in (the
// stubs came in a walk of the same tree). It returns the names to ask the
// holder for first: none if the order's stubs are the layer's first by
// place (a step that walks the tree in name order), which the stream brings
// first anyway; asking costs the holder a lookup of each by name and a set
// of them to leave out of its walk, 0.1 s of its CPU for 50,000 files.
// Until StreamEnded, a reader of a file the stream brings next waits for
// it: a step that reads the layer in the order the stream brings it (a
// walk, or a recorded read order) would otherwise fetch each file on its
// own, and each fetch holds the stream back (see readersFirst).
func (l *Layer) Streaming(order []string) (first []string) {
	l.mu.Lock()
	var named []*file
	for _, rel := range order {
		if f := l.byRel[rel]; f != nil {
			named = append(named, f)
		}
	}
	// The stubs were added as their makers finished them, not in the
	// stream's order.
	byPlace := slices.Clone(l.files)
	l.mu.Unlock()
	slices.SortFunc(byPlace, func(a, b *file) int { return cmp.Compare(a.place, b.place) })
	if len(named) > len(byPlace) || !slices.Equal(named, byPlace[:len(named)]) {
		for _, f := range named {
			first = append(first, f.rel)
		}
	}
	l.g.mu.Lock() // readers' events look at the places
	defer l.g.mu.Unlock()
	at, bytes := 0, int64(0)
	for _, f := range append(named, byPlace...) {
		if f.streamAt < 0 {
			f.streamAt, f.streamBytes = at, bytes
			at++
			bytes += f.size
		}
	}
	l.streaming, l.streamAt, l.streamBytes = true, 0, 0
	return first
}

// StreamEnded says the stream offers no more files (it ended, or broke
// off): readers waiting for it are fetched for.
func (l *Layer) StreamEnded() {
	l.g.mu.Lock()
	l.streaming = false
	l.g.mu.Unlock()
	for _, f := range l.snapshot() {
		l.fetchStranded(f)
	}
}

// fetchStranded fetches f if readers wait for it and no fill of it runs:
// the stream they waited for did not bring it.
func (l *Layer) fetchStranded(f *file) {
	l.g.mu.Lock()
	if len(f.waiters) == 0 || !take(f, claim) {
		l.g.mu.Unlock()
		return
	}
	l.urgent++
	l.g.mu.Unlock()
	go func() {
		defer l.urgentEnded()
		l.g.fill(f, f.fetch)
	}()
}

// streamBringsNext says the layer's stream is about to bring f (under the
// group's mu): it is at most streamNext ahead of the stream's place.
func (l *Layer) streamBringsNext(f *file) bool {
	ahead := f.streamBytes - l.streamBytes
	return l.streaming && f.streamAt >= 0 && ahead >= 0 && ahead <= streamNext
}

// Prefetch fills every file not filled yet in the background, those named
// in order first and the rest as added, workers at a time; readers' files
// jump the queue as they are opened. It returns at once.
func (l *Layer) Prefetch(order []string, workers int) {
	l.mu.Lock()
	queue := make([]*file, 0, len(l.files))
	seen := map[*file]bool{}
	for _, rel := range order {
		if f := l.byRel[rel]; f != nil && !seen[f] {
			seen[f] = true
			queue = append(queue, f)
		}
	}
	for _, f := range l.files {
		if !seen[f] {
			queue = append(queue, f)
		}
	}
	l.mu.Unlock()
	next := make(chan *file)
	for range max(workers, 1) {
		go func() {
			for f := range next {
				l.readersFirst()
				_ = l.g.ensure(f)
			}
		}()
	}
	go func() {
		defer close(next)
		for _, f := range queue {
			select {
			case next <- f:
			case <-l.ctx.Done():
				return
			}
		}
	}()
}
