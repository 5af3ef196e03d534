# device call of session 32; .agents/common.sh is benchmarks/results/h200/s32_common.sh
source .agents/common.sh
( timeout 200 python3 benchmarks/sweep_bwd.py --fams delta --out $OUT/sweep --variants "p16:;p16off:CHUNKWISE_BWD_DQK_PAIR16=0;states:CHUNKWISE_SAVE_STATES=1" ) > $OUT/sweep.log 2>&1
tail -10 $OUT/sweep.log
( timeout 120 python3 -m pytest -q -s -o addopts="" -p no:cacheprovider tests/test_triton_chunk_bwd.py -k "real_size and delta" ) > $OUT/tests.log 2>&1
grep -E "rel err|passed|failed" $OUT/tests.log
python3 - > $OUT/errs.txt 2>&1 <<'PY'
import torch, sys
sys.path.insert(0, "tests")
from test_triton_chunk_bwd import make_inputs, _grads, _grads_device64, _fla_grads, rel_err, DEVICE
for env in ("1", "0"):
    import os; os.environ["CHUNKWISE_BWD_DQK_PAIR16"] = env
    for H, HV, seed in ((8, 8, 11), (4, 8, 13)):
        inp = make_inputs("delta", B=2, T=1000, H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, seed=seed, device=DEVICE)
        ours = _grads(inp, "triton", torch.bfloat16); ref, do, dht = _grads_device64(inp); fla = _fla_grads(inp, do, dht)
        print("pair16", env, H, HV, " ".join(f"{n} {rel_err(ours[n], r):.5e}/{rel_err(fla[n], r):.5e}" for n, r in ref.items()))
PY
cat $OUT/errs.txt | grep pair16
( timeout 280 python3 benchmarks/bench_forward.py --families gdn,kda,delta,gla --shapes B8-T4096-H32 --out $OUT/fwd_B8 ) > $OUT/fwd_B8.log 2>&1
tail -8 $OUT/fwd_B8.log
