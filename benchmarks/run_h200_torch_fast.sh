#!/usr/bin/env bash
# Issue 30's speed targets through the compiled build, on the H200 (about 4 minutes of GPU time).
# From the repository root on the GPU machine, with .whl/ carried (simpy, plotly, and Cython and
# setuptools for the machine's Python: the compiled build needs them):
#   bash benchmarks/run_h200_torch_fast.sh
# 0. the torch allocator's GPU tests;
# 1. build the compiled copy in /tmp/compiled (policies.testing.compiled.build_compiled_copy), or, with
#    a carried .compiled_so/ (the extension modules built elsewhere for this Python), copy the tree and them;
# 2. generate under PyTorch's allocator and under best-fit, size-class, paged and torch-caching,
#    each policy in this tree and then in the compiled copy, against one PyTorch run per round,
#    2 rounds (bench_torch_alloc.py --compiled), the per-call figures from the trampoline's samples;
#    (8 layers and 3 batch shapes: 18 workers in all, about 10 s each, to fit the budget).
# Measured on the CPU in the same way: bench_torch_alloc.py --calls --compiled DIR (benchmarks/RESULTS.md).
# Everything lands in $OUT: log.txt and torch_fast.tgz (the CSVs and JSON), nothing else.
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup torch_fast
step gpu-tests 90 python3 -m pytest tests/realgpu/test_torch_allocator.py -m gpu -q -p no:cacheprovider \
    --import-mode=importlib -rfE
if [ -d .compiled_so ]; then  # extension modules built elsewhere for this Python (cp312, x86-64): copy, not build
    step copy-compiled 60 bash -c "mkdir -p /tmp/compiled && tar -c --exclude=./.git --exclude=./.whl \
        --exclude=./.compiled_so . | tar -x -C /tmp/compiled && cp -r .compiled_so/. /tmp/compiled/"
else
    step build 100 python3 -c "from pathlib import Path; from policies.testing.compiled import build_compiled_copy; \
build_compiled_copy(Path('/tmp/compiled'), quiet=False)"
fi
POLICIES=${POLICIES:-"-p best-fit -p size-class -p paged -p torch-caching"}
if [ -f /tmp/compiled/realgpu/malloc_path.py ] && ls /tmp/compiled/realgpu/malloc_path*.so > /dev/null 2>&1; then
    COMPILED="--compiled /tmp/compiled"
else
    COMPILED=""; echo "no compiled copy: the interpreted tree alone" >> $LOG
fi
step generate 210 python3 benchmarks/bench_torch_alloc.py --rounds 2 --layers 8 --shapes 8x128,32x64,4x1500 \
    --worker-timeout 45 $POLICIES $COMPILED --out $R/generate
