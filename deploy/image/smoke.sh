#!/usr/bin/env bash
# Runs what `make image` built, without a container engine daemon: every
# binary's --help in each image, then a tool gateway from the full image
# (libtorch loaded) and an orchestrator from the slim one, each answering
# gRPC health on a loopback port, checked by this checkout's `sleuth`.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
tag="${SLEUTH_IMAGE_TAG:-$(sed -n 's/^appVersion: "\(.*\)"$/\1/p' "$root/helm/sleuth/Chart.yaml")}"
full="${SLEUTH_IMAGE:-sleuth}:$tag"
slim="${SLEUTH_IMAGE_SLIM:-sleuth-slim}:$tag"
sleuth="${SLEUTH_CLI:-${CARGO_TARGET_DIR:-$HOME/.cache/sleuth/target}/debug/sleuth}"

say() { printf '\033[1msmoke:\033[0m %s\n' "$*"; }
containers=()
cleanup() { for c in "${containers[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done; }
trap cleanup EXIT

check_image() {
  local image="$1"; shift
  local ctr; ctr="$(buildah from --pull-never "$image")"; containers+=("$ctr")
  for binary in "$@"; do
    buildah run --isolation chroot "$ctr" -- "/usr/local/bin/$binary" --help >/dev/null
    say "$image: $binary --help"
  done
  echo "$ctr"
}

# One service on a free loopback port (chroot isolation shares this
# machine's network); health is SERVING or NOT_SERVING, answered either way.
# Extra arguments after the flag: the service's own settings (state goes to
# /tmp, as the image's user may write nowhere else).
serve() {
  local ctr="$1" binary="$2" flag="$3" port
  shift 3
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  buildah run --isolation chroot "$ctr" -- "/usr/local/bin/$binary" --listen "127.0.0.1:$port" --insecure "$@" >"/tmp/smoke-$binary.log" 2>&1 &
  local pid=$!
  local answered=""
  for _ in $(seq 120); do
    if answered="$("$sleuth" health "$flag" "127.0.0.1:$port" 2>&1)"; then break; fi
    sleep 1
  done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  local line
  line="$(grep -E "^$binary +127\.0\.0\.1:$port " <<<"$answered" || true)"
  echo "$line"
  grep -qE ' (SERVING|NOT_SERVING)' <<<"$line" || { say "$binary from $ctr did not answer health"; cat "/tmp/smoke-$binary.log"; return 1; }
}

full_ctr="$(check_image "$full" rollout-orchestrator agent tool-gateway inference-gateway policy-server learner sleuth | tail -n1)"
slim_ctr="$(check_image "$slim" rollout-orchestrator agent inference-gateway sleuth | tail -n1)"
serve "$full_ctr" tool-gateway --tool-gateway
# Redis is not running: the orchestrator answers NOT_SERVING, naming it in its log.
serve "$slim_ctr" rollout-orchestrator --orchestrator --http-listen 127.0.0.1:0 \
  --database-url sqlite:///tmp/sleuth.db --report-dir /tmp/evaluations --redis-url redis://127.0.0.1:9/0
say "both images run"
