# device call of session 32; .agents/common.sh is benchmarks/results/h200/s32_common.sh
source .agents/common.sh
( timeout 510 python3 -m pytest -v -n 16 --dist loadgroup --max-worker-restart 32 -p no:cacheprovider -o addopts="" --tb=line -rfE \
   tests/test_triton_chunk_bwd.py tests/test_triton_chunk_fwd.py ) > $OUT/tests.log 2>&1
echo rc=$?
grep -c " PASSED" $OUT/tests.log; grep -E " FAILED| ERROR" $OUT/tests.log | head; tail -3 $OUT/tests.log
