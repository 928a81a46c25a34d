#!/usr/bin/env bash
# Installs the node runtime make e2e runs, from Debian, where missing:
# containerd, runc, etcd, the CNI plugins (loopback) and a static busybox
# (the step pods' image is built from it).
set -euo pipefail
pkgs=(containerd runc etcd-server containernetworking-plugins busybox-static)
need=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
[ ${#need[@]} -eq 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
