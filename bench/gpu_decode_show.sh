#!/usr/bin/env bash
# The decode issue's remaining Show rows on a CUDA machine in one go (the C++ core built first:
# pip install -e .); measured on an H200: 263 s for all five steps (qwen2 beside the checkpoint write
# 54 s, int4 85 s, stream 60 s, mistral 29 s, tests 35 s); each step under its own timeout (60, 95, 65, 60 s):
#   int4    -- bench/quant.py --decode graphs: the 8B llama int4 store (default settings, tile
#              layout) resident under 8 GiB (vs the HBM bound, measured in the same run) and
#              streamed under 3 GiB (vs the PCIe bound), batch 1 and 8, with a profile of one
#              replayed batch-1 step;
#   stream  -- bench/decode_stream.py: the 8B llama bf16 streamed under an 8 GiB budget with graphs,
#              batch 1 (vs the PCIe bound, and the hooks' path), same checkpoint as int4;
#   qwen2, mistral -- bench/decode.py --arch: the 8B-shaped model resident, graphs, batch 1 and 8;
#   tests   -- (only when named) pytest -m gpu tests/decode (about 30 s).
# qwen2 runs while the 16 GB checkpoint is written (CPU and disk only); everything else alone.
#   bash bench/gpu_decode_show.sh OUTDIR [STEPS] [--smoke]
# INT4_PHASES: bench/quant.py's phases for int4 (default int4_budget,int4_small_budget; add
# int4_budget_tinygemm for the resident phase on torch's int4 kernel too), INT4_TIMEOUT its limit (95 s).
# STEPS: comma-separated subset of int4,stream,qwen2,mistral,tests (default all but tests). --smoke: the same steps
# on the CPU with tiny models (what CI proves). Work files go under /var/tmp/flash-decode-show
# (OUTDIR/work with --smoke) and are deleted at the end. OUTDIR keeps the JSON results, steps.txt
# and logs.tar.gz (logs, machine.txt, the profile tables): six files.
set -u -o pipefail
out=${1:-/tmp/flash-decode-show}; steps=${2:-int4,stream,qwen2,mistral}; smoke=${3:-}
py=${PYTHON:-python3}
source "$(dirname "$0")/steps.sh"
cd "$(dirname "$0")"
work=/var/tmp/flash-decode-show; flags=(); t_dec=60; t_int4=${INT4_TIMEOUT:-95}; t_stream=65
if [ "$smoke" = "--smoke" ]; then
  work="$out/work"; flags=(--smoke); t_dec=300; t_int4=300; t_stream=300
fi
mkdir -p "$work"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU";
  $py -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)';
  git log --oneline -1 2>/dev/null || true; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
status=0

writer=
if [ -z "$smoke" ] && { has int4 || has stream; }; then
  # The 8B llama checkpoint bench/quant.py and decode_stream.py share (written once).
  $py -c "import sys; sys.path.insert(0, '.'); from _common import write_finite_model; write_finite_model('$work/src-llama', 'llama')" \
    > "$out/src.log" 2>&1 &
  writer=$!
fi
decode_arch() {
  timeout "$t_dec" $py decode.py --arch "$1" "${flags[@]}" --variants graphs --skip-eager --skip-peer \
    --skip-ops --parity-steps 32 --output "$out/decode_$1.json" --out-dir "$out" > "$out/decode_$1.log" 2>&1
  local rc=$?; lap "decode.py --arch $1 rc=$rc"; [ $rc -eq 0 ] || { status=1; tail -5 "$out/decode_$1.log"; }
}
if has qwen2; then decode_arch qwen2; fi
if [ -n "$writer" ]; then wait "$writer"; lap "checkpoint written rc=$?"; fi
if has int4; then
  timeout "$t_int4" $py quant.py --arch llama --dir "$work" "${flags[@]}" --decode graphs \
    --phases "${INT4_PHASES:-int4_budget,int4_small_budget}" --tokens 48 --output "$out/quant_int4_graphs.json" \
    > "$out/quant_int4_graphs.log" 2>&1
  rc=$?; lap "quant.py --decode graphs rc=$rc"; [ $rc -eq 0 ] || { status=1; tail -5 "$out/quant_int4_graphs.log"; }
  rm -rf "$work"/store-llama-*          # disk for the bf16 store of the next step
fi
if has stream; then
  if [ -n "$smoke" ]; then sargs=(--smoke --src "$work/src-smoke"); else sargs=(--arch llama --layers 32 --budget 8GiB --src "$work/src-llama"); fi
  timeout "$t_stream" $py decode_stream.py "${sargs[@]}" --batches 1 --prompt 32 --new 12 --dir "$work" \
    --output "$out/decode_stream_8b.json" > "$out/decode_stream_8b.log" 2>&1
  rc=$?; lap "decode_stream.py rc=$rc"; [ $rc -eq 0 ] || { status=1; tail -5 "$out/decode_stream_8b.log"; }
  rm -rf "$work"/llama-32 "$work"/src-llama &       # ~32 GB: deleting took > 30 s on the H200 machine
fi
if has mistral; then decode_arch mistral; fi
if has tests; then
  (cd .. && timeout 60 $py -m pytest -q -m gpu tests/decode -p no:cacheprovider -rs > "$out/gpu_tests.log" 2>&1)
  rc=$?; lap "gpu tests rc=$rc: $(tail -1 "$out/gpu_tests.log")"; [ $rc -eq 0 ] || status=1
  grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -20
fi
wait
rm -rf "$work"

$py - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError) as exc:
        return None
for arch in ("qwen2", "mistral"):
    d = load(f"decode_{arch}.json")
    if d:
        for b, e in d.get("graphs", {}).items():
            print(f"{arch} b{b}: {e.get('tok_s')} tok/s, {e.get('vs_hbm_bound')} x HBM bound "
                  f"({d.get('hbm_bound_tok_s_per_seq')}), mode {e.get('mode')}, step {e.get('step')}, "
                  f"capture {e.get('capture_s')} s, pool {e.get('graph_pool_bytes')} B")
        for b, p in d.get("parity", {}).items():
            print(f"{arch} parity b{b}: first diff {p.get('first_divergent_step')} max logit diff {p.get('max_logit_diff')}")
q = load("quant_int4_graphs.json")
if q:
    r = q.get("int4_budget", {})
    print(f"int4 resident: {r.get('tok_s')} tok/s, HBM bound {r.get('hbm_bound_tok_s_per_seq')}, "
          f"x bound {r.get('vs_hbm_bound')}, decoder {[(b, s.get('mode'), s.get('captures')) for b, s in r.get('decoder', {}).items()]}")
    s = q.get("int4_small_budget", {})
    print(f"int4 streamed 3 GiB: {s.get('tok_s')} tok/s, bound b1 {s.get('bound_batch1_tok_s')}, x bound {s.get('vs_bound')}")
    t = q.get("int4_budget_tinygemm")
    if t:
        print(f"int4 resident on tinygemm: {t.get('tok_s')} tok/s, x bound {t.get('vs_hbm_bound')}")
    print("goals", q.get("goals"))
s = load("decode_stream_8b.json")
if s:
    for b, e in s.get("batches", {}).items():
        print(f"streamed 8B b{b}: graphs {e['graphs_tok_s']} ({e['graphs_vs_bound']} x bound "
              f"{s.get('bound_tok_s_per_seq')}, {e['mode']}), hooks {e['hooks_tok_s']} ({e['hooks_vs_bound']})")
EOF
lap "done status=$status"
# Few files come back from a lent machine: the JSON results and steps.txt stay, the rest is packed.
(cd "$out" && ls | grep -E '\.(log|txt)$' | grep -vx steps.txt | xargs -r tar czf logs.tar.gz --remove-files)
ls "$out"
exit $status
