#!/usr/bin/env bash
# Issue 30's speed targets through the compiled build, on the H200 (about 4 minutes of GPU time).
# From the repository root on the GPU machine, with .whl/ carried (simpy, plotly, and Cython and
# setuptools for the machine's Python: the compiled build needs them):
#   bash benchmarks/run_h200_torch_fast.sh
# 1. build the compiled copy in /tmp/compiled (policies.testing.compiled.build_compiled_copy);
# 2. generate under PyTorch's allocator and under best-fit, size-class, paged and torch-caching,
#    each policy in this tree and then in the compiled copy, against one PyTorch run per round,
#    2 rounds (bench_torch_alloc.py --compiled), the per-call figures from the trampoline's samples;
#    (8 layers and 3 batch shapes: 18 workers in all, about 10 s each, to fit the budget).
# Measured on the CPU in the same way: bench_torch_alloc.py --calls --compiled DIR (benchmarks/RESULTS.md).
# Everything lands in $OUT: log.txt and torch_fast.tgz (the CSVs and JSON), nothing else.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
R=/tmp/res; mkdir -p $R; LOG=$R/log.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name: $* ($(date -u +%T))" >> $LOG
         timeout $limit "$@" >> $LOG 2>&1; echo "== $name rc=$? $(date -u +%T)" >> $LOG; cp $LOG $OUT/log.txt; }
finish() { cp $LOG $OUT/log.txt; tar -czf $OUT/torch_fast.tgz -C $R .; }
trap finish EXIT
trap 'exit 143' TERM INT
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c "import torch, transformers, Cython; print(torch.__version__, transformers.__version__, Cython.__version__)"
  date -u; } >> $LOG 2>&1
step build 100 python3 -c "from pathlib import Path; from policies.testing.compiled import build_compiled_copy; \
build_compiled_copy(Path('/tmp/compiled'), quiet=False)"
POLICIES="-p best-fit -p size-class -p paged -p torch-caching"
if [ -f /tmp/compiled/realgpu/malloc_path.py ] && ls /tmp/compiled/realgpu/malloc_path*.so > /dev/null 2>&1; then
    COMPILED="--compiled /tmp/compiled"
else
    COMPILED=""; echo "no compiled copy: the interpreted tree alone" >> $LOG
fi
step generate 210 python3 benchmarks/bench_torch_alloc.py --rounds 2 --layers 8 --shapes 8x128,32x64,4x1500 \
    --worker-timeout 45 $POLICIES $COMPILED --out $R/generate
