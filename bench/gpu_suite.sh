#!/usr/bin/env bash
# Build, GPU tests and benchmarks on a CUDA machine, in one go (what the docs' GPU figures come from).
#   bash bench/gpu_suite.sh quick|full OUTDIR [STEP...]
# quick: a 4-layer 8B-shaped model; full: the 32-layer 8B model. Steps (default all): tests io load
# stream profile -- each fits a 10-minute slot on its own, so a long run can be split by step.
set -u
mode=${1:-quick}
out=${2:-/tmp/flash-gpu}
shift 2 2>/dev/null || shift $#
steps=" ${*:-tests io load stream profile} "
want() { [[ "$steps" == *" $1 "* ]]; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
work=/var/tmp/flash-bench-$mode
{ uname -r; nproc; free -g | head -2; df -h /var/tmp | tail -1;
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader;
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
if want tests; then
  python3 -m pytest -q -m gpu tests/client/test_load_model.py > "$out/gpu_tests.log" 2>&1
  echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
fi
if [ "$mode" = quick ]; then
  layers=4; budget=3GiB; cache=6GiB; size=2GiB; window=15
else
  layers=32; budget=8GiB; cache=20GiB; size=4GiB; window=30
fi
want io && { python3 bench/io.py --size $size --dir /var/tmp > "$out/io.json" 2> "$out/io.err"; echo "io: $?"; }
want load && { python3 bench/load.py --dir $work --layers $layers --host-cache $cache --output "$out/load.json" > "$out/load.log" 2>&1; echo "load: $?"; }
want stream && { python3 bench/stream.py --dir $work --layers $layers --budget $budget --host-cache $cache --output "$out/stream.json" > "$out/stream.log" 2>&1; echo "stream: $?"; }
want profile && { python3 bench/profile_cold.py --dir $work --layers $layers --duration $window --output-dir "$out" > "$out/profile.log" 2>&1; echo "profile: $?"; }
for f in gpu_tests.log load.log stream.log profile.log io.err; do [ -f "$out/$f" ] && { echo "== $f"; tail -25 "$out/$f"; }; done
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("io", "load", "stream"):
    p = out / f"{name}.json"
    if p.exists():
        d = json.loads(p.read_text())
        keep = {k: v for k, v in d.items() if k in ("engine_vs_best_raw", "pinned_h2d_gbps", "raw_odirect_read_gbps",
                "cold_load", "warm_load", "warm_attach", "streamed_tok_s", "vs_bound", "resident_tok_s",
                "bound_batch1_tok_s", "steady_prefetch_hit_rate", "accelerate_tok_s", "vs_accelerate",
                "cold_ttft_s", "goals", "tokens_identical_to_resident", "fabric_stall_cycles_per_token")}
        print(name, json.dumps(keep))
PY
