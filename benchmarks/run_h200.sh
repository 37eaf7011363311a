#!/usr/bin/env bash
# What one device session on the H200 runs (the device keeps nothing: results land in $OUT and
# are committed under benchmarks/results/). From the repository root on the GPU machine, with
# .whl/simpy-*.whl carried along (no package registry there):
#   bash benchmarks/run_h200.sh tests      # GPU tests, VMM replay against the simulator, calibration, step times
#   bash benchmarks/run_h200.sh sweep      # sweep scaling on the 16 cores (nothing else running)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
LOG=$OUT/h200_log.txt
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; nproc; } >> $LOG
step() { local name=$1; shift; echo "== $name: $*" >> $LOG; "$@" >> $LOG 2>&1; echo "== $name rc=$? $(date -u +%T)" >> $LOG; }
if [ "${1:-tests}" = tests ]; then
    python3 -m pytest tests/realgpu -q -p no:cacheprovider --import-mode=importlib -rfE > $OUT/gpu_tests.log 2>&1
    echo "== gpu tests rc=$? $(date -u +%T)" >> $LOG
    step vmm-replay timeout 120 python3 -m poollab gpu replay traces/data/llama1b_generate_slice.pickle.gz \
        -p best-fit -p torch-caching -p size-class -p best-fit:virtual=true -p vmm-stitch --device-kind vmm \
        --validate --sim --out /tmp/vmm --no-progress
    cp /tmp/vmm/summary.csv $OUT/gpu_vmm_replay_summary.csv
    step seg-replay timeout 120 python3 -m poollab gpu replay traces/data/llama1b_generate_slice.pickle.gz \
        -p best-fit -p paged -p torch-caching -p cupy-pool -b all --validate --sim --out /tmp/seg --no-progress
    cp /tmp/seg/summary.csv $OUT/gpu_segment_replay_summary.csv
    step calibrate timeout 120 python3 -m poollab gpu calibrate --out $OUT/costs_h200_calibrated.json
    step steptime timeout 230 python3 benchmarks/steptime/measure_grid.py
else
    step sweep timeout 300 python3 benchmarks/bench_sweep.py --workers 1,2,4,8,16 --out $OUT/sweep_h200.json
fi
