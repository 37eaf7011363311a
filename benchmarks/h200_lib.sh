# Sourced by the benchmarks/run_h200_*.sh scripts (the device keeps nothing: each lands in $OUT as
# log_NAME.txt and NAME.tgz). Call `h200_setup NAME` first; then `step LABEL SECONDS CMD...` runs a
# command under a timeout, logging its output and exit status, and sends the log back after each.
h200_setup() {
    H200_NAME=$1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
    R=/tmp/res_$H200_NAME; mkdir -p $R; LOG=$R/log.txt
    trap h200_finish EXIT
    trap 'exit 143' TERM INT
    { nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader; nproc
      python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; date -u; } >> $LOG 2>&1
}
step() { local name=$1 limit=$2; shift 2; echo "== $name: $* ($(date -u +%T))" >> $LOG
         timeout $limit "$@" >> $LOG 2>&1; echo "== $name rc=$? $(date -u +%T)" >> $LOG; cp $LOG $OUT/log_$H200_NAME.txt; }
h200_finish() { cp $LOG $OUT/log_$H200_NAME.txt; tar -czf $OUT/$H200_NAME.tgz -C $R .; }
# The carried .compiled_so/ (cp312 modules of this tree) over a copy of the tree in /tmp/compiled,
# the carried data left out, and which build a test or benchmark run there imports
# (.compiled_so/ must hold every declared module's .so: realgpu/live_map too, which malloc_path
# cimports; a .py left in its place fails malloc_path's import).
h200_compiled_copy() {
    step copy-compiled 60 bash -c "mkdir -p /tmp/compiled && tar -c --exclude=./.git --exclude=./.whl \
        --exclude=./.data --exclude=./.before --exclude=./.compiled_so . | tar -x -C /tmp/compiled \
        && cp -r .compiled_so/. /tmp/compiled/"
    step which-build 20 bash -c "cd /tmp/compiled && PYTHONPATH=/tmp/site:/tmp/compiled python3 -c \
        'import realgpu.malloc_path as m, realgpu.live_map as l, policies.best_fit as b, policies.size_class as s; \
print(m.__file__, l.__file__, b.__file__, s.__file__)'"
}
