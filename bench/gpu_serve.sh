#!/usr/bin/env bash
# bench/serve.py on a CUDA machine in one go: the serve extra's wheels (FastAPI, uvicorn, uvloop,
# httptools and the pydantic stack, carried in .whl/ since the machine has no network -- docs/benchmarks.md, "serve"),
# the C++ core, the GPU tests of the decode step's CUDA graphs, then the bench against the scheduler
# and FIFO. About 2.5 minutes on the H200 (the bench itself is limited to 160 s -- ~115 s expected:
# the model ~20 s, 200 unloaded requests ~10 s, the two load phases ~35-40 s each with 10 s waves,
# enough for ~100 L0 requests, so that their p99 is not their maximum; its JSON is saved after
# every phase).
#   bash bench/gpu_serve.sh OUTDIR [ARCH] [extra bench/serve.py arguments]
set -u -o pipefail
out=${1:-/tmp/flash-serve}; arch=${2:-llama}; shift 2 2>/dev/null || shift $#
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c 'import fastapi, uvicorn' || { echo "FastAPI/uvicorn missing: carry .whl/ (docs/benchmarks.md, serve)"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers, fastapi, uvicorn; print("torch", torch.__version__, "transformers", transformers.__version__, "fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__)'
  python3 -c 'import importlib.util as u; print("uvloop", u.find_spec("uvloop") is not None, "httptools", u.find_spec("httptools") is not None)'
  nproc; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
# The C++ core: built here unless this tree's build is already there and newer than its sources
# (a combined run builds first; the build is then ~15 s saved from this script's time).
core=$(python3 -c 'import os, deepseek_flash._core as c; print(os.path.realpath(c.__file__))' 2>/dev/null)
if [ -n "$core" ] && [ "${core#$(pwd -P)/}" != "$core" ] && [ -z "$(find ext setup.py -newer "$core" 2>/dev/null)" ]; then
  echo "C++ core already built: $core" > "$out/build.log"
else
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
    || { echo "build failed"; tail -20 "$out/build.log"; exit 1; }
fi
# The decode step's CUDA graphs give the eager step's tokens (tests/serve/test_graphs.py, -m gpu;
# ~20-30 s), then the bench (its JSON says how the batch decoded: engine_decode, flash.decode).
timeout 90 python3 -m pytest -q -m gpu tests/serve/test_graphs.py -p no:cacheprovider -rs > "$out/gpu_tests.log" 2>&1
echo "gpu tests: $? -- $(tail -1 "$out/gpu_tests.log")"
(cd bench && timeout 160 python3 serve.py --arch "$arch" --device cuda:0 --wave-seconds 10 --drain-seconds 25 \
   --output "$out/serve_$arch.json" --png-dir "$out/png" "$@") > "$out/serve_$arch.log" 2>&1
rc=$?
echo "bench: $rc"
tail -6 "$out/serve_$arch.log"
exit $rc
