#!/usr/bin/env bash
# session 31 call 5: the fast-exp value test and KDA's real-size gradients at the final defaults (state-tile pass on tl.exp)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 GIT_COMMIT=$(cat .agents/commit)
tar xzf .triton_sm90/cache.tgz -C /tmp && export TRITON_CACHE_DIR=/tmp/triton_cache_sm90
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp; done
export TRITON_CACHE_AUTOTUNING=1
S=$(date +%s)
timeout 200 python3 -m pytest -q -rf -p no:cacheprovider -n 4 tests/test_triton_chunk_fwd.py tests/test_triton_chunk_bwd.py -k "fast_exp or (real_size and kda)" > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - S ))s"; grep -E "passed|failed|Error" $OUT/tests.log | tail -5
