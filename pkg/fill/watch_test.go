package fill

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// dfidNameRecord is an info record of infoType for the dir handle handle
// of type typ and name (its NUL not added: a caller adds what it tests);
// size, if not negative, is the handle length it claims.
func dfidNameRecord(infoType byte, typ int32, handle []byte, size int, name string) []byte {
	if size < 0 {
		size = len(handle)
	}
	rec := []byte{infoType, 0, 0, 0}
	rec = append(rec, make([]byte, fidFsidLen)...)
	rec = binary.NativeEndian.AppendUint32(rec, uint32(size))
	rec = binary.NativeEndian.AppendUint32(rec, uint32(typ))
	rec = append(rec, handle...)
	rec = append(rec, name...)
	binary.NativeEndian.PutUint16(rec[2:], uint16(len(rec)))
	return rec
}

// eventDirName reads the dir handle of a DFID_NAME record as handleKey
// writes the handles of name_to_handle_at, and its name; nothing out of a
// record's bounds, and no name that is not one entry's.
func TestEventDirName(t *testing.T) {
	handle := []byte{1, 2, 3, 4, 5, 6, 7, 8}
	want := handleKey(0x81, handle)
	record := func(name string) []byte {
		return dfidNameRecord(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, 0x81, handle, -1, name)
	}
	for _, tc := range []struct {
		name     string
		info     []byte
		wantName string // "": none found
	}{
		{"a record", record("f1\x00"), "f1"},
		{"padded", record("f1\x00\x00\x00\x00"), "f1"},
		{"after a record of another type", append(dfidNameRecord(unix.FAN_EVENT_INFO_TYPE_FID, 0x1, []byte{9, 9}, -1, ""), record("f1\x00")...), "f1"},
		{"none", nil, ""},
		{"only another type", dfidNameRecord(unix.FAN_EVENT_INFO_TYPE_DFID, 0x81, handle, -1, ""), ""},
		{"a name not terminated", record("f1"), ""},
		{"no name", record("\x00"), ""},
		{"a dot", record(".\x00"), ""},
		{"a dot dot", record("..\x00"), ""},
		{"a path", record("a/b\x00"), ""},
		{"a handle longer than its record", dfidNameRecord(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, 0x81, handle, 64, "f1\x00"), ""},
		{"a record cut short", record("f1\x00")[:10], ""},
		{"a record longer than the event", func() []byte {
			rec := record("f1\x00")
			binary.NativeEndian.PutUint16(rec[2:], uint16(len(rec)+1))
			return rec
		}(), ""},
		{"a zero length", []byte{unix.FAN_EVENT_INFO_TYPE_DFID_NAME, 0, 0, 0, 1, 2, 3, 4}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key, name, ok := eventDirName(tc.info)
			require.Equal(t, tc.wantName != "", ok)
			if ok {
				require.Equal(t, want, string(key))
				require.Equal(t, tc.wantName, name)
			}
		})
	}
}
