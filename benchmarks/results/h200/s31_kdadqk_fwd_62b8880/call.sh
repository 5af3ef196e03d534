#!/usr/bin/env bash
# session 31 call 4: KDA's state-tile pass with / without the fast gate factors; the forward against fla (fresh search) at B1
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 GIT_COMMIT=$(cat .agents/commit)
tar xzf .triton_sm90/cache.tgz -C /tmp && export TRITON_CACHE_DIR=/tmp/triton_cache_sm90
S=$(date +%s)
for v in 1 0 1; do
  CHUNKWISE_FAST_EXP_KDA_DQK=$v timeout 100 python3 benchmarks/bench_train.py --no-fla --families kda --shapes B1-T32768-H32 --profile --out $OUT/kda_dqk$v > $OUT/kda_dqk$v.log 2>&1
  echo "kda dqk fast=$v rc=$? $(( $(date +%s) - S ))s"
  python3 -c "
import json; r=json.load(open('$OUT/kda_dqk$v/bench_train.json'))['results'][0]
print('  fwd %.3f train fwd %.3f fwd+bwd %.3f' % (r['ours_fwd_ms'], r['ours_train_fwd_ms'], r['ours_fwdbwd_ms']), {k[:16]: round(x, 3) for k, x in r['ours_profile_ms'].items() if x > 0.05})"
done
export FLA_CACHE_RESULTS=0 TRITON_CACHE_AUTOTUNING=0
left=$(( 590 - ($(date +%s) - S) ))
timeout $left python3 benchmarks/bench_forward.py --families gdn,kda,gla,delta --shapes B1-T32768-H32 --out $OUT/fwd_B1 > $OUT/fwd_B1.log 2>&1
echo "fwd rc=$? $(( $(date +%s) - S ))s"
grep '^{' $OUT/fwd_B1.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); print('%-14s %-6s ours %.3f fla %.3f %.2fx' % (r['shape'], r['family'], r['ours_ms'], r.get('fla_ms', float('nan')), r.get('speedup', float('nan'))))"
