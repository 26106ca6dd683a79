#!/usr/bin/env bash
# The decode int4/int8 kernels (quant.gemv, off by default) on a CUDA machine, in one go (the
# package installed first: pip install -e .); about 80 s on an H200:
#   gemv  -- bench/gemv.py: every 8B llama layer shape at batch 1 and 8: our kernels vs torch's
#            int4 kernel, the Triton int8 kernel, a bf16 matmul and the copy rate, same run
#            -> gemv.json, gemv.log (about 45 s)
#   tests -- pytest -m gpu tests/quant/test_gemv.py (kernels vs the reference, split-K bits,
#            the layer in a CUDA graph) -> gpu_tests.log (about 30 s)
#   int4  -- (only when named) bench/gpu_decode_show.sh OUT/show int4: the 8B int4 decode with
#            graphs (about 140 s)
#   bash bench/gpu_gemv.sh OUTDIR [gemv,tests,int4]
set -u -o pipefail
out=${1:?usage: gpu_gemv.sh OUTDIR [gemv,tests,int4]}; steps=${2:-gemv,tests}
py=${PYTHON:-python3}
mkdir -p "$out"; out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
start=$(date +%s); status=0
lap() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$out/steps.txt"; }
has() { [[ ",$steps," == *,$1,* ]]; }
if has gemv; then
  timeout 75 $py bench/gemv.py --output "$out/gemv.json" --ms 1,8 --int8 > "$out/gemv.log" 2>&1
  rc=$?; lap "gemv rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -v '^{' "$out/gemv.log" | tail -12
fi
if has tests; then
  timeout 60 $py -m pytest -q -m gpu tests/quant/test_gemv.py -p no:cacheprovider -rs \
    > "$out/gpu_tests.log" 2>&1
  rc=$?; lap "gpu tests rc=$rc: $(tail -1 "$out/gpu_tests.log")"; [ $rc -eq 0 ] || status=1
  grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -10
fi
if has int4; then
  bash bench/gpu_decode_show.sh "$out/show" int4; rc=$?; lap "int4 show rc=$rc"; [ $rc -eq 0 ] || status=1
fi
exit $status
