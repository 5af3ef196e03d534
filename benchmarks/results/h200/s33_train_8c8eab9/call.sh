# .agents/common.sh of these session-33 calls is benchmarks/results/h200/s32_common.sh, unchanged
# session 33 call 2: fwd+bwd at the PAIR16 3 default. DeltaNet against fla (fresh search) at B1 in one process; GDN and
# simple GLA (fla refuses their backward here) ours alone at B1; then ours alone at the other three shapes
source .agents/common.sh
T0=$(date +%s)
run() { local name=$1 lim=$2; shift 2; left=$(( 570 - ($(date +%s) - T0) )); [ $left -lt 40 ] && { echo "skip $name"; return; }
  [ $lim -gt $left ] && lim=$left; S=$(date +%s)
  timeout $lim python3 benchmarks/bench_train.py "$@" --out $OUT/$name > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - S ))s"; }
run train_delta_b1 330 --families delta --shapes B1-T32768-H32 --profile
run train_gated_b1 100 --families gdn,gla --shapes B1-T32768-H32 --no-fla
run train_rest 200 --families delta,gdn,gla --shapes B8-T4096-H32,B4-T8192-H16/HV32,varlen16-T32768-H32 --no-fla
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.environ["OUT"] + "/train_*.log")):
    for line in open(p):
        if line.startswith("{"):
            r = json.loads(line)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if not isinstance(v, (dict, list))})
PY
