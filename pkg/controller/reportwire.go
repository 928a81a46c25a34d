package controller

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// reportwire.go: a node's report read straight from its bytes into the
// view's Report. Whole inventories are the controller's biggest messages
// (10,000 volumes a node, and a thousand nodes re-sending theirs at once
// after a failover); through the generated types each volume costs a
// message, its refs and its properties, allocations the collector then
// traces while the view is rebuilt. Read here, a report costs one copy of
// its bytes, one array of Held and one of properties.

// encodedReport is a ReportRequest's bytes, as the Report method's handler
// (reportHandler) has reportCodec leave them.
type encodedReport struct{ raw []byte }

// reportCodec is the proto codec, but for encodedReports, which it fills
// with a copy of the bytes received (the transport's own buffers go back to
// its pool once the call is read).
type reportCodec struct{ encoding.CodecV2 }

func (c reportCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if r, ok := v.(*encodedReport); ok {
		r.raw = data.Materialize()
		return nil
	}
	return c.CodecV2.Unmarshal(data, v)
}

// ServerOptions are the options a server the controller's APIs are
// registered on (Register) must be made with.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.ForceServerCodecV2(reportCodec{encoding.GetCodecV2(proto.Name)})}
}

// registryDesc is the Registry service as generated, but for Report, which
// reportHandler decodes.
func registryDesc() *grpc.ServiceDesc {
	desc := controllerv1.Registry_ServiceDesc
	desc.Methods = slices.Clone(desc.Methods)
	for i, m := range desc.Methods {
		if "/"+desc.ServiceName+"/"+m.MethodName == controllerv1.Registry_Report_FullMethodName {
			desc.Methods[i].Handler = reportHandler
		}
	}
	return &desc
}

// reportHandler is the Report method's gRPC handler: the request's bytes,
// through the server's interceptors, to registryServer.report.
func reportHandler(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
	in := &encodedReport{}
	if err := dec(in); err != nil {
		return nil, err
	}
	handle := func(ctx context.Context, req any) (any, error) {
		return srv.(*registryServer).report(ctx, req.(*encodedReport).raw)
	}
	if interceptor == nil {
		return handle(ctx, in)
	}
	return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: controllerv1.Registry_Report_FullMethodName}, handle)
}

// decodeReport reads a ReportRequest as the generated types read it (the
// fuzz test holds it to them): a field of an unknown number, or of a known
// one on another wire type, is skipped, a message field said twice is
// merged, a string that is not UTF-8 is refused; and every ref is checked
// as refFromWire checks one. The volumes' names and properties are strings over raw (which
// must not change): what the view keeps of them it copies (View.put). The
// node's own names are copies: the controller keeps them.
func decodeReport(raw []byte) (fleet.Report, error) {
	var r fleet.Report
	// Counted first, and bounded before anything is made: the upserts' and
	// their properties' arrays are made once, at their size (a count the
	// sender chose: a few bytes an entry would otherwise cost a hundred).
	upserts, deletes, props := 0, 0, 0
	err := eachField(raw, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if typ != protowire.BytesType {
			return nil
		}
		switch num {
		case 6:
			if upserts++; upserts > controllerv1.MaxReportVolumes {
				return fmt.Errorf("a report of more than %d volumes: %w", controllerv1.MaxReportVolumes, fleet.ErrInvalid)
			}
			return eachField(v, func(num protowire.Number, typ protowire.Type, _ []byte, _ uint64) error {
				if num == 7 && typ == protowire.BytesType {
					if props++; props > controllerv1.MaxReportProperties {
						return fmt.Errorf("a report of more than %d properties: %w", controllerv1.MaxReportProperties, fleet.ErrInvalid)
					}
				}
				return nil
			})
		case 7:
			if deletes++; deletes > controllerv1.MaxReportVolumes {
				return fmt.Errorf("a report of more than %d deletions: %w", controllerv1.MaxReportVolumes, fleet.ErrInvalid)
			}
		}
		return nil
	})
	if err != nil {
		return fleet.Report{}, err
	}
	r.Upserts = make([]fleet.Held, 0, upserts)
	properties := make([]fleet.Property, 0, props)
	err = eachField(raw, func(num protowire.Number, typ protowire.Type, v []byte, n uint64) error {
		var err error
		switch {
		case typ == protowire.BytesType && (num == 1 || num == 2 || num == 11 || num == 12):
			var s string
			if s, err = stringField(num, v); err != nil {
				return err
			}
			s = strings.Clone(s) // kept by the view
			switch num {
			case 1:
				r.NodeID = s
			case 2:
				r.StoreID = s
			case 11:
				r.PeerAddress = s
			default:
				r.PullMode = s // checked once read: a later field 12 replaces it
			}
		case typ == protowire.VarintType && num == 3:
			r.Revision = n
		case typ == protowire.VarintType && num == 4:
			r.Full = n != 0
		case typ == protowire.VarintType && num == 5:
			r.BaseRevision = n
		case typ == protowire.BytesType && num == 6:
			var h fleet.Held
			h, properties, err = decodeHeld(v, properties)
			r.Upserts = append(r.Upserts, h)
		case typ == protowire.BytesType && num == 7:
			var ref volume.Ref
			if err = decodeRef(v, &ref); err == nil {
				err = checkRef(ref)
			}
			r.Deletes = append(r.Deletes, ref)
		case typ == protowire.VarintType && num == 8:
			r.BytesFree = int64(n)
		case typ == protowire.VarintType && num == 9:
			r.OverHighWatermark = n != 0
		case typ == protowire.VarintType && num == 10:
			r.StepVolumes = int32(n)
		}
		return err
	})
	if err == nil {
		err = checkPullMode(r.PullMode)
	}
	if err != nil {
		return fleet.Report{}, err
	}
	return r, nil
}

// decodeHeld reads a VolumeSummary, its properties appended to props.
func decodeHeld(raw []byte, props []fleet.Property) (fleet.Held, []fleet.Property, error) {
	var h fleet.Held
	var parent, base volume.Ref
	var layer, view []byte
	var firstHand bool
	from := len(props)
	err := eachField(raw, func(num protowire.Number, typ protowire.Type, v []byte, n uint64) error {
		switch {
		case typ == protowire.BytesType && num == 1:
			return decodeRef(v, &h.Ref)
		case typ == protowire.BytesType && (num == 2 || num == 6):
			s, err := stringField(num, v)
			if err != nil {
				return err
			}
			if num == 2 {
				h.State = volume.State(s)
			} else {
				h.Scope = volume.Scope(s)
			}
		case typ == protowire.VarintType && num == 3:
			h.SizeBytes = int64(n)
		case typ == protowire.BytesType && num == 4:
			return decodeRef(v, &parent)
		case typ == protowire.BytesType && num == 5:
			return decodeRef(v, &base) // (checked as UTF-8, and left)
		case typ == protowire.BytesType && num == 7:
			var p fleet.Property
			err := decodePair(v, &p.Key, &p.Value)
			props = append(props, p)
			return err
		case typ == protowire.VarintType && num == 8:
			h.StepVolumes = int32(n)
		case typ == protowire.VarintType && num == 9:
			h.Pinned = n != 0
		case typ == protowire.VarintType && num == 10:
			h.Copies = int32(n)
		case typ == protowire.BytesType && num == 11:
			layer = v
		case typ == protowire.BytesType && num == 12:
			view = v
		case typ == protowire.VarintType && num == 13:
			firstHand = n != 0
		}
		return nil
	})
	if err != nil {
		return fleet.Held{}, props, err
	}
	if err := checkRef(h.Ref); err != nil {
		return fleet.Held{}, props, err
	}
	if h.Vouch, err = vouchFromWire(layer, view, firstHand); err != nil {
		return fleet.Held{}, props, fmt.Errorf("volume %s: %w", h.Ref, err)
	}
	if parent.Handle != "" {
		if err := checkRef(parent); err != nil {
			return fleet.Held{}, props, err
		}
		h.Parent = parent
	}
	if len(props) > from {
		h.Properties = props[from:len(props):len(props)]
	}
	return h, props, nil
}

// vouchFromWire reads a volume's digests: both or neither, of 32 bytes.
func vouchFromWire(layer, view []byte, firstHand bool) (volume.Digests, error) {
	var d volume.Digests
	if len(layer) == 0 && len(view) == 0 {
		return d, nil
	}
	if len(layer) != len(d.Layer) || len(view) != len(d.View) {
		return d, fmt.Errorf("digests of %d and %d bytes: want both, of %d: %w", len(layer), len(view), len(d.Layer), fleet.ErrInvalid)
	}
	copy(d.Layer[:], layer)
	copy(d.View[:], view)
	d.FirstHand = firstHand
	return d, nil
}

// decodeRef reads a VolumeRef into ref, over what it holds (a ref said
// twice is merged, as protobuf merges messages).
func decodeRef(raw []byte, ref *volume.Ref) error {
	return decodePair(raw, &ref.Namespace, &ref.Handle)
}

// decodePair reads a message of two strings, fields 1 and 2 (a VolumeRef,
// a Property), into first and second, over what they hold.
func decodePair(raw []byte, first, second *string) error {
	return eachField(raw, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if typ != protowire.BytesType || (num != 1 && num != 2) {
			return nil
		}
		s, err := stringField(num, v)
		if err != nil {
			return err
		}
		if num == 1 {
			*first = s
		} else {
			*second = s
		}
		return nil
	})
}

// checkRef is refFromWire's check of a ref.
func checkRef(ref volume.Ref) error {
	if err := ref.Validate(); err != nil {
		return fmt.Errorf("volume: %w: %w", err, fleet.ErrInvalid)
	}
	return nil
}

// eachField calls fn with each field of a message: its number, its wire
// type, and its bytes (length-delimited) or its value (varint, fixed).
// Groups are skipped; a malformed message is refused.
func eachField(raw []byte, fn func(num protowire.Number, typ protowire.Type, v []byte, n uint64) error) error {
	for len(raw) > 0 {
		num, typ, w := protowire.ConsumeTag(raw)
		if w < 0 {
			return malformed(w)
		}
		if num > protowire.MaxValidNumber {
			return fmt.Errorf("a malformed report: field number %d: %w", num, fleet.ErrInvalid)
		}
		raw = raw[w:]
		var v []byte
		var n uint64
		switch typ {
		case protowire.VarintType:
			n, w = protowire.ConsumeVarint(raw)
		case protowire.BytesType:
			v, w = protowire.ConsumeBytes(raw)
		case protowire.Fixed32Type:
			var f uint32
			f, w = protowire.ConsumeFixed32(raw)
			n = uint64(f)
		case protowire.Fixed64Type:
			n, w = protowire.ConsumeFixed64(raw)
		default:
			w = protowire.ConsumeFieldValue(num, typ, raw)
		}
		if w < 0 {
			return malformed(w)
		}
		raw = raw[w:]
		if typ == protowire.StartGroupType {
			continue
		}
		if err := fn(num, typ, v, n); err != nil {
			return err
		}
	}
	return nil
}

func malformed(w int) error {
	return fmt.Errorf("a malformed report: %w: %w", protowire.ParseError(w), fleet.ErrInvalid)
}

// stringField is a string field's bytes as a string sharing them (they
// must not change), refused unless UTF-8 as protobuf refuses it.
// maxPullMode bounds what a node may say of how it pulls.
const maxPullMode = 32

// checkPullMode takes a node's word on how it pulls only as a few words of
// lower-case letters, spaces and parentheses: it is printed to operators
// (kubectl cowvol nodes), and a node may be an attacker's.
func checkPullMode(s string) error {
	if len(s) > maxPullMode || strings.ContainsFunc(s, func(r rune) bool { return (r < 'a' || r > 'z') && r != ' ' && r != '(' && r != ')' }) {
		return fmt.Errorf("a report's pull mode %q is not a few lower-case words: %w", s, fleet.ErrInvalid)
	}
	return nil
}

func stringField(num protowire.Number, v []byte) (string, error) {
	s := unsafe.String(unsafe.SliceData(v), len(v))
	if !utf8.ValidString(s) {
		return "", fmt.Errorf("a malformed report: field %d is not UTF-8: %w", num, fleet.ErrInvalid)
	}
	return s, nil
}
