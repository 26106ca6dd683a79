#!/usr/bin/env bash
# KV importance pruning on a CUDA machine in one go (issue 16's Show):
#   bash bench/gpu_prune.sh OUTDIR [ARCH] [--smoke]
# 1. pytest -m gpu tests/kv/test_prune_gpu.py: pruned recall on CUDA (page-locked rows, the
#    device-indexed gather, int4 decompressed on the device) == the same recall through the host,
#    and level 2 lossless == the tiered cache alone;
# 2. bench/kv_prune.py --show at 32K: GPU KV and decode tok/s of DynamicCache (with and without
#    cuDNN: the stronger is the baseline), the tiered cache alone (lossless, top-K 25 %) and
#    pruning (default, top-K 25 %, every page demoted), each at least 8 timed steps, each
#    step's ms with the evaluation steps apart, the scorer's ms per step, and a profiler table of
#    the default pruned row up to its next evaluation (OUTDIR/kv_prune.pruned-32768.txt).
# ~120 s on an H200 (the Show is bounded by --budget-s 100). --smoke: the CPU with a tiny model.
set -u -o pipefail
out=${1:-/tmp/flash-prune}; arch=${2:-llama}; smoke=${3:-}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
source bench/_machine.sh
machine_info "$out" "$py"
status=0
flags=(--show-context 32768 --decode 16 --min-steps 8 --budget-s 100)
if [ "$smoke" = "--smoke" ]; then
  flags=(--smoke --show-context 2048 --decode 16 --threads 1)
else
  $py -m pytest -q -m gpu tests/kv/test_prune_gpu.py -p no:cacheprovider -rs > "$out/prune_gpu_tests.log" 2>&1 || status=1
  echo "gpu tests: $(tail -1 "$out/prune_gpu_tests.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$out/prune_gpu_tests.log" | head -20
fi
$py bench/kv_prune.py --show --arch "$arch" "${flags[@]}" --profile-dir "$out" \
  --output "$out/kv_prune_show.json" > "$out/kv_prune_show.out" 2> "$out/kv_prune_show.log" || status=1
tail -12 "$out/kv_prune_show.log"
exit $status
