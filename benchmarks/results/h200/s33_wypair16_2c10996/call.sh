# .agents/common.sh of these session-33 calls is benchmarks/results/h200/s32_common.sh, unchanged
# session 33 call 5: the WY pass's split pairwise products (CHUNKWISE_BWD_WY_PAIR16=1) timed per kernel, then their
# real-size errors against float64 and fla
source .agents/common.sh
T0=$(date +%s)
timeout 120 python3 benchmarks/sweep_bwd.py --fams delta,gdn --out $OUT/wyp --variants "w0:;w1:CHUNKWISE_BWD_WY_PAIR16=1" > $OUT/wyp.log 2>&1
echo "sweep rc=$? $(( $(date +%s) - T0 ))s"; grep -A12 "B1-T32768-H32: fwd+bwd" $OUT/wyp.log
left=$(( 300 - ($(date +%s) - T0) ))
timeout $left python3 -m pytest -v -rP -n 2 -p no:cacheprovider -o addopts="" --tb=line tests/test_triton_chunk_bwd.py -k "wy_pair16" > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -2 $OUT/tests.log; grep -h "rel err" $OUT/tests.log
