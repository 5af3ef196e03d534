#!/usr/bin/env bash
# session 29 call 7: the bounds-check switches (PREP_FULL, BWD_FULL) on the H200
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp; done
export TRITON_CACHE_DIR=/tmp/triton_cache_sm90 PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 GIT_COMMIT=$(cat .agents/commit)
S=$(date +%s)
timeout 170 python3 benchmarks/bench_forward.py --variants --variant-set full --families gdn,kda,delta --shapes B1-T32768-H32 --out $OUT/fullfwd > $OUT/fullfwd.log 2>&1; echo "fullfwd rc=$? $(( $(date +%s) - S ))s"
python3 - <<'PY'
import json,os
for l in open(os.environ["OUT"]+"/fullfwd.log"):
    if l.startswith("{"):
        r=json.loads(l); print(r["family"], r.get("shape",""), "ours %.3f fla %.3f" % (r["ours_ms"], r.get("fla_ms") or 0), {k:(round(v,4) if isinstance(v,float) else v) for k,v in r.get("variants",{}).items()})
PY
timeout 260 python3 benchmarks/sweep_bwd.py --fams gdn,delta,kda --variants full --out $OUT/fullbwd > $OUT/fullbwd.log 2>&1; echo "fullbwd rc=$? $(( $(date +%s) - S ))s"; grep -v "^\s*$" $OUT/fullbwd.log | tail -30
timeout 120 python3 -m pytest -q -rf -p no:cacheprovider -n 12 tests/test_triton_chunk_fwd.py tests/test_triton_chunk_bwd.py -k "full_tiles or full_chunks or bwd_full" > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - S ))s"; tail -3 $OUT/tests.log
