#!/usr/bin/env bash
# session 31 call 2: the backward test file at f3332f6 (the _chunk_len change, not yet run on the GPU), then Nsight
# Compute of the state-tile and WY passes: GDN against DeltaNet, and GDN's WY pass folded against masked
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 GIT_COMMIT=$(cat .agents/commit)
tar xzf .triton_sm90/cache.tgz -C /tmp && export TRITON_CACHE_DIR=/tmp/triton_cache_sm90
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp; done
export TRITON_CACHE_AUTOTUNING=1
S=$(date +%s)
timeout 300 python3 -m pytest -q -rf -p no:cacheprovider -n 16 tests/test_triton_chunk_bwd.py tests/test_triton_pipeline.py > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - S ))s"; tail -n 4 $OUT/tests.log
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
run_ncu() { local tag=$1 fam=$2 rx=$3 cnt=$4; shift 4
  S=$(date +%s)
  env "$@" timeout 110 "$NCU" --clock-control none -k "regex:$rx" -s "$cnt" -c "$cnt" --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section InstructionStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 benchmarks/ncu_run.py --fam "$fam" --mode train > $OUT/ncu_$tag.log 2>&1
  echo "== ncu $tag rc=$? $(( $(date +%s) - S ))s"; python3 benchmarks/ncu_summary.py $OUT/ncu_$tag.log
}
run_ncu gdn gdn "_bwd_dqk_kernel|_bwd_wy_kernel" 2 X=1
run_ncu delta delta "_bwd_dqk_kernel|_bwd_wy_kernel" 2 X=1
run_ncu gdn_wyfull gdn "_bwd_wy_kernel" 1 CHUNKWISE_BWD_FULL=fwd_h,bwd_dh,bwd_wy
