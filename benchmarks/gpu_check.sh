#!/usr/bin/env bash
# GPU readiness in a few minutes, on a machine with an NVIDIA GPU: tfgpt2's logits and greedy
# tokens on the GPU against the CPU, decode ms/token (batch 1 and 8, float32 and bfloat16) and
# training step tokens/s (float32, mixed_bfloat16), written as a report into benchmarks/reports/
# (gpu-check.json and .md; then `python benchmarks/collect.py` pastes it into docs/benchmarks.md).
#
#   benchmarks/gpu_check.sh                        # 124M-shaped random weights, made in a temporary folder
#   benchmarks/gpu_check.sh --model_dir models/124M
#   benchmarks/gpu_check.sh --cpu-only ...         # a dry run on the CPU (the script's logic only)
#
# Options go to benchmarks/gpu_check.py (--help). $PYTHON picks the interpreter (default: the
# repository's .venv where there is one). Without a GPU it says so and exits 0; it exits 1
# where a check fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
cpu_only=0
for arg in "$@"; do
  if [[ "$arg" == "--cpu-only" ]]; then cpu_only=1; fi
done
if [[ $cpu_only == 0 ]]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi missing or lists none): nothing checked." >&2
    exit 0
  fi
  nvidia-smi -L >&2
fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec "$PYTHON" benchmarks/gpu_check.py "$@"
