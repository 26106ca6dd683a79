#!/usr/bin/env bash
# The decode int4/int8 kernels (quant.gemv) on a CUDA machine, in one go (the package installed
# first: pip install -e .); about 95 s on an H200:
#   gemv  -- bench/gemv.py: every 8B llama layer shape at batch 1 and 8: the tensor-core int4
#            kernel (default shape, plus a sweep of others at batch 1) vs torch's int4 kernel, a
#            bf16 matmul and the copy rate, same run -> gemv.json, gemv.log (GEMV_TIMEOUT, 50 s)
#   old   -- the same with the CUDA-core kernels of 2026-12-01 and the int8 ones (only when named)
#   tests -- pytest -m gpu tests/quant/test_gemv.py -k "mma or graph" (the tensor-core kernel vs
#            the reference, split-K bits, the layer in a CUDA graph; TESTS_K to change the selection)
#            -> gpu_tests.log (TESTS_TIMEOUT, 45 s)
#   int4  -- (only when named) bench/gpu_decode_show.sh OUT/show int4: the 8B int4 decode with
#            graphs (about 140 s)
#   bash bench/gpu_gemv.sh OUTDIR [gemv,tests,old,int4]
set -u -o pipefail
out=${1:?usage: gpu_gemv.sh OUTDIR [gemv,tests,old,int4]}; steps=${2:-gemv,tests}
py=${PYTHON:-python3}
source "$(dirname "$0")/steps.sh"
cd "$(dirname "$0")/.."
if has gemv; then
  timeout "${GEMV_TIMEOUT:-50}" $py bench/gemv.py --output "$out/gemv.json" --ms 1,8 --sweep \
    --budget-s "${SWEEP_BUDGET:-32}" > "$out/gemv.log" 2>&1
  rc=$?; lap "gemv rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -v '^{' "$out/gemv.log" | tail -20
fi
if has old; then
  timeout 75 $py bench/gemv.py --output "$out/gemv_old.json" --ms 1,8 --old --int8 \
    > "$out/gemv_old.log" 2>&1
  rc=$?; lap "gemv old rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -v '^{' "$out/gemv_old.log" | tail -12
fi
if has tests; then
  timeout "${TESTS_TIMEOUT:-45}" $py -m pytest -q -m gpu tests/quant/test_gemv.py \
    -k "${TESTS_K:-mma or graph}" -p no:cacheprovider -rs > "$out/gpu_tests.log" 2>&1
  rc=$?; lap "gpu tests rc=$rc: $(tail -1 "$out/gpu_tests.log")"; [ $rc -eq 0 ] || status=1
  grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -10
fi
if has int4; then
  bash bench/gpu_decode_show.sh "$out/show" int4; rc=$?; lap "int4 show rc=$rc"; [ $rc -eq 0 ] || status=1
fi
exit $status
