#!/usr/bin/env bash
# Session 11's one closing H200 call (the device keeps nothing: everything lands in $OUT as one
# tarball plus a log, committed under benchmarks/results/engine_check/). From the repository root on
# the GPU machine, with .whl/ carried (simpy, plotly):
#   bash benchmarks/run_h200_engine.sh
# 1. the GPU tests (tests/realgpu -m gpu: GpuPool over policy objects, page-pool ranges, the torch
#    allocator, gpu serve);
# 2. generate under PyTorch's allocator and under each fast policy, interleaved (bench_torch_alloc.py);
# 3. issue 34's real check: `poollab plan` on the committed start-up snapshot with the device's real
#    free memory, then `gpu serve` at the planned KV size and at the size the planner would give if it
#    also grew the engine's attention mask with the cache (4 MiB per 32 MiB block).
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup engine_check
python3 -m pytest tests/realgpu -m gpu -q -p no:cacheprovider --import-mode=importlib -rfE > $R/gpu_tests.log 2>&1 &
TESTS=$!
( sleep 150; kill -INT $TESTS 2>/dev/null ) &
wait $TESTS; echo "== gpu tests rc=$? $(date -u +%T)" >> $LOG
step torch-alloc 190 python3 benchmarks/bench_torch_alloc.py --rounds 1 --validate best-fit --worker-timeout 90 --out $R/torch
FREE=$(python3 -c "import torch; torch.empty(1, device='cuda'); f, t = torch.cuda.mem_get_info(); print(f + torch.cuda.memory_reserved())")
echo "free for the allocator: $FREE" >> $LOG
step plan 40 python3 -m poollab plan tests/data/snapshots_h200/startup_transformers_cb.pickle.gz --memory $FREE \
    --model Llama-3-8B --block-tokens 256 -p torch-caching --out $R/plan --no-progress
PAGES=$(python3 -c "import pandas as pd; print(int(pd.read_csv('$R/plan/plan.csv').safe_kv_pages[0]))")
# the engine adds 2 padding blocks to --num-blocks; its mask grows 4 MiB for each 32 MiB block
RECORDED=3062; N=$((PAGES - 2)); N_MASK=$((RECORDED + (PAGES - RECORDED) * 32 / 36 - 2))
echo "planned pages $PAGES: --num-blocks $N; with the mask grown too: $N_MASK" >> $LOG
for n in $N $N_MASK; do
    step serve-$n 85 python3 -m poollab gpu serve traces/data/azure_code_slice.csv -p pytorch --max-requests 4 \
        --num-blocks $n --out $R/serve_$n --no-sim
done
