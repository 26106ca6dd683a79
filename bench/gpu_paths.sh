#!/usr/bin/env bash
# Every path a user takes, on a CUDA machine, default configuration (docs/benchmarks.md, "paths"):
#   bash bench/gpu_paths.sh OUTDIR 1   build, GPU parity tests, llama: stream (batch 1, 8) + paths
#   bash bench/gpu_paths.sh OUTDIR 2   build, qwen2 and mistral: stream (batch 1, 8)
#   bash bench/gpu_paths.sh OUTDIR cold [ARCH]  (default mistral) a cold load right after a default daemon
#                                            starts, in a fresh client process: the daemon's first
#                                            ever, then after its restart (the import files learned
#                                            from the first read ahead at start) (~150 s on a fresh
#                                            machine; PATHS_COLD_ARGS e.g. --skeleton-alone, --no-restart,
#                                            --restarts 2 (one more sample after a restart, ~25 s);
#                                            the imports beside the IO engine at PATHS_BESIDE_ENGINE,
#                                            default 32x1MiB, '' to skip: ~12 s each);
#                                            PATHS_READ_SHAPES (e.g. 32x1MiB,8x4MiB): first, those
#                                            read shapes against dd on the store's file (bench/io.py
#                                            --file; PATHS_SHAPE_BYTES a reading, default 1GiB,
#                                            PATHS_SHAPE_ROUNDS, default 2: ~1 s a reading);
#                                            PATHS_ALT='{"config": {...}, "env": {...}}': last, one
#                                            more cold load after a restart with that daemon
#                                            configuration (a comparison; ~25 s)
#   bash bench/gpu_paths.sh OUTDIR imports [ARCH]  (default qwen2; its store made if missing) the
#         skeleton's imports in a fresh interpreter, cache dropped: alone, beside the IO engine
#         reading the store at each PATHS_IMPORTS_ENGINE shape (default 32x1MiB,4x4MiB,1x4MiB) and
#         beside dd; ~10-15 s each, no daemon
#   bash bench/gpu_paths.sh OUTDIR windows [ARCH...]   per arch (default llama qwen2 mistral),
#         one process: stream batch 1, 8 with the default window and with prefetch_window 1 (a
#         ring of two, an experiment), accelerate each token timed (median, spread); ~100 s an
#         arch on a fresh machine (write + pack ~35 s); PATHS_BUDGET_S=N skips an arch that would
#         start after N - PATHS_ARCH_S (default 100) s; an arch's files are deleted before the next when the disk is short;
#         PATHS_STREAM_ARGS: more bench/stream.py flags, e.g. "--skip-accelerate --skip-resident"
#         (the windows' bound check alone, ~65 s an arch), "--windows default,cudnn,default" (the
#         default; then with torch's own attention kernels, cuDNN's included; the default again)
# Each step writes its JSON under OUTDIR as it goes; a short table comes last.
set -u -o pipefail
out=${1:-/tmp/flash-paths}
part=${2:-1}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
cd "$(dirname "$0")/.."
work=/var/tmp/flash-bench
{ nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader;
  nproc; free -g | head -2; df -h /var/tmp | tail -1; } > "$out/machine.txt" 2>&1
t0=$(date +%s)
if python3 -c "import deepseek_flash._core, deepseek_flash, sys; sys.exit(not deepseek_flash.__file__.startswith('$PWD/'))" 2>/dev/null; then
  echo "built already"
else
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
logs=/tmp/flash-paths-logs   # at most 8 files come back: the JSON, run.log, build.log, machine.txt
mkdir -p $logs
stream() {  # arch
  python3 bench/stream.py --arch "$1" --dir $work --batches 1,8 --tokens 8 --skip-ttft \
    --host-cache 20GiB --output "$out/stream-$1.json" > "$logs/stream-$1.log" 2>&1
  rc=$?; echo "stream $1: rc $rc at $(( $(date +%s) - t0 )) s"
  [ $rc = 0 ] || tail -25 "$logs/stream-$1.log"
}
if [ "$part" = cold ]; then
  arch=${3:-mistral}    # a store another bench left under $work is used as it is
  python3 bench/stream.py --arch "$arch" --dir $work --prepare-only > "$logs/prep-$arch.txt" 2>&1
  echo "prepared at $(( $(date +%s) - t0 )) s: $(tail -1 "$logs/prep-$arch.txt")"
  if [ -n "${PATHS_READ_SHAPES:-}" ]; then
    data=$(python3 -c "from deepseek_flash.store import Store; s = Store.open('$work/$arch/store'); print(s.data_path(s.blocks[0]))")
    python3 bench/io.py --file "$data" --bytes "${PATHS_SHAPE_BYTES:-1GiB}" --rounds "${PATHS_SHAPE_ROUNDS:-2}" \
      --shapes "$PATHS_READ_SHAPES" --output "$out/shapes-$arch.json" > "$logs/shapes-$arch.log" 2>&1
    rc=$?; echo "read shapes: rc $rc at $(( $(date +%s) - t0 )) s"; [ $rc = 0 ] || tail -25 "$logs/shapes-$arch.log"
  fi
  python3 bench/paths.py --arch "$arch" --dir $work --only shared_gpu_cold \
    --beside-engine "${PATHS_BESIDE_ENGINE-32x1MiB}" ${PATHS_COLD_ARGS:-} ${PATHS_ALT:+--alt "$PATHS_ALT"} \
    --output "$out/paths-$arch.json" > "$out/cold.log" 2>&1
  rc=$?; echo "cold: rc $rc at $(( $(date +%s) - t0 )) s"; [ $rc = 0 ] || tail -25 "$out/cold.log"
elif [ "$part" = imports ]; then
  arch=${3:-qwen2}
  python3 bench/stream.py --arch "$arch" --dir $work --prepare-only > "$logs/prep-$arch.txt" 2>&1
  python3 bench/paths.py --arch "$arch" --dir $work --only imports \
    --beside-engine "${PATHS_IMPORTS_ENGINE-32x1MiB,4x4MiB,1x4MiB}" \
    --output "$out/imports-$arch.json" > "$logs/imports-$arch.log" 2>&1
  rc=$?; echo "imports: rc $rc at $(( $(date +%s) - t0 )) s"; [ $rc = 0 ] || tail -25 "$logs/imports-$arch.log"
elif [ "$part" = windows ]; then
  archs=${*:3}
  for a in ${archs:-llama qwen2 mistral}; do
    el=$(( $(date +%s) - t0 ))
    if [ "${PATHS_BUDGET_S:-0}" -gt 0 ] && [ $(( el + ${PATHS_ARCH_S:-100} )) -gt "$PATHS_BUDGET_S" ]; then
      echo "windows $a: not started at $el s (PATHS_BUDGET_S=$PATHS_BUDGET_S)"; continue
    fi
    # A 7-8B checkpoint and its store take ~30 GB: make room by deleting the other archs'.
    if [ "$(df --output=avail -B1G /var/tmp | tail -1)" -lt 36 ]; then
      for o in llama qwen2 mistral; do [ "$o" = "$a" ] || rm -rf "$work/$o"; done
    fi
    # Written and packed by a process of its own (the timed one starts with a sync).
    python3 bench/stream.py --arch "$a" --dir $work --prepare-only > "$logs/prep-$a.txt" 2>&1
    python3 bench/stream.py --arch "$a" --dir $work --batches 1,8 --tokens 8 --skip-ttft \
      --windows default,1 --host-cache 20GiB ${PATHS_STREAM_ARGS:-} --output "$out/stream-$a.json" > "$logs/stream-$a.log" 2>&1
    rc=$?; echo "windows $a: rc $rc at $(( $(date +%s) - t0 )) s"; [ $rc = 0 ] || tail -25 "$logs/stream-$a.log"
  done
elif [ "$part" = 1 ]; then
  timeout 110 python3 -m pytest -q -x -m gpu tests/client/test_load_model.py > "$out/gpu_tests.log" 2>&1
  echo "gpu tests: rc $? $(tail -1 "$out/gpu_tests.log") at $(( $(date +%s) - t0 )) s"
  grep -E "^(FAILED|ERROR)|Error" "$out/gpu_tests.log" | head -20
  stream llama
  python3 bench/paths.py --arch llama --dir $work --output "$out/paths-llama.json" > "$out/paths-llama.log" 2>&1
  echo "paths llama: rc $? at $(( $(date +%s) - t0 )) s"; tail -4 "$out/paths-llama.log"
else
  # Both checkpoints written and packed at once (CPU and disk, before any timing), then measured
  # one after the other; last, a cold load right after a default daemon starts, on mistral.
  for a in qwen2 mistral; do python3 bench/stream.py --arch $a --dir $work --prepare-only > "$logs/prep-$a.txt" 2>&1 & done
  wait
  echo "prepared at $(( $(date +%s) - t0 )) s:"; tail -3 "$logs"/prep-*.txt
  stream qwen2
  stream mistral
  python3 bench/paths.py --arch mistral --dir $work --only shared_gpu_cold --raw-bytes 2GiB \
    --output "$out/paths-mistral.json" > "$logs/paths-mistral.log" 2>&1
  rc=$?; echo "paths mistral: rc $rc at $(( $(date +%s) - t0 )) s"; [ $rc = 0 ] || tail -25 "$logs/paths-mistral.log"
fi
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for p in sorted(out.glob("stream-*.json")):
    d = json.loads(p.read_text())
    print(f"{d.get('arch')}: h2d {d.get('pinned_h2d_gbps')} GB/s plan {d.get('plan')} "
          f"tok/s {d.get('streamed_tok_s')} vs_bound {d.get('vs_bound')} resident {d.get('resident_tok_s')} "
          f"accelerate {d.get('accelerate_tok_s')} x{d.get('vs_accelerate')} hit {d.get('steady_prefetch_hit_rate')} "
          f"same_tokens {d.get('tokens_identical_to_resident')} decisions {d.get('window_decisions_by_batch')} "
          f"accelerate_gpu {d.get('accelerate_gpu_weight_bytes')} + peak {d.get('accelerate_gpu_peak_above_weights_bytes')} "
          f"phase_s {d.get('phase_s')}")
    acc = d.get("accelerate") or {}
    if acc:
        print(f"  accelerate median {acc.get('median_tok_s')} mean {acc.get('mean_tok_s')} "
              f"fastest {acc.get('fastest_tok_s')} slowest {acc.get('slowest_tok_s')} ms {acc.get('token_ms')}")
    for w, r in (d.get("windows") or {}).items():
        print(f"  window {w}: plan {r.get('plan')} tok/s {r.get('streamed_tok_s')} vs_bound {r.get('vs_bound')} "
              f"x{r.get('vs_accelerate')} range {r.get('vs_accelerate_range')} medians x{r.get('vs_accelerate_median_tokens')} "
              f"b1 tokens ms {(r.get('batch1_tokens') or {}).get('token_ms')} hit {r.get('steady_prefetch_hit_rate')} "
              f"same_tokens {r.get('tokens_identical_to_resident')} decisions {r.get('window_decisions_by_batch')} "
              f"copy_idle {r.get('batch1_copy_idle')} gc_ms {r.get('gc_pauses_ms')} {r.get('attention', '')}")
        if r.get("tokens_identical_to_first_run"):
            print(f"    tokens identical to the first run: {r['tokens_identical_to_first_run']}")
for p in sorted(out.glob("shapes-*.json")):
    d = json.loads(p.read_text())
    print(f"read shapes vs dd ({d.get('bytes_each')} bytes a reading, {d.get('rounds')} rounds): "
          f"dd median {d.get('dd_median_gbps')} GB/s runs {d.get('runs')}")
    for s, r in (d.get("shapes") or {}).items():
        print(f"  {s}: {r}")
for p in sorted(out.glob("imports-*.json")):
    d = json.loads(p.read_text()).get("imports", {})
    print("imports alone (cache dropped):", d.get("alone_cold"))
    for spec, r in (d.get("beside_engine") or {}).items():
        print(f"imports beside engine {spec}:", json.dumps(r))
    print("imports beside dd:", d.get("beside_dd"))
for p in sorted(out.glob("paths-*.json")):
    d = json.loads(p.read_text())
    for cache, e in d.get("attach", {}).items():
        for kind in ("streaming", "resident"):
            r = e.get(kind, {})
            print(f"attach {kind} @{cache}: {r.get('load_model_ms')} ms phases {r.get('phases_ms')} "
                  f"forward_s {r.get('forward_s')} pin {r.get('streamed_ranges_pin_s')} "
                  f"whole_arena_pin {r.get('whole_arena_pin_s')} err {e.get('error')}")
    cold = d.get("shared_gpu_cold") or {}
    keys = ("alt", "error", "cache_dropped", "import_manifest_before", "imports_read_ahead", "packages_read_ahead",
            "daemon_start_to_hello_s", "request_at", "loaded_at",
            "request_to_loaded_s", "vs_best_raw", "phases_ms", "imports_thread_s", "imports_thread_cpu_s",
            "shallow_read_s", "daemon_load_s", "daemon_load_gbps", "daemon_side_after_request_s",
            "daemon_side_vs_best_raw", "daemon_log_pin")
    if cold:
        print("cold raw:", {k: cold.get(k) for k in ("python_odirect_gbps", "dd_direct_gbps", "best_raw_gbps", "raw_bytes_read")})
    more = [(f"cold after restart {i}", r) for i, r in enumerate(cold.get("after_restart_more") or [], 2)]
    for name, r in (("cold first-ever", cold), ("cold after restart", cold.get("after_restart")), *more,
                    ("cold after restart, alt", cold.get("after_restart_alt"))):
        if r:
            print(f"{name}:", json.dumps({k: r.get(k) for k in keys if k in r}))
            tl = [x for x in r.get("reads_timeline") or [] if isinstance(x[0], (int, float))]
            # The daemon's disk rate, GB/s a second after the request (bytes_read_nvme sampled).
            rates, j = [], 0
            for i, (ts, gb) in enumerate(tl):
                while j < i and ts - tl[j][0] > 1.0:
                    j += 1
                if ts >= 1.0 and ts - tl[j][0] > 0:
                    rates.append((round(ts, 1), round((gb - tl[j][1]) / (ts - tl[j][0]), 2)))
            print(f"  reads GB/s by second: {rates[::4]}; {tl[-1][1] if tl else None} GB read by {tl[-1][0] if tl else None} s")
    for k in ("skeleton_alone", "skeleton_alone_cold", "skeleton_beside_engine"):
        if k in cold:
            print(k, json.dumps(cold[k])[:600])
    print("goals:", d.get("goals"))
PY
