package volume

import (
	"fmt"
	"strings"
)

// Owner is the object a captured volume belongs to: the controller of the
// pod that captured it, in the pod's namespace (or cluster-scoped).
type Owner struct {
	// Group is its API group ("" for the core group), Kind its kind.
	Group, Kind string
	Name        string
	UID         string
}

// String names the owner as kubectl does: Kind.group/name.
func (o Owner) String() string {
	if o.Group == "" {
		return o.Kind + "/" + o.Name
	}
	return o.Kind + "." + o.Group + "/" + o.Name
}

// Properties are the properties that record the owner on its volume.
func (o Owner) Properties() map[string]string {
	return map[string]string{PropertyOwner: o.String(), PropertyOwnerUID: o.UID}
}

// OwnerOf reads the owner a volume's properties record, if they record a
// well-formed one.
func OwnerOf(props map[string]string) (Owner, bool) {
	named, uid := props[PropertyOwner], props[PropertyOwnerUID]
	kindGroup, name, ok := strings.Cut(named, "/")
	if !ok {
		return Owner{}, false
	}
	kind, group, _ := strings.Cut(kindGroup, ".")
	o := Owner{Group: group, Kind: kind, Name: name, UID: uid}
	if err := o.Validate(); err != nil {
		return Owner{}, false
	}
	return o, true
}

// Validate checks an owner's fields as the API server would have.
func (o Owner) Validate() error {
	switch {
	case o.Kind == "" || len(o.Kind) > 63 || strings.ContainsAny(o.Kind, "./ "):
		return fmt.Errorf("owner kind %s is invalid", Quote(o.Kind))
	case o.Group != "" && (len(o.Group) > 253 || !dns1123Subdomain.MatchString(o.Group)):
		return fmt.Errorf("owner group %s is invalid: want a DNS-1123 subdomain", Quote(o.Group))
	case o.Name == "" || len(o.Name) > 253 || strings.ContainsAny(o.Name, "/%"):
		return fmt.Errorf("owner name %s is invalid", Quote(o.Name))
	case !uidRE.MatchString(o.UID):
		return fmt.Errorf("owner UID %s is invalid: want a UUID", Quote(o.UID))
	}
	return nil
}
