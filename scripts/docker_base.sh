#!/usr/bin/env bash
# Build the base image docker/Dockerfile (bookworm) or docker/Dockerfile.gpu (trixie) starts from, when
# it is missing, without pulling from a container registry: a Debian minbase root filesystem made by
# debootstrap, imported with `docker import`.
#
#   scripts/docker_base.sh                 # builds hvdtrain/bookworm-minbase:latest if missing
#   SUITE=trixie scripts/docker_base.sh    # hvdtrain/trixie-minbase:latest, the GPU image's base
#   scripts/docker_base.sh --force         # rebuild it
#   BASE_IMAGE=name:tag scripts/docker_base.sh
#
# The root filesystem gets this machine's apt sources where they are for the same suite (so apt inside
# containers uses the same mirror/snapshot), else DEBIAN_MIRROR's main, contrib and non-free (Debian's CUDA
# toolkit is in non-free, its NCCL in contrib); and this machine's local CA certificates
# (/usr/local/share/ca-certificates/*), so that apt and pip inside the containers trust the same TLS
# proxies this machine trusts. Where you can pull images, you may instead build with
# --build-arg BASE=debian:bookworm-slim.
set -euo pipefail

SUITE=${SUITE:-bookworm}
IMAGE=${BASE_IMAGE:-hvdtrain/$SUITE-minbase:latest}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { echo "docker_base: $*" >&2; }

if [ "${1:-}" != "--force" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "$IMAGE exists"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || { log "debootstrap needs root"; exit 1; }
if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap (apt)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi

ROOTFS=$(mktemp -d /var/tmp/hvdtrain-rootfs.XXXXXX)
cleanup() { rm -rf --one-file-system "$ROOTFS"; }
trap cleanup EXIT

log "debootstrap --variant=minbase $SUITE into $ROOTFS (a few minutes)"
debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || {
  tail -30 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"

# the same apt sources as this machine (mirror, snapshot, suites), where this machine runs the same suite
if [ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" != "$SUITE" ]; then
  rm -f "$ROOTFS/etc/apt/sources.list"
  printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main contrib non-free\nSigned-By: %s\n' \
    "$MIRROR" "$SUITE" "$SUITE" /usr/share/keyrings/debian-archive-keyring.gpg > "$ROOTFS/etc/apt/sources.list.d/debian.sources"
elif [ -d /etc/apt/sources.list.d ] && ls /etc/apt/sources.list.d/*.sources >/dev/null 2>&1; then
  rm -f "$ROOTFS/etc/apt/sources.list"
  cp /etc/apt/sources.list.d/*.sources "$ROOTFS/etc/apt/sources.list.d/"
elif [ -f /etc/apt/sources.list ]; then
  cp /etc/apt/sources.list "$ROOTFS/etc/apt/sources.list"
fi
# local CAs (a TLS-intercepting proxy, a company CA): trusted inside the containers as well
if ls /usr/local/share/ca-certificates/* >/dev/null 2>&1; then
  mkdir -p "$ROOTFS/usr/local/share/ca-certificates"
  cp -r /usr/local/share/ca-certificates/. "$ROOTFS/usr/local/share/ca-certificates/"
  chroot "$ROOTFS" update-ca-certificates >/dev/null
fi
# smaller and quieter apt inside images
cat > "$ROOTFS/etc/apt/apt.conf.d/90hvdtrain" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
EOF
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*

log "importing as $IMAGE"
tar -C "$ROOTFS" --numeric-owner -c . | docker import \
  --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
log "built $IMAGE"
