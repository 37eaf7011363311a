#!/usr/bin/env bash
# Issue 30 on the H200: the torch allocator's GPU tests, then its speed targets measured ABAB
# (about 9 minutes of GPU time: a worker takes about 20 s on the H200, 8 layers, two shapes, two
# repeats; session 12's call, cut at 240 s, ran 12 of its 15 workers). From the repository root on the GPU machine, with .whl/ carried
# (simpy, plotly, narwhals; Cython and setuptools too if the compiled copy is built there):
#   bash benchmarks/run_h200_torch_fast.sh
# 0. the torch allocator's GPU tests (pluggable, paged over stitched ranges, mempool mode with CUDA
#    graphs) and gpu serve --cuda-graphs with a policy in mempool mode;
# 1. build the compiled copy in /tmp/compiled (policies.testing.compiled.build_compiled_copy), or, with
#    a carried .compiled_so/ (the extension modules built elsewhere for this Python), copy the tree and them;
# 2. generate under PyTorch's allocator and under each policy of the compiled copy (POLICIES), one
#    worker process per allocator and round, ROUNDS rounds in ABAB order (reversed every other round),
#    each shape timed REPEATS times in a worker; then one process running PyTorch's allocator and each
#    policy in mempool mode, round by round (bench_torch_alloc.py --compiled-only --mempool): paired
#    ratios to PyTorch's run of the same round, their median and spread, the per-call cost.
# Everything lands in $OUT: log_torch_fast.txt and torch_fast.tgz (the CSVs and JSON), nothing else.
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup torch_fast
# SKIP_TESTS=1: the generate rows alone (a call that ran tests/realgpu -m gpu already)
[ -n "${SKIP_TESTS:-}" ] || step gpu-tests ${TESTS_S:-120} python3 -m pytest tests/realgpu/test_torch_allocator.py tests/realgpu/test_serve.py -m gpu \
    -k "not test_gpu_serve_runs_pytorch" -q -p no:cacheprovider --import-mode=importlib -rfE
if [ -d .compiled_so ]; then  # extension modules built elsewhere for this Python (cp312, x86-64): copy, not build
    h200_compiled_copy
else
    step build 100 python3 -c "from pathlib import Path; from policies.testing.compiled import build_compiled_copy; \
build_compiled_copy(Path('/tmp/compiled'), quiet=False)"
fi
POLICIES=${POLICIES:-"-p best-fit -p size-class -p torch-caching -p paged"}
if [ -f /tmp/compiled/realgpu/malloc_path.py ] && ls /tmp/compiled/realgpu/malloc_path*.so > /dev/null 2>&1; then
    COMPILED="--compiled /tmp/compiled --compiled-only"
else
    COMPILED=""; echo "no compiled copy: the interpreted tree alone" >> $LOG
fi
step generate ${GENERATE_S:-400} python3 benchmarks/bench_torch_alloc.py --rounds ${ROUNDS:-3} --repeats ${REPEATS:-2} \
    --layers 8 --shapes ${SHAPES:-8x128,4x1500} --worker-timeout 45 --mempool $POLICIES $COMPILED --out $R/generate
