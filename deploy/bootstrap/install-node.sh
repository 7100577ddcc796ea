#!/bin/sh
# gpufleet's install step, run by every machine's user data right before `kubeadm join` (which
# runs only if this exits 0). It installs only what the image lacks: a prepared image (README.md
# of this folder) passes every check and this changes nothing. Rendering puts the pinned versions
# and sha256 sums of deploy/bootstrap/node-install.yaml after the first line; a part that is
# missing is fetched from its publisher and checked against its pinned sum before anything is
# unpacked, and a part without a pinned sum, or whose download does not match, stops the join.
set -eu
say() { echo "gpufleet install: $*"; }
die() { echo "gpufleet install: $*: not joining" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }
case "$(uname -m)" in
  x86_64) ARCH=amd64 ;;
  aarch64 | arm64) ARCH=arm64 ;;
  *) die "no pinned parts for architecture $(uname -m)" ;;
esac
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
CONFIG=/etc/containerd/config.toml
DID=""

fetch() {  # part url: $WORK/part, its sha256 the pinned one
  eval "want=\${SHA256_${ARCH}_$1:-}"
  [ -n "$want" ] || die "$1 is not on this image and node-install.yaml pins no sha256 for it ($ARCH)"
  have curl || die "$1 is not on this image and there is no curl to fetch it"
  say "fetching $2"
  curl -fsSL --retry 5 --retry-delay 3 -o "$WORK/$1" "$2" || die "cannot download $2"
  echo "$want  $WORK/$1" | sha256sum -c --status - || die "$2 does not have the pinned sha256 $want"
  DID="$DID $1"
}

unit() {  # path: the unit read from stdin
  mkdir -p "$(dirname "$1")"
  cat > "$1"
}

unit_missing() {  # name: no systemd unit of that name anywhere systemd looks
  for dir in /etc/systemd/system /usr/local/lib/systemd/system /lib/systemd/system /usr/lib/systemd/system; do
    [ ! -f "$dir/$1" ] || return 1
  done
}

# kubeadm's preflight: IPv4 forwarding, bridged traffic through iptables, no swap.
if [ ! -d /sys/module/br_netfilter ]; then
  mkdir -p /etc/modules-load.d
  printf 'overlay\nbr_netfilter\n' > /etc/modules-load.d/gpufleet-kubernetes.conf
  modprobe overlay
  modprobe br_netfilter
  DID="$DID br_netfilter"
fi
if [ "$(cat /proc/sys/net/ipv4/ip_forward 2>/dev/null)" != 1 ] \
    || [ "$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null)" != 1 ]; then
  mkdir -p /etc/sysctl.d
  printf 'net.ipv4.ip_forward = 1\nnet.bridge.bridge-nf-call-iptables = 1\nnet.bridge.bridge-nf-call-ip6tables = 1\n' \
    > /etc/sysctl.d/90-gpufleet-kubernetes.conf
  sysctl -q -p /etc/sysctl.d/90-gpufleet-kubernetes.conf
  DID="$DID sysctl"
fi
if [ -r /proc/swaps ] && [ "$(wc -l < /proc/swaps)" -gt 1 ]; then
  swapoff -a
  [ ! -f /etc/fstab ] || sed -i 's/^\([^#].*[[:space:]]swap[[:space:]].*\)$/# off for the kubelet: \1/' /etc/fstab
  DID="$DID swap-off"
fi

# containerd with its CRI plugin (kubeadm talks to it) and runc.
if ! have containerd; then
  fetch containerd "https://github.com/containerd/containerd/releases/download/v$CONTAINERD_VERSION/containerd-$CONTAINERD_VERSION-linux-$ARCH.tar.gz"
  mkdir -p /usr/local
  tar -C /usr/local -xzf "$WORK/containerd"
fi
# The units, as containerd's repository and kubeadm's packages ship them, where no package did.
if unit_missing containerd.service; then
  unit /etc/systemd/system/containerd.service <<'EOF'
[Unit]
Description=containerd container runtime
Documentation=https://containerd.io
After=network.target local-fs.target dbus.service
[Service]
ExecStartPre=-/sbin/modprobe overlay
ExecStart=/usr/local/bin/containerd
Type=notify
Delegate=yes
KillMode=process
Restart=always
RestartSec=5
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999
[Install]
WantedBy=multi-user.target
EOF
  DID="$DID containerd-unit"
fi
if ! have runc; then
  fetch runc "https://github.com/opencontainers/runc/releases/download/v$RUNC_VERSION/runc.$ARCH"
  mkdir -p /usr/local/sbin
  install -m 0755 "$WORK/runc" /usr/local/sbin/runc
fi
# Docker's containerd packages ship `disabled_plugins = ["cri"]`; no config at all is CRI's
# defaults with the cgroupfs driver. Either way: containerd's own defaults, systemd cgroups.
if [ ! -s "$CONFIG" ] || grep -Eq '^[[:space:]]*disabled_plugins[[:space:]]*=.*"cri"' "$CONFIG"; then
  mkdir -p "$(dirname "$CONFIG")"
  containerd config default | sed 's/SystemdCgroup = false/SystemdCgroup = true/' > "$CONFIG.gpufleet"
  mv "$CONFIG.gpufleet" "$CONFIG"
  DID="$DID containerd-config"
fi

# The NVIDIA driver comes with the image (a first-boot driver build is no join step); the
# container toolkit's runtime goes into containerd.
have nvidia-smi || die "no NVIDIA driver (nvidia-smi) on this image"
if ! have nvidia-ctk; then
  have dpkg || die "nvidia-container-toolkit is not on this image and this is no Debian-family system"
  fetch nvidia_container_toolkit "https://github.com/NVIDIA/nvidia-container-toolkit/releases/download/v$NVIDIA_CONTAINER_TOOLKIT_VERSION/nvidia-container-toolkit_${NVIDIA_CONTAINER_TOOLKIT_VERSION}_deb_$ARCH.tar.gz"
  tar -C "$WORK" -xzf "$WORK/nvidia_container_toolkit"
  base=$(find "$WORK" -name 'nvidia-container-toolkit-base_*.deb' | head -n 1)
  [ -n "$base" ] || die "the nvidia-container-toolkit download holds no packages"
  debs=$(dirname "$base")
  dpkg -i "$debs"/libnvidia-container1_*.deb "$debs"/libnvidia-container-tools_*.deb \
    "$debs"/nvidia-container-toolkit-base_*.deb "$debs"/nvidia-container-toolkit_*.deb
fi
if ! grep -q nvidia-container-runtime "$CONFIG"; then
  nvidia-ctk runtime configure --runtime=containerd --set-as-default --config="$CONFIG"
  DID="$DID nvidia-runtime"
fi

# kubelet and kubeadm, and the kubelet's units as kubeadm's packages ship them.
for tool in kubeadm kubelet; do
  if ! have $tool; then
    fetch $tool "https://dl.k8s.io/release/$KUBERNETES_VERSION/bin/linux/$ARCH/$tool"
    mkdir -p /usr/local/bin
    install -m 0755 "$WORK/$tool" "/usr/local/bin/$tool"
  fi
done
if unit_missing kubelet.service; then
  unit /etc/systemd/system/kubelet.service <<'EOF'
[Unit]
Description=kubelet: The Kubernetes Node Agent
Documentation=https://kubernetes.io/docs/
Wants=network-online.target
After=network-online.target
[Service]
ExecStart=/usr/local/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10
[Install]
WantedBy=multi-user.target
EOF
  unit /etc/systemd/system/kubelet.service.d/10-kubeadm.conf <<'EOF'
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/local/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
EOF
  DID="$DID kubelet-unit"
fi

if [ -z "$DID" ]; then
  say "nothing to install: the image has every part"
  exit 0
fi
systemctl daemon-reload
case "$DID" in *containerd* | *nvidia*) systemctl enable containerd; systemctl restart containerd ;; esac
case "$DID" in *kubelet*) systemctl enable kubelet ;; esac
say "installed or set up:$DID"
