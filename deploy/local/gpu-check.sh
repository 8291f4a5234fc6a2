#!/usr/bin/env bash
# The CUDA paths, checked in one go on a machine with an NVIDIA GPU (under 5
# minutes after the build): golden logits on CUDA in f32 and bf16, a policy
# server generating on CUDA against the CPU's tokens and logprobs, and
# learner ranks training on CUDA through ProcessGroupNCCL (one per GPU, two at
# most; one GPU still runs every collective through NCCL) against one CPU rank.
#
#   make gpu-check      (builds first; run from the checkout)
#
# Exits 1 with a message when no GPU is visible: these tests never pass by
# skipping.
set -euo pipefail

say() { printf '\033[1mgpu-check:\033[0m %s\n' "$*"; }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  say "no NVIDIA GPU found (nvidia-smi missing or sees no device): the CUDA checks need one" >&2
  exit 1
fi
nvidia-smi -L
python="${SLEUTH_VENV:?run through make gpu-check}/bin/python"
if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  say "the venv's torch $("$python" -c 'import torch; print(torch.__version__)') sees no CUDA device (driver too old for its CUDA?)" >&2
  exit 1
fi
"$python" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, sm_{p.major}{p.minor}, bf16 {torch.cuda.is_bf16_supported()}")'

say "golden logits on CUDA (f32, bf16); SmolLM2 generation on CUDA vs the CPU; learner ranks on NCCL vs one CPU rank"
OMP_WAIT_POLICY=passive cargo nextest run --profile ci --run-ignored only \
  -p sleuth-model -p policy-server -p learner -E 'test(/^gpu_/)' --no-capture
say "all CUDA checks passed"
