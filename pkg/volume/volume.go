// Package volume holds the types every side of cowvol shares: a cached
// volume's identity (namespace and handle), its states and scopes, the pod
// identity the kubelet vouches for, and the validation of each. It imports no
// storage, gRPC or filesystem code, so that the node plugin, a controller and
// a scheduler's client can all use it; it must never grow any.
package volume

import (
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"
)

// DriverName is the CSI driver name step pods name in their inline volumes.
const DriverName = "cowvol.concourse-ci.org"

// Volume attributes a step pod may set on an inline cowvol volume.
const (
	AttrSource          = "source"
	AttrSourceNamespace = "sourceNamespace"
	AttrCapture         = "capture"
	AttrScope           = "scope"
	AttrSizeLimit       = "sizeLimit"
	AttrTTL             = "ttl"
	// AttrCopies asks for a captured volume on that many nodes: the
	// controller has other nodes pull it once it is captured, so that it
	// outlives the node that captured it.
	AttrCopies         = "copies"
	AttrPropertyPrefix = "property."
	// AttrReadProfile names the order in which the step reads its source,
	// recorded by a node that pulls the source lazily and used, by the
	// next lazy pull under the same name in the pod's namespace, to fetch
	// the files in that order: a scheduler names it after the job, the
	// step and the input ("pipeline/job/step/input").
	AttrReadProfile = "readProfile"
	// AttrOwner makes the captured volume belong to an object: its only
	// value, OwnerController, names the object that controls the step's
	// pod (an Argo Workflow, a Tekton TaskRun, a Job), and the controller
	// destroys the volume once that object is gone.
	AttrOwner       = "owner"
	OwnerController = "controller"
)

// Keys the kubelet adds to an inline volume's context when the CSIDriver
// has podInfoOnMount: the only word on which pod (and namespace) a publish
// is for.
const (
	KeyEphemeral      = "csi.storage.k8s.io/ephemeral"
	KeyPodName        = "csi.storage.k8s.io/pod.name"
	KeyPodNamespace   = "csi.storage.k8s.io/pod.namespace"
	KeyPodUID         = "csi.storage.k8s.io/pod.uid"
	KeyServiceAccount = "csi.storage.k8s.io/serviceAccount.name"
	KeySATokens       = "csi.storage.k8s.io/serviceAccount.tokens"
)

// Properties cowvol sets itself, under a prefix a step may not use: a
// scheduler can trust them.
const (
	// ReservedPropertyPrefix starts every property cowvol sets.
	ReservedPropertyPrefix = DriverName + "/"
	// PropertyStepResult says how the step that a volume was captured from
	// ended: one of the StepResult values. It is missing where that could
	// not be told (no API server, or the pod was gone).
	PropertyStepResult = ReservedPropertyPrefix + "step-result"
	// PropertyOwner names the object a volume captured with owner:
	// controller belongs to, as kubectl names one (Kind.group/name, in the
	// volume's namespace), and PropertyOwnerUID is that object's UID: an
	// object of the same name and another UID is another object.
	PropertyOwner    = ReservedPropertyPrefix + "owner"
	PropertyOwnerUID = ReservedPropertyPrefix + "owner-uid"
	// reservedProperties is how many of the above (and a cache version's
	// three, cachekey.go) a volume may carry on top of MaxProperties of
	// its own.
	reservedProperties = 6
)

// StepResult is how a step pod's containers ended.
type StepResult string

const (
	// StepSucceeded: every container ran and exited 0.
	StepSucceeded StepResult = "succeeded"
	// StepFailed: a container ran and exited otherwise (or was killed).
	StepFailed StepResult = "failed"
	// StepNotStarted: no container of the pod ever started (an image that
	// could not be pulled, a runtime that refused it, a pod deleted first):
	// the captured volume is its source, unchanged, not an output.
	StepNotStarted StepResult = "not-started"
)

// State is the life-cycle state of a cached volume.
type State string

const (
	// StateCreating marks a handle reserved by a step volume that will be
	// captured into it; it is never usable as a source.
	StateCreating State = "creating"
	// StateReady marks an immutable cached volume that steps may use.
	StateReady State = "ready"
	// StateFilling marks a volume whose tree is here and whose data is
	// still arriving from a peer: steps on this node may use it (reads wait
	// for what they touch), peers may not (it is not all here).
	StateFilling State = "filling"
	// StateFailed marks a volume whose data was found damaged or missing.
	StateFailed State = "failed"
	// StateDestroying marks a volume whose data is being removed.
	StateDestroying State = "destroying"
)

// Need says how much of a volume a reader on the node needs here before
// it reads.
type Need int

const (
	// NeedWhole: all of its data, ready (a runtime pulling an image reads
	// every byte, and a peer is served only what is all here).
	NeedWhole Need = iota
	// NeedTree: its tree, each file's data arriving as the file is
	// opened; a volume filling will do (a container running on the
	// volume's own layers, as a step's view does).
	NeedTree
)

// Present says whether a volume in state s is here as far as a reader that
// needs n is concerned.
func (n Need) Present(s State) bool {
	return s == StateReady || (n == NeedTree && s == StateFilling)
}

// Scope says who may use a cached volume as a source.
type Scope string

const (
	// ScopeNamespace limits use to pods of the namespace that captured it.
	ScopeNamespace Scope = "namespace"
	// ScopeCluster lets pods of any namespace use it, naming its namespace:
	// the capturing namespace consented to share it.
	ScopeCluster Scope = "cluster"
)

// Readable says whether pods of namespace may use the volume r, of scope,
// as a source (and so see the volumes under it, merged into it).
func Readable(r Ref, scope Scope, namespace string) bool {
	return r.Namespace == namespace || scope == ScopeCluster
}

// Ref names a cached volume: a handle is unique within its namespace only,
// so two namespaces may use the same handle without ever meeting.
type Ref struct {
	Namespace string `json:"namespace"`
	Handle    string `json:"handle"`
}

// String is "namespace/handle", also the volume's key in stores and APIs.
func (r Ref) String() string {
	if r.IsZero() {
		return ""
	}
	return r.Namespace + "/" + r.Handle
}

// IsZero says the ref names nothing.
func (r Ref) IsZero() bool { return r.Handle == "" }

// Validate checks both parts of the ref.
func (r Ref) Validate() error {
	return errors.Join(ValidateNamespace(r.Namespace), ValidateHandle(r.Handle))
}

// ParseRef parses "namespace/handle".
func ParseRef(s string) (Ref, error) {
	ns, h, ok := strings.Cut(s, "/")
	if !ok {
		return Ref{}, fmt.Errorf("volume %s: want namespace/handle", Quote(s))
	}
	r := Ref{Namespace: ns, Handle: h}
	return r, r.Validate()
}

// HandleDescription says what a valid handle looks like, for messages.
const HandleDescription = "1-128 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"

// Handles name dirs on disk, so their charset leaves no room for path
// tricks: no slash, no leading dot.
// isHandle says whether h is a handle: 1 to 128 of A-Z a-z 0-9 . _ -, not
// starting with . _ or -. By hand, not a regexp: the controller checks a
// million of them when a fleet reports.
func isHandle(h string) bool {
	if len(h) == 0 || len(h) > 128 {
		return false
	}
	for i := 0; i < len(h); i++ {
		switch c := h[i]; {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case (c == '.' || c == '_' || c == '-') && i > 0:
		default:
			return false
		}
	}
	return true
}

// Quote quotes a caller's string for a message or a log: escaped, and cut
// short, so that a hostile value can neither forge a log line nor flood one.
func Quote(s string) string {
	const max = 80
	if len(s) > max {
		return fmt.Sprintf("%q...(%d bytes)", s[:max], len(s))
	}
	return fmt.Sprintf("%q", s)
}

// ValidateHandle checks a cached volume handle.
func ValidateHandle(h string) error {
	if !isHandle(h) {
		return fmt.Errorf("handle %s is invalid: want %s", Quote(h), HandleDescription)
	}
	return nil
}

// isDNS1123Label says whether s is a Kubernetes namespace (or volume) name:
// 1 to 63 of a-z 0-9 -, starting and ending with a letter or digit.
func isDNS1123Label(s string) bool {
	if len(s) == 0 || len(s) > 63 {
		return false
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c == '-' && i > 0 && i < len(s)-1:
		default:
			return false
		}
	}
	return true
}

// dns1123Subdomain is a Kubernetes object name such as a pod's.
var dns1123Subdomain = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)

// uidRE is a pod UID: a UUID, or the 32 hex digits of a static pod's hash.
var uidRE = regexp.MustCompile(`^([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32})$`)

// MaxCopies is the most nodes a captured volume may ask to be kept on.
const MaxCopies = 5

// MaxReadProfile is the longest read profile name.
const MaxReadProfile = 253

// A read order (the files a read profile's steps reached, in order) is at
// most MaxReadOrderFiles paths and MaxReadOrderBytes of them: it travels
// in one request, to a peer or the controller.
const (
	MaxReadOrderFiles = 50_000
	MaxReadOrderBytes = 1 << 20
)

// ValidateReadProfile checks a read profile's name: 1 to MaxReadProfile of
// A-Z a-z 0-9 . _ - / :, starting with a letter or a digit.
func ValidateReadProfile(name string) error {
	ok := len(name) > 0 && len(name) <= MaxReadProfile
	for i := 0; ok && i < len(name); i++ {
		switch c := name[i]; {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case i > 0 && strings.IndexByte("._-/:", c) >= 0:
		default:
			ok = false
		}
	}
	if !ok {
		return fmt.Errorf("read profile %s is invalid: want 1-%d of A-Z a-z 0-9 . _ - / :, starting with a letter or a digit", Quote(name), MaxReadProfile)
	}
	return nil
}

// ValidateNamespace checks a Kubernetes namespace name (a DNS-1123 label).
func ValidateNamespace(ns string) error {
	if !isDNS1123Label(ns) {
		return fmt.Errorf("namespace %s is invalid: want a DNS-1123 label (1-63 of a-z 0-9 -)", Quote(ns))
	}
	return nil
}

// ValidateLabel checks a DNS-1123 label, such as a pod's volume name.
func ValidateLabel(what, s string) error {
	if !isDNS1123Label(s) {
		return fmt.Errorf("%s %s is invalid: want a DNS-1123 label (1-63 of a-z 0-9 -)", what, Quote(s))
	}
	return nil
}

// ValidatePodUID checks the shape of a pod UID.
func ValidatePodUID(uid string) error {
	if !uidRE.MatchString(uid) {
		return fmt.Errorf("pod UID %s is invalid: want a UUID (or a static pod's 32 hex digits)", Quote(uid))
	}
	return nil
}

// Pod identifies the pod a step volume is published for, as the kubelet
// told it (podInfoOnMount). Its namespace owns what the pod captures.
type Pod struct {
	Name      string `json:"name,omitempty"`
	Namespace string `json:"namespace,omitempty"`
	UID       string `json:"uid,omitempty"`
}

// Validate checks each field's shape, so that nothing a pod author could
// smuggle in (a newline, an escape sequence, a path) reaches a log, a
// message or a file name.
func (p Pod) Validate() error {
	var errs []error
	if len(p.Name) > 253 || !dns1123Subdomain.MatchString(p.Name) {
		errs = append(errs, fmt.Errorf("pod name %s is invalid: want a DNS-1123 subdomain", Quote(p.Name)))
	}
	errs = append(errs, ValidateNamespace(p.Namespace), ValidatePodUID(p.UID))
	return errors.Join(errs...)
}

// ParseScope checks a scope's name.
func ParseScope(s string) (Scope, error) {
	switch sc := Scope(s); sc {
	case ScopeNamespace, ScopeCluster:
		return sc, nil
	}
	return "", fmt.Errorf("scope %s is invalid: want namespace or cluster", Quote(s))
}

// Limits on a volume's properties.
const (
	MaxProperties    = 64
	MaxPropertyValue = 4096
)

var propertyKeyRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/-]{0,252}$`)

// ValidateProperty checks one property of a volume.
func ValidateProperty(key, value string) error {
	if !propertyKeyRE.MatchString(key) {
		return fmt.Errorf("property key %s is invalid: want 1-253 characters of A-Z a-z 0-9 . _ / -", Quote(key))
	}
	if len(value) > MaxPropertyValue || !utf8.ValidString(value) || strings.ContainsRune(value, 0) {
		return fmt.Errorf("property %s: value must be at most %d bytes of UTF-8 without NUL", Quote(key), MaxPropertyValue)
	}
	return nil
}

// ValidateUserProperty checks a property a step pod or a user sets: one of
// cowvol's own keys is refused, so that a scheduler can trust them.
func ValidateUserProperty(key, value string) error {
	if strings.HasPrefix(key, ReservedPropertyPrefix) {
		return fmt.Errorf("property key %s is reserved: cowvol sets the keys starting %s itself", Quote(key), Quote(ReservedPropertyPrefix))
	}
	return ValidateProperty(key, value)
}

// ValidateProperties checks a volume's properties: a step's own, and
// cowvol's.
func ValidateProperties(props map[string]string) error {
	if len(props) > MaxProperties+reservedProperties {
		return fmt.Errorf("%d properties given: at most %d", len(props), MaxProperties+reservedProperties)
	}
	for k, v := range props {
		if err := ValidateProperty(k, v); err != nil {
			return err
		}
	}
	return nil
}

// Digest is a SHA-256 that stands for a volume's files (pkg/filesum makes
// them), written in hex.
type Digest [32]byte

func (d Digest) String() string { return hex.EncodeToString(d[:]) }

// MarshalText writes the digest in hex.
func (d Digest) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// UnmarshalText reads a digest in hex.
func (d *Digest) UnmarshalText(b []byte) error {
	if len(b) != 2*len(d) {
		return fmt.Errorf("a digest of %d characters: want %d hex digits", len(b), 2*len(d))
	}
	_, err := hex.Decode(d[:], b)
	return err
}

// Digests are what the node that captured a volume vouches for its bytes
// with, so that a peer that sends it can be checked by another than
// itself: Layer stands for the volume's own layer over its base (the
// base's name and the layer's files), View for every regular file a step
// sees through the volume (its chain merged). A volume captured whole has
// a View equal to its own files. FirstHand says that the node reporting
// them computed them from the capture; a pulled copy keeps, second-hand,
// those its pull was checked against. Zero: none known.
type Digests struct {
	Layer     Digest `json:"layer"`
	View      Digest `json:"view"`
	FirstHand bool   `json:"firstHand,omitempty"`
}

// Known says whether there are digests.
func (d Digests) Known() bool { return d.View != Digest{} }

// repositoryComponent is a component of an image repository's name, as
// the distribution spec allows it.
var repositoryComponent = regexp.MustCompile(`^[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*$`)

// ParseRepository reads the name of a repository of a node's image
// registry (docs/step-images.md): <namespace>/<handle>, a volume of the
// reading pod's namespace, or <namespace>/<owner namespace>/<handle>, a
// volume another namespace shared. reader is the pod's namespace.
func ParseRepository(name string) (reader string, r Ref, err error) {
	parts := strings.Split(name, "/")
	for _, p := range parts {
		if !repositoryComponent.MatchString(p) {
			return "", Ref{}, fmt.Errorf("repository %s: want <namespace>/<handle> or <namespace>/<owner namespace>/<handle>, lower case", Quote(name))
		}
	}
	switch len(parts) {
	case 2:
		reader, r = parts[0], Ref{Namespace: parts[0], Handle: parts[1]}
	case 3:
		reader, r = parts[0], Ref{Namespace: parts[1], Handle: parts[2]}
	default:
		return "", Ref{}, fmt.Errorf("repository %s: want <namespace>/<handle> or <namespace>/<owner namespace>/<handle>", Quote(name))
	}
	if err := errors.Join(ValidateNamespace(reader), r.Validate()); err != nil {
		return "", Ref{}, err
	}
	return reader, r, nil
}
