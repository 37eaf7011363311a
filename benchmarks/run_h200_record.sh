#!/usr/bin/env bash
# Session 13's repeated engine recordings for issue 31 (the engine's run-to-run spread per condition,
# cold against warm starts, and whether its 0.5-0.7 s pauses are Python's garbage collector), on the
# H200 in at most 9 minutes (the device keeps nothing: $OUT gets log_record.txt and record.tgz, and
# engine_s13.tgz after every run, so a call cut short keeps the runs done). From the repository root
# on the GPU machine, with .whl/ (simpy, plotly) carried beside it or in it, and
# ../shared/data/engine/synth_mixed_60s.csv copied to .data/ (bench_serve.py's SYNTH):
#   bash benchmarks/run_h200_record.sh            (DRY=1: the plumbing only, no engine: a dry run)
# Runs, interleaved so that a drift of the machine over the call falls on every condition alike
# (bench_serve.py list: each about 60-75 s with the engine's start): Azure code x2 (b, c: with session
# 11's x2, three), the synthetic trace's first 10 s three times, Azure code x1 cold (--no-warmup; b, c:
# with the shared cold recording, three). Every Python process logs its collections
# (benchmarks/gc_log/sitecustomize.py) into the run's gc/ folder.
# Session 16 (issue 31: the engine's slow stretches), about 5 minutes:
#   MONITOR=1 RECORD_S=300 BUNDLE=engine_s16 NAMES="synth_mixed_10s_x1_d azure_code_60s_x1_d \
#       synth_mixed_10s_x1_e azure_code_60s_x1_e" bash benchmarks/run_h200_record.sh
# Session 17 (issue 31: four more repeats of the same conditions), about 6 minutes:
#   MONITOR=1 RECORD_S=520 BUNDLE=engine_s17 NAMES="synth_mixed_10s_x1_f azure_code_60s_x1_f \
#       synth_mixed_10s_x1_g azure_code_60s_x1_g" bash benchmarks/run_h200_record.sh
set -u
[ -d .whl ] || { [ -d ../.whl ] && ln -s ../.whl .whl; }
. "$(dirname "$0")/h200_lib.sh"
T_START=$(date +%s)
if [ -n "${DRY:-}" ]; then  # h200_setup installs wheels and asks the GPU: a dry run here skips it
    H200_NAME=record; OUT=${OUT:-/tmp/out_record}; mkdir -p $OUT; R=/tmp/res_record; mkdir -p $R
    LOG=$R/log.txt; trap h200_finish EXIT; DRY_FLAG=--dry-run
else
    h200_setup record; DRY_FLAG=
fi
[ -f .data/synth_mixed_60s.csv ] || echo "missing .data/synth_mixed_60s.csv (the synthetic runs fail)" >> $LOG
export POOLLAB_GC_LOG_DIR=$R/gc PYTHONPATH=$PWD/benchmarks/gc_log:${PYTHONPATH:-.}
python3 -c "import sitecustomize, gc; print('gc log:', sitecustomize.__file__, gc.get_threshold())" >> $LOG 2>&1
# 540 s in all (RECORD_S overrides it): what the setup took comes off the recordings' budget; 15 s
# kept for the bundles
BUDGET=$((${RECORD_S:-540} - 15 - ($(date +%s) - T_START)))
echo "recording budget ${BUDGET} s" >> $LOG
# NAMES overrides the runs (session 14: NAMES="synth_mixed_60s_x1_b synth_mixed_60s_x2_b")
NAMES=${NAMES:-azure_code_60s_x2_b synth_mixed_10s_x1_a azure_code_60s_x1_cold_b \
    synth_mixed_10s_x1_b azure_code_60s_x2_c synth_mixed_10s_x1_c azure_code_60s_x1_cold_c}
# MONITOR=1 (session 16): the GPU's clocks, power and clock-event reasons every 100 ms
# (gpu_clocks.csv, wall-clock stamps: each run's gc/*.csv rows pair perf_counter with the wall clock)
# and the host's CPU use, run queue and steal time every second (vmstat.txt), beside the runs
MONITORS=
if [ -n "${MONITOR:-}" ] && [ -z "$DRY_FLAG" ]; then
    mkdir -p $R/eng
    REASONS=clocks_event_reasons.active
    nvidia-smi --help-query-gpu | grep -q "$REASONS" || REASONS=clocks_throttle_reasons.active
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,$REASONS \
        --format=csv -lms 100 > $R/eng/gpu_clocks.csv 2>> $LOG & MONITORS="$MONITORS $!"
    vmstat -t 1 > $R/eng/vmstat.txt 2>> $LOG & MONITORS="$MONITORS $!"
fi
step record $((BUDGET + 10)) python3 benchmarks/bench_serve.py record $NAMES \
    --out $R/eng --bundle $OUT/${BUNDLE:-engine_s13}.tgz --budget-s $BUDGET $DRY_FLAG
for pid in $MONITORS; do kill $pid 2>/dev/null; done
ls -R $R/eng | head -80 >> $LOG
