#!/usr/bin/env bash
# Issue 30's one missed target on the H200: a PyTorch allocator call at most 1.5 us, malloc
# included (about 4 minutes of device time; builds nothing). From the repository root on the GPU
# machine, with .whl/ (simpy, plotly, narwhals) and .compiled_so/ (the compiled build's cp312
# extension modules of this tree, built elsewhere by policies.testing.compiled.build_compiled_copy)
# carried, and optionally .data/llama1b_generate_mixed.pickle.gz (the shared snapshot; without it
# the bundled slice of the same run):
#   bash benchmarks/run_h200_malloc.sh
# 0. this host: its clock source and CPU (the trampoline reads the clock twice a call);
# 1. the torch allocator's GPU tests in the compiled copy (/tmp/compiled: the tree and .compiled_so/);
# 2. no GPU: a real generate's requests (the snapshot's sizes, order and lifetimes) through the
#    trampoline on a host-backed pool, without the GIL as PyTorch calls it, compiled: this host's
#    per-call cost with none of the GPU run's other work around it, and where the time goes;
# 3. generate under PyTorch's allocator and under compiled best-fit and size-class (pluggable mode),
#    one worker process per allocator and round, ABAB: the paired ratio to PyTorch's run of the same
#    round, and per policy generate's malloc/free mean and p50 through the trampoline with the
#    breakdown (calls over 10 us and their share of the time, calls without the GIL, mallocs off the
#    hot path, new segments, GC passes, the trampoline's split of every 16th malloc, what a clock
#    read, a capture check and a monitor sample cost here).
# Everything lands in $OUT: log_malloc.txt and malloc.tgz (CSVs and JSON).
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup malloc
{ echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>&1)"
  lscpu | grep -E "^Model name|^CPU\(s\)|MHz" ; } >> $LOG 2>&1
h200_compiled_copy
step gpu-tests ${TESTS_S:-100} bash -c "cd /tmp/compiled && PYTHONPATH=/tmp/site:/tmp/compiled python3 -m pytest \
    tests/realgpu/test_torch_allocator.py -m gpu -v -p no:cacheprovider -rfE"
TRACE=.data/llama1b_generate_mixed.pickle.gz
[ -f $TRACE ] || TRACE=traces/data/llama1b_generate_slice.pickle.gz  # the bundled slice of the same run
step calls-host 40 bash -c "cd /tmp/compiled && PYTHONPATH=/tmp/site:/tmp/compiled python3 benchmarks/bench_torch_alloc.py \
    --calls 120000 --rounds 2 --trace $(realpath $TRACE) --release-gil -p best-fit -p size-class --out $R/calls"
step generate ${GENERATE_S:-140} python3 benchmarks/bench_torch_alloc.py --rounds ${ROUNDS:-2} --repeats 2 --layers 8 \
    --shapes 8x128,4x1500 --worker-timeout 45 -p best-fit -p size-class --compiled /tmp/compiled --compiled-only \
    --out $R/generate
