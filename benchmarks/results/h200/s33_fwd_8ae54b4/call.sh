# .agents/common.sh of these session-33 calls is benchmarks/results/h200/s32_common.sh, unchanged
# session 33 call 4: the fixed pair16 GPU tests; the forward rows session 30 / 32 left (varlen16 all four families,
# simple GLA at B8), fla searched afresh in the same process (bench_forward), one process per shape
source .agents/common.sh
T0=$(date +%s)
timeout 120 python3 -m pytest -q -n 8 -p no:cacheprovider -o addopts="" --tb=line tests/test_triton_chunk_bwd.py -k "pair16" > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 ))s"; tail -2 $OUT/tests.log
run() { local name=$1; shift; left=$(( 520 - ($(date +%s) - T0) )); [ $left -lt 40 ] && { echo "skip $name"; return; }
  S=$(date +%s); timeout $left python3 benchmarks/bench_forward.py "$@" --out $OUT/$name > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - S ))s"; }
run fwd_gla_b8 --families gla --shapes B8-T4096-H32
run fwd_varlen16 --families gla,delta,gdn,kda --shapes varlen16-T32768-H32
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.environ["OUT"] + "/fwd_*.log")):
    for line in open(p):
        if line.startswith("{"):
            r = json.loads(line)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if not isinstance(v, (dict, list))})
PY
