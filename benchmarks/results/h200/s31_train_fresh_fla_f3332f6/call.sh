#!/usr/bin/env bash
# session 31 call 1: fla's fwd+bwd with a fresh autotuning search (bench_train calls fla_fresh_search), one process
# per family at B1-T32768-H32; ours beside it in the same process
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 GIT_COMMIT=$(cat .agents/commit)
tar xzf .triton_sm90/cache.tgz -C /tmp && export TRITON_CACHE_DIR=/tmp/triton_cache_sm90
export FLA_CACHE_RESULTS=0 TRITON_CACHE_AUTOTUNING=0
T0=$(date +%s)
for fam in delta kda; do
  left=$(( 575 - ($(date +%s) - T0) )); [ $left -lt 60 ] && { echo "skip $fam"; continue; }
  S=$(date +%s)
  prof=""; [ $fam = delta ] && prof="--profile"
  timeout $left python3 benchmarks/bench_train.py --families $fam --shapes B1-T32768-H32 $prof --out $OUT/train_$fam > $OUT/train_$fam.log 2>&1
  echo "$fam rc=$? $(( $(date +%s) - S ))s"
done
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.environ["OUT"] + "/train_*.log")):
    for line in open(p):
        if line.startswith("{"):
            r = json.loads(line)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if not isinstance(v, (dict, list))})
PY
