// Command podnet is the local cluster's CNI plugin. Its config's "subnet"
// chooses between two networks:
//
//   - none (the one-node cluster, whose node is the test's own network
//     namespace): isolated. The pod gets an interface with an address,
//     which is all the CRI needs to start it, and reaches nothing through
//     it; the host is left untouched. It is a veth pair made inside the
//     pod's namespace, both ends there (these kernels have no dummy
//     interfaces).
//   - a node's pod subnet (a fleet's node, a network namespace of its own):
//     routed, as Calico routes a pod. A veth pair joins the pod to its
//     node: the pod's end is eth0 with a /32 address from the subnet and a
//     default route to the config's link-local "gateway", the node's end
//     has a /32 route to the pod. The harness sets up the rest on the node
//     as a CNI's node agent would: the gateway's address on its loopback
//     (so the node answers the pods' ARP for it on every pair), forwarding,
//     a masquerade of what leaves the cluster's pod range, and routes to
//     the other nodes' subnets over the lab's bridge; so a pod reaches
//     Services through its node's kube-proxy and pods on other nodes at
//     their addresses.
//
// Addresses are leased as files named by address in "dataDir", made with
// O_EXCL, each holding the container's ID: a crash leaves a lease that DEL
// of the same container frees.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

const cniVersion = "0.4.0"

// netConf is what podnet reads of its config on stdin.
type netConf struct {
	Subnet  string `json:"subnet"`
	Gateway string `json:"gateway"`
	DataDir string `json:"dataDir"`
}

func main() {
	if err := run(); err != nil {
		_ = json.NewEncoder(os.Stdout).Encode(map[string]any{"cniVersion": cniVersion, "code": 100, "msg": err.Error()})
		os.Exit(1)
	}
}

func run() error {
	command := os.Getenv("CNI_COMMAND")
	if command == "VERSION" {
		return json.NewEncoder(os.Stdout).Encode(map[string]any{"cniVersion": cniVersion,
			"supportedVersions": []string{"0.3.0", "0.3.1", "0.4.0"}})
	}
	var conf netConf
	if b, err := io.ReadAll(os.Stdin); err != nil {
		return err
	} else if err := json.Unmarshal(b, &conf); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	netns, ifname, id := os.Getenv("CNI_NETNS"), os.Getenv("CNI_IFNAME"), os.Getenv("CNI_CONTAINERID")
	switch {
	case command == "ADD" && conf.Subnet == "":
		return isolated(netns, ifname, id)
	case command == "ADD":
		return routed(conf, netns, ifname, id)
	case command == "DEL" && conf.Subnet != "":
		// The pod's end goes with its namespace, and the node's end and
		// route with it; the lease is the node's to free.
		return release(conf.DataDir, id)
	case command == "DEL", command == "CHECK":
		return nil
	}
	return fmt.Errorf("unknown CNI_COMMAND %q", command)
}

// isolated gives the pod an interface and an address that lead nowhere.
func isolated(netns, ifname, id string) error {
	h := fnv.New32a()
	h.Write([]byte(id))
	addr := fmt.Sprintf("10.%d.%d.%d/32", 200+h.Sum32()%50, h.Sum32()>>8&0xff, 1+h.Sum32()>>16%254)
	if err := ipIn(netns, [][]string{
		{"link", "add", ifname, "type", "veth", "peer", "name", "podnet0"},
		{"addr", "add", addr, "dev", ifname},
		{"link", "set", ifname, "up"},
	}); err != nil {
		return err
	}
	return result(netns, ifname, addr)
}

// routed joins the pod to its node with an address of the node's subnet.
func routed(conf netConf, netns, ifname, id string) (err error) {
	addr, err := lease(conf, id)
	if err != nil {
		return err
	}
	// An ADD that fails holds no address: the runtime need not DEL it.
	defer func() {
		if err != nil {
			err = errors.Join(err, release(conf.DataDir, id))
		}
	}()
	// Named for the container, within IFNAMSIZ; made in the pod's
	// namespace and moved to the node's (this process's), where the
	// runtime that runs podnet lives.
	h := fnv.New32a()
	h.Write([]byte(id))
	nodeEnd := fmt.Sprintf("pn%08x", h.Sum32())
	if err := ipIn(netns, [][]string{
		{"link", "add", ifname, "type", "veth", "peer", "name", nodeEnd},
		{"link", "set", nodeEnd, "netns", fmt.Sprint(os.Getpid())},
		{"addr", "add", addr.String() + "/32", "dev", ifname},
		{"link", "set", ifname, "up"},
		{"route", "add", conf.Gateway, "dev", ifname, "scope", "link"},
		{"route", "add", "default", "via", conf.Gateway, "dev", ifname},
	}); err != nil {
		return err
	}
	if err := ipIn("", [][]string{
		{"link", "set", nodeEnd, "up"},
		{"route", "replace", addr.String() + "/32", "dev", nodeEnd},
	}); err != nil {
		return err
	}
	return result(netns, ifname, addr.String()+"/32")
}

// lease takes the first free address of the subnet for the container (the
// one it holds already, for an ADD repeated).
func lease(conf netConf, id string) (netip.Addr, error) {
	prefix, err := netip.ParsePrefix(conf.Subnet)
	if _, gerr := netip.ParseAddr(conf.Gateway); err != nil || gerr != nil || conf.DataDir == "" {
		return netip.Addr{}, fmt.Errorf("routed mode needs a subnet, a gateway and a dataDir: %q, %q, %q", conf.Subnet, conf.Gateway, conf.DataDir)
	}
	if err := os.MkdirAll(conf.DataDir, 0o700); err != nil {
		return netip.Addr{}, err
	}
	// .0 is the subnet's, .1 is left for the node.
	for a := prefix.Masked().Addr().Next().Next(); prefix.Contains(a) && prefix.Contains(a.Next()); a = a.Next() {
		path := filepath.Join(conf.DataDir, a.String())
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, os.ErrExist) {
			if held, _ := os.ReadFile(path); string(held) == id {
				return a, nil
			}
			continue
		}
		if err != nil {
			return netip.Addr{}, err
		}
		_, werr := f.WriteString(id)
		if err := errors.Join(werr, f.Close()); err != nil {
			return netip.Addr{}, errors.Join(err, os.Remove(path))
		}
		return a, nil
	}
	return netip.Addr{}, fmt.Errorf("no address left in %s", conf.Subnet)
}

// release frees the container's lease, if it holds one.
func release(dataDir, id string) error {
	entries, err := os.ReadDir(dataDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	for _, e := range entries {
		path := filepath.Join(dataDir, e.Name())
		if held, err := os.ReadFile(path); err == nil && string(held) == id {
			return os.Remove(path)
		}
	}
	return nil
}

// ipIn runs ip commands in namespace netns (empty: this process's).
func ipIn(netns string, commands [][]string) error {
	for _, args := range commands {
		cmd := exec.Command("ip", args...)
		if netns != "" {
			cmd = exec.Command("nsenter", append([]string{"--net=" + netns, "ip"}, args...)...)
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
		}
	}
	return nil
}

// result is the CNI answer for the pod's interface and address.
func result(netns, ifname, addr string) error {
	return json.NewEncoder(os.Stdout).Encode(map[string]any{"cniVersion": cniVersion,
		"interfaces": []any{map[string]any{"name": ifname, "sandbox": netns}},
		"ips":        []any{map[string]any{"version": "4", "address": addr, "interface": 0}}})
}
