#!/usr/bin/env bash
# session 29 call 8: the new defaults (PREP_FULL, BWD_FULL per gate kind): GPU test files, simple GLA's sweep
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp; done
export TRITON_CACHE_DIR=/tmp/triton_cache_sm90 PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 GIT_COMMIT=$(cat .agents/commit)
S=$(date +%s)
timeout 100 python3 benchmarks/sweep_bwd.py --fams gla,gdn --variants "def:;none:CHUNKWISE_BWD_FULL=0" --out $OUT/glafull > $OUT/glafull.log 2>&1; echo "glafull rc=$? $(( $(date +%s) - S ))s"; grep -v "^{" $OUT/glafull.log | grep -v "^\s*$" | tail -22
timeout 420 python3 -m pytest -q -rf -p no:cacheprovider -n 16 tests/test_triton_chunk_fwd.py tests/test_triton_chunk_bwd.py > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - S ))s"
grep -E "^FAILED|passed|failed" $OUT/tests.log | cut -c1-200 | tail -12; echo "dots: $(grep -E '^[.sFEx]+( +\[)' $OUT/tests.log | tr -cd '.' | wc -c) F: $(grep -E '^[.sFEx]+( +\[)' $OUT/tests.log | tr -cd 'F' | wc -c)"
