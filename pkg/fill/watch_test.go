package fill

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// fidRecord is a FAN_EVENT_INFO_TYPE_FID info record (or another type's)
// for a handle of type typ; size, if not negative, is the handle length it
// claims.
func fidRecord(infoType byte, typ int32, handle []byte, size int) []byte {
	if size < 0 {
		size = len(handle)
	}
	rec := []byte{infoType, 0, 0, 0}
	rec = append(rec, make([]byte, fidFsidLen)...)
	rec = binary.NativeEndian.AppendUint32(rec, uint32(size))
	rec = binary.NativeEndian.AppendUint32(rec, uint32(typ))
	rec = append(rec, handle...)
	binary.NativeEndian.PutUint16(rec[2:], uint16(len(rec)))
	return rec
}

// eventHandle reads the handle of a FID record as handleKey writes the
// handles of name_to_handle_at, and nothing out of a record's bounds.
func TestEventHandle(t *testing.T) {
	handle := []byte{1, 2, 3, 4, 5, 6, 7, 8}
	want := handleKey(0x81, handle)
	for _, tc := range []struct {
		name string
		info []byte
		ok   bool
	}{
		{"a fid record", fidRecord(unix.FAN_EVENT_INFO_TYPE_FID, 0x81, handle, -1), true},
		{"after a record of another type", append(fidRecord(unix.FAN_EVENT_INFO_TYPE_DFID, 0x1, []byte{9, 9}, -1),
			fidRecord(unix.FAN_EVENT_INFO_TYPE_FID, 0x81, handle, -1)...), true},
		{"none", nil, false},
		{"only another type", fidRecord(unix.FAN_EVENT_INFO_TYPE_DFID, 0x81, handle, -1), false},
		{"a handle longer than its record", fidRecord(unix.FAN_EVENT_INFO_TYPE_FID, 0x81, handle, 64), false},
		{"a record cut short", fidRecord(unix.FAN_EVENT_INFO_TYPE_FID, 0x81, handle, -1)[:10], false},
		{"a record longer than the event", func() []byte {
			rec := fidRecord(unix.FAN_EVENT_INFO_TYPE_FID, 0x81, handle, -1)
			binary.NativeEndian.PutUint16(rec[2:], uint16(len(rec)+1))
			return rec
		}(), false},
		{"a zero length", []byte{unix.FAN_EVENT_INFO_TYPE_FID, 0, 0, 0, 1, 2, 3, 4}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key, ok := eventHandle(tc.info)
			require.Equal(t, tc.ok, ok)
			if tc.ok {
				require.Equal(t, want, string(key))
			}
		})
	}
}
