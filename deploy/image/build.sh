#!/usr/bin/env bash
# Builds Sleuth's two images from docker/Dockerfile (`make image`): the full
# image (every binary, libtorch) and the slim one (no libtorch). With Docker
# when an engine answers, else with buildah (no daemon; Debian's `buildah`).
#
#   SLEUTH_IMAGE       repository of the full image (default sleuth)
#   SLEUTH_IMAGE_SLIM  repository of the slim image (default sleuth-slim)
#   SLEUTH_IMAGE_TAG   tag (default: the chart's appVersion)
#   TORCH_INDEX_URL    where pip takes torch from. Empty (default): PyPI's
#                      wheel, whose CUDA 13 libraries need an NVIDIA driver
#                      of the 580 series or newer (it runs on CPU too);
#                      https://download.pytorch.org/whl/cpu: a CPU-only image,
#                      about 4 GB smaller.
#
# Machines that cannot pull the base images: deploy/image/offline-bases.sh.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
tag="${SLEUTH_IMAGE_TAG:-$(sed -n 's/^appVersion: "\(.*\)"$/\1/p' "$root/helm/sleuth/Chart.yaml")}"
full="${SLEUTH_IMAGE:-sleuth}:$tag"
slim="${SLEUTH_IMAGE_SLIM:-sleuth-slim}:$tag"
args=(-f "$root/docker/Dockerfile" --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-}")

say() { printf '\033[1mimage:\033[0m %s\n' "$*"; }

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  build() { docker build "${args[@]}" "$@" "$root"; }
elif command -v buildah >/dev/null; then
  # chroot isolation needs no daemon; --layers caches the build stage, so
  # the slim image reuses the full image's compilation.
  build() { buildah bud --isolation chroot --layers "${args[@]}" "$@" "$root"; }
else
  echo "make image: neither a Docker engine nor buildah found (apt-get install buildah)" >&2
  exit 1
fi

started=$SECONDS
say "building $full (the first build compiles the workspace in release mode: most of an hour on 2 cores)"
build -t "$full"
say "building $slim"
build --target slim -t "$slim"
say "built $full and $slim in $((SECONDS - started)) s"
