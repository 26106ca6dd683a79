#!/usr/bin/env bash
# The resident int4 decode step on a CUDA machine (the package installed first: pip install -e .):
#   decode -- bench/decode.py --int4: the 8B llama, every projection int4 g128 in the tile layout,
#             graphs, vs the HBM bound measured in the same run; variants (VARIANTS) graphs (the
#             default step: merged q|k|v and gate|up, sdpa), graphs_unmerged (one GEMV a projection),
#             graphs_triton_attention / graphs_rope_attention (our attention kernels), graphs_cuda_gemv /
#             graphs_tinygemm (the CUDA C++ int4 GEMV on / off); parity vs
#             transformers' modules; one profiled step each -> decode_int4.json, decode_int4.log,
#             profile_*.txt (DECODE_TIMEOUT, 36 s)
#   bf16   -- (only when named) bench/decode.py, the bf16 8B llama: graphs vs graphs_triton_attention,
#             parity over 32 steps -> decode_bf16.json (BF16_TIMEOUT, 30 s)
#   attn   -- (only when named) bench/attention.py: decode_attention's kernels (a sweep of their shapes)
#             vs sdpa at the 8B heads, batch 1 and 8 -> attention.json (ATTN_TIMEOUT, 20 s)
#   tests  -- pytest -m gpu (TESTS_FILES, TESTS_K) -> gpu_tests.log (TESTS_TIMEOUT, 20 s)
#   bash bench/gpu_int4.sh OUTDIR [decode,bf16,attn,tests] [--smoke]
set -u -o pipefail
out=${1:?usage: gpu_int4.sh OUTDIR [decode,tests] [--smoke]}; steps=${2:-decode,tests}; smoke=${3:-}
py=${PYTHON:-python3}
source "$(dirname "$0")/steps.sh"
cd "$(dirname "$0")/.."
if has decode; then
  timeout "${DECODE_TIMEOUT:-36}" $py bench/decode.py --int4 $smoke --batches "${BATCHES:-1}" --prompt 128 \
    --new "${NEW:-128}" --variants "${VARIANTS:-graphs,graphs_unmerged,graphs_triton_attention}" --skip-eager --skip-peer \
    --skip-ops --parity-steps 16 --output "$out/decode_int4.json" --out-dir "$out" > "$out/decode_int4.log" 2>&1
  rc=$?; lap "decode --int4 rc=$rc"; [ $rc -eq 0 ] || { status=1; tail -3 "$out/decode_int4.log"; }
fi
if has bf16; then
  mkdir -p "$out/bf16"
  timeout "${BF16_TIMEOUT:-30}" $py bench/decode.py $smoke --batches "${BATCHES:-1}" --prompt 128 --new "${NEW:-128}" \
    --variants "${BF16_VARIANTS:-graphs,graphs_triton_attention}" --skip-eager --skip-peer --skip-ops --parity-steps 32 \
    --output "$out/decode_bf16.json" --out-dir "$out/bf16" > "$out/decode_bf16.log" 2>&1
  rc=$?; lap "decode bf16 rc=$rc"; [ $rc -eq 0 ] || { status=1; tail -3 "$out/decode_bf16.log"; }
fi
if has attn; then
  timeout "${ATTN_TIMEOUT:-20}" $py bench/attention.py $smoke --budget-s "${ATTN_BUDGET:-12}" --batches "${ATTN_BATCHES:-1,8}" \
    --lengths "${ATTN_LENGTHS:-256,512,4096}" ${ATTN_FLAGS:-} --output "$out/attention.json" > "$out/attention.log" 2>&1
  rc=$?; lap "attention rc=$rc"; [ $rc -eq 0 ] || status=1; tail -6 "$out/attention.log"
fi
if has tests; then
  timeout "${TESTS_TIMEOUT:-20}" $py -m pytest -q -m gpu ${TESTS_FILES:-tests/quant/test_gemv.py} \
    -k "${TESTS_K:-mma or graph}" -p no:cacheprovider -rs ${PYTEST_FLAGS:--x --tb=short} > "$out/gpu_tests.log" 2>&1
  rc=$?; lap "gpu tests rc=$rc: $(tail -1 "$out/gpu_tests.log")"; [ $rc -eq 0 ] || status=1
  grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -8
fi
for f in "$out/decode_int4.json" "$out/decode_bf16.json"; do [ -f "$f" ] && $py - "$f" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("==", sys.argv[1].rsplit("/", 1)[-1])
print(f"copy {r.get('copy_bandwidth_gbps')} GB/s, {r.get('weight_bytes_per_step', 0) / 1e9:.3f} GB a step, "
      f"bound {r.get('hbm_bound_tok_s_per_seq')} tok/s")
own = ("graphs_sdpa", "graphs_triton_attention", "graphs_rope_attention", "graphs_flash_attention", "graphs_cuda_gemv", "graphs_tinygemm",
       "graphs_cuda_gemv_a0", "graphs_silu_apart", "graphs_swap", "graphs_silu_fused", "graphs_swap_silu",
       "graphs_glu", "graphs_glu_apart", "graphs_flash_glu", "graphs_ring", "graphs_flash_glu_ring",
       "graphs_flash_glu_norm", "graphs_all", "graphs_pdl", "graphs_g4", "graphs_flash_tuned")
for v in ("graphs", "graphs_unmerged") + own:
    for b, e in r.get(v, {}).items():
        m = e.get("merged") or {}
        print(f"{v:16} b{b}: {e['tok_s']:>8} tok/s  vs bound {e.get('vs_hbm_bound', '-')}  mode {e['mode']} "
              f"step {e['step']} triton {e.get('triton')} merged {m.get('quantized')}/{m.get('unmerged')}")
for v in own:
    for b, e in r.get(v, {}).items():
        if "parity" in e:
            print(f"parity {v} b{b}: {e['parity']}"[:300])
        p = e.get("profile") or {}
        if "top" in p:
            print(f"profile {v} b{b}: {p.get('kernel_time_us_per_step')} us;",
                  [(t['kernel'][:28], t['per_step'], t['us']) for t in p['top'][:8]])
for b, p in r.get("parity", {}).items():
    print(f"parity b{b}: {p}"[:300])
for b, p in r.get("profile", {}).items():
    print(f"profile b{b}: {p.get('kernels_per_step')} kernels, {p.get('kernel_time_us_per_step')} us;",
          [(t['kernel'][:40], t['per_step'], t['us']) for t in p.get('top', [])[:7]])
print("summary", json.dumps(r.get("summary")))
PY
done
exit $status
