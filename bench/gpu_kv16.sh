#!/usr/bin/env bash
# Issue 15's last Show on a CUDA machine: an 8B-shaped model at 128K context within 16 GiB of GPU
# memory (weights streamed under a weight budget, KV in the tiered cache, the prompt in chunks):
#   bash bench/gpu_kv16.sh OUTDIR [ARCH] [BUDGET] [CONTEXT] [ROWS]
# The bench first (a run cut by a time limit keeps its figures), then the tests:
# 1. bench/kv_16g.py (store under /var/tmp/flash-bench, written once: ~50 s on a fresh machine):
#    TTFT of the chunked prefill, decode tok/s top-K 25 % and lossless vs their PCIe bound, GPU
#    memory peak vs the 16 GiB goal (OUTDIR/kv16.json, rewritten after each phase; progress lines
#    in OUTDIR/kv16.log, printed at the end); ROWS "bf16 int8" (default "bf16") adds the lossy
#    second row, the model packed as int8 and resident (--quantize int8_symmetric --budget none;
#    the pack ~25 s): OUTDIR/kv16-int8.*;
# 2. pytest -m gpu tests/kv/test_kv_16g.py: a prefill chunk's attention by the flash kernel's
#    lower-right causality == the built mask; top-K's one gather over the controller's arena ==
#    the pages copied run by run (log: OUTDIR/gpu_tests.log); GPU_TESTS=0 leaves them out.
set -u -o pipefail
out=${1:-/tmp/flash-kv16}; arch=${2:-llama}; budget=${3:-7GiB}; context=${4:-131072}
rows=${5:-bf16}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
source bench/_machine.sh
machine_info "$out" "$py"
status=0
for row in $rows; do
  case $row in
    bf16) name=kv16; flags=(--budget "$budget") ;;
    int8) name=kv16-int8; flags=(--budget none --quantize int8_symmetric) ;;
    *) echo "unknown row $row"; status=1; continue ;;
  esac
  $py bench/kv_16g.py --arch "$arch" --context "$context" "${flags[@]}" \
    --dir /var/tmp/flash-bench --output "$out/$name.json" > "$out/$name.out" 2> "$out/$name.log" \
    || status=1
  echo "== $row"
  grep -E '^\[' "$out/$name.log"
  tail -5 "$out/$name.log" | grep -vE '^\[' || true
done
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout 120 $py -m pytest -q -m gpu tests/kv/test_kv_16g.py -p no:cacheprovider -rs \
    > "$out/gpu_tests.log" 2>&1 || status=1
  echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -20
fi
exit $status
