#!/usr/bin/env bash
# The tiered KV cache on a CUDA machine in one go (issue 15's Show):
#   bash bench/gpu_kv.sh OUTDIR [ARCH] [CONTEXTS] [--smoke]
# 1. pytest -m gpu tests/kv: lossless == DynamicCache on CUDA (page-locked pages, copy stream,
#    one _foreach_copy_ per layer), top-K's one gather == the same pages copied run by run;
# 2. bench/kv.py --profile: GPU KV, decode tok/s of DynamicCache (as a default user gets it, and
#    with cuDNN's attention left out: the stronger is the baseline) / top-K 25 % / lossless /
#    transformers' offload, PCIe bound, TTFT, host share per mode, and a profiler table of two
#    steps per mode at 32K only (OUTDIR/kv.<mode>-32768.txt).
# CONTEXTS default "32768 8192" (the goals' context first; ~100 s on an H200 with the tests);
# --smoke: the CPU with a tiny model. PROFILE_AT (default "32768"): the contexts profiled;
# NO_TESTS=1: the bench alone (a second call at 131072, say); PAGE_CACHE_MULTIPLES="2 3": top-K
# also timed with those page-cache multiples (informational; the goals use the default);
# HOST_PROFILE=1: Python's profiler over 10 decode steps of DynamicCache and top-K.
set -u -o pipefail
out=${1:-/tmp/flash-kv}; arch=${2:-llama}; contexts=${3:-32768 8192}; smoke=${4:-}
profile_at=${PROFILE_AT:-32768}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
source bench/_machine.sh
machine_info "$out" "$py"
status=0
flags=()
if [ "$smoke" = "--smoke" ]; then
  flags=(--smoke --decode 2)
elif [ -z "${NO_TESTS:-}" ]; then
  $py -m pytest -q -m gpu tests/kv -p no:cacheprovider -rs > "$out/gpu_tests.log" 2>&1 || status=1
  echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -20
fi
if [ -n "${KV_FLAGS:-}" ]; then
  # shellcheck disable=SC2206
  flags+=($KV_FLAGS)  # more bench/kv.py flags (--no-fused: the other paths' timings left out)
fi
if [ -n "${HOST_PROFILE:-}" ]; then
  flags+=(--host-profile)  # cProfile of decode steps per mode (kv.hostprof-*.txt)
fi
if [ -n "${PAGE_CACHE_MULTIPLES:-}" ]; then
  # shellcheck disable=SC2206
  flags+=(--page-cache-multiples $PAGE_CACHE_MULTIPLES)
fi
# shellcheck disable=SC2086
$py bench/kv.py --arch "$arch" --contexts $contexts --profile --profile-at $profile_at "${flags[@]}" \
  --output "$out/kv.json" > "$out/kv.out" 2> "$out/kv.log" || status=1
sed -n '/^dynamic floor/,/^goals:/p' "$out/kv.log"
exit $status
