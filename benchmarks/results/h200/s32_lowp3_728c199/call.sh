# device call of session 32; .agents/common.sh is benchmarks/results/h200/s32_common.sh
source .agents/common.sh
cd $PWD
( timeout 260 python3 benchmarks/sweep_bwd.py --fams delta --out $OUT/sweep --variants "l4:;lowp3:CHUNKWISE_BWD_LOWP=3" ) > $OUT/sweep.log 2>&1
tail -12 $OUT/sweep.log
( timeout 150 python3 -m pytest -q -s -o addopts="" -p no:cacheprovider tests/test_triton_chunk_bwd.py -k "real_size and delta" ) > $OUT/tests_l4.log 2>&1
grep -E "rel err|passed|failed" $OUT/tests_l4.log
( CHUNKWISE_BWD_LOWP=3 timeout 150 python3 -m pytest -q -s -o addopts="" -p no:cacheprovider tests/test_triton_chunk_bwd.py -k "real_size and delta" ) > $OUT/tests_l3.log 2>&1
grep -E "rel err|passed|failed|Warn" $OUT/tests_l3.log
