# Sleuth developer entry points. Every target installs what it needs first.
#
#   make demo   train a search agent on a generated collection and show it got better
#   make train SOURCE=DIR COLLECTION=NAME   the same recipe on any BEIR collection
#   make tour   start the whole mesh locally, show it healthy, stop it
#   make test   build and run every test (real Redis, PostgreSQL, S3, libtorch)
#   make lint   rustfmt check, clippy with warnings as errors, cargo deny
#   make audit  cargo deny's advisories check against the RustSec database
#   make stress the fault, restart and resume tests 20 times, idle and loaded
#   make image  build the container images (Docker, or buildah without a daemon)
#
# The venv (libtorch) and the cargo build cache live outside the checkout,
# under $(SLEUTH_CACHE), so fresh clones build incrementally.

SHELL := /bin/bash
SLEUTH_CACHE ?= $(HOME)/.cache/sleuth
VENV := $(SLEUTH_CACHE)/venv

export SLEUTH_CACHE
export SLEUTH_VENV := $(VENV)
export CARGO_TARGET_DIR ?= $(SLEUTH_CACHE)/target
# tch's build finds libtorch through the venv's torch package.
export LIBTORCH_USE_PYTORCH := 1
export PATH := $(VENV)/bin:$(SLEUTH_CACHE)/bin:$(PATH)
# Binaries find libtorch at run time without LD_LIBRARY_PATH. Recursive (=) and
# through the shell (make caches directory listings for $(wildcard)), so it is
# evaluated after `setup` created the venv.
TORCH_LIB = $(shell ls -d $(VENV)/lib/python3*/site-packages/torch/lib 2>/dev/null | head -n 1)
export RUSTFLAGS = -C link-arg=-Wl,-rpath,$(TORCH_LIB)

.PHONY: setup build test-fixtures test stress lint audit demo train tour bench gpu-check proto env clean-cache image

setup:
	@deploy/local/setup.sh

build: setup
	@test -n "$(TORCH_LIB)" || { echo "libtorch not found under $(VENV); run make setup" >&2; exit 1; }
	cargo build --workspace --all-targets

# Fixtures too heavy to build inside a test (SciFact embedded for vector
# search, the rollout tests' imprinted policies), built once per machine into
# $(SLEUTH_CACHE) with progress, so a cold cache and a warm one give the same
# verdicts. Needs ../shared/data (or SLEUTH_SHARED_DATA).
test-fixtures: build
	OMP_WAIT_POLICY=passive "$(CARGO_TARGET_DIR)/debug/sleuth-test-fixtures"

# Tests run many libtorch processes on few cores: OpenMP threads that sleep
# instead of spinning while they wait leave the cores to the other processes.
test: test-fixtures
	OMP_WAIT_POLICY=passive cargo nextest run --workspace --profile ci

# Races one run misses: the fault, restart and resume tests STRESS_RUNS
# times (default 20) on an idle machine, then beside a CPU hog on every core;
# prints how many runs of each passed. Hours, so not part of `make test`.
stress: test-fixtures
	OMP_WAIT_POLICY=passive deploy/local/stress.sh

# Both images from docker/Dockerfile (deploy/image/build.sh says how to
# choose the torch wheel; offline-bases.sh makes the base images where no
# registry can be reached).
image:
	@deploy/image/build.sh

# cargo deny: licenses, banned crates and sources (deny.toml).
lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo deny check licenses bans sources

# cargo deny's advisories: RustSec's database from GitHub, or a local clone
# of it where GitHub is out of reach (ADVISORY_DB=DIR). Apart from `lint`,
# whose verdict must not depend on a network.
audit: setup
	@deploy/local/audit.sh

demo: build
	@deploy/local/demo.sh

# ARGS: more train.sh options, e.g. ARGS="--policy models/qwen3 --vectors".
train: build
	@test -n "$(SOURCE)" -a -n "$(COLLECTION)" || { echo "usage: make train SOURCE=DIR COLLECTION=NAME [ARGS=...]" >&2; exit 2; }
	@deploy/local/train.sh --source "$(SOURCE)" --collection "$(COLLECTION)" $(ARGS)

tour: build
	@deploy/local/tour.sh

# The CUDA paths (tch on CUDA, bf16 on GPU, learner ranks with CUDA tensors)
# on a machine with an NVIDIA GPU; exits non-zero where there is none.
gpu-check: build
	@deploy/local/gpu-check.sh

# Benchmarks against the named peers, in release mode; they print ratios.
bench: test-fixtures
	cargo bench -p tool-gateway --bench retrieval
	cargo bench -p policy-server --bench generation
	cargo bench -p inference-gateway --bench overhead
	cargo bench -p inference-gateway --bench long_episodes
	cargo bench -p learner --bench grpo_step
	cargo bench -p sleuth-c10d --bench sharded_exchange
	cargo bench -p rollout-orchestrator --bench dashboard
	cargo build --release --workspace --bins
	OMP_WAIT_POLICY=passive cargo bench -p sleuth-tests --bench rollout_throughput
	OMP_WAIT_POLICY=passive cargo bench -p sleuth-tests --bench staleness

# Code generation runs in crates/sleuth-proto/build.rs; this only forces it.
proto: setup
	cargo build -p sleuth-proto

# For running cargo by hand with the same settings: eval "$$(make -s env)"
env:
	@echo 'export CARGO_TARGET_DIR="$(CARGO_TARGET_DIR)" LIBTORCH_USE_PYTORCH=1 SLEUTH_VENV="$(VENV)" PATH="$(VENV)/bin:$(SLEUTH_CACHE)/bin:$$PATH" RUSTFLAGS="$(RUSTFLAGS)"'

clean-cache:
	rm -rf "$(CARGO_TARGET_DIR)"
