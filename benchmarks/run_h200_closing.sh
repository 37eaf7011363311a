#!/usr/bin/env bash
# The closing H200 call on a merged tree (sessions 13-14; at most about 9.5 minutes), most wanted
# first, so that a cut run still brings back the earlier steps:
#   1. issue 30: the shared snapshot's calls through the compiled trampoline on this host's CPU, then
#      generate under PyTorch's allocator and compiled best-fit and size-class in paired rounds
#      (benchmarks/run_h200_paired.sh's steps, with a shorter budget);
#   2. issue 33: simulate of the conversation hour, and the million-event replay before/after (.before/
#      holds the tree issue 33 was filed against, 6dfe9d0; replay_peaks.py names the process at the
#      peak);
#   3. every GPU test (tests/realgpu -m gpu) in the compiled copy;
#   4. the step-time grid (benchmarks/steptime/measure_grid.py) cut to STEPTIME_BUDGET_S, a smoke run.
# Carry .whl, .compiled_so (cp312 modules of this tree), .data (AzureLLMInferenceTrace_conv.csv,
# llama1b_generate_mixed.pickle.gz), .before:   bash benchmarks/run_h200_closing.sh
# ONLY="simulate million gpu-tests" runs just those steps (a re-check after a late change).
# PAIRED_EXTRA="--floor" adds the floor worker to the paired rounds (benchmarks/torch_floor_alloc.cpp:
# exact-size C++ free lists behind PyTorch's pluggable interface, no Python).
# READ_BEFORE=.s22 (a carried tree) adds the read-compare step after million.
set -u
. "$(dirname "$0")/h200_lib.sh"
wanted() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
h200_setup closing
{ echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>&1)"
  lscpu | grep -E "^Model name|^CPU\(s\)|MHz" ; } >> $LOG 2>&1
h200_compiled_copy
# issue 30: the snapshot's calls through the trampoline on this host's CPU, then generate's paired
# rounds (one pinned worker per allocator, shuffled order, the bootstrap verdict): what
# benchmarks/run_h200_paired.sh runs, with a shorter budget
TRACE=$(realpath .data/llama1b_generate_mixed.pickle.gz)
wanted calls-host && step calls-host 40 bash -c "cd /tmp/compiled && PYTHONPATH=/tmp/site:/tmp/compiled python3 benchmarks/bench_torch_alloc.py \
    --calls 120000 --rounds 2 --trace $TRACE --release-gil -p best-fit -p size-class --out $R/calls"
wanted paired && step paired ${PAIRED_S:-175} python3 benchmarks/bench_torch_alloc.py --persistent --rounds ${ROUNDS:-60} \
    --budget-s ${BUDGET_S:-150} --warmup-rounds 2 --layers 8 --shapes 8x128,4x1500 --worker-timeout 90 \
    -p best-fit -p size-class --compiled /tmp/compiled --compiled-only ${PAIRED_EXTRA:-} --out $R/generate
wanted simulate && step simulate 70 python3 benchmarks/bench_simulate.py .data/AzureLLMInferenceTrace_conv.csv --mode repeat --scale 1 \
    --repeat 1 --target 1000 -p paged -p best-fit
# the hour's simulate against an earlier tree side by side (SIM_BEFORE: a tree carried in, e.g. the
# session's starting commit as `git archive`; results must be identical, CPU best of 3 alternating)
wanted simulate-compare && step simulate-compare ${COMPARE_S:-150} python3 benchmarks/compare_simulate.py ${SIM_BEFORE:-.before} \
    .data/AzureLLMInferenceTrace_conv.csv -p paged -p best-fit --repeat 3
# the phases twice: as the command runs, then with numpy's BLAS held to one thread (its threads
# spin on every core a while after the import, beside the read ahead: the first round's read)
wanted million && step million ${MILLION_S:-200} bash -c "python3 benchmarks/make_million_snapshot.py --source .data/llama1b_generate_mixed.pickle.gz \
    && python3 benchmarks/bench_user_speed.py --before .before --rows replay --repeat ${MILLION_REPEAT:-2} \
    && python3 benchmarks/replay_peaks.py /tmp/llama1b_generate_1m.pickle.gz \
    && python3 benchmarks/replay_phases.py /tmp/llama1b_generate_1m.pickle.gz --repeat 2 \
    && OPENBLAS_NUM_THREADS=1 python3 benchmarks/replay_phases.py /tmp/llama1b_generate_1m.pickle.gz --repeat 2"
# the million replay's read (its critical path's first part) against an earlier tree side by side
# (READ_BEFORE: a tree carried in that reads ahead, session 20 on, e.g. the session's starting commit
# as `git archive`; .before has no read ahead): the parsed snapshots must be identical
wanted read-compare && [ -n "${READ_BEFORE:-}" ] && step read-compare ${READ_COMPARE_S:-90} bash -c "python3 benchmarks/make_million_snapshot.py \
    --source .data/llama1b_generate_mixed.pickle.gz && python3 benchmarks/compare_read.py $READ_BEFORE /tmp/llama1b_generate_1m.pickle.gz --repeat 5"
wanted gpu-tests && step gpu-tests ${TESTS_S:-150} bash -c "cd /tmp/compiled && PYTHONPATH=/tmp/site:/tmp/compiled python3 -m pytest \
    tests/realgpu -m gpu -v -p no:cacheprovider -rfE"
# the step-time scripts' shared module (benchmarks/steptime/llama8b.py), a short grid as a smoke run
wanted steptime && step steptime 90 env STEPTIME_BUDGET_S=${STEPTIME_BUDGET_S:-20} OUT=$R python3 benchmarks/steptime/measure_grid.py
