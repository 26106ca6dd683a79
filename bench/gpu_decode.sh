#!/usr/bin/env bash
# Decode on a CUDA machine in one go: bench/decode.py (8B shape) while the C++ core builds, then
# the decode GPU tests, then the compiled peer (longest, last).
#   bash bench/gpu_decode.sh OUTDIR [ARCH] [extra bench/decode.py arguments]
set -u -o pipefail
out=${1:-/tmp/flash-decode}; arch=${2:-llama}; shift 2 2>/dev/null || shift $#
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
root=$(pwd)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
# The bench needs no C++ core: run it from a package tree of links while the core builds.
pkg=$(mktemp -d)/deepseek_flash; mkdir -p "$pkg"
for f in deepseek_flash/*; do ln -s "$root/$f" "$pkg/"; done
for d in client daemon decode sysfs_shim; do ln -s "$root/$d" "$pkg/$d"; done
nice -n 19 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 &
build=$!
(cd bench && PYTHONPATH=$(dirname "$pkg") python3 decode.py --arch "$arch" --skip-peer --output "$out/decode_$arch.json" --out-dir "$out" "$@") > "$out/decode_$arch.log" 2>&1
echo "bench: $?"; tail -3 "$out/decode_$arch.log"
# The peer compiles for a minute or more (CPU): start it now; its timed part records when it ran.
(cd bench && PYTHONPATH=$(dirname "$pkg") python3 decode.py --arch "$arch" --only-peer --batches 1 --output "$out/peer_$arch.json") > "$out/peer_$arch.log" 2>&1 &
peer=$!
wait $build && echo "build: ok" || { echo "build failed"; tail -20 "$out/build.log"; }
python3 -m pytest -q -m gpu tests/decode/test_decode_load_model.py tests/decode/test_decode_engine.py -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
echo "tests_end $(date +%s.%N)" | tee -a "$out/machine.txt"
echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | head -20
wait $peer; echo "peer: $?"; tail -5 "$out/peer_$arch.log"
