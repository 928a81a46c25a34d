// Command podnet is the e2e harness's CNI plugin for pods that cannot share
// the host's network (a pod with a user namespace of its own may not): it
// gives the pod's network namespace an interface with an address, which is
// all the CRI needs to start the pod, and changes nothing on the host: a veth
// pair made inside the namespace, both ends there (these kernels have no
// dummy interfaces). The pods reach nothing through it; they need nothing.
package main

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
)

const cniVersion = "0.4.0"

func main() {
	if err := run(); err != nil {
		_ = json.NewEncoder(os.Stdout).Encode(map[string]any{"cniVersion": cniVersion, "code": 100, "msg": err.Error()})
		os.Exit(1)
	}
}

func run() error {
	switch os.Getenv("CNI_COMMAND") {
	case "VERSION":
		return json.NewEncoder(os.Stdout).Encode(map[string]any{"cniVersion": cniVersion,
			"supportedVersions": []string{"0.3.0", "0.3.1", "0.4.0"}})
	case "ADD":
		netns, ifname := os.Getenv("CNI_NETNS"), os.Getenv("CNI_IFNAME")
		h := fnv.New32a()
		h.Write([]byte(os.Getenv("CNI_CONTAINERID")))
		addr := fmt.Sprintf("10.%d.%d.%d/32", 200+h.Sum32()%50, h.Sum32()>>8&0xff, 1+h.Sum32()>>16%254)
		for _, args := range [][]string{
			{"link", "add", ifname, "type", "veth", "peer", "name", "podnet0"},
			{"addr", "add", addr, "dev", ifname},
			{"link", "set", ifname, "up"},
		} {
			cmd := exec.Command("nsenter", append([]string{"--net=" + netns, "ip"}, args...)...)
			if out, err := cmd.CombinedOutput(); err != nil {
				return fmt.Errorf("ip %v: %v: %s", args, err, out)
			}
		}
		return json.NewEncoder(os.Stdout).Encode(map[string]any{"cniVersion": cniVersion,
			"interfaces": []any{map[string]any{"name": ifname, "sandbox": netns}},
			"ips":        []any{map[string]any{"version": "4", "address": addr, "interface": 0}}})
	case "DEL", "CHECK":
		return nil // the interface goes with the namespace
	}
	return fmt.Errorf("unknown CNI_COMMAND %q", os.Getenv("CNI_COMMAND"))
}
