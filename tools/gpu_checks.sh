#!/usr/bin/env bash
# The checks that need a CUDA GPU, which CI (CPU only) cannot run: the
# `cuda`-marked tests, the doctor, the GPU benchmarks, then the rest of the
# suite with CUDA visible. Each part has its own time limit and its own log in
# OUTDIR, so a part that hangs or fails leaves the others' results.
# Usage, from the repository root on a GPU machine with torch installed:
#   bash tools/gpu_checks.sh OUTDIR
set -u
out=${1:?usage: bash tools/gpu_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

part() {  # part LOG SECONDS COMMAND...: run COMMAND with a limit, appending to OUTDIR/LOG
  local name=$1 log=$out/$1 limit=$2 begin
  shift 2
  begin=$(date +%s)
  echo "\$ $*" >>"$log"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "[rc=$rc, $(($(date +%s) - begin)) s, $(date -u +%FT%TZ)]" >>"$log"
  echo "$name: rc=$rc after $(($(date +%s) - begin)) s: $*"
}

part env.log 60 bash -c "nvidia-smi -L; $py -c 'import sys, torch; print(sys.version); \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'"
part cuda_tests.log 180 "$py" -m pytest -m cuda -q -rfE -p no:cacheprovider tests
part env.log 90 "$py" -m gradsafe doctor
part bench_cuda_graphs.log 150 bash -c "for b in capture_order one_microbatch ownership \
split_stages; do $py benchmarks/cuda_graphs_\$b.py || echo \"[\$b failed: rc=\$?]\"; done"
part bench_memory.log 90 "$py" benchmarks/pipelining_memory.py --device cuda
part bench_split.log 150 "$py" benchmarks/pipelining_split.py --device cuda --section 2 --section 6
# gradsafe verify on the GPU: examples/verify_transformer.py's twelve_blocks moved to CUDA.
factory=$(mktemp -d)
cat >"$factory/gpu_factory.py" <<'PY'
from examples.verify_transformer import twelve_blocks


def twelve_blocks_cuda():  # type: ignore[no-untyped-def]
    stages, microbatches, loss = twelve_blocks()
    return [s.cuda() for s in stages], [tuple(t.cuda() for t in m) for m in microbatches], loss
PY
for dtype in float64 float32; do
  part verify.log 90 env PYTHONPATH="$PWD:$factory" "$py" -m gradsafe verify --dtype $dtype \
    --time gpu_factory:twelve_blocks_cuda
done
part suite.log 150 "$py" -m pytest -m "not cuda" -q -rfE -p no:cacheprovider -n 12 tests
