package plugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	contentapi "github.com/containerd/containerd/api/services/content/v1"
	imagesapi "github.com/containerd/containerd/api/services/images/v1"
	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/opencontainers/go-digest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/cache"
	"github.com/concourse/cowvol/pkg/image"
	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/registry"
	"github.com/concourse/cowvol/pkg/registry/credential"
	"github.com/concourse/cowvol/pkg/snapshotter"
	"github.com/concourse/cowvol/pkg/streamer"
	"github.com/concourse/cowvol/pkg/volume"
)

// This file composes step images: the registry that serves the images
// cached volumes hold, the snapshotter that runs them on the volumes'
// layers, and what the plugin asks of and tidies in the node's containerd.

// imageVolumes are the node's volumes as its image registry reads them.
type imageVolumes struct{ engine *node.Engine }

func (v imageVolumes) Version(namespace string, r volume.Ref, need volume.Need) (string, error) {
	return v.engine.VolumeVersion(namespace, r, need)
}

func (v imageVolumes) OpenVolume(namespace string, r volume.Ref, path string, format streamer.Format, need volume.Need) (streamer.Reading, error) {
	return v.engine.OpenVolume(namespace, r, path, format, need)
}

func (v imageVolumes) Fetch(ctx context.Context, namespace string, r volume.Ref, need volume.Need) error {
	err := v.engine.Fetch(ctx, namespace, r, need)
	if errors.Is(err, cache.ErrNotFound) {
		return fmt.Errorf("%w: %w", streamer.ErrNotHeld, err)
	}
	return err
}

// imageRunners serve the images cached volumes hold to the node's runtime:
// the registry, and the snapshotter that runs them on the volumes' layers.
func (d *Driver) imageRunners() ([]runner, error) {
	var runners []runner
	opts := registry.Options{Mode: d.opts.Images.RegistryAuth}
	if d.kube != nil {
		opts.Auth = registry.NewTokenReviews(d.kube, d.opts.NodeID, pullReviewTTL)
	}
	if d.opts.Images.SnapshotterEndpoint != "" {
		k, err := image.LoadLayerKey(filepath.Join(d.opts.Node.StateDir, "image-layer.key"))
		if err != nil {
			return nil, fmt.Errorf("the image snapshotter's key: %w", err)
		}
		opts.Grants = image.NewPullGrants(k, registry.GrantTTL)
		root := filepath.Join(d.opts.Node.StateDir, "snapshotter")
		sn, err := snapshotter.New(context.Background(), root, opts.Grants, d.engine)
		if err != nil {
			return nil, fmt.Errorf("the image snapshotter at %s: %w", root, err)
		}
		opts.RemoteLayers = sn
		srv := grpc.NewServer(grpc.ChainUnaryInterceptor(d.metrics.interceptor))
		snapshotsapi.RegisterSnapshotsServer(srv, snapshotservice.FromSnapshotter(sn))
		// containerd's alone: it hands out the node's volumes as root
		// filesystems.
		runners = append(runners, logged(grpcRunner("serving the image snapshotter", srv,
			unixListener(d.opts.Images.SnapshotterEndpoint, 0o600), func(srv *grpc.Server) { srv.Stop(); sn.Close() }),
			"Serving containerd the cowvol snapshotter", "endpoint", d.opts.Images.SnapshotterEndpoint, "root", root))
		if d.opts.Images.ContainerdAddress != "" {
			runners = append(runners, loopRunner("checking containerd's config", d.checkContainerd))
		} else {
			klog.InfoS("Not checking that containerd runs step images on the cowvol snapshotter: no --containerd-address")
		}
	}
	reg := registry.New(imageVolumes{d.engine}, d.imageMetrics, opts)
	if d.opts.Images.ContainerdAddress != "" {
		runners = append(runners, loopRunner("deleting the runtime's images of volumes gone", func(ctx context.Context) error {
			d.forgetImages(ctx, reg)
			return nil
		}))
	}
	runners = append(runners, loopRunner("checking that pulls carry credentials", func(ctx context.Context) error {
		d.checkPullCredentials(ctx, reg, time.Minute)
		return nil
	}))
	srv := &http.Server{Handler: reg, ReadHeaderTimeout: 10 * time.Second}
	runners = append(runners, logged(serverRunner("serving images", tcpListener(d.opts.Images.RegistryAddress), srv.Serve,
		func() { srv.Close() }), "Serving cached volumes' images to the node's runtime", "address", d.opts.Images.RegistryAddress,
		"auth", d.opts.Images.RegistryAuth))
	return runners, nil
}

// pullReviewTTL is how long the registry trusts an API server's review of
// a pull's token: a pull's few requests cost one review.
const pullReviewTTL = 30 * time.Second

// checkPullCredentials says, in the log and in an Event on the Node, when
// the runtime pulls from the node's registry without credentials: a period
// in which manifests were asked for without one and none with one means
// the kubelet's cowvol credential provider is missing or not configured
// for the registry's address (a runtime first asks without, and again
// with the credential it was given once challenged). It is said once, and
// again only after pulls carried credentials in between.
func (d *Driver) checkPullCredentials(ctx context.Context, reg *registry.Server, period time.Duration) {
	var lastAnon, lastAuth uint64
	warned := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(period):
		}
		anon, auth := reg.Credentials()
		switch {
		case anon > lastAnon && auth == lastAuth && !warned:
			how := "refused"
			if d.opts.Images.RegistryAuth == registry.AuthGrace {
				how = "served as their path says (--image-registry-auth=grace)"
			}
			msg := fmt.Sprintf("the runtime pulled %d image manifests from the node's image registry without credentials, %s: "+
				"install cowvol-credential-provider in the kubelet's --image-credential-provider-bin-dir and name it for %s in its --image-credential-provider-config "+
				"(tokenAttributes.serviceAccountTokenAudience: %s)", anon-lastAnon, how, d.opts.Images.RegistryAddress, credential.Audience)
			klog.ErrorS(nil, "Image pulls arrive without credentials", "pulls", anon-lastAnon, "auth", d.opts.Images.RegistryAuth)
			d.podEvents.NodeEvent(corev1.EventTypeWarning, "ImagePullsWithoutCredentials", msg)
			warned = true
		case auth > lastAuth && warned:
			klog.InfoS("Image pulls arrive with their pods' credentials again")
			warned = false
		}
		lastAnon, lastAuth = anon, auth
	}
}

// checkContainerd says, in the log and in an Event on the Node, what the
// node's containerd lacks to run step images on the snapshotter, until it
// has it all (a containerd restarted with a new config is seen within a
// minute).
func (d *Driver) checkContainerd(ctx context.Context) error {
	_, socket, _ := parseEndpoint(d.opts.Images.SnapshotterEndpoint)
	said := ""
	for {
		askCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		missing, err := snapshotter.Check(askCtx, d.opts.Images.ContainerdAddress, socket)
		cancel()
		switch {
		case err != nil:
			if say := err.Error(); say != said {
				klog.ErrorS(err, "Could not check that containerd runs step images on the cowvol snapshotter; checking again every minute")
				said = say
			}
		case len(missing) > 0:
			if say := strings.Join(missing, "; "); say != said {
				klog.ErrorS(nil, "containerd cannot run step images on the cowvol snapshotter: pods of the RuntimeClass cowvol will not start",
					"containerd", d.opts.Images.ContainerdAddress, "missing", missing)
				d.podEvents.NodeEvent(corev1.EventTypeWarning, "ImageSnapshotterNotConfigured",
					"containerd cannot run step images on the cowvol snapshotter: "+say)
				said = say
			}
		default:
			klog.InfoS("containerd runs step images on the cowvol snapshotter", "containerd", d.opts.Images.ContainerdAddress)
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Minute):
		}
	}
}

// criNamespace is the containerd namespace the CRI keeps pods' images in.
const criNamespace = "k8s.io"

// forgetImages deletes from containerd, every half minute, the images it
// keeps of this node's registry that no longer name what the node serves
// (registry.Stale): the kubelet would otherwise start pods on an image
// whose volume was destroyed, or fail to start them on one whose layers
// are gone. Each delete waits for containerd to collect what only the
// image held (its content, and snapshots no container runs on).
func (d *Driver) forgetImages(ctx context.Context, reg *registry.Server) {
	ctx = metadata.AppendToOutgoingContext(ctx, "containerd-namespace", criNamespace)
	said := ""
	for {
		err := func() error {
			conn, err := grpc.NewClient("unix://"+d.opts.Images.ContainerdAddress, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				return err
			}
			defer conn.Close()
			return forgetStale(ctx, imagesapi.NewImagesClient(conn), contentapi.NewContentClient(conn), reg, d.opts.Images.RegistryAddress+"/")
		}()
		if err != nil && err.Error() != said {
			klog.ErrorS(err, "Could not delete the runtime's images of volumes gone; trying again every half minute", "containerd", d.opts.Images.ContainerdAddress)
		}
		said = ""
		if err != nil {
			said = err.Error()
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(30 * time.Second):
		}
	}
}

// imageID is the name the CRI also keeps each image under: its config's
// digest.
var imageID = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

// forgetStale deletes the images under prefix that are stale, and then
// the CRI's image ID records left naming nothing else: while one is left,
// containerd keeps everything the image held.
func forgetStale(ctx context.Context, imgs imagesapi.ImagesClient, blobs contentapi.ContentClient, reg *registry.Server, prefix string) error {
	list, err := imgs.List(ctx, &imagesapi.ListImagesRequest{Filters: []string{imagesUnder(prefix)}})
	if err != nil {
		return err
	}
	targets := map[string]bool{}
	for _, img := range list.Images {
		ref, ok := strings.CutPrefix(img.Name, prefix)
		if !ok || img.Target == nil {
			continue
		}
		manifest := func() ([]byte, error) { return readBlob(ctx, blobs, img.Target.Digest, img.Target.Size) }
		if stale, err := reg.Stale(ctx, ref, digest.Digest(img.Target.Digest), manifest); err != nil || !stale {
			continue
		}
		if err := deleteImage(ctx, imgs, img.Name); err != nil {
			return err
		}
		targets[img.Target.Digest] = true
		klog.InfoS("Deleted from the runtime an image whose volume the node no longer serves", "image", img.Name)
	}
	for target := range targets {
		same, err := imgs.List(ctx, &imagesapi.ListImagesRequest{Filters: []string{"target.digest==" + strconv.Quote(target)}})
		if err != nil {
			return err
		}
		var ids []string
		for _, img := range same.Images {
			if !imageID.MatchString(img.Name) {
				ids = nil // another name still runs it: the runtime keeps it
				break
			}
			ids = append(ids, img.Name)
		}
		for _, id := range ids {
			if err := deleteImage(ctx, imgs, id); err != nil {
				return err
			}
		}
	}
	return nil
}

// maxManifest bounds a manifest read from the runtime's content store.
const maxManifest = 4 << 20

// readBlob reads a small blob from containerd's content store.
func readBlob(ctx context.Context, blobs contentapi.ContentClient, d string, size int64) ([]byte, error) {
	if size < 0 || size > maxManifest {
		return nil, fmt.Errorf("blob %s: %d bytes, more than a manifest", d, size)
	}
	stream, err := blobs.Read(ctx, &contentapi.ReadContentRequest{Digest: d})
	if err != nil {
		return nil, err
	}
	var data []byte
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		if data = append(data, resp.Data...); int64(len(data)) > size {
			return nil, fmt.Errorf("blob %s: more than its %d bytes", d, size)
		}
	}
	return data, nil
}

// deleteImage deletes an image, waiting for containerd to collect what
// only it held.
func deleteImage(ctx context.Context, imgs imagesapi.ImagesClient, name string) error {
	_, err := imgs.Delete(ctx, &imagesapi.DeleteImageRequest{Name: name, Sync: true})
	if status.Code(err) == codes.NotFound {
		return nil
	}
	return err
}

// imagesUnder is containerd's filter for the images whose name starts
// with prefix (its quoted strings take Go's escapes).
func imagesUnder(prefix string) string {
	return "name~=" + strconv.Quote("^"+regexp.QuoteMeta(prefix))
}
