# Sourced by the bench/gpu_*.sh device scripts once they have set $out (and $steps): the output
# folder made absolute, unbuffered Python, and the two helpers they share.
#   lap MSG   -- "[Ns] MSG" since the script's start, printed and appended to $out/steps.txt
#   has STEP  -- true when STEP is in the comma-separated $steps
mkdir -p "$out"; out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
start=$(date +%s); status=0
lap() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$out/steps.txt"; }
has() { [[ ",$steps," == *,$1,* ]]; }
