# Session 18 (t1)'s held-out command, with --hosts (session 21, t5); run from the worktree root
E=/work/shared/data/engine/transformers_cb_
PYTHONPATH=. /work/venv/bin/python benchmarks/bench_calibration.py --no-shared \
    --run azure_code_60s=${E}azure_code_60s_steps.csv,${E}azure_code_60s_requests.csv \
    --run synth_mixed_60s=${E}synth_mixed_60s_steps.csv,${E}synth_mixed_60s_requests.csv \
    --runs-dir benchmarks/results/engine --runs-dir benchmarks/results/engine_s13 \
    --runs-dir benchmarks/results/engine_s14 --runs-dir benchmarks/results/engine_s16 \
    --runs-dir benchmarks/results/engine_s17 --skip best-fit --skip torch-caching \
    --repeat azure_code_60s_x1_a,azure_code_60s_x1_b,azure_code_60s_x1_c,azure_code_60s_x1_d,azure_code_60s_x1_e,azure_code_60s_x1_f,azure_code_60s_x1_g \
    --repeat azure_code_60s_x2,azure_code_60s_x2_b,azure_code_60s_x2_c \
    --repeat azure_code_60s_x1_cold_b,azure_code_60s_x1_cold_c \
    --repeat synth_mixed_10s_x1_a,synth_mixed_10s_x1_b,synth_mixed_10s_x1_c,synth_mixed_10s_x1_d,synth_mixed_10s_x1_e,synth_mixed_10s_x1_f,synth_mixed_10s_x1_g \
    --repeat synth_mixed_60s_x1,synth_mixed_60s_x1_b \
    --repeat synth_mixed_60s_x2,synth_mixed_60s_x2_b --pooled --hosts "$@"
