# Sourced by the bench/gpu_*.sh scripts: the GPU, torch/transformers and the commit measured,
# written to OUTDIR/machine.txt and printed.
machine_info() {  # OUTDIR [PYTHON]
  local py=${2:-python3}
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU";
    $py -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)';
    git log --oneline -1 2>/dev/null || true; } > "$1/machine.txt" 2>&1
  cat "$1/machine.txt"
}
