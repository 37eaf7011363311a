#!/usr/bin/env bash
# Issue 30's two missed "Fast" targets in one device call (at most 300 s; builds nothing): one
# allocator call at most 1.5 us under a real generate, and generate at most 1.05x PyTorch's own
# allocator, settled by paired rounds. From the repository root on the GPU machine, with .whl/
# (simpy, plotly, narwhals), .compiled_so/ (this tree's cp312 extension modules, built elsewhere
# by policies.testing.compiled.build_compiled_copy) and .data/ (llama1b_generate_mixed.pickle.gz;
# without it the bundled slice of the same run) carried:
#   bash benchmarks/run_h200_paired.sh
# 1. no GPU: the snapshot's requests through the compiled trampoline on a host-backed pool, GIL
#    released as PyTorch calls it (this host's per-call cost with nothing else running; ~30 s);
# 2. bench_torch_alloc.py --persistent: PyTorch's allocator and compiled best-fit and size-class
#    (pluggable mode), one worker each for the whole run, all pinned to the same two CPUs, the
#    model built and warmed once; then up to ROUNDS rounds (2 untimed first), each running every
#    worker's generate (8x128 and 4x1500, 16 new tokens, 8 layers) one at a time in a shuffled
#    order, until BUDGET_S: per policy the median of the per-round ratios with a bootstrap 95 %
#    interval (met / missed / not settled against 1.05x), the per-round malloc and free means the
#    same way against 1.5 us, tokens compared with PyTorch's round by round, and generate's malloc
#    breakdown over every timed round (calls over 10 us, new segments, GC, the trampoline's split).
# Everything lands in $OUT: log_paired.txt and paired.tgz ($R: calls/torch_alloc_calls.csv,
# generate/torch_alloc_verdict.csv, torch_alloc_rounds.csv, torch_alloc_breakdown.csv,
# torch_alloc_summary.csv, torch_alloc_runs.csv, torch_alloc_paired.json, worker_logs/).
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup paired
{ echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>&1)"
  lscpu | grep -E "^Model name|^CPU\(s\)|MHz" ; } >> $LOG 2>&1
h200_compiled_copy
TRACE=.data/llama1b_generate_mixed.pickle.gz
[ -f $TRACE ] || TRACE=traces/data/llama1b_generate_slice.pickle.gz  # the bundled slice of the same run
step calls-host 40 bash -c "cd /tmp/compiled && PYTHONPATH=/tmp/site:/tmp/compiled python3 benchmarks/bench_torch_alloc.py \
    --calls 120000 --rounds 2 --trace $(realpath $TRACE) --release-gil -p best-fit -p size-class --out $R/calls"
step paired ${PAIRED_S:-210} python3 benchmarks/bench_torch_alloc.py --persistent --rounds ${ROUNDS:-60} \
    --budget-s ${BUDGET_S:-190} --warmup-rounds 2 --layers 8 --shapes 8x128,4x1500 --worker-timeout 90 \
    -p best-fit -p size-class --compiled /tmp/compiled --compiled-only --out $R/generate
