#!/usr/bin/env bash
# Session 13's one closing H200 call on the merged tree (at most about 9.5 minutes), most wanted
# first, so that a cut run still brings back the earlier steps:
#   1. issue 30: generate under PyTorch's allocator and compiled best-fit and size-class (pluggable,
#      ABAB, with each worker's malloc breakdown) and the trace's calls through the trampoline on this
#      host's CPU (what benchmarks/run_h200_malloc.sh runs, without its GPU-test step);
#   2. issue 33: simulate of the conversation hour, and the million-event replay before/after (.before/
#      holds the tree issue 33 was filed against, 6dfe9d0);
#   3. every GPU test (tests/realgpu -m gpu) in the compiled copy.
# Carry .whl, .compiled_so (cp312 modules of this tree), .data (AzureLLMInferenceTrace_conv.csv,
# llama1b_generate_mixed.pickle.gz), .before:   bash benchmarks/run_h200_closing_s13.sh
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup closing
{ echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>&1)"
  lscpu | grep -E "^Model name|^CPU\(s\)|MHz" ; } >> $LOG 2>&1
step copy-compiled 30 bash -c "mkdir -p /tmp/compiled && tar -c --exclude=./.git --exclude=./.whl --exclude=./.data \
    --exclude=./.before --exclude=./.compiled_so . | tar -x -C /tmp/compiled && cp -r .compiled_so/. /tmp/compiled/"
step which-build 20 bash -c "cd /tmp/compiled && PYTHONPATH=/tmp/site:/tmp/compiled python3 -c \
    'import realgpu.malloc_path as m, policies.best_fit as b; print(m.__file__, b.__file__)'"
step generate ${GENERATE_S:-140} python3 benchmarks/bench_torch_alloc.py --rounds ${ROUNDS:-2} --repeats 2 --layers 8 \
    --shapes 8x128,4x1500 --worker-timeout 45 -p best-fit -p size-class --compiled /tmp/compiled --compiled-only \
    --out $R/generate
step calls-host 40 bash -c "cd /tmp/compiled && PYTHONPATH=/tmp/site:/tmp/compiled python3 benchmarks/bench_torch_alloc.py \
    --calls 120000 --rounds 2 --trace $(realpath .data/llama1b_generate_mixed.pickle.gz) --release-gil -p best-fit -p size-class --out $R/calls"
step simulate 70 python3 benchmarks/bench_simulate.py .data/AzureLLMInferenceTrace_conv.csv --mode repeat --scale 1 \
    --repeat 1 --target 1000 -p paged -p best-fit
step million ${MILLION_S:-110} bash -c "python3 benchmarks/make_million_snapshot.py --source .data/llama1b_generate_mixed.pickle.gz \
    && python3 benchmarks/bench_user_speed.py --before .before --rows replay --repeat 2"
step gpu-tests ${TESTS_S:-150} bash -c "cd /tmp/compiled && PYTHONPATH=/tmp/site:/tmp/compiled python3 -m pytest \
    tests/realgpu -m gpu -v -p no:cacheprovider -rfE"
