// Package controller serves the fleet's model (pkg/controller/fleet) over
// gRPC: the nodes' Registry (reports read from their bytes, reportwire.go,
// admitted a few whole inventories at a time, admission.go) and the
// schedulers' Cache API (server.go, and data.go, which reads and uploads
// volumes through the nodes), with who may ask (a tokens file, or the API
// server's TokenReviews and SubjectAccessReviews: auth.go, kubeauth.go).
// It converts at the edge (wire.go): how the model keeps a fleet in
// memory is its own business.
package controller

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"k8s.io/klog/v2"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/internal/peerid"
	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/volume"
)

// maxLookup bounds a lookup or placement batch.
const maxLookup = 1000

// NodeEvents tells a node's operators what the controller did with it, on
// its Node object.
type NodeEvents interface {
	NodeEventOn(node, eventType, reason, message string)
}

// Services are what the controller's APIs serve from.
type Services struct {
	View *fleet.View
	// Orders keep the read orders nodes share.
	Orders *fleet.ReadOrders
	// FullReports admits nodes' whole inventories a few at a time.
	FullReports *FullReports
	Metrics     *fleet.Metrics
	Events      NodeEvents
	// Dial reaches nodes' data for reads and uploads (nil: they are
	// refused).
	Dial PeerDialer
	// PeerCA signs nodes' peer certificates (nil: it signs none).
	PeerCA PeerSigner
}

// PeerSigner signs a peer certificate for an identity (peerid.Signer).
type PeerSigner interface {
	Sign(csr []byte, id peerid.Identity) (*peerid.Issued, error)
}

// Register serves the view's Registry (for nodes) and Cache (for
// schedulers) on srv, which must have been made with ServerOptions.
func Register(srv *grpc.Server, s Services) {
	srv.RegisterService(registryDesc(), &registryServer{view: s.View, orders: s.Orders, fullReports: s.FullReports, peerCA: s.PeerCA})
	controllerv1.RegisterCacheServer(srv, &cacheServer{view: s.View, metrics: s.Metrics, events: s.Events, dial: s.Dial})
}

func code(err error) error {
	switch {
	case errors.Is(err, fleet.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, fleet.ErrUnknownNode):
		return status.Error(codes.NotFound, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

type registryServer struct {
	controllerv1.UnimplementedRegistryServer
	view        *fleet.View
	orders      *fleet.ReadOrders
	fullReports *FullReports
	peerCA      PeerSigner
}

// report is the Report method (reportwire.go reads the request): a report
// in one message, at most controllerv1.MaxMessage bytes. A whole inventory
// is admitted by what it is, not by what its call's headers say: it takes
// room among the few being applied (FullReports), or is deferred.
func (s *registryServer) report(ctx context.Context, raw []byte) (*controllerv1.ReportResponse, error) {
	if err := need(ctx, "update", ResourceNodes, "", "report a node's cache"); err != nil {
		return nil, err
	}
	report, err := decodeReport(raw)
	if err != nil {
		return nil, code(err)
	}
	if err := speaksFor(ctx, report.NodeID); err != nil {
		return nil, err
	}
	if report.Full {
		release, err := s.fullReports.Take(report.NodeID, time.Now())
		if err != nil {
			return nil, err
		}
		defer release()
	}
	return s.apply(report)
}

// SendReport is a report too big for one message, in parts. Its node (the
// caller's own, or the one its header names) is admitted before any part
// is read, and the parts are read only up to controllerv1.MaxReport bytes.
func (s *registryServer) SendReport(stream controllerv1.Registry_SendReportServer) error {
	ctx := stream.Context()
	if err := need(ctx, "update", ResourceNodes, "", "report a node's cache"); err != nil {
		return err
	}
	node := CallerFrom(ctx).Node
	if node == "" {
		node = incomingHeader(ctx, controllerv1.ReportNodeHeader)
	}
	if node == "" {
		return status.Errorf(codes.InvalidArgument, "a report in parts names its node in the %s header", controllerv1.ReportNodeHeader)
	}
	if err := speaksFor(ctx, node); err != nil {
		return err
	}
	release, err := s.fullReports.Take(node, time.Now())
	if err != nil {
		return err
	}
	defer release()
	raw, err := readParts(stream)
	if err != nil {
		return err
	}
	report, err := decodeReport(raw)
	if err != nil {
		return code(err)
	}
	if report.NodeID != node {
		return status.Errorf(codes.InvalidArgument, "a report in parts for node %s says it is node %s", volume.Quote(node), volume.Quote(report.NodeID))
	}
	resp, err := s.apply(report)
	if err != nil {
		return err
	}
	return stream.SendAndClose(resp)
}

// readParts joins a SendReport's parts, refusing past controllerv1.MaxReport
// bytes.
func readParts(stream controllerv1.Registry_SendReportServer) ([]byte, error) {
	var raw []byte
	for {
		part, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return raw, nil
		}
		if err != nil {
			return nil, err
		}
		if len(raw)+len(part.GetData()) > controllerv1.MaxReport {
			return nil, status.Errorf(codes.ResourceExhausted, "a report of more than %d bytes", controllerv1.MaxReport)
		}
		raw = append(raw, part.GetData()...)
	}
}

// apply brings the view up to a node's report.
func (s *registryServer) apply(report fleet.Report) (*controllerv1.ReportResponse, error) {
	now := time.Now()
	answer, err := s.view.Report(report, now)
	if err != nil {
		return nil, code(err)
	}
	resp := toWireAnswer(answer)
	if answer.Resync && !report.Full {
		if wait := s.fullReports.Grant(report.NodeID, now); wait > 0 {
			resp.FullReportAfter = durationpb.New(wait)
		}
	}
	if report.Full {
		klog.V(2).InfoS("A node reported its whole inventory", "node", report.NodeID, "store", report.StoreID,
			"volumes", len(report.Upserts), "revision", report.Revision)
	}
	return resp, nil
}

func (s *registryServer) ShareReadOrder(ctx context.Context, req *controllerv1.ShareReadOrderRequest) (*controllerv1.ShareReadOrderResponse, error) {
	if err := need(ctx, "update", ResourceNodes, "", "share a read order"); err != nil {
		return nil, err
	}
	if err := speaksFor(ctx, req.GetOrder().GetNodeId()); err != nil {
		return nil, err
	}
	if err := s.orders.Share(req.GetOrder()); err != nil {
		return nil, code(err)
	}
	klog.V(2).InfoS("A node shared a read order", "node", req.GetOrder().GetNodeId(), "namespace", req.GetOrder().GetNamespace(),
		"readProfile", req.GetOrder().GetName(), "files", len(req.GetOrder().GetFiles()))
	return &controllerv1.ShareReadOrderResponse{}, nil
}

// SignPeerCertificate signs the certificate of the node the caller proves
// to be: a node's credential gets its own node's name and no other.
func (s *registryServer) SignPeerCertificate(ctx context.Context, req *controllerv1.SignPeerCertificateRequest) (*controllerv1.SignPeerCertificateResponse, error) {
	if err := need(ctx, "update", ResourceNodes, "", "have a peer certificate signed"); err != nil {
		return nil, err
	}
	node := req.GetNodeId()
	if err := peerid.CheckNodeName(node); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := speaksFor(ctx, node); err != nil {
		return nil, err
	}
	if s.peerCA == nil {
		return nil, status.Error(codes.FailedPrecondition, "this controller signs no peer certificates: give it --peer-ca-cert-file and --peer-ca-key-file")
	}
	issued, err := s.peerCA.Sign(req.GetRequest(), peerid.Node(node))
	if errors.Is(err, peerid.ErrBadRequest) {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err != nil {
		klog.ErrorS(err, "Signing a node's peer certificate failed", "node", node)
		return nil, status.Errorf(codes.Internal, "signing the peer certificate: %v", err)
	}
	klog.V(2).InfoS("Signed a node's peer certificate", "node", node)
	return &controllerv1.SignPeerCertificateResponse{Certificate: issued.Certificate, Authorities: issued.Authorities}, nil
}

// GetReadOrder answers nodes only: an order's names are the files of its
// namespace's volumes, which schedulers of other namespaces must not learn.
func (s *registryServer) GetReadOrder(ctx context.Context, req *controllerv1.GetReadOrderRequest) (*controllerv1.ReadOrder, error) {
	if err := need(ctx, "update", ResourceNodes, "", "read a shared read order"); err != nil {
		return nil, err
	}
	if err := volume.ValidateNamespace(req.GetNamespace()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := volume.ValidateReadProfile(req.GetName()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	o, ok := s.orders.Get(req.GetNamespace(), req.GetName())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "no read order is shared for namespace %s under %s", volume.Quote(req.GetNamespace()), volume.Quote(req.GetName()))
	}
	return o, nil
}

type cacheServer struct {
	controllerv1.UnimplementedCacheServer
	view    *fleet.View
	metrics *fleet.Metrics
	events  NodeEvents
	dial    PeerDialer
}

// lookup is the view's answer as the caller may see it: another
// namespace's volume that was not shared is answered as not found.
func (s *cacheServer) lookup(ctx context.Context, refs []*controllerv1.VolumeRef, maxNodes int32) ([]*controllerv1.VolumeLocation, error) {
	if len(refs) > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d volumes in one call: at most %d", len(refs), maxLookup)
	}
	if err := checkMaxNodes(maxNodes); err != nil {
		return nil, err
	}
	parsed, err := refsFromWire(refs)
	if err != nil {
		return nil, code(err)
	}
	locs := s.view.Lookup(parsed, int(maxNodes), time.Now())
	may := CallerFrom(ctx).MayIn(ctx, "get")
	for i, l := range locs {
		if l.Scope != volume.ScopeCluster && !may(l.Ref.Namespace) {
			locs[i] = fleet.Location{Ref: l.Ref}
		}
	}
	return toWireLocations(locs), nil
}

// checkMaxNodes refuses a lookup's or a listing's max_nodes below 0.
func checkMaxNodes(maxNodes int32) error {
	if maxNodes < 0 {
		return status.Errorf(codes.InvalidArgument, "max_nodes %d: want 0 (all) or more", maxNodes)
	}
	return nil
}

func (s *cacheServer) LookupVolumes(ctx context.Context, req *controllerv1.LookupVolumesRequest) (*controllerv1.LookupVolumesResponse, error) {
	locs, err := s.lookup(ctx, req.GetRefs(), req.GetMaxNodes())
	if err != nil {
		return nil, err
	}
	return &controllerv1.LookupVolumesResponse{Volumes: locs}, nil
}

// LookupCaches answers a namespace's keys as the fleet holds them; a
// namespace the caller may not read holds none.
func (s *cacheServer) LookupCaches(ctx context.Context, req *controllerv1.LookupCachesRequest) (*controllerv1.LookupCachesResponse, error) {
	ns, keys := req.GetNamespace(), req.GetKeys()
	if err := volume.ValidateNamespace(ns); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if len(keys) > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d keys in one call: at most %d", len(keys), maxLookup)
	}
	for _, k := range keys {
		if err := volume.ValidateCacheKey(k); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	if err := checkMaxNodes(req.GetMaxNodes()); err != nil {
		return nil, err
	}
	var found []fleet.CacheLocation
	if CallerFrom(ctx).MayIn(ctx, "get")(ns) {
		found = s.view.Caches(ns, keys, int(req.GetMaxNodes()), time.Now())
	} else {
		for _, k := range keys {
			found = append(found, fleet.CacheLocation{Namespace: ns, Key: k})
		}
	}
	return &controllerv1.LookupCachesResponse{Caches: toWireCaches(found)}, nil
}

// ClearCaches destroys every version of each key on every node holding
// one; a node destroying its key's current version clears the key there.
func (s *cacheServer) ClearCaches(ctx context.Context, req *controllerv1.ClearCachesRequest) (*controllerv1.ClearCachesResponse, error) {
	ns, keys := req.GetNamespace(), req.GetKeys()
	if err := volume.ValidateNamespace(ns); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if len(keys) == 0 || len(keys) > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d keys in one call: want 1 to %d", len(keys), maxLookup)
	}
	for _, k := range keys {
		if err := volume.ValidateCacheKey(k); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	if err := need(ctx, "delete", ResourceVolumes, ns, "clear caches"); err != nil {
		return nil, err
	}
	resp := &controllerv1.ClearCachesResponse{}
	for _, k := range keys {
		told := s.view.ClearCache(volume.CacheRef{Namespace: ns, Key: k}, time.Now())
		s.metrics.Commands.WithLabelValues("destroy").Add(float64(len(told)))
		resp.Caches = append(resp.Caches, &controllerv1.ClearedCache{Key: k, Versions: toWireVolumeNodes(told)})
		klog.InfoS("Clearing a cache key on the nodes holding its versions", "namespace", ns, "key", k, "versions", len(told),
			"caller", CallerFrom(ctx).User)
	}
	return resp, nil
}

// Page sizes of ListVolumes.
const (
	defaultListLimit = 500
	maxListLimit     = 5000
)

// ListVolumes lists what the caller may see: its namespaces' volumes, and
// others' shared with scope cluster. Listing a node's volumes needs no
// cluster-wide token: the answer holds only what the caller may see.
func (s *cacheServer) ListVolumes(ctx context.Context, req *controllerv1.ListVolumesRequest) (*controllerv1.ListVolumesResponse, error) {
	limit := int(req.GetLimit())
	switch {
	case limit < 0 || limit > maxListLimit:
		return nil, status.Errorf(codes.InvalidArgument, "limit %d: want 0 to %d", limit, maxListLimit)
	case limit == 0:
		limit = defaultListLimit
	}
	if err := checkMaxNodes(req.GetMaxNodes()); err != nil {
		return nil, err
	}
	after := ""
	if tok := req.GetPageToken(); tok != "" {
		var err error
		if after, err = fleet.AfterToken(tok); err != nil {
			return nil, code(err)
		}
	}
	c := CallerFrom(ctx)
	visible := c.MayIn(ctx, "list")
	if c.May(ctx, "list", ResourceVolumes, "") {
		visible = nil // every namespace
	}
	vols, more, err := s.view.List(fleet.ListQuery{Visible: visible, Namespace: req.GetNamespace(), Node: req.GetNodeId(),
		Selector: req.GetSelector(), After: after, Limit: limit, MaxNodes: int(req.GetMaxNodes())}, time.Now())
	if err != nil {
		return nil, code(err)
	}
	resp := &controllerv1.ListVolumesResponse{Volumes: toWireLocations(vols)}
	if more {
		resp.NextPageToken = fleet.PageToken(vols[len(vols)-1].Ref)
	}
	return resp, nil
}

// Place ranks nodes by the inputs the caller may read; one it may not is
// missing everywhere, as if it did not exist.
func (s *cacheServer) Place(ctx context.Context, req *controllerv1.PlaceRequest) (*controllerv1.PlaceResponse, error) {
	if n := len(req.GetInputs()) + len(req.GetCaches()); n > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d inputs and caches in one call: at most %d", n, maxLookup)
	}
	if req.GetLimit() < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "limit %d: want 0 (every node) or more", req.GetLimit())
	}
	inputs, err := refsFromWire(req.GetInputs())
	if err != nil {
		return nil, code(err)
	}
	caches, err := cachesFromWire(req.GetCaches())
	if err != nil {
		return nil, code(err)
	}
	may, now := CallerFrom(ctx).MayIn(ctx, "get"), time.Now()
	inputs = append(inputs, s.view.CacheInputs(caches, may, now)...)
	return &controllerv1.PlaceResponse{Nodes: toWirePlacements(s.view.Place(inputs, may, int(req.GetLimit()), now))}, nil
}

func (s *cacheServer) ListNodes(ctx context.Context, _ *controllerv1.ListNodesRequest) (*controllerv1.ListNodesResponse, error) {
	if err := need(ctx, "list", ResourceNodes, "", "list the nodes"); err != nil {
		return nil, err
	}
	var nodes []*controllerv1.NodeStatus
	for _, n := range s.view.Nodes(time.Now()) {
		nodes = append(nodes, toWireNodeStatus(n))
	}
	return &controllerv1.ListNodesResponse{Nodes: nodes}, nil
}

func (s *cacheServer) DestroyVolumes(ctx context.Context, req *controllerv1.DestroyVolumesRequest) (*controllerv1.DestroyVolumesResponse, error) {
	if len(req.GetRefs()) > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d volumes in one batch: at most %d", len(req.GetRefs()), maxLookup)
	}
	if err := needNamespaces(ctx, "delete", "destroy volumes", req.GetRefs()); err != nil {
		return nil, err
	}
	refs, err := refsFromWire(req.GetRefs())
	if err != nil {
		return nil, code(err)
	}
	out := s.view.Destroy(refs, time.Now())
	klog.V(2).InfoS("Destroying volumes on the nodes holding them", "volumes", len(out), "caller", CallerFrom(ctx).User)
	s.metrics.Commands.WithLabelValues("destroy").Add(float64(len(out)))
	return &controllerv1.DestroyVolumesResponse{Volumes: toWireVolumeNodes(out)}, nil
}

func (s *cacheServer) PinVolumes(ctx context.Context, req *controllerv1.PinVolumesRequest) (*controllerv1.PinVolumesResponse, error) {
	if len(req.GetRefs()) > maxLookup {
		return nil, status.Errorf(codes.InvalidArgument, "%d volumes in one batch: at most %d", len(req.GetRefs()), maxLookup)
	}
	if err := needNamespaces(ctx, "update", "pin or unpin volumes", req.GetRefs()); err != nil {
		return nil, err
	}
	if u := req.GetUntil(); u != nil && u.CheckValid() != nil {
		return nil, status.Errorf(codes.InvalidArgument, "until: %v", u.CheckValid())
	}
	refs, err := refsFromWire(req.GetRefs())
	if err != nil {
		return nil, code(err)
	}
	out := s.view.Pin(refs, req.GetUnpin(), untilFromWire(req.GetUntil()), time.Now())
	s.metrics.Commands.WithLabelValues(map[bool]string{false: "pin", true: "unpin"}[req.GetUnpin()]).Add(float64(len(out)))
	return &controllerv1.PinVolumesResponse{Volumes: toWireVolumeNodes(out)}, nil
}

func (s *cacheServer) SetNodeLifecycle(ctx context.Context, req *controllerv1.SetNodeLifecycleRequest) (*controllerv1.NodeStatus, error) {
	if err := need(ctx, "patch", ResourceNodes, "", "land, retire or resume a node"); err != nil {
		return nil, err
	}
	st, err := s.view.SetLifecycle(req.GetNodeId(), req.GetAction(), time.Now())
	if err != nil {
		return nil, code(err)
	}
	klog.InfoS("Changed a node's lifecycle", "node", req.GetNodeId(), "action", req.GetAction(), "state", st.State,
		"caller", CallerFrom(ctx).User)
	s.metrics.Commands.WithLabelValues(req.GetAction()).Inc()
	s.events.NodeEventOn(req.GetNodeId(), "Normal", "Cowvol"+strings.ToUpper(req.GetAction()[:1])+req.GetAction()[1:],
		fmt.Sprintf("%s asked cowvol to %s the node: it is %s", CallerFrom(ctx).User, req.GetAction(), st.State))
	return toWireNodeStatus(st), nil
}
