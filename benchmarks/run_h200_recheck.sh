#!/usr/bin/env bash
# One closing H200 call on a merged tree (about 9 minutes): the GPU tests, the torch allocator's
# generate speed (ABAB rounds, compiled build), and the CPU-bound speed targets on the host's 16 cores.
# From the repository root on the GPU machine, with .whl/ (simpy, plotly, narwhals), .compiled_so/
# (the compiled build's cp312 extension modules, built elsewhere by
# policies.testing.compiled.build_compiled_copy) and .data/AzureLLMInferenceTrace_conv.csv (the
# public Azure 2023 conversation trace) and .data/llama1b_generate_mixed.pickle.gz (the shared snapshot),
# .before/ (a checkout of the code before, for the million-event row) carried:
#   bash benchmarks/run_h200_recheck.sh
# Everything lands in $OUT: log_recheck.txt and recheck.tgz.
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup recheck
# 1. every GPU test, one line per test so that a cut run still says which passed
step gpu-tests ${TESTS_S:-170} python3 -m pytest tests/realgpu -m gpu -v -p no:cacheprovider --import-mode=importlib -rfE
# 2. generate under PyTorch's allocator and the compiled policies, ABAB, then mempool mode
h200_compiled_copy
step generate ${GENERATE_S:-210} python3 benchmarks/bench_torch_alloc.py --rounds ${ROUNDS:-3} --repeats 2 --layers 8 \
    --shapes 8x128,4x1500 --worker-timeout 45 --mempool ${POLICIES:--p best-fit -p size-class} \
    --compiled /tmp/compiled --compiled-only --out $R/generate
# 3. simulate of the conversation hour on these cores (issue 33: >= 1,000x real time per policy)
step simulate 70 python3 benchmarks/bench_simulate.py .data/AzureLLMInferenceTrace_conv.csv --mode repeat --scale 1 \
    --repeat 1 --target 1000 -p paged -p best-fit
# 4. the million-event replay under five policies on 16 cores, before (a checkout carried in .before/)
#    and after side by side (bench_user_speed.py: wall, CPU, peak memory of the command's processes)
step million ${MILLION_S:-100} bash -c "python3 benchmarks/make_million_snapshot.py --source .data/llama1b_generate_mixed.pickle.gz \
    && python3 benchmarks/bench_user_speed.py --before .before --rows replay --repeat 2"
