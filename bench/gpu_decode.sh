#!/usr/bin/env bash
# Decode on a CUDA machine in one go (the C++ core built first: pip install -e .), about 130 s on
# an H200:
#   1. bench/decode.py: the 8B shape of ARCH resident, batch 1 and 8, graphs with the fused step
#      and through transformers' modules, operations per step, profile, logit parity (<= 70 s;
#      no eager generate() and no compiled peer: measured before, add --with-eager / --with-peer);
#   2. the decode GPU tests (<= 35 s);
#   3. bench/decode_stream.py: a streamed model (4 layers of the 8B layer shape, 1.5 GiB budget)
#      decoding with graphs vs the PCIe bound and vs the hooks' path (<= 35 s).
#   bash bench/gpu_decode.sh OUTDIR [ARCH] [--with-eager] [--with-peer]
set -u -o pipefail
out=${1:-/tmp/flash-decode}; arch=${2:-llama}; shift 2 2>/dev/null || shift $#
extra=(--skip-eager --skip-peer)
for a in "$@"; do
  case $a in
    --with-eager) extra=("${extra[@]/--skip-eager}") ;;
    --with-peer) extra=("${extra[@]/--skip-peer}") ;;
  esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)'; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
lap() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$out/steps.txt"; }

(cd bench && timeout 70 python3 decode.py --arch "$arch" ${extra[@]} --output "$out/decode_$arch.json" --out-dir "$out") > "$out/decode_$arch.log" 2>&1
lap "decode.py rc=$?"
timeout 35 python3 -m pytest -q -m gpu tests/decode -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
lap "gpu tests rc=$?: $(tail -1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -20
(cd bench && timeout 35 python3 decode_stream.py --arch mistral --layers 4 --budget 1536MiB --dir /var/tmp/flash-decode-stream --output "$out/decode_stream.json") > "$out/decode_stream.log" 2>&1
lap "decode_stream.py rc=$?"

python3 - "$out" "$arch" <<'EOF'
import json, sys, pathlib
out, arch = pathlib.Path(sys.argv[1]), sys.argv[2]
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}
d = load(f"decode_{arch}.json")
print(f"HBM bound {d.get('hbm_bound_tok_s_per_seq')} tok/s/seq (copy {d.get('copy_bandwidth_gbps')} GB/s)")
ops = d.get("ops_per_step", {})
print("ops/step fused", ops.get("fused", {}).get("total"), "modules", ops.get("modules", {}).get("total"))
print("| batch | graphs fused tok/s | x HBM | graphs modules tok/s | step | triton | capture s |")
for b, e in d.get("graphs", {}).items():
    m = d.get("graphs_modules", {}).get(b, {})
    print(f"| {b} | {e.get('tok_s')} | {e.get('vs_hbm_bound')} | {m.get('tok_s')} | {e.get('step')} | {e.get('triton')} | {e.get('capture_s')} |")
for b, p in d.get("parity", {}).items():
    print(f"parity b{b}: identical {p.get('tokens_identical')} first diff {p.get('first_divergent_step')} max logit diff {p.get('max_logit_diff')}")
s = load("decode_stream.json")
print(f"streamed: bound {s.get('bound_tok_s_per_seq')} tok/s/seq, plan {s.get('plan')}")
for b, e in s.get("batches", {}).items():
    print(f"| streamed b{b} | graphs {e['graphs_tok_s']} ({e['graphs_vs_bound']} x bound, {e['mode']}) | hooks {e['hooks_tok_s']} ({e['hooks_vs_bound']}) | first diff {e['first_divergent_step']} |")
EOF
