#!/usr/bin/env bash
# Issue 33 on the H200 host's 16 cores: `simulate` of the Azure 2023 conversation hour, before and
# after side by side (about 3 minutes, CPU only: the target there is >= 1,000x real time per policy).
# From the repository root on the GPU machine, with .whl/ (simpy, plotly, narwhals),
# .data/AzureLLMInferenceTrace_conv.csv (the public trace) and .before/ (the code before:
# `git archive 43c57ca | tar -x -C .before`) carried:
#   bash benchmarks/run_h200_simulate.sh
# Rounds alternate before, after, after, before (ROUNDS pairs); each is bench_simulate.py's own
# best of --repeat 2. Everything lands in $OUT: log_simulate.txt and simulate.tgz.
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup simulate
TRACE=$PWD/.data/AzureLLMInferenceTrace_conv.csv
bench() {  # bench LABEL TREE: the bench of TREE, its modules first on the path
    step "$1" ${BENCH_S:-80} bash -c "cd $2 && PYTHONPATH=/tmp/site:. python3 benchmarks/bench_simulate.py $TRACE \
        --mode repeat --scale 1 --repeat 2 --target 1000 ${POLICIES:--p paged -p best-fit}"
}
for round in $(seq ${ROUNDS:-2}); do
    if [ $((round % 2)) = 1 ]; then bench before-$round .before; bench after-$round .
    else bench after-$round .; bench before-$round .before; fi
done
