#!/usr/bin/env bash
# session 31 call 3: gate factors through ex2.approx.ftz (FAST_EXP) against tl.exp, each in its own process (the switch
# is read at import); then the real-size GPU tests at the new default
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 GIT_COMMIT=$(cat .agents/commit)
tar xzf .triton_sm90/cache.tgz -C /tmp && export TRITON_CACHE_DIR=/tmp/triton_cache_sm90
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp; done
export TRITON_CACHE_AUTOTUNING=1
S=$(date +%s)
CHUNKWISE_FAST_EXP=1 timeout 200 python3 benchmarks/bench_train.py --no-fla --families gdn,kda,delta,gla --shapes B1-T32768-H32 --profile --out $OUT/fast1 > $OUT/fast1.log 2>&1
echo "fast1 rc=$? $(( $(date +%s) - S ))s"
CHUNKWISE_FAST_EXP=0 timeout 200 python3 benchmarks/bench_train.py --no-fla --families gdn,kda,delta,gla --shapes B1-T32768-H32 --profile --out $OUT/fast0 > $OUT/fast0.log 2>&1
echo "fast0 rc=$? $(( $(date +%s) - S ))s"
left=$(( 585 - ($(date +%s) - S) ))
timeout $left python3 -m pytest -q -rf -p no:cacheprovider -n 16 tests/test_triton_chunk_fwd.py tests/test_triton_chunk_bwd.py -k "real_size or hopper or full" > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - S ))s"; tail -n 3 $OUT/tests.log
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
rows = {}
for tag in ("fast0", "fast1"):
    try:
        d = json.load(open(f"{out}/{tag}/bench_train.json"))
    except Exception as e:
        print(tag, "missing", e); continue
    for r in d["results"]:
        rows.setdefault(r["family"], {})[tag] = r
for fam, v in rows.items():
    a, b = v.get("fast0", {}), v.get("fast1", {})
    print(f"{fam:6s} fwd {a.get('ours_fwd_ms', 0):.3f} -> {b.get('ours_fwd_ms', 0):.3f}  train fwd {a.get('ours_train_fwd_ms', 0):.3f} -> "
          f"{b.get('ours_train_fwd_ms', 0):.3f}  fwd+bwd {a.get('ours_fwdbwd_ms', 0):.3f} -> {b.get('ours_fwdbwd_ms', 0):.3f}")
    pa, pb = a.get("ours_profile_ms", {}), b.get("ours_profile_ms", {})
    for k in sorted(set(pa) | set(pb), key=lambda k: -pb.get(k, 0)):
        if pb.get(k, 0) > 0.05 or pa.get(k, 0) > 0.05:
            print(f"    {k[:40]:40s} {pa.get(k, 0):.3f} -> {pb.get(k, 0):.3f}")
PY
