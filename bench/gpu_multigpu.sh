#!/usr/bin/env bash
# Several GPUs of one host on a CUDA machine (docs/multigpu.md; results into docs/benchmarks.md):
#   bash bench/gpu_multigpu.sh OUTDIR cuda:0 cuda:0   one GPU as two logical slices (code paths)
#   bash bench/gpu_multigpu.sh OUTDIR cuda:0 cuda:1   two GPUs (the Show: split >= 1.8x one, TP attach)
# Build (skipped where the C++ core already imports), the GPU-marked device_map and
# tensor-parallel tests (GPU_TESTS=0 skips them), then bench/multigpu.py (PHASES, default
# stream,tp -- tp_stream runs with both): ARCH (default mistral)
# cut to LAYERS (default 16: a 7.5 GB model, budget half of it -- each of the split's two parts
# must hold its own anchors and two slots, so a model under ~14 layers of these shapes is too
# short for that; the bench says so before starting). JSON under OUTDIR; a short table comes last.
# On the H200, one GPU as two slices: ~35 s to write and pack the model, ~60 s of phases, ~30 s
# of tests.
set -u -o pipefail
out=${1:-/tmp/flash-multigpu}
shift || true
devices=("$@")
[ ${#devices[@]} -ge 2 ] || devices=(cuda:0 cuda:1)
export PYTHONUNBUFFERED=1
mkdir -p "$out"
cd "$(dirname "$0")/.."
work=/var/tmp/flash-bench
{ nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader;
  nvidia-smi topo -m; nproc; free -g | head -2; df -h /var/tmp | tail -1; } > "$out/machine.txt" 2>&1
t0=$(date +%s)
python3 -c "import deepseek_flash._core" 2>/dev/null ||
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/client/test_device_map.py \
    tests/client/test_tensor_parallel.py > "$out/gpu_tests.log" 2>&1
  echo "gpu tests: rc $? $(tail -1 "$out/gpu_tests.log") at $(( $(date +%s) - t0 )) s"
  grep -E "^(FAILED|ERROR)|Error|max \|logit" "$out/gpu_tests.log" | head -20
fi
timeout "${MG_TIMEOUT:-400}" python3 bench/multigpu.py --devices "${devices[@]}" --arch "${ARCH:-mistral}" \
  --layers "${LAYERS:-16}" --tokens 16 --phases "${PHASES:-stream,tp}" \
  --dir $work --host-cache 24GiB --output "$out/multigpu.json" > "$out/multigpu.log" 2>&1
rc=$?; echo "multigpu ${devices[*]}: rc $rc at $(( $(date +%s) - t0 )) s"
[ $rc = 0 ] || tail -30 "$out/multigpu.log"
python3 - "$out/multigpu.json" <<'PY'
import json, sys, pathlib
p = pathlib.Path(sys.argv[1])
if not p.exists():
    sys.exit("no multigpu.json")
d = json.loads(p.read_text())
s = d.get("stream", {})
print(f"devices {d['devices']} h2d {d.get('pinned_h2d_gbps')} GB/s; {d['arch']} {d.get('layers')} layers")
b = d.get("budgets", {})
if b:
    print(f"budgets: total {b['total']} (one-device minimum {b['one_device_minimum']}); parts " +
          ", ".join(f"{p['budget']} (min {p['minimum']})" for p in b["split"]))
if s:
    o, sp = s["one_device"], s.get("split", {})
    print(f"stream: model {s['model_bytes']} budget {s['total_budget_bytes']}; one {o['tok_s']} tok/s "
          f"(bound {o['bound_tok_s']}); split {sp.get('tok_s')} tok/s (bound {sp.get('bound_tok_s')}) "
          f"x{s.get('split_vs_one')} hit {sp.get('prefetch_hit_rate')} same tokens "
          f"{sp.get('tokens_identical_to_one_device')} parts {sp.get('parts')}")
t = d.get("tp", {})
ts = d.get("tp_stream", {})
if ts:
    print(f"tp_stream: {ts['tok_s']} tok/s x{ts['vs_one_device']} vs one device, budget/rank "
          f"{ts['budget_bytes_per_rank']} streaming {ts['streaming']} same tokens {ts['ranks_same_tokens']}")
if t:
    print(f"tp: first run {t['first_run_s']} s; attach " +
          ", ".join(f"rank {r['rank']} {r['load_model_ms']} ms ({r['backend']})" for r in t["ranks"]) +
          f"; logits {t['logits']}")
print("goals", d.get("goals"))
PY
