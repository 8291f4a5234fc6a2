#!/usr/bin/env bash
# For machines that reach a Debian mirror but no container registry: makes
# local stand-ins for docker/Dockerfile's two base images with buildah, so
# `make image` builds the unchanged Dockerfile:
#
#   docker.io/library/debian:bookworm-slim  debootstrap --variant=minbase bookworm
#   docker.io/library/rust:1.95-bookworm    that, with the build tools of the
#                                           official image (apt) and this
#                                           machine's Rust 1.95 toolchain
#
# A machine that can pull them needs none of this. Needs root (debootstrap),
# buildah and debootstrap (apt-get install buildah debootstrap).
#
# The site's extra certificate authorities (/usr/local/share/ca-certificates,
# e.g. a TLS-inspecting egress proxy's) go into both stand-ins, with the
# variables that point pip and other clients at the system's bundle, as a
# site's own base images would carry them: the build stage's pip and cargo
# download through that proxy.
#
#   DEBIAN_MIRROR  default: the first mirror apt is configured with
set -euo pipefail

say() { printf '\033[1mbases:\033[0m %s\n' "$*"; }

mirror="${DEBIAN_MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)}"
mirror="${mirror:-http://deb.debian.org/debian}"
toolchain="$(rustup toolchain list | awk '/^1\.95/ {print $1; exit}')"
[ -n "$toolchain" ] || { echo "offline-bases: no Rust 1.95 toolchain (rustup toolchain install 1.95)" >&2; exit 1; }
sysroot="$(rustup run "$toolchain" rustc --print sysroot)"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

say "debootstrap bookworm from $mirror"
debootstrap --variant=minbase bookworm "$scratch/rootfs" "$mirror" >"$scratch/debootstrap.log" 2>&1 ||
  { tail -20 "$scratch/debootstrap.log" >&2; exit 1; }
ctr="$(buildah from scratch)"
buildah copy --quiet "$ctr" "$scratch/rootfs" /
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd bash "$ctr"
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  say "adding the site's certificate authorities: $(ls /usr/local/share/ca-certificates | tr '\n' ' ')"
  buildah run --isolation chroot "$ctr" -- sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates >/dev/null && rm -rf /var/lib/apt/lists/*'
  buildah copy --quiet "$ctr" /usr/local/share/ca-certificates /usr/local/share/ca-certificates
  buildah run --isolation chroot "$ctr" -- update-ca-certificates >/dev/null
  bundle=/etc/ssl/certs/ca-certificates.crt
  buildah config --env PIP_CERT="$bundle" --env SSL_CERT_FILE="$bundle" --env REQUESTS_CA_BUNDLE="$bundle" \
    --env CURL_CA_BUNDLE="$bundle" "$ctr"
fi
buildah commit --quiet "$ctr" docker.io/library/debian:bookworm-slim
buildah rm "$ctr" >/dev/null
say "committed docker.io/library/debian:bookworm-slim"

ctr="$(buildah from docker.io/library/debian:bookworm-slim)"
# What the official image's buildpack-deps base brings that a Rust build uses.
buildah run --isolation chroot "$ctr" -- sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends build-essential pkg-config cmake git ca-certificates curl libssl-dev >/dev/null && rm -rf /var/lib/apt/lists/*'
buildah copy --quiet "$ctr" "$sysroot" /usr/local/rust
buildah config --env RUSTUP_HOME=/usr/local/rustup --env CARGO_HOME=/usr/local/cargo \
  --env PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
buildah commit --quiet "$ctr" docker.io/library/rust:1.95-bookworm
buildah rm "$ctr" >/dev/null
say "committed docker.io/library/rust:1.95-bookworm ($toolchain)"
