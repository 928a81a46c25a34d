#!/usr/bin/env bash
# Installs what make e2e needs from Debian, where missing: etcd, the CNI
# plugins (loopback), a static busybox (the step pods' image is built from
# it) and libseccomp-dev (runc links it). containerd and runc are built
# from their Go modules at pinned versions (test/e2e/tools/runtime).
set -euo pipefail
pkgs=(etcd-server containernetworking-plugins busybox-static libseccomp-dev)
need=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
[ ${#need[@]} -eq 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
