#!/usr/bin/env bash
# Build a Debian bookworm base image with python3.11 WITHOUT any image registry: debootstrap a
# minbase root file system from Debian's package mirror, then `docker import` it. Needs root.
#
#   DOCKER_HOST=... deploy/docker/base-image.sh [TAG]     # default TAG: pdserve-base:bookworm
#
# Cached twice: the image itself (skipped when TAG already exists in the engine) and the root file
# system tarball ($PDSERVE_BASE_CACHE, default /var/cache/pdserve/base-bookworm.tar) for a fresh engine.
# Set PDSERVE_DEBIAN_MIRROR to use another mirror (default: the first one in this host's apt sources).
#
# The image also trusts this host's extra CA certificates (/usr/local/share/ca-certificates) and
# tells pip to use the system CA bundle, so `pip install` inside a build works behind a
# TLS-inspecting proxy just as it does on the host.
set -euo pipefail

TAG=${1:-pdserve-base:bookworm}
CACHE=${PDSERVE_BASE_CACHE:-/var/cache/pdserve/base-bookworm.tar}
PACKAGES=python3.11,python3-venv,python3-pip,ca-certificates

die() { echo "base-image.sh: $*" >&2; exit 1; }

default_mirror() {
    local m
    m=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
        | grep -oE 'https?://[^ ]+' | head -n1 || true)
    echo "${m:-http://deb.debian.org/debian}"
}

build_rootfs_tar() {
    [[ $EUID -eq 0 ]] || die "debootstrap needs root"
    command -v debootstrap >/dev/null || {
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    } || die "debootstrap is missing and could not be installed"
    local work; work=$(mktemp -d /var/tmp/pdserve-rootfs.XXXXXX)
    trap 'rm -rf "$work"' RETURN
    local mirror=${PDSERVE_DEBIAN_MIRROR:-$(default_mirror)}
    echo "base-image.sh: debootstrap bookworm from $mirror" >&2
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$work/rootfs" "$mirror" \
        >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
    local r="$work/rootfs"
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$r/usr/local/share/ca-certificates/"
        chroot "$r" update-ca-certificates >/dev/null
    fi
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$r/etc/pip.conf"
    echo "deb $mirror bookworm main" >"$r/etc/apt/sources.list"
    # Leave no caches or host-specific files in the image.
    rm -rf "$r"/var/cache/apt/archives/*.deb "$r"/var/lib/apt/lists/* "$r"/tmp/* "$r"/etc/hostname "$r"/etc/resolv.conf
    mkdir -p "$(dirname "$CACHE")"
    tar --numeric-owner -C "$r" -cf "$CACHE.part" . && mv "$CACHE.part" "$CACHE"
}

if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base-image.sh: $TAG already present" >&2
    exit 0
fi
[[ -s "$CACHE" ]] || build_rootfs_tar
docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    "$CACHE" "$TAG" >/dev/null || die "docker import of $CACHE failed"
echo "base-image.sh: imported $TAG from $CACHE" >&2
