#!/usr/bin/env bash
# Issue 34's real check of the KV plan, on the H200 (about 3-4 minutes; the device keeps nothing:
# everything lands in $OUT as log.txt and plan_check.tgz). From the repository root on the GPU
# machine, with .whl/ carried (simpy, plotly):
#   bash benchmarks/run_h200_plan_check.sh
# 1. the free memory PyTorch's allocator can have (free + what it already reserved), with cuBLAS and
#    SDPA's kernels loaded (what they hold is outside the allocator in the engine's process too);
# 2. `poollab plan` on the committed start-up snapshot with that memory, --engine transformers: the
#    paged|sdpa attention mask (8,192 x (tokens + 8,192) bf16) grows with the KV cache in every replay;
# 3. `gpu serve -p pytorch --no-engine-footprint-check` (transformers' own estimate would refuse the
#    planned size before allocating anything) with --num-blocks N = planned pages - 2 (the engine adds
#    2 padding blocks) and N + 1, 4 requests each: N should start, warm up and serve; N + 1 should
#    run out of CUDA memory at start-up or warm-up, reported as one line (exit 2);
# 4. at N a 30 s serving run. The start-up snapshot holds start-up and warm-up, not serving's peak
#    (the RESULTS runs peaked at 135-139 GiB reserved while serving), so this one may run out of
#    memory while serving: the plan promises the recorded run, not traffic it never saw.
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup plan_check
# free + reserved once CUDA is up (as session 11 measured it), and again once cuBLAS and SDPA kernels are
# loaded: their handles and modules sit outside the allocator in the serving process too, so the second is
# what the engine's allocator can really have; the plan uses it and the log keeps both
read -r FREE_BARE FREE < <(python3 -c "
import torch, torch.nn.functional as F
torch.empty(1, device='cuda'); f, _ = torch.cuda.mem_get_info(); bare = f + torch.cuda.memory_reserved()
a = torch.randn(512, 512, device='cuda', dtype=torch.bfloat16); q = torch.randn(1, 32, 256, 128, device='cuda', dtype=torch.bfloat16)
(a @ a).sum().item(); F.scaled_dot_product_attention(q, q, q).sum().item(); torch.cuda.synchronize()
f, _ = torch.cuda.mem_get_info(); print(bare, f + torch.cuda.memory_reserved())")
echo "free for the allocator: $FREE ($FREE_BARE before cuBLAS and SDPA were loaded)" >> $LOG
[ -n "$FREE" ] || exit 1
step plan 60 python3 -m poollab plan tests/data/snapshots_h200/startup_transformers_cb.pickle.gz --memory $FREE \
    --model Llama-3-8B --engine transformers -p torch-caching --out $R/plan --no-progress
PAGES=$(python3 -c "import pandas as pd; print(int(pd.read_csv('$R/plan/plan.csv').safe_kv_pages[0]))") || exit 1
N=$((PAGES - 2))
echo "planned pages $PAGES (mask grown with them): --num-blocks $N, and $((N + 1)) one page more" >> $LOG
for n in $N $((N + 1)); do
    step serve-$n 90 python3 -m poollab gpu serve traces/data/azure_code_slice.csv -p pytorch --max-requests 4 \
        --num-blocks $n --no-engine-footprint-check --out $R/serve_$n --no-sim
done
step serve-$N-30s 90 python3 -m poollab gpu serve traces/data/azure_code_slice.csv -p pytorch --duration 30 \
    --num-blocks $N --no-engine-footprint-check --out $R/serve_${N}_30s --no-sim
