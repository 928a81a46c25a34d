package client

import (
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// RetryAfter is how long the controller asked the caller to wait before it
// sends a call again, when it turned the call away to spread its load
// (ResourceExhausted with a RetryInfo): false for any other error.
func RetryAfter(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.ResourceExhausted {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay().IsValid() {
			return max(0, ri.GetRetryDelay().AsDuration()), true
		}
	}
	return 0, false
}
