#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine, for tests that need what only a node
# does: run preStop hooks, inject service links, run probes, evict through a PDB (issue 22).
#
#   scripts/k8s-node.sh up      start it; the last line on stdout is the admin kubeconfig
#   scripts/k8s-node.sh down    stop everything it started and restore what it changed
#   scripts/k8s-node.sh import IMAGE.tar   load an OCI image archive (scripts/oci-image.py)
#   scripts/k8s-node.sh status  whether it is up
#
# Needs root and: the binaries of `scripts/k8s-tools.sh --node` (.cache/k8s/<version>/),
# Debian's etcd-server, containerd, runc, containernetworking-plugins and gcc (the pause
# image is k8s' own build/pause/linux/pause.c, compiled statically: no registry is reachable).
# Pods pull nothing: images are imported, and pods use imagePullPolicy Never.
#
# The node, as this sandbox allows it:
#   - node IP 10.250.0.1 on a bridge of its own (handoff-node, no ports); the API server
#     listens there, so pods reach it through the `kubernetes` Service;
#   - pods on 10.244.0.0/24 through the ptp CNI plugin (every packet routed by the host, so
#     kube-proxy's iptables rules see pod-to-Service traffic without br_netfilter); Services
#     on 10.96.0.0/24; no cluster DNS (Service names do not resolve; their IPs do);
#   - a filter chain (HANDOFF-NODE, first in FORWARD) lets pod traffic go between pods only:
#     nothing a pod sends is forwarded off this machine;
#   - cgroup v1 with the cgroupfs driver (kubelet failCgroupV1: false), no systemd;
#   - containerd's CRI with restrict_oom_score_adj (root here lacks CAP_SYS_RESOURCE, and
#     runc fails to write a pod's oom_score_adj without it);
#   - the API server reaches the kubelet by its InternalIP (exec, logs).
# The kubelet and kube-proxy change host settings (vm.overcommit_memory, kernel.panic*,
# net.ipv4.ip_forward, route_localnet...): `up` records them and `down` puts them back.
# State, logs and certificates live in .cache/k8s/node/ (HANDOFF_K8S_NODE_DIR); etcd's data
# on tmpfs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/k8s-versions
. "$root/scripts/k8s-versions"
bin="$root/.cache/k8s/$KUBE_VERSION"
state=${HANDOFF_K8S_NODE_DIR:-$root/.cache/k8s/node}
NODE_NAME=handoff-node
NODE_IF=handoff-node
NODE_IP=10.250.0.1
POD_CIDR=10.244.0.0/24
SVC_CIDR=10.96.0.0/24
SVC_API_IP=10.96.0.1
PAUSE_IMAGE=registry.k8s.io/pause:3.10.1
CHAIN=HANDOFF-NODE
SYSCTLS="net.ipv4.ip_forward vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables net.netfilter.nf_conntrack_max"

say() { echo "k8s-node: $*" >&2; }
die() { say "error: $*"; exit 1; }
sock="$state/containerd/containerd.sock"
ctr_() { ctr -a "$sock" -n k8s.io "$@"; }
alive() { [ -f "$state/pids/$1" ] && kill -0 "$(cat "$state/pids/$1")" 2>/dev/null; }

# start NAME CMD...: in the background, its output in logs/NAME.log, its pid in pids/NAME.
start() {
  local name=$1; shift
  "$@" >"$state/logs/$name.log" 2>&1 &
  echo $! >"$state/pids/$name"
}

# wait_for WHAT SECONDS CMD...: CMD until it succeeds, or fail with the log of WHAT.
wait_for() {
  local what=$1 secs=$2; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    if ! alive "$what"; then tail -n 30 "$state/logs/$what.log" >&2 || true; die "$what exited"; fi
    [ "$(date +%s)" -lt "$deadline" ] || { tail -n 30 "$state/logs/$what.log" >&2 || true; die "$what not ready in ${secs}s"; }
    sleep 0.5
  done
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

certs() {
  local d="$state/pki"
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=handoff-node-ca -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  # sign NAME SUBJECT [SANS]
  sign() {
    openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$d/$1.key" -out "$d/$1.csr" 2>/dev/null
    local ext="$d/$1.ext"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' >"$ext"
    [ -n "${3:-}" ] && echo "subjectAltName=$3" >>"$ext"
    openssl x509 -req -in "$d/$1.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 2 -extfile "$ext" -out "$d/$1.crt" 2>/dev/null
  }
  sign apiserver /CN=kube-apiserver "IP:$NODE_IP,IP:127.0.0.1,IP:$SVC_API_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  sign kubelet "/CN=system:node:$NODE_NAME/O=system:nodes" "IP:$NODE_IP,DNS:$NODE_NAME"
  sign admin "/CN=admin/O=system:masters"
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
}

kubeconfig() { # kubeconfig FILE CERT
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: node
  cluster: {server: "https://$NODE_IP:$API_PORT", certificate-authority: "$state/pki/ca.crt"}
users:
- name: $2
  user: {client-certificate: "$state/pki/$2.crt", client-key: "$state/pki/$2.key"}
contexts:
- name: node
  context: {cluster: node, user: $2, namespace: default}
current-context: node
EOF
}

pause_image() {
  local out="$state/images/pause.tar"
  [ -f "$out" ] && return 0
  local src="$root/.cache/k8s/src/kubernetes-$KUBE_VERSION/build/pause/linux/pause.c"
  [ -f "$src" ] || die "no $src: run scripts/k8s-tools.sh --node"
  local dir="$state/images/pause-root"
  rm -rf "$dir"; mkdir -p "$dir"
  gcc -Os -static -DVERSION=handoff -o "$dir/pause" "$src" || die "gcc -static pause.c failed (libc6-dev?)"
  strip "$dir/pause"
  python3 "$root/scripts/oci-image.py" --dir "$dir" --name "$PAUSE_IMAGE" --entrypoint '["/pause"]' --out "$out" 2>/dev/null
}

# Rules a node adds: kube-proxy's and the kubelet's KUBE-* chains, and ours. None of them is
# the host's own (only this script runs a node here).
clean_rules() {
  if [ -x "$bin/kube-proxy" ]; then "$bin/kube-proxy" --cleanup >/dev/null 2>&1 || true; fi
  while iptables -D FORWARD -j "$CHAIN" 2>/dev/null; do :; done
  iptables -F "$CHAIN" 2>/dev/null || true
  iptables -X "$CHAIN" 2>/dev/null || true
}

# The host settings the node changes, as they were: sysctls, and every iptables table (the
# kubelet and kube-proxy add chains to filter, nat and mangle). A node that was never taken
# down (a killed run, another checkout's state directory) left its rules and its bridge: they
# go first, so they are neither saved as the host's nor in the way.
record_host() {
  [ -f "$state/sysctl.saved" ] && return 0
  clean_rules
  ip link del "$NODE_IF" 2>/dev/null || true
  iptables-save >"$state/iptables.saved"
  for k in $SYSCTLS; do
    v=$(sysctl -n "$k" 2>/dev/null) && printf '%s=%s\n' "$k" "$v"
  done >"$state/sysctl.saved.tmp"
  mv "$state/sysctl.saved.tmp" "$state/sysctl.saved"
}

up() {
  [ "$(id -u)" = 0 ] || die "needs root"
  for b in kube-apiserver kubelet kube-controller-manager kube-scheduler kube-proxy kubectl; do
    [ -x "$bin/$b" ] || die "no $bin/$b: run scripts/k8s-tools.sh --node"
  done
  for c in etcd containerd runc ctr gcc openssl iptables; do command -v "$c" >/dev/null || die "$c not found"; done
  [ -x /usr/lib/cni/ptp ] || die "no /usr/lib/cni/ptp: apt-get install containernetworking-plugins"
  if alive kubelet && alive kube-apiserver; then
    say "already up"; echo "$state/admin.kubeconfig"; return 0
  fi
  down >/dev/null 2>&1 || true
  local t0; t0=$(date +%s)
  mkdir -p "$state"/{pids,logs,images,cni,cni-ipam,kubelet,containerd}
  record_host
  certs

  # The node's own address, and pods kept on this machine.
  ip link add "$NODE_IF" type bridge
  ip addr add "$NODE_IP/32" dev "$NODE_IF"
  ip link set "$NODE_IF" up
  iptables -N "$CHAIN"
  iptables -A "$CHAIN" -s "$POD_CIDR" -d "$POD_CIDR" -j ACCEPT
  iptables -A "$CHAIN" -s "$POD_CIDR" -j DROP
  iptables -A "$CHAIN" -d "$POD_CIDR" -j DROP
  iptables -I FORWARD 1 -j "$CHAIN"
  sysctl -qw net.ipv4.ip_forward=1

  ETCD_PORT=$(free_port); ETCD_PEER=$(free_port); API_PORT=$(free_port); KUBELET_PORT=$(free_port)
  KUBELET_HEALTH=$(free_port); PROXY_METRICS=$(free_port); PROXY_HEALTH=$(free_port); CM_PORT=$(free_port); SCHED_PORT=$(free_port)
  printf 'API_PORT=%s\nKUBELET_PORT=%s\n' "$API_PORT" "$KUBELET_PORT" >"$state/ports"
  kubeconfig "$state/admin.kubeconfig" admin
  kubeconfig "$state/kubelet.kubeconfig" kubelet

  local etcd_dir=/dev/shm/handoff-k8s-node-etcd
  rm -rf "$etcd_dir"
  start etcd etcd --name node --data-dir "$etcd_dir" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-cluster "node=http://127.0.0.1:$ETCD_PEER" --log-level warn
  wait_for etcd 20 curl -sf "http://127.0.0.1:$ETCD_PORT/health"

  local pki="$state/pki"
  start kube-apiserver "$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$NODE_IP" --advertise-address "$NODE_IP" --secure-port "$API_PORT" \
    --service-cluster-ip-range "$SVC_CIDR" --client-ca-file "$pki/ca.crt" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc --authorization-mode Node,RBAC \
    --kubelet-client-certificate "$pki/admin.crt" --kubelet-client-key "$pki/admin.key" \
    --kubelet-preferred-address-types InternalIP --allow-privileged=true --profiling=false --v=1
  wait_for kube-apiserver 60 curl -sf --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" "https://$NODE_IP:$API_PORT/readyz"

  start kube-controller-manager "$bin/kube-controller-manager" --kubeconfig "$state/admin.kubeconfig" \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
    --leader-elect=false --secure-port "$CM_PORT" --bind-address 127.0.0.1 --use-service-account-credentials=false --v=1
  start kube-scheduler "$bin/kube-scheduler" --kubeconfig "$state/admin.kubeconfig" --leader-elect=false \
    --secure-port "$SCHED_PORT" --bind-address 127.0.0.1 --v=1

  # containerd: its own root, state and socket; the CRI with our CNI config and pause image.
  cat >"$state/containerd/config.toml" <<EOF
version = 2
root = "$state/containerd/root"
state = "$state/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.opt"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$state/cni"
EOF
  cat >"$state/cni/10-handoff.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "handoff-node", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": 1500,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$state/cni-ipam"}}
]}
EOF
  start containerd containerd --config "$state/containerd/config.toml"
  wait_for containerd 30 ctr -a "$sock" version
  pause_image
  ctr_ images import "$state/images/pause.tar" >/dev/null || die "importing the pause image failed"

  cat >"$state/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: $KUBELET_PORT
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTH
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "$pki/ca.crt"}
authorization: {mode: AlwaysAllow}
tlsCertFile: "$pki/kubelet.crt"
tlsPrivateKeyFile: "$pki/kubelet.key"
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: "unix://$sock"
resolvConf: ""
podCIDR: "$POD_CIDR"
maxPods: 40
serializeImagePulls: false
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
syncFrequency: 10s
EOF
  start kubelet "$bin/kubelet" --config "$state/kubelet/config.yaml" --kubeconfig "$state/kubelet.kubeconfig" \
    --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --root-dir "$state/kubelet/root" --v=1
  start kube-proxy "$bin/kube-proxy" --kubeconfig "$state/admin.kubeconfig" --hostname-override "$NODE_NAME" \
    --proxy-mode iptables --cluster-cidr "$POD_CIDR" --metrics-bind-address "127.0.0.1:$PROXY_METRICS" \
    --healthz-bind-address "127.0.0.1:$PROXY_HEALTH" --conntrack-max-per-core 0 --iptables-localhost-nodeports=false --v=1

  local k=("$bin/kubectl" --kubeconfig "$state/admin.kubeconfig")
  wait_for kubelet 120 sh -c "\"\$0\" \"\$@\" get node $NODE_NAME -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True" "${k[@]}"
  wait_for kube-controller-manager 60 "${k[@]}" get serviceaccount default -n default
  wait_for kube-controller-manager 60 "${k[@]}" get configmap kube-root-ca.crt -n default
  say "up in $(( $(date +%s) - t0 ))s: node $NODE_NAME Ready, API server https://$NODE_IP:$API_PORT"
  echo "$state/admin.kubeconfig"
}

import_image() {
  [ -f "${1:-}" ] || die "usage: k8s-node.sh import IMAGE.tar"
  alive containerd || die "the node is not up"
  ctr_ images import "$1" >/dev/null || die "ctr images import $1 failed"
}

down() {
  [ -d "$state" ] || return 0
  local t0; t0=$(date +%s)
  # The kubelet first, so it restarts nothing; then every container, then the runtime.
  for p in kube-proxy kubelet kube-scheduler kube-controller-manager; do
    if [ -f "$state/pids/$p" ]; then kill "$(cat "$state/pids/$p")" 2>/dev/null || true; fi
  done
  sleep 0.5
  if alive containerd; then
    for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
    sleep 0.5
    for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$id" >/dev/null 2>&1 || true; done
    for id in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers delete "$id" >/dev/null 2>&1 || true; done
  fi
  for p in containerd kube-apiserver etcd; do
    if [ -f "$state/pids/$p" ]; then kill "$(cat "$state/pids/$p")" 2>/dev/null || true; fi
  done
  # Shims outlive containerd; their address names our socket.
  pkill -9 -f "containerd-shim-runc-v2 .*-address $sock" 2>/dev/null || true
  for p in "$state"/pids/*; do
    [ -f "$p" ] || continue
    pid=$(cat "$p")
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 0.3; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$p"
  done
  # Mounts the kubelet and containerd made (volumes, rootfs, network namespaces), deepest first.
  # (None at all is no failure: under pipefail a grep that finds nothing ended `down` here,
  # before the rules and the bridge, and the next `up` found them still there.)
  { grep -E " ($state|/run/netns/cni-|/var/run/netns/cni-)" /proc/mounts || true; } | awk '{print $2}' | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
  rm -f /run/netns/cni-* 2>/dev/null || true
  # The rules as they were before `up`; without that record, kube-proxy's cleanup and ours.
  if [ -f "$state/iptables.saved" ]; then
    iptables-restore <"$state/iptables.saved" || say "iptables-restore failed"
  fi
  # Whatever was saved, no rule of a node may outlive it (record_host saves a clean host).
  clean_rules
  ip link del "$NODE_IF" 2>/dev/null || true
  # Pod veths left by a namespace that could not be torn down.
  for v in $(ip -o link show type veth 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep '^veth' || true); do
    ip link del "$v" 2>/dev/null || true
  done
  # The kubelet's cgroups (empty once their processes died), deepest first.
  for c in /sys/fs/cgroup/*/kubepods* /sys/fs/cgroup/*/kubepods.slice; do
    [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  if [ -f "$state/sysctl.saved" ]; then
    while IFS='=' read -r k v; do sysctl -qw "$k=$v" 2>/dev/null || true; done <"$state/sysctl.saved"
  fi
  rm -rf /dev/shm/handoff-k8s-node-etcd
  # The images stay (cached for the next `up`); everything else goes.
  find "$state" -mindepth 1 -maxdepth 1 ! -name images -exec rm -rf {} + 2>/dev/null || true
  say "down in $(( $(date +%s) - t0 ))s"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  import) import_image "${2:-}" ;;
  status) if alive kubelet && alive kube-apiserver; then echo up; else echo down; exit 1; fi ;;
  *) sed -n '2,8p' "$0" >&2; exit 2 ;;
esac
