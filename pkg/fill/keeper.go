package fill

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// keeper.go: the fanotify group outlives the plugin. A group lives as long
// as a descriptor of it does, and when the last one closes the kernel lets
// every held reader go and drops every mark: a reader of a stub not filled
// yet then reads its holes as if they were the file. So a small process of
// the plugin's pod, the keeper (cowvol-plugin fill-keeper), holds the group
// and reads its events; the plugin gets a descriptor of the group from it
// (to mark stubs and answer directly should the keeper go) and each
// event's descriptor, and answers through it. When the plugin dies, its
// readers' events stay with the keeper: the next plugin gets them, or,
// once the keeper's grace passes without one, every reader gets EIO.
//
// The keeper also answers, on its own, the reads of an index's blob whose
// blocks are all in place (placed.go): the plugin shares a bitmap of them
// per blob, and is handed only the reads that wait for data.
//
// The wire is a SOCK_SEQPACKET unix socket, one message a packet: an op
// byte, little-endian fields, and at most one descriptor beside it.
const (
	opHello  = 'H' // plugin: the group, if one is kept
	opGroup  = 'G' // keeper: features uint64 [group fd]
	opNone   = 'N' // keeper: features uint64: none kept yet
	opPut    = 'P' // plugin: [group fd] keep this one
	opEvent  = 'E' // keeper: id int32, offset, count int64 [event fd]: a held reader, the range it reads
	opAnswer = 'A' // plugin: id int32, response uint32
	opSync   = 'S' // either: seq uint64, sent back once every answer before it is written
	opBlob   = 'B' // plugin: dev, ino, blocks uint64 [memfd]: the blocks in place of that blob (placed.go)
	opForget = 'F' // plugin: dev, ino uint64: answer no read of that blob any more
)

// keeperAnswersPlaced is the feature bit of a keeper that takes opBlob
// (one that does not drops a plugin that sends it).
const keeperAnswersPlaced = 1

// sendPacket sends op and fields, with fd beside them (-1: none).
func sendPacket(c *net.UnixConn, fd int, op byte, fields ...uint64) error {
	b := []byte{op}
	for _, f := range fields {
		b = binary.LittleEndian.AppendUint64(b, f)
	}
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	_, _, err := c.WriteMsgUnix(b, oob, nil)
	return err
}

// readPacket reads one message: its op, its fields and the descriptor
// beside it (-1: none; any more are closed).
func readPacket(c *net.UnixConn) (op byte, fields []uint64, fd int, err error) {
	b, oob := make([]byte, 1+3*8), make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := c.ReadMsgUnix(b, oob)
	if err == nil && n == 0 {
		err = errors.New("closed")
	}
	fd = -1
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
		for _, m := range msgs {
			fds, _ := unix.ParseUnixRights(&m)
			for _, f := range fds {
				unix.CloseOnExec(f) // (the plugin runs helpers)
				if fd < 0 {
					fd = f
				} else {
					unix.Close(f)
				}
			}
		}
		if err == nil {
			err = perr
		}
	}
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return 0, nil, -1, err
	}
	for off := 1; off+8 <= n; off += 8 {
		fields = append(fields, binary.LittleEndian.Uint64(b[off:]))
	}
	return b[0], fields, fd, nil
}

// Keeper holds the node's fanotify pre-content group between plugins.
type Keeper struct {
	grace time.Duration

	mu sync.Mutex
	// group is the kept group (nil until a plugin puts one), groupFD its
	// descriptor (File.Fd would make it blocking, for the plugin too),
	// plugin the connection of the plugin it hands events to (nil: none
	// now).
	group   *os.File
	groupFD int
	plugin  *net.UnixConn
	// pending are the events read and not answered, by the keeper's
	// descriptor of each (the group knows them by it).
	pending map[int32]event
	// expired: no plugin came back within the grace; readers get EIO at
	// once until one does. losses counts the plugins gone, so that the
	// timer of an earlier loss does nothing.
	expired bool
	losses  int
	// placed are the blobs whose reads of blocks in place the keeper
	// answers itself, by key: the current plugin's, dropped when it goes
	// (the next one says again which are its own). blobs counts them, to
	// read without mu whether an event's file is worth a stat.
	placed map[fileKey]*placedBlocks
	blobs  atomic.Int32
}

// ServeKeeper keeps the group for the plugins that connect to socket until
// ctx ends. A plugin gone, its readers wait up to grace for the next one,
// then get EIO.
func ServeKeeper(ctx context.Context, socket string, grace time.Duration) error {
	if st, err := os.Lstat(socket); err == nil && st.Mode().Type() == os.ModeSocket {
		_ = os.Remove(socket) // a keeper's before this one
	}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("listening for the plugin: %w", err)
	}
	defer l.Close()
	if err := os.Chmod(socket, 0o600); err != nil {
		return err
	}
	k := &Keeper{grace: grace, pending: map[int32]event{}, placed: map[fileKey]*placedBlocks{}}
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	klog.InfoS("Keeping the fanotify group of lazy fills for the plugin", "socket", socket, "grace", grace)
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go k.serve(c)
	}
}

// serve reads a plugin's messages until it goes.
func (k *Keeper) serve(c *net.UnixConn) {
	defer c.Close()
	for {
		op, fields, fd, err := readPacket(c)
		if err != nil {
			k.gone(c)
			return
		}
		switch {
		case op == opHello:
			k.hello(c)
		case op == opPut && fd >= 0:
			k.put(c, fd)
			fd = -1
		case op == opAnswer && len(fields) == 2:
			k.answer(c, int32(fields[0]), uint32(fields[1]))
		case op == opBlob && len(fields) == 3 && fd >= 0:
			k.blob(c, fileKey{dev: fields[0], ino: fields[1]}, int64(fields[2]), fd)
		case op == opForget && len(fields) == 2:
			k.forget(c, fileKey{dev: fields[0], ino: fields[1]})
		case op == opSync && len(fields) == 1:
			// Answers are written as they are read, in order: every one
			// before this message is.
			_ = sendPacket(c, -1, opSync, fields[0])
		default:
			klog.ErrorS(nil, "A message the fill keeper does not know; dropping the plugin", "op", op)
			if fd >= 0 {
				unix.Close(fd)
			}
			k.gone(c)
			return
		}
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

// hello makes c the plugin: it gets the group kept (if any) and every
// event not answered, an earlier plugin's included.
func (k *Keeper) hello(c *net.UnixConn) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.plugin != nil && k.plugin != c {
		klog.InfoS("A new plugin connected to the fill keeper; the one before is dropped")
		k.plugin.Close()
	}
	k.plugin, k.expired = c, false
	k.dropPlaced() // (an earlier plugin's)
	if k.group == nil {
		_ = sendPacket(c, -1, opNone, keeperAnswersPlaced)
		return
	}
	if err := sendPacket(c, k.groupFD, opGroup, keeperAnswersPlaced); err != nil {
		return // (its serve sees it gone)
	}
	for _, ev := range k.pending {
		if err := sendEvent(c, ev); err != nil {
			return
		}
	}
	klog.InfoS("A plugin took the kept fanotify group back", "heldReaders", len(k.pending))
}

// put keeps the group a plugin made, and begins to read its events.
func (k *Keeper) put(c *net.UnixConn, fd int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.group != nil || k.plugin != c {
		klog.ErrorS(nil, "A plugin put a fanotify group the keeper does not take (it keeps one, or the plugin is not the current one)")
		unix.Close(fd)
		return
	}
	// The group's descriptor is non-blocking: reads wait in Go's poller,
	// and Close ends one.
	k.group, k.groupFD = os.NewFile(uintptr(fd), "fanotify"), fd
	go k.read(k.group)
}

// read reads the group's events until it fails, handing each to the
// plugin, or holding it for the next, or answering EIO once the grace
// passed.
func (k *Keeper) read(group *os.File) {
	buf := make([]byte, 64<<10)
	for {
		n, err := group.Read(buf)
		if err != nil {
			klog.ErrorS(err, "Reading the kept fanotify group's events failed; readers of stubs are no longer held")
			return
		}
		eachEvent(buf[:n], k.event)
	}
}

func (k *Keeper) event(ev event) {
	key, keyed := fileKey{}, false
	if k.blobs.Load() > 0 && ev.n > 0 {
		var err error
		key, err = keyOf(int(ev.fd))
		keyed = err == nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.expired {
		k.respond(ev.fd, denyEIO)
		return
	}
	if p := k.placed[key]; keyed && p != nil && p.has(blockSpan(ev.off, ev.n)) {
		k.respond(ev.fd, unix.FAN_ALLOW) // its bytes are in place, and were checked
		return
	}
	k.pending[ev.fd] = ev
	if k.plugin != nil {
		_ = sendEvent(k.plugin, ev) // (a plugin gone gets it again from hello)
	}
}

// sendEvent hands the plugin c a held reader.
func sendEvent(c *net.UnixConn, ev event) error {
	return sendPacket(c, int(ev.fd), opEvent, uint64(uint32(ev.id)), uint64(ev.off), uint64(ev.n))
}

// answer writes the plugin's answer to a held reader.
func (k *Keeper) answer(c *net.UnixConn, id int32, response uint32) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if _, ok := k.pending[id]; !ok || c != k.plugin {
		return // (answered, or an earlier plugin's: the current one answers it)
	}
	k.respond(id, response)
}

// blob has the keeper answer the reads of the blob key whose blocks the
// plugin c marks in place in the bitmap of blocks blocks in memfd fd.
func (k *Keeper) blob(c *net.UnixConn, key fileKey, blocks int64, fd int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if c != k.plugin {
		return
	}
	p, err := mapPlacedBlocks(fd, blocks, unix.PROT_READ)
	if err != nil {
		klog.ErrorS(err, "A blob's bitmap of blocks in place the keeper cannot map; its reads go to the plugin")
		return
	}
	if old := k.placed[key]; old != nil {
		_ = old.close()
	} else {
		k.blobs.Add(1)
	}
	k.placed[key] = p
}

// forget has the keeper hand every read of the blob key to the plugin c
// again.
func (k *Keeper) forget(c *net.UnixConn, key fileKey) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if p := k.placed[key]; p != nil && c == k.plugin {
		_ = p.close()
		delete(k.placed, key)
		k.blobs.Add(-1)
	}
}

// dropPlaced forgets every blob's bitmap. The caller holds mu.
func (k *Keeper) dropPlaced() {
	for key, p := range k.placed {
		_ = p.close()
		delete(k.placed, key)
	}
	k.blobs.Store(0)
}

// respond answers the reader of event fd and lets go of its descriptor.
// The caller holds mu.
func (k *Keeper) respond(fd int32, response uint32) {
	resp := unix.FanotifyResponse{Fd: fd, Response: response}
	if _, err := k.group.Write((*[unsafe.Sizeof(resp)]byte)(unsafe.Pointer(&resp))[:]); err != nil {
		klog.ErrorS(err, "Answering a held reader")
	}
	unix.Close(int(fd))
	delete(k.pending, fd)
}

// gone: the plugin c went. Its readers wait for the next one for the
// grace, then get EIO.
func (k *Keeper) gone(c *net.UnixConn) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.plugin != c {
		return
	}
	k.plugin = nil
	k.losses++
	loss := k.losses
	// Which blocks are in place is the plugin's to say: while none is
	// here, its readers wait for the next, whose volumes left unfinished
	// are failed (their readers get EIO).
	k.dropPlaced()
	klog.InfoS("The plugin went; its held readers wait for the next one", "heldReaders", len(k.pending), "grace", k.grace)
	time.AfterFunc(k.grace, func() {
		k.mu.Lock()
		defer k.mu.Unlock()
		if k.plugin != nil || k.losses != loss {
			return
		}
		klog.InfoS("No plugin came back within the grace: readers of stubs and blobs not filled get EIO until one does", "heldReaders", len(k.pending))
		k.expired = true
		for fd := range k.pending {
			k.respond(fd, denyEIO)
		}
	})
}

// keeperConn is the plugin's end of the keeper's socket.
type keeperConn struct {
	c  *net.UnixConn
	mu sync.Mutex // one message at a time
	// answersPlaced: the keeper answers reads of blocks in place (opBlob).
	answersPlaced bool
	// syncMu serializes syncs, numbered by seq; synced hears the
	// keeper's replies.
	syncMu sync.Mutex
	seq    uint64
	synced chan uint64
}

// ErrNoKeeper: no fill keeper listens at the socket (yet).
var ErrNoKeeper = errors.New("no fill keeper listens")

// dialKeeper connects to the keeper at socket and says hello: it answers
// with the group it keeps (fd ≥ 0) or none (-1).
func dialKeeper(socket string) (*keeperConn, int, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return nil, -1, fmt.Errorf("reaching the fill keeper at %s: %w: %w", socket, ErrNoKeeper, err)
	}
	kc := &keeperConn{c: c, synced: make(chan uint64, 1)}
	op, fields, fd, err := func() (byte, []uint64, int, error) {
		if err := sendPacket(c, -1, opHello); err != nil {
			return 0, nil, -1, err
		}
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		defer c.SetReadDeadline(time.Time{})
		return readPacket(c)
	}()
	if len(fields) > 0 {
		kc.answersPlaced = fields[0]&keeperAnswersPlaced != 0
	}
	switch {
	case err != nil:
	case op == opGroup && fd >= 0:
		return kc, fd, nil
	case op == opNone:
		return kc, -1, nil
	default:
		err = fmt.Errorf("an answer it does not know (%q)", op)
	}
	c.Close()
	return nil, -1, fmt.Errorf("the fill keeper at %s: %w", socket, err)
}

// put hands the keeper a new group.
func (kc *keeperConn) put(fd int) error {
	kc.mu.Lock()
	defer kc.mu.Unlock()
	return sendPacket(kc.c, fd, opPut)
}

// shareBlob has the keeper answer the reads of the blob key whose blocks
// are set in the bitmap of blocks blocks in memfd fd.
func (kc *keeperConn) shareBlob(key fileKey, blocks int64, fd int) error {
	kc.mu.Lock()
	defer kc.mu.Unlock()
	return sendPacket(kc.c, fd, opBlob, key.dev, key.ino, uint64(blocks))
}

// forgetBlob has the keeper hand every read of the blob key to the plugin
// again.
func (kc *keeperConn) forgetBlob(key fileKey) error {
	kc.mu.Lock()
	defer kc.mu.Unlock()
	return sendPacket(kc.c, -1, opForget, key.dev, key.ino)
}

// answer answers the held reader the keeper knows as id.
func (kc *keeperConn) answer(id int32, response uint32) error {
	kc.mu.Lock()
	defer kc.mu.Unlock()
	return sendPacket(kc.c, -1, opAnswer, uint64(uint32(id)), uint64(response))
}

// sync waits (at most a few seconds) until the keeper wrote every answer
// sent before it.
func (kc *keeperConn) sync() {
	kc.syncMu.Lock()
	defer kc.syncMu.Unlock()
	kc.seq++
	kc.mu.Lock()
	err := sendPacket(kc.c, -1, opSync, kc.seq)
	kc.mu.Unlock()
	if err != nil {
		return
	}
	timeout := time.After(5 * time.Second)
	for {
		select {
		case s := <-kc.synced:
			if s == kc.seq {
				return
			}
		case <-timeout:
			return
		}
	}
}
