#!/bin/bash
# hvdtrain container entrypoint.
#
#   hvdtrain-entrypoint keygen       make the cluster keys in $HVDTRAIN_KEYS if missing, then exit
#   hvdtrain-entrypoint sshd         install the cluster keys, run sshd in the foreground (workers)
#   hvdtrain-entrypoint CMD...       install the cluster keys, wait for $HVDTRAIN_WAIT_FOR to answer
#                                    ssh, then run CMD (the launcher: horovodrun ... / mpirun ...)
#
# $HVDTRAIN_KEYS (default /keys) is a volume shared by the cluster's containers. Keys are made at
# cluster start, never baked into the image; `docker compose down -v` throws them away.
set -euo pipefail
KEYS=${HVDTRAIN_KEYS:-/keys}

keygen() {
  mkdir -p "$KEYS"
  if [ ! -s "$KEYS/id_ed25519" ] || [ ! -s "$KEYS/ssh_host_ed25519_key" ]; then
    rm -f "$KEYS"/id_ed25519* "$KEYS"/ssh_host_ed25519_key*
    ssh-keygen -q -t ed25519 -N '' -C hvdtrain-cluster -f "$KEYS/id_ed25519.tmp"
    ssh-keygen -q -t ed25519 -N '' -C hvdtrain-cluster-host -f "$KEYS/ssh_host_ed25519_key.tmp"
    for f in id_ed25519 ssh_host_ed25519_key; do
      mv "$KEYS/$f.tmp.pub" "$KEYS/$f.pub"; mv "$KEYS/$f.tmp" "$KEYS/$f"
    done
    echo "hvdtrain: new cluster keys in $KEYS"
  fi
  chmod 600 "$KEYS/id_ed25519" "$KEYS/ssh_host_ed25519_key"
}

install_keys() {  # wait for keygen (it may still be running), then install the keys
  for _ in $(seq 120); do [ -s "$KEYS/ssh_host_ed25519_key.pub" ] && break; sleep 0.5; done
  [ -s "$KEYS/ssh_host_ed25519_key.pub" ] || { echo "hvdtrain: no cluster keys in $KEYS (run keygen)" >&2; exit 1; }
  install -d -m 700 /root/.ssh
  install -m 600 "$KEYS/id_ed25519" /root/.ssh/id_ed25519
  install -m 644 "$KEYS/id_ed25519.pub" /root/.ssh/id_ed25519.pub
  install -m 600 "$KEYS/id_ed25519.pub" /root/.ssh/authorized_keys
  install -m 600 "$KEYS/ssh_host_ed25519_key" /etc/ssh/ssh_host_ed25519_key
  install -m 644 "$KEYS/ssh_host_ed25519_key.pub" /etc/ssh/ssh_host_ed25519_key.pub
  # every node of this cluster has the cluster host key, whatever its name
  echo "* $(cut -d' ' -f1,2 "$KEYS/ssh_host_ed25519_key.pub")" > /root/.ssh/known_hosts
}

case "${1:-sshd}" in
  keygen) keygen ;;
  sshd)
    install_keys
    mkdir -p /run/sshd
    exec /usr/sbin/sshd -D -e ;;
  *)
    # a cluster launcher waits for the keys; a plain `docker run IMAGE python ...` needs none
    if [ -n "${HVDTRAIN_WAIT_FOR:-}" ] || [ -d "$KEYS" ]; then install_keys; fi
    for host in ${HVDTRAIN_WAIT_FOR:-}; do
      for _ in $(seq 120); do ssh "$host" true 2>/dev/null && break; sleep 0.5; done
      ssh "$host" true || { echo "hvdtrain: $host does not answer ssh" >&2; exit 1; }
    done
    exec "$@" ;;
esac
