#!/usr/bin/env bash
# Issue 34's real check of the KV plan, on the H200 (about 1.5 minutes: 91 and 98 s in session 12; the device keeps nothing:
# everything lands in $OUT as log_plan_check.txt and plan_check.tgz). From the repository root on the
# GPU machine, with .whl/ carried (simpy, plotly):
#   bash benchmarks/run_h200_plan_check.sh     (TRAFFIC="--max-requests 8" of the Azure code slice;
#                                               CHECK="startup run": the plans checked)
# 1. record: `gpu serve -p pytorch --snapshot --snapshot-until both`, the engine sizing its own KV
#    cache: a start-up snapshot, the whole run's snapshot, and beside each the device memory the
#    engine's process held outside PyTorch's allocator (cudaMemGetInfo used less torch's reserved, at
#    start-up's end and while serving: snapshot_pytorch.json);
# 2. plan on each snapshot with what was measured beside it (no --memory, no --non-torch), --engine
#    transformers (the paged|sdpa attention mask grows with the cache): the engine's --num-blocks N
#    (the plan's pages less the engine's 2 padding blocks, from the JSON);
# 3. check in fresh processes (nothing fitted on them): `gpu serve --num-blocks N` and N + 1 with the
#    start-up plan's N (the plan promises start-up and warm-up), and with the whole run's plan's N
#    (it promises the recorded requests too), the same requests, --no-engine-footprint-check
#    (transformers' own estimate would refuse these sizes before allocating anything).
set -u
. "$(dirname "$0")/h200_lib.sh"
h200_setup plan_check
TRAFFIC=${TRAFFIC:---max-requests 8}
CHECK=${CHECK:-startup run}
# what a separate probe process sees free for the allocator (session 11 planned with this; logged to compare)
python3 -c "
import torch, torch.nn.functional as F
torch.empty(1, device='cuda'); a = torch.randn(512, 512, device='cuda', dtype=torch.bfloat16)
q = torch.randn(1, 32, 256, 128, device='cuda', dtype=torch.bfloat16)
(a @ a).sum().item(); F.scaled_dot_product_attention(q, q, q).sum().item(); torch.cuda.synchronize()
f, t = torch.cuda.mem_get_info(); r = torch.cuda.memory_reserved()
print(f'probe process: total {t}, outside the allocator {t - f - r}')" >> $LOG 2>&1
SERVE="python3 -m poollab gpu serve traces/data/azure_code_slice.csv -p pytorch $TRAFFIC --no-sim"
step record 150 $SERVE --snapshot --snapshot-until both --out $R/rec
ls -l $R/rec >> $LOG
cat $R/rec/snapshot_pytorch.json >> $LOG
for what in $CHECK; do
    snap=$R/rec/snapshot_pytorch.pickle.gz; [ $what = run ] && snap=$R/rec/snapshot_pytorch_run.pickle.gz
    step plan-$what 120 python3 -m poollab plan $snap --model Llama-3-8B --engine transformers -p torch-caching \
        --out $R/plan_$what --no-progress
done
blocks() { python3 -c "import pandas as pd; print(int(pd.read_csv('$R/plan_$1/plan.csv').engine_num_blocks[0]))"; }
sizes=""
for what in $CHECK; do
    n=$(blocks $what) || exit 1
    echo "engine blocks, $what plan: $n" >> $LOG
    sizes="$sizes $n $((n + 1))"
done
done_n=""
for n in $sizes; do
    case " $done_n " in *" $n "*) continue;; esac
    done_n="$done_n $n"
    step serve-$n 100 $SERVE --num-blocks $n --no-engine-footprint-check --out $R/serve_$n
done
python3 - >> $LOG 2>&1 <<EOF
import glob, pandas as pd
cols = ["kv_blocks", "n_finished", "n_request_errors", "peak_reserved_bytes", "non_torch_startup_bytes",
        "non_torch_serving_max_bytes"]
for path in sorted(glob.glob("$R/serve_*/summary.csv")) + ["$R/rec/summary.csv"]:
    row = pd.read_csv(path).iloc[0]
    print(path.split("/")[-2], {c: row.get(c) for c in cols})
EOF
