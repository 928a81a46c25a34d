// Package fill holds the readers of a lazily pulled layer until the data
// they open is in place: the layer's regular files are made as stubs (the
// right size, no data), each stub is marked in one fanotify pre-content
// group, and an open or a read of a stub that is not filled yet waits while
// the file's bytes are fetched and written in place, then goes on; if they
// cannot be fetched it fails with EIO.
//
// A file is filled whole before its first open returns. Ranges would let a
// reader of a few pages of a large file go on sooner, but a mapping made
// through an overlay mount raises no event (the kernel maps the lower file
// without asking), so an executable, a shared library or a git pack opened
// from a step's view and then mapped would read holes as zeros. Opens raise
// events through overlayfs on every kernel with pre-content events, so
// filling on open is correct for every way of reading.
//
// Where the order readers reach files in is recorded (or a read-ahead's
// hits are counted), a file filled before its first reader came is watched
// by its layer's notification group (watch.go), which notes that reader
// without holding it.
//
// A fill writes through a clone of the stubs' mount that the group ignores,
// opening the stub by its XFS handle where it can (handle.go: its writes
// leave the stub's times alone), else by name, checked to be the stub.
//
// Its rooms: group.go is the fanotify group, its event loop and its
// answers to readers; file.go a stub and what state its fill is in;
// schedule.go who goes first (readers, the read-ahead window, the
// stream's place, the background fill); write.go how a stub's data is put
// in place; layer.go the Layer its caller drives; watch.go the watcher of
// filled files; handle.go XFS's open by handle; keeper.go the process that
// keeps the group, and its held readers, while the plugin restarts;
// blob.go the blob of a mounted index, filled by extent; placed.go which
// of its blocks are in place, shared with the keeper, which answers the
// reads of those itself.
//
// It owns the fanotify groups, the marks and the writes into stubs. It does
// not know where bytes come from (a FetchFunc brings them), nor the cache's
// states: the caller makes the stubs, adds them, and records the layer
// filled or failed.
package fill
