#!/usr/bin/env bash
# session 28 call 4: the new head-dim grids (forward, decode), then the whole backward test file at HEAD
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp; done
export TRITON_CACHE_DIR=/tmp/triton_cache_sm90 PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
S=$(date +%s)
timeout 120 python3 -m pytest -q -rf -p no:cacheprovider -n 16 tests/test_triton_chunk_fwd.py tests/test_triton_recurrent.py tests/test_compile.py -k "head_dim_grid or gpu_bf16_real_size or gpu_pool or compile" > $OUT/grid.log 2>&1; echo "grid rc=$? $(( $(date +%s) - S ))s"
grep -E "^FAILED|passed|failed" $OUT/grid.log | cut -c1-200 | tail -12
timeout 330 python3 -m pytest -q -rf -p no:cacheprovider -n 16 tests/test_triton_chunk_bwd.py > $OUT/bwd.log 2>&1; echo "bwd rc=$? $(( $(date +%s) - S ))s"
grep -E "^FAILED|passed|failed" $OUT/bwd.log | cut -c1-200 | tail -12
grep -cE "^\[|^\.|PASSED" $OUT/bwd.log
