#!/usr/bin/env bash
# session 29 call 10: every other GPU test file at the new defaults (the forward / backward files ran in calls 8-9)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp; done
export TRITON_CACHE_DIR=/tmp/triton_cache_sm90 PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 GIT_COMMIT=$(cat .agents/commit)
S=$(date +%s)
timeout 420 python3 -m pytest -q -rfs -p no:cacheprovider -n 16 tests --ignore=tests/test_triton_chunk_fwd.py --ignore=tests/test_triton_chunk_bwd.py --ignore=tests/test_triton_pipeline.py > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - S ))s"
grep -E "^FAILED|^SKIPPED|passed|failed" $OUT/tests.log | cut -c1-220 | tail -25; echo "dots: $(grep -E '^[.sFEx]+( +\[)' $OUT/tests.log | tr -cd '.' | wc -c) F: $(grep -E '^[.sFEx]+( +\[)' $OUT/tests.log | tr -cd 'F' | wc -c) s: $(grep -E '^[.sFEx]+( +\[)' $OUT/tests.log | tr -cd 's' | wc -c)"
