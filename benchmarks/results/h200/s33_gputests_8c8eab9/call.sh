# .agents/common.sh of these session-33 calls is benchmarks/results/h200/s32_common.sh, unchanged
# session 33 call 3: the GPU backward tests at the PAIR16 3 default (whole file, real sizes in bf16 / fp16 against
# float64 and fla)
source .agents/common.sh
( timeout 500 python3 -m pytest -v -n 16 --dist loadgroup --max-worker-restart 32 -p no:cacheprovider -o addopts="" --tb=line -rfE \
   tests/test_triton_chunk_bwd.py ) > $OUT/tests.log 2>&1
echo rc=$?
grep -c " PASSED" $OUT/tests.log; grep -E " FAILED| ERROR" $OUT/tests.log | head; tail -3 $OUT/tests.log
grep -h "rel err" $OUT/tests.log | sort -u
gzip $OUT/tests.log
