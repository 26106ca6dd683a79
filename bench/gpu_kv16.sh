#!/usr/bin/env bash
# Issue 15's last Show on a CUDA machine: an 8B-shaped model at 128K context within 16 GiB of GPU
# memory (weights streamed under a weight budget, KV in the tiered cache, the prompt in chunks):
#   bash bench/gpu_kv16.sh OUTDIR [ARCH] [BUDGET] [CONTEXT]
# 1. pytest -m gpu tests/kv/test_kv_16g.py: a prefill chunk's attention by the flash kernel's
#    lower-right causality == the built mask; top-K's one gather over the controller's arena ==
#    the pages copied run by run (log: OUTDIR/gpu_tests.log);
# 2. bench/kv_16g.py (store under /var/tmp/flash-bench, written once; ~20 s the first time):
#    TTFT of the chunked prefill, decode tok/s top-K 25 % and lossless vs their PCIe bound, GPU
#    memory peak vs the 16 GiB goal (OUTDIR/kv16.json, rewritten after each phase; progress lines
#    in OUTDIR/kv16.log, printed at the end).
set -u -o pipefail
out=${1:-/tmp/flash-kv16}; arch=${2:-llama}; budget=${3:-10GiB}; context=${4:-131072}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
source bench/_machine.sh
machine_info "$out" "$py"
status=0
timeout 120 $py -m pytest -q -m gpu tests/kv/test_kv_16g.py -p no:cacheprovider -rs \
  > "$out/gpu_tests.log" 2>&1 || status=1
echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -20
$py bench/kv_16g.py --arch "$arch" --budget "$budget" --context "$context" \
  --dir /var/tmp/flash-bench --output "$out/kv16.json" > "$out/kv16.out" 2> "$out/kv16.log" \
  || status=1
grep -E '^\[' "$out/kv16.log"
tail -5 "$out/kv16.log" | grep -vE '^\[' || true
exit $status
