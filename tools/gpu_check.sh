#!/usr/bin/env bash
# GPT-2 on an NVIDIA GPU, on a machine with one: the quick tier of the tests (and the tests
# marked gpu) on the GPU, then tools/gpu_check.py (the numbers against the CPU, decode and
# training speed beside HF transformers, the floor), written as a report into tools/reports/
# (gpu-check.json and .md; then `python tools/collect.py` pastes it into docs/benchmarks.md).
#
#   tools/gpu_check.sh                        # 124M-shaped random weights, made in a temporary folder
#   tools/gpu_check.sh --model_dir models/124M
#   tools/gpu_check.sh --cpu-only ...         # a dry run on the CPU (the script's logic only)
#
# Options go to tools/gpu_check.py (--help). $PYTHON picks the interpreter (default: the
# repository's .venv where there is one); $TEST_WORKERS the test workers (default 8);
# $TEST_TIMEOUT their seconds (default 300); SKIP_TESTS=1 leaves the tests out. The tests' last
# line goes into the report as a note. Without a GPU it says so and exits 0; it exits 1 where a
# check or a test fails.
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
# several TensorFlow processes (test workers, the check's stages) share the GPU
export TF_FORCE_GPU_ALLOW_GROWTH="${TF_FORCE_GPU_ALLOW_GROWTH:-true}"
notes=()
tests_status=0
if [[ $cpu_only == 0 && "${SKIP_TESTS:-0}" != 1 ]]; then
  command=(-m pytest -q -m "not slow or gpu" -n "${TEST_WORKERS:-8}" -p no:cacheprovider)
  echo "gpu_check: the tests on the GPU: python ${command[*]}" >&2
  log=$(mktemp)
  timeout "${TEST_TIMEOUT:-300}" "$PYTHON" "${command[@]}" 2>&1 | tee "$log" >&2 || tests_status=$?
  summary=$(grep -E "(passed|failed|error)" "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//' || true)
  failures=$(grep -E "^(FAILED|ERROR) " "$log" | head -n 20 | tr '\n' ';' || true)
  notes+=(--note "Tests on this GPU (\`python ${command[*]}\`): ${summary:-no summary (status $tests_status)}${failures:+; $failures}.")
  rm -f "$log"
fi
status=0
"$PYTHON" tools/gpu_check.py "$@" "${notes[@]}" || status=$?
if [[ $tests_status != 0 && $status == 0 ]]; then status=1; fi
exit $status
