// Package credential is what the node's image registry and the kubelet's
// cowvol credential provider agree on: the audience of the tokens a pull
// carries and the user name they come under. It holds constants only, so
// that the provider, which the kubelet runs for each pull, links nothing
// else of cowvol's.
package credential

// Audience is the audience of the ServiceAccount tokens a pull's
// credential carries: the kubelet asks for it for cowvol's credential
// provider (tokenAttributes.serviceAccountTokenAudience), and the registry
// refuses a token of any other audience. It is a plain word, since RBAC
// names it as a resource where nodes are granted it
// (request-serviceaccounts-token-audience).
const Audience = "cowvol-image-registry"

// User is the user name the provider gives with a pod's token as the
// password.
const User = "serviceaccount-token"
