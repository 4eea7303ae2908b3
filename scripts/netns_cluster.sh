#!/usr/bin/env bash
# A throw-away cluster of N "hosts" on this machine, for multi-node tests without more machines:
#
#   scripts/netns_cluster.sh up 2      # node1, node2: ssh node1 works as root, no prompt
#   scripts/netns_cluster.sh status
#   scripts/netns_cluster.sh down      # removes everything `up` made (N is not needed)
#   scripts/netns_cluster.sh sshd-stop node2 / sshd-start node2   # a host that stops answering ssh
#
# Each host nodeI is a network namespace with loopback and an `eth0` (one end of a veth pair whose
# other end sits on the bridge hvdbr0 in the root namespace) at 198.18.0.I/24, and its own UTS
# namespace with hostname nodeI, in which an sshd listens on 198.18.0.I:22 only. The bridge has
# 198.18.0.254/24, so the root namespace (where horovodrun or mpirun is started) reaches every node.
# No namespace has a default route: nothing a node sends can leave 198.18.0.0/24.
# All hosts share this machine's filesystem, so a virtualenv is "installed on every host" at once.
#
# A fresh ssh key pair (and host key) is made at every `up` under $HVDTRAIN_NETNS_DIR
# (default /tmp/hvdtrain-netns). Key auth only. ssh finds it through one `Include` line at the top of
# /root/.ssh/config; /etc/hosts gets one line per node. Both are removed by `down`.
# Both commands are idempotent: `up` first takes down what a previous `up` left.
set -euo pipefail

DIR=${HVDTRAIN_NETNS_DIR:-/tmp/hvdtrain-netns}
BR=hvdbr0
NET=198.18.0
MARK="# hvdtrain-netns"
SSH_CONFIG_USER=/root/.ssh/config

die() { echo "netns_cluster: $*" >&2; exit 1; }
log() { echo "netns_cluster: $*" >&2; }

need_root() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces, bridge, sshd on port 22)"
  ip netns list >/dev/null 2>&1 || die "'ip netns' is not available (iproute2 missing or no netns support)"
}

ensure_sshd() {
  if [ ! -x /usr/sbin/sshd ] || ! command -v ssh-keygen >/dev/null; then
    log "installing openssh-server openssh-client (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends openssh-server openssh-client >/dev/null
  fi
  mkdir -p /run/sshd && chmod 755 /run/sshd   # sshd's privilege-separation directory
}

nodes() {  # the node names `up` made, from its state dir (so `down` needs no N)
  [ -f "$DIR/nodes" ] && cat "$DIR/nodes" || true
}

remove_hosts_entries() {
  if grep -q "$MARK" /etc/hosts 2>/dev/null; then
    # /etc/hosts may be a bind mount (containers): rewrite in place, never replace the file
    local tmp; tmp=$(mktemp)
    grep -v "$MARK" /etc/hosts > "$tmp" || true
    cat "$tmp" > /etc/hosts
    rm -f "$tmp"
  fi
}

remove_ssh_include() {
  if [ -f "$SSH_CONFIG_USER" ] && grep -q -F "$MARK" "$SSH_CONFIG_USER"; then
    local tmp; tmp=$(mktemp)
    grep -v -F -e "$MARK" -e "Include $DIR/ssh_config" "$SSH_CONFIG_USER" > "$tmp" || true
    if [ -s "$tmp" ]; then cat "$tmp" > "$SSH_CONFIG_USER"; else rm -f "$SSH_CONFIG_USER"; fi
    rm -f "$tmp"
  fi
}

# With br_netfilter loaded (dockerd loads it, and sets the FORWARD policy to DROP), frames crossing
# the bridge from one node to another go through iptables' FORWARD chain: without this rule node1
# and node2 cannot talk to each other (each still reaches the root namespace), and a job hangs in its
# first allreduce. The rule is tagged, and `down` removes it.
IPT_RULE=(FORWARD -i "$BR" -o "$BR" -m comment --comment hvdtrain-netns -j ACCEPT)
allow_forwarding() {
  command -v iptables >/dev/null || return 0
  iptables -C "${IPT_RULE[@]}" 2>/dev/null || iptables -I "${IPT_RULE[@]:0:1}" 1 "${IPT_RULE[@]:1}" 2>/dev/null \
    || log "warning: could not add an iptables FORWARD rule for $BR (nodes may not reach each other)"
}
remove_forwarding() {
  command -v iptables >/dev/null || return 0
  while iptables -D "${IPT_RULE[@]}" 2>/dev/null; do :; done
}

down() {
  need_root
  local n pid
  for pidfile in "$DIR"/sshd-*.pid; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile" 2>/dev/null || true)
    # kill only the sshd we started (its pid file), and only if it is an sshd
    if [ -n "$pid" ] && grep -q sshd "/proc/$pid/comm" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
  done
  for n in $(nodes) $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^node[0-9]+$' || true); do
    if ip netns list | awk '{print $1}' | grep -qx "$n"; then
      # processes still in the namespace (ssh sessions, workers of an aborted job): ours, end them
      for pid in $(ip netns pids "$n" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
      sleep 0.2
      for pid in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$n" 2>/dev/null || true
    fi
    ip link del "vh-$n" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
  remove_forwarding
  remove_hosts_entries
  remove_ssh_include
  rm -rf "$DIR"
}

up() {
  local N=$1
  [[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -ge 1 ] && [ "$N" -le 200 ] || die "N must be 1..200, got '$N'"
  need_root
  ensure_sshd
  down 2>/dev/null || true
  mkdir -p "$DIR" && chmod 700 "$DIR"

  ssh-keygen -q -t ed25519 -N '' -C "hvdtrain-netns" -f "$DIR/id_ed25519"
  ssh-keygen -q -t ed25519 -N '' -C "hvdtrain-netns-host" -f "$DIR/ssh_host_ed25519_key"
  cp "$DIR/id_ed25519.pub" "$DIR/authorized_keys"
  chmod 600 "$DIR/authorized_keys"

  cat > "$DIR/sshd_config" <<EOF
# sshd for the hvdtrain netns cluster; ListenAddress is given per node on the command line
Port 22
HostKey $DIR/ssh_host_ed25519_key
AuthorizedKeysFile $DIR/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
ChallengeResponseAuthentication no
UsePAM no
# the key lives under /tmp (mode 1777), which StrictModes would refuse
StrictModes no
PrintMotd no
AcceptEnv LANG LC_*
Subsystem sftp internal-sftp
MaxStartups 100:30:200
MaxSessions 100
EOF

  ip link add "$BR" type bridge
  ip addr add "$NET.254/24" dev "$BR"
  ip link set "$BR" up
  allow_forwarding

  : > "$DIR/known_hosts"
  local hostkey; hostkey=$(cut -d' ' -f1,2 "$DIR/ssh_host_ed25519_key.pub")
  local i n names=()
  for i in $(seq 1 "$N"); do
    n=node$i; names+=("$n")
    echo "$n" >> "$DIR/nodes"
    ip netns add "$n"
    ip link add "vh-$n" type veth peer name "vp-$n"
    ip link set "vp-$n" netns "$n"
    ip -n "$n" link set "vp-$n" name eth0
    ip -n "$n" link set lo up
    ip -n "$n" addr add "$NET.$i/24" dev eth0
    ip -n "$n" link set eth0 up
    ip link set "vh-$n" master "$BR"
    ip link set "vh-$n" up
    echo "$NET.$i $n $MARK" >> /etc/hosts
    echo "$n,$NET.$i $hostkey" >> "$DIR/known_hosts"
  done

  cat > "$DIR/ssh_config" <<EOF
# ssh client settings for the hvdtrain netns cluster (included from $SSH_CONFIG_USER)
Host ${names[*]} $(for i in $(seq 1 "$N"); do printf '%s.%s ' "$NET" "$i"; done)
    User root
    IdentityFile $DIR/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $DIR/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
    LogLevel ERROR
    ConnectTimeout 5
EOF
  mkdir -p /root/.ssh && chmod 700 /root/.ssh
  remove_ssh_include
  { echo "$MARK: the next line is removed by scripts/netns_cluster.sh down"; echo "Include $DIR/ssh_config"; cat "$SSH_CONFIG_USER" 2>/dev/null || true; } > "$DIR/user_config.new"
  cat "$DIR/user_config.new" > "$SSH_CONFIG_USER" && rm -f "$DIR/user_config.new"
  chmod 600 "$SSH_CONFIG_USER"

  for n in "${names[@]}"; do sshd_start "$n"; done
  for n in "${names[@]}"; do sshd_wait "$n"; done
  log "up: ${names[*]} ($NET.1-$NET.$N, bridge $BR $NET.254), ssh config $DIR/ssh_config"
}

node_index() {  # node7 -> 7, after checking that `up` made it
  local n=$1
  grep -qx "$n" "$DIR/nodes" 2>/dev/null || die "no node '$n' in this cluster (nodes: $(nodes | xargs))"
  echo "${n#node}"
}

sshd_start() {
  local n=$1 i; i=$(node_index "$n")
  # its own UTS namespace so `hostname` on nodeI says nodeI (Horovod and hvdtrain tell hosts apart by it)
  ip netns exec "$n" unshare --uts sh -c "hostname $n && exec /usr/sbin/sshd -f '$DIR/sshd_config' \
    -o ListenAddress=$NET.$i -o PidFile='$DIR/sshd-$n.pid' -E '$DIR/sshd-$n.log'"
}

sshd_wait() {
  local n=$1 i; i=$(node_index "$n")
  for _ in $(seq 100); do
    ssh -o ConnectTimeout=2 "$n" true 2>/dev/null && return 0
    sleep 0.1
  done
  cat "$DIR/sshd-$n.log" >&2 || true
  die "sshd on $n ($NET.$i) does not answer"
}

sshd_stop() {  # the listening sshd only: sessions already open go on, new ssh connections are refused
  local n=$1 pid; node_index "$n" >/dev/null
  pid=$(cat "$DIR/sshd-$n.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && grep -q sshd "/proc/$pid/comm" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$DIR/sshd-$n.pid"
}

status() {
  local n
  ip -br addr show "$BR" 2>/dev/null || echo "no bridge $BR"
  for n in $(nodes); do
    printf '%s: ' "$n"
    if ssh -o ConnectTimeout=2 "$n" 'echo "$(hostname) $(ip -4 -br addr show eth0 | awk "{print \$3}")"' 2>/dev/null; then :
    else echo "ssh fails"; fi
  done
}

case "${1:-}" in
  up) up "${2:-2}" ;;
  down) down ;;
  status) status ;;
  sshd-stop) need_root; sshd_stop "${2:?node name}" ;;
  sshd-start) need_root; sshd_stop "${2:?node name}"; sshd_start "$2"; sshd_wait "$2" ;;
  *) echo "usage: $0 up N | down | status | sshd-stop nodeI | sshd-start nodeI" >&2; exit 2 ;;
esac
