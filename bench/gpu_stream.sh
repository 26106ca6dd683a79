#!/usr/bin/env bash
# Streamed decode of one arch on a CUDA machine, then the GPU tests of the streaming paths in the
# time left (docs/benchmarks.md, "Streamed decode: one MLP projection a slot"):
#   bash bench/gpu_stream.sh OUTDIR ARCH [WINDOWS]
# ARCH (llama | qwen2 | mistral): bench/stream.py through `gpu_paths.sh OUTDIR windows ARCH`, resident
# run skipped, accelerate timed once, WINDOWS (default "default") the plans compared in one process
# (bench/stream.py --windows: "default,projection", "projection:4", ...). Then, until STREAM_BUDGET_S
# (default 130) seconds after the start, pytest -m gpu on the slot ring's CUDA paths: the hooks with
# projection slots (tests/client/test_load_model.py) and the decode graphs' static ring
# (tests/decode/test_decode_load_model.py), each unit kind.
set -u -o pipefail
out=${1:?OUTDIR}
arch=${2:?ARCH}
windows=${3:-default}
t0=$(date +%s)
cd "$(dirname "$0")/.."
PATHS_STREAM_ARGS="--skip-resident --windows $windows ${STREAM_ARGS:-}" bash bench/gpu_paths.sh "$out" windows "$arch"
left=$(( ${STREAM_BUDGET_S:-130} - ($(date +%s) - t0) - 3 ))
if [ "$left" -gt 10 ]; then
  timeout "$left" python3 -m pytest -q -m gpu -p no:cacheprovider tests/decode/test_decode_load_model.py \
    tests/client/test_load_model.py -k "slot_ring or projection" > "$out/gpu_tests.log" 2>&1
  echo "gpu tests: rc $? in ${left} s or less: $(tail -1 "$out/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -10
else
  echo "gpu tests: not run (${left} s left)"
fi
