#!/usr/bin/env bash
# What one device session on the H200 runs (the device keeps nothing: results land in $OUT and
# are committed under benchmarks/results/). From the repository root on the GPU machine, with
# .whl/simpy-*.whl carried along (no package registry there):
#   bash benchmarks/run_h200.sh tests      # GPU tests, VMM replay against the simulator, calibration, step times
#   bash benchmarks/run_h200.sh sweep      # sweep scaling on the 16 cores (nothing else running)
#   bash benchmarks/run_h200.sh soak       # the soak, one process per policy spec, and the torch.cuda
#                                          # baseline on the recorded server snapshots
#   bash benchmarks/run_h200.sh speed      # issue 16 on quiet cores: sweeps on 16 workers (400 cells), the
#                                          # step loop on the Azure conversation trace (carried in .data/,
#                                          # git-ignored)
#   bash benchmarks/run_h200.sh final      # GPU tests on the final tree, and the replay harness against the
#                                          # bare loop on quiet cores (full snapshot carried in .data/)
#   bash benchmarks/run_h200.sh compiled   # Cython against pure Python (carried .whl/cython*), and
#                                          # GpuPool.malloc of both builds against CuPy's MemoryPool
#   bash benchmarks/run_h200.sh malloc     # GPU tests in both builds, GpuPool.malloc (realgpu.malloc_path) of both
#                                          # builds against CuPy's MemoryPool (one CSV), and its C stand-in bench
#   bash benchmarks/run_h200.sh compiled-replay  # GPU tests, then Cython against pure Python on the replay
#                                          # (bench_compiled.py, the battery against the compiled copy first)
#   bash benchmarks/run_h200.sh recheck    # after a change to the core, in one call: GPU tests in both builds,
#                                          # GpuPool.malloc of both builds against CuPy (two rounds, one CSV),
#                                          # the replay harness, and pure against compiled on the replay
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
LOG=$OUT/h200_log.txt
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; nproc; } >> $LOG
step() { local name=$1; shift; echo "== $name: $*" >> $LOG; "$@" >> $LOG 2>&1; echo "== $name rc=$? $(date -u +%T)" >> $LOG; }
# GPU tests in this tree, then in a compiled copy built in /tmp/compiled
gpu_tests_both_builds() {
    python3 -m pytest tests/realgpu -q -p no:cacheprovider --import-mode=importlib -rfE > $OUT/gpu_tests.log 2>&1
    echo "== gpu tests rc=$? $(date -u +%T)" >> $LOG
    step build python3 -c "from pathlib import Path; from policies.testing.compiled import build_compiled_copy; \
build_compiled_copy(Path('/tmp/compiled'), quiet=False)"
    (cd /tmp/compiled && PYTHONPATH=/tmp/site:. python3 -m pytest tests/realgpu -q -p no:cacheprovider \
        --import-mode=importlib -rfE > $OUT/gpu_tests_compiled.log 2>&1; echo "== compiled gpu tests rc=$?" >> $LOG)
}
# GpuPool.malloc of both builds against CuPy's MemoryPool, alternating twice, in one CSV (the
# device hands back 8 files): each run's rows with its build and run (``round`` is bench_gpu's
# own: the two rounds within a run)
roundtrips_both_builds() {
    local RT="--stages roundtrip --iterations 20000 --policy paged --policy size-class --policy best-fit"
    for round in 1 2; do
        step roundtrip-pure-$round timeout 120 python3 benchmarks/bench_gpu.py --out /tmp/rt/pure_$round $RT
        (cd /tmp/compiled && PYTHONPATH=/tmp/site:. step roundtrip-compiled-$round timeout 120 \
            python3 benchmarks/bench_gpu.py --out /tmp/rt/compiled_$round $RT)
    done
    python3 -c "import glob, pandas as pd; pd.concat([pd.read_csv(f).assign(build=f.split('/')[3].split('_')[0], \
run=int(f.split('/')[3].split('_')[1])) for f in sorted(glob.glob('/tmp/rt/*/gpu_roundtrip.csv'))]).to_csv(\
'$OUT/gpu_roundtrip_recheck.csv', index=False)" >> $LOG 2>&1
}
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
elif [ "$1" = soak ]; then
    # 10^6 operations per spec, each its own process (its JSON lands when it ends); size-class's
    # brute-force invariant recount costs ~3 ms an operation, so it gets 3x10^5 in the same time
    mkdir -p /tmp/soak
    python3 -c "from policies.testing.soak import soak_specs; print('\n'.join(soak_specs()))" > /tmp/soak/specs
    i=0
    while read -r spec; do
        ops=1000000; [ "$spec" = size-class ] && ops=300000
        timeout 540 python3 benchmarks/soak.py --ops $ops --spec "$spec" --out /tmp/soak/$i.json > /tmp/soak/$i.txt 2>&1 &
        i=$((i+1))
    done < /tmp/soak/specs
    for s in graphs compile static_empty_cache; do
        step "torch.cuda $s" timeout 120 python3 -m poollab gpu replay tests/data/snapshots_h200/$s.pickle.gz \
            -p torch-caching -b torch.cuda --sim --out /tmp/fid_$s --no-progress
    done
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step "torch.cuda expandable" timeout 120 python3 -m poollab \
        gpu replay tests/data/snapshots_h200/expandable.pickle.gz -p torch-caching:expandable_segments=true \
        -b torch.cuda --sim --out /tmp/fid_expandable --no-progress
    python3 -c "import pandas as pd, glob; pd.concat([pd.read_csv(f).assign(snapshot=f.split('_',1)[1].split('/')[0]) for f in sorted(glob.glob('/tmp/fid_*/summary.csv'))]).to_csv('$OUT/torch_cuda_snapshots.csv', index=False)"
    wait
    python3 -c "import json, glob; json.dump([r for f in sorted(glob.glob('/tmp/soak/*.json')) for r in json.load(open(f))['policies']], open('$OUT/soak_h200.json', 'w'), indent=1)" >> $LOG 2>&1
    cat /tmp/soak/*.txt > $OUT/soak_h200.txt
elif [ "$1" = speed ]; then
    step sweep timeout 280 python3 benchmarks/bench_sweep.py --workers 1,2,4,8,16 --cells 400 --out $OUT/sweep_h200.json
    step simulate timeout 280 python3 benchmarks/bench_simulate.py .data/AzureLLMInferenceTrace_conv.csv \
        --mode repeat --scale 1 2 --repeat 2
elif [ "$1" = final ]; then
    python3 -m pytest tests/realgpu -q -p no:cacheprovider --import-mode=importlib -rfE > $OUT/gpu_tests.log 2>&1
    echo "== gpu tests rc=$? $(date -u +%T)" >> $LOG
    step harness timeout 300 python3 benchmarks/bench_replay.py .data/llama1b_generate_mixed.pickle.gz --repeat 3 \
        -p paged -p size-class -p best-fit -p first-fit -p tlsf --out $OUT/replay_harness_sampled_h200.csv
elif [ "$1" = compiled ]; then
    # the opt-in compiled build (cdef declarations; Cython from the carried .whl/cython*): the battery
    # against it, pure against compiled side by side, and GpuPool.malloc of both builds against
    # CuPy's MemoryPool with the pointer floor (realgpu.roundtrip.pointer_floor_roundtrip)
    { gcc --version | head -1; python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])'; } >> $LOG 2>&1
    TRACE=.data/llama1b_generate_mixed.pickle.gz
    step compiled timeout 360 python3 benchmarks/bench_compiled.py $TRACE --test --rounds 3 --repeat 3 --clock wall \
        -p paged -p size-class -p best-fit -p first-fit -p tlsf --keep /tmp/compiled
    RT="--stages roundtrip --iterations 20000 --policy paged --policy size-class --policy best-fit"
    step roundtrip-pure timeout 120 python3 benchmarks/bench_gpu.py --out $OUT/roundtrip_pure $RT
    [ -d /tmp/compiled ] && (cd /tmp/compiled && PYTHONPATH=/tmp/site:. step roundtrip-compiled timeout 120 \
        python3 benchmarks/bench_gpu.py --out $OUT/roundtrip_compiled $RT)
elif [ "$1" = compiled-replay ]; then
    python3 -m pytest tests/realgpu -q -p no:cacheprovider --import-mode=importlib -rfE > $OUT/gpu_tests.log 2>&1
    echo "== gpu tests rc=$? $(date -u +%T)" >> $LOG
    { gcc --version | head -1; } >> $LOG 2>&1
    step compiled timeout 480 python3 benchmarks/bench_compiled.py .data/llama1b_generate_mixed.pickle.gz --test \
        --rounds 3 --repeat 3 --clock wall -p paged -p size-class -p best-fit -p first-fit -p tlsf
elif [ "$1" = malloc ]; then
    gpu_tests_both_builds
    roundtrips_both_builds
    step malloc-path timeout 200 python3 benchmarks/bench_malloc_path.py --compiled --iterations 100000 --repeat 5 \
        --out $OUT/malloc_path_h200.csv
elif [ "$1" = recheck ]; then
    gpu_tests_both_builds
    roundtrips_both_builds
    TRACE=.data/llama1b_generate_mixed.pickle.gz
    step harness timeout 240 python3 benchmarks/bench_replay.py $TRACE --repeat 3 \
        -p paged -p size-class -p best-fit -p first-fit -p tlsf --out $OUT/replay_harness_recheck.csv
    step compiled timeout 240 python3 benchmarks/bench_compiled.py $TRACE --rounds 2 --repeat 3 --clock wall \
        -p paged -p size-class -p best-fit -p first-fit
else
    step sweep timeout 300 python3 benchmarks/bench_sweep.py --workers 1,2,4,8,16 --out $OUT/sweep_h200.json
fi
