#!/usr/bin/env bash
# Make sure a Docker daemon answers, and say which compose to use.
#
#   scripts/docker_up.sh            # prints the compose command on stdout: "docker compose" or "docker-compose"
#
# Installs docker.io and docker-compose with apt when dockerd is missing (root only), and starts
# dockerd in the background (log: /var/log/hvdtrain-dockerd.log) when nothing answers on its socket:
# for machines and CI containers without systemd. A daemon that already runs is left alone.
set -euo pipefail

log() { echo "docker_up: $*" >&2; }
die() { log "$*"; exit 1; }

if ! docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null; then
    [ "$(id -u)" -eq 0 ] || die "no dockerd; as root: apt-get install docker.io docker-compose"
    log "installing docker.io docker-compose (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends docker.io docker-compose >/dev/null
  fi
  [ "$(id -u)" -eq 0 ] || die "dockerd is not running and only root can start it here"
  if [ -S /var/run/docker.sock ] && ! pgrep -x dockerd >/dev/null; then
    rm -f /var/run/docker.sock   # stale socket of a daemon that died
  fi
  if ! pgrep -x dockerd >/dev/null; then
    log "starting dockerd (log /var/log/hvdtrain-dockerd.log)"
    nohup dockerd >/var/log/hvdtrain-dockerd.log 2>&1 &
  fi
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || { tail -20 /var/log/hvdtrain-dockerd.log >&2 || true; die "dockerd did not come up"; }
fi

if docker compose version >/dev/null 2>&1; then
  echo "docker compose"
elif command -v docker-compose >/dev/null && docker-compose version >/dev/null 2>&1; then
  echo "docker-compose"
else
  die "no compose: install the docker compose plugin or docker-compose"
fi
