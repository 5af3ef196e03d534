# device call of session 32; .agents/common.sh is benchmarks/results/h200/s32_common.sh
source .agents/common.sh
( timeout 200 python3 benchmarks/sweep_bwd.py --fams delta --out $OUT/sweep --variants "p1:;p0:CHUNKWISE_BWD_DQK_PAIR16=0;p2:CHUNKWISE_BWD_DQK_PAIR16=2" ) > $OUT/sweep.log 2>&1
tail -9 $OUT/sweep.log
python3 - > $OUT/errs.txt 2>&1 <<'PY'
import torch, sys, os
sys.path.insert(0, "tests")
from test_triton_chunk_bwd import make_inputs, _grads, _grads_device64, _fla_grads, rel_err, DEVICE
for env in ("1", "0"):
    os.environ["CHUNKWISE_BWD_DQK_PAIR16"] = env
    for H, HV, seed in ((8, 8, 11), (4, 8, 13)):
        inp = make_inputs("delta", B=2, T=1000, H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, seed=seed, device=DEVICE)
        ours = _grads(inp, "triton", torch.bfloat16); ref, do, dht = _grads_device64(inp); fla = _fla_grads(inp, do, dht)
        print("pair16", env, H, HV, " ".join(f"{n} {rel_err(ours[n], r):.5e}/{rel_err(fla[n], r):.5e}" for n, r in ref.items()))
PY
grep pair16 $OUT/errs.txt || tail -5 $OUT/errs.txt
( timeout 150 python3 -m pytest -q -s -o addopts="" -p no:cacheprovider tests/test_triton_chunk_bwd.py -k "(real_size and delta) or hopper or pair16" ) > $OUT/tests.log 2>&1
grep -E "rel err|passed|failed" $OUT/tests.log | tail -12
( timeout 230 python3 benchmarks/bench_forward.py --families gdn,kda,delta,gla --shapes B4-T8192-H16/HV32 --out $OUT/fwd_B4 ) > $OUT/fwd_B4.log 2>&1
grep -o '"shape[^,]*, "family[^,]*, "ours_ms[^,]*\|"fla_ms[^,]*, "speedup[^,]*' $OUT/fwd_B4.log
