#!/usr/bin/env bash
# session 29 call 9: KDA's form-1 fix on the GPU; fwd+bwd at B1 and the forward at B8 / B4 against fla, new defaults
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp; done
export TRITON_CACHE_DIR=/tmp/triton_cache_sm90 PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 GIT_COMMIT=$(cat .agents/commit)
S=$(date +%s)
timeout 90 python3 -m pytest -q -rf -p no:cacheprovider -n 12 tests/test_triton_chunk_fwd.py -k "kda_pairwise_blocks" > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - S ))s"; tail -n 2 $OUT/tests.log
timeout 230 python3 benchmarks/bench_train.py --families delta,kda,gdn,gla --shapes B1-T32768-H32 --fla-families delta,kda --out $OUT/train > $OUT/train.log 2>&1; echo "train rc=$? $(( $(date +%s) - S ))s"
timeout 200 python3 benchmarks/bench_forward.py --families gdn,kda,delta --shapes B8-T4096-H32,B4-T8192-H16/HV32 --out $OUT/fwd > $OUT/fwd.log 2>&1; echo "fwd rc=$? $(( $(date +%s) - S ))s"
python3 - <<'PY'
import json,os,glob
for f in glob.glob(os.environ["OUT"]+"/train/*.json")+glob.glob(os.environ["OUT"]+"/fwd/*.json"):
    d=json.load(open(f)); rows=d["results"] if isinstance(d,dict) and "results" in d else d
    for r in rows:
        if isinstance(r,dict): print({k:(round(v,3) if isinstance(v,float) else v) for k,v in r.items() if not isinstance(v,(dict,list))})
PY
