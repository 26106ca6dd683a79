#!/usr/bin/env bash
# Quantized weights on a CUDA machine in one go (the kernel check and the Show of the quant issue):
#   bash bench/gpu_quant.sh OUTDIR [ARCH] [STEPS] [--smoke]
# STEPS (comma-separated, default tests,kernel,show):
#   tests  -- pytest -m gpu tests/quant: torch's packing op == int4pack.cuda_layout, torch's int4
#             kernel vs dequantize-then-matmul (M = 1, 3, 8, 64; g32/64/128), the runtime vs the
#             same-dtype reference (teacher-forced) and vs float32 (published as junit properties);
#   kernel -- bench/quant.py --kernel: every layer shape at M = 1..128, bf16 / Triton / torch int4;
#   show   -- bench/quant.py: store sizes, the 8 GiB and 3 GiB budgets, the 4-bit peer.
# --smoke runs the same steps on the CPU with the tiny model (the CI-sized proof of this script).
# Each step writes JSON/logs under OUTDIR; a short table is printed last.
set -u -o pipefail
out=${1:-/tmp/flash-quant}; arch=${2:-llama}; steps=${3:-tests,kernel,show}; smoke=${4:-}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
flags=(); work=/var/tmp/flash-bench
if [ "$smoke" = "--smoke" ]; then flags=(--smoke); work="$out/work"; fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU";
  $py -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)';
  git log --oneline -1 2>/dev/null || true; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
status=0
if [[ ",$steps," == *,tests,* ]]; then
  $py -m pytest -q -m gpu tests/quant -p no:cacheprovider -rs --junitxml="$out/gpu_tests.xml" \
    > "$out/gpu_tests.log" 2>&1 || status=1
  echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -20
fi
if [[ ",$steps," == *,kernel,* ]]; then
  $py bench/quant.py --kernel --arch "$arch" "${flags[@]}" --output "$out/kernel_$arch.json" \
    > "$out/kernel_$arch.log" 2>&1 || { status=1; tail -20 "$out/kernel_$arch.log"; }
fi
if [[ ",$steps," == *,show,* ]]; then
  $py bench/quant.py --arch "$arch" --dir "$work" "${flags[@]}" --output "$out/quant_$arch.json" \
    > "$out/quant_$arch.log" 2>&1 || { status=1; tail -20 "$out/quant_$arch.log"; }
fi
$py - "$out" "$arch" <<'EOF'
import json, sys
from pathlib import Path
out, arch = Path(sys.argv[1]), sys.argv[2]
kernel = out / f"kernel_{arch}.json"
if kernel.exists():
    rows = json.loads(kernel.read_text()).get("kernel", [])
    cols = ["bf16_us", "triton_int4_g128_us", "torch_int4_us", "torch_int4_derived_per_call_us",
            "runtime_int4_g128_us", "runtime_int8_g128_us", "torch_int4_max_rel_err"]
    print(f"{'shape':14} {'M':>4} " + " ".join(f"{c[:22]:>22}" for c in cols))
    for r in rows:
        print(f"{r['shape']:14} {r['M']:>4} " + " ".join(
            f"{r.get(c, float('nan')):>22.4g}" for c in cols))
show = out / f"quant_{arch}.json"
if show.exists():
    r = json.loads(show.read_text())
    print("store bytes", r.get("store_bytes"), "ratio", r.get("store_ratio_int4_vs_bf16"))
    for phase in ("int4_budget", "bf16_budget", "int4_small_budget"):
        p = r.get(phase, {})
        print(f"{phase:18} tok/s {p.get('tok_s')} streamed/token {p.get('streamed_bytes_per_token')} "
              f"derived {p.get('derived_bytes')} gpu_peak {p.get('gpu_peak_bytes')}"
              + (f" step {p['step_profile']}" if "step_profile" in p else ""))
    print("int4 vs bf16 streamed", r.get("int4_vs_bf16_streamed"), "small vs bound",
          r.get("int4_small_budget", {}).get("vs_bound"), "peer", r.get("peer"))
    print("goals", r.get("goals"))
EOF
exit $status
