package client

import (
	"context"
	"errors"
	"io"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
)

// SendReport sends a node's report: in one message, or in parts
// (SendReportParts) where its encoding is larger than one part may be.
func SendReport(ctx context.Context, c controllerv1.RegistryClient, req *controllerv1.ReportRequest) (*controllerv1.ReportResponse, error) {
	if proto.Size(req) <= controllerv1.ReportPartSize {
		return c.Report(ctx, req)
	}
	raw, err := proto.Marshal(req)
	if err != nil {
		return nil, err
	}
	return SendReportParts(ctx, c, req.GetNodeId(), raw)
}

// SendReportParts sends node's encoded report through Registry.SendReport,
// in parts of controllerv1.ReportPartSize, its node in the header the
// controller admits it by before it reads a part.
func SendReportParts(ctx context.Context, c controllerv1.RegistryClient, node string, raw []byte) (*controllerv1.ReportResponse, error) {
	stream, err := c.SendReport(metadata.AppendToOutgoingContext(ctx, controllerv1.ReportNodeHeader, node))
	if err != nil {
		return nil, err
	}
	for len(raw) > 0 {
		n := min(len(raw), controllerv1.ReportPartSize)
		if err := stream.Send(&controllerv1.ReportPart{Data: raw[:n]}); errors.Is(err, io.EOF) {
			break // the controller answered already (deferred, refused): CloseAndRecv says how
		} else if err != nil {
			return nil, err
		}
		raw = raw[n:]
	}
	return stream.CloseAndRecv()
}
