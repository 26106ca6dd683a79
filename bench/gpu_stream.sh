#!/usr/bin/env bash
# Streamed decode on a CUDA machine, one arch after another, and the GPU tests of the streaming
# paths (docs/benchmarks.md, "Streamed decode: one MLP projection a slot"):
#   bash bench/gpu_stream.sh OUTDIR ARCHS [WINDOWS]
# ARCHS: llama | qwen2 | mistral, comma-separated, in the order given. Each arch: bench/stream.py
# through `gpu_paths.sh OUTDIR windows ARCH` (resident run skipped, accelerate timed once,
# WINDOWS -- default "default" -- the plans compared in one process: "default,projection",
# "layer", ...), under a `timeout` of what is left of STREAM_BUDGET_S (default 130) seconds since
# the start; the bench files (STREAM_CLEAN, default /var/tmp/flash-*) are deleted before the next arch (a 7-8B store and
# its checkpoint take ~30 GB). An arch that would start with less than STREAM_ARCH_MIN_S (default
# 60) seconds left is skipped. The GPU tests (pytest -m gpu on the slot ring's CUDA paths: the hooks
# with projection slots, tests/client/test_load_model.py, and the decode graphs' static ring,
# tests/decode/test_decode_load_model.py, each unit kind) run where STREAM_TESTS says: "first"
# (under `timeout` STREAM_TESTS_S, default 45), "last" (the default: in the time left, if more
# than 10 s) or "none"; STREAM_TESTS_K: pytest's -k (default "slot_ring or projection").
set -u -o pipefail
out=${1:?OUTDIR}
archs=${2:?ARCHS}
windows=${3:-default}
budget=${STREAM_BUDGET_S:-130}
t0=$(date +%s)
cd "$(dirname "$0")/.."
mkdir -p "$out"
left() { echo $(( budget - ($(date +%s) - t0) - 3 )); }
build() {
  if ! python3 -c "import deepseek_flash._core, deepseek_flash, sys; sys.exit(not deepseek_flash.__file__.startswith('$PWD/'))" 2>/dev/null; then
    python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - t0 )) s"
  fi
}
gpu_tests() {  # seconds
  timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider tests/decode/test_decode_load_model.py \
    tests/client/test_load_model.py -k "${STREAM_TESTS_K:-slot_ring or projection}" > "$out/gpu_tests.log" 2>&1
  echo "gpu tests: rc $? at $(( $(date +%s) - t0 )) s (cap $1 s): $(tail -1 "$out/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -10
}
build
if [ "${STREAM_TESTS:-last}" = first ]; then
  gpu_tests "${STREAM_TESTS_S:-45}"
fi
first=1
for arch in ${archs//,/ }; do
  cap=$(left)
  if [ "$cap" -lt "${STREAM_ARCH_MIN_S:-60}" ]; then
    echo "stream $arch: not started ($cap s left)"; continue
  fi
  [ $first = 1 ] || rm -rf ${STREAM_CLEAN:-/var/tmp/flash-*}
  first=0
  PATHS_STREAM_ARGS="--skip-resident --windows $windows ${STREAM_ARGS:-}" \
    timeout "$cap" bash bench/gpu_paths.sh "$out" windows "$arch"
  rc=$?; [ $rc = 124 ] && echo "stream $arch: cut at the cap ($cap s)"
done
if [ "${STREAM_TESTS:-last}" = last ]; then
  cap=$(left)
  if [ "$cap" -gt 10 ]; then gpu_tests "$cap"; else echo "gpu tests: not run (${cap} s left)"; fi
fi
# The short table, last: each arch's plans against the bound and accelerate, where the link idled.
python3 - "$out" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("stream-*.json")):
    d = json.loads(p.read_text())
    for w, r in (d.get("windows") or {}).items():
        plan, idle = r.get("plan") or {}, r.get("batch1_copy_idle") or {}
        print(f"{d.get('arch'):8} {w:12} unit {plan.get('unit')} slots {plan.get('slots')} streamed "
              f"{plan.get('streamed_layers')} GB/token {plan.get('streamed_bytes_per_token', 0) / 1e9:.3f} | "
              f"h2d {d.get('pinned_h2d_gbps')} tok/s {r.get('streamed_tok_s')} vs_bound {r.get('vs_bound')} "
              f"accelerate {d.get('accelerate_tok_s')} x{r.get('vs_accelerate')} | idle ms/pass "
              f"{idle.get('idle_ms_per_pass')} busy {idle.get('busy_ms_per_pass')}")
PY
