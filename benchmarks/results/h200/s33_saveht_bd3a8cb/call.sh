# .agents/common.sh of these session-33 calls is benchmarks/results/h200/s32_common.sh, unchanged
# session 33 call 6: DeltaNet's per-chunk states formed backwards in the reverse pass (CHUNKWISE_SAVE_HT=1) timed per
# kernel, then its real-size errors against float64 and fla, and its GPU gradient test
source .agents/common.sh
T0=$(date +%s)
timeout 100 python3 benchmarks/sweep_bwd.py --fams delta --out $OUT/ht --variants "h0:;h1:CHUNKWISE_SAVE_HT=1" > $OUT/ht.log 2>&1
echo "sweep rc=$? $(( $(date +%s) - T0 ))s"; grep -A9 "B1-T32768-H32: fwd+bwd" $OUT/ht.log
CHUNKWISE_SAVE_HT=1 timeout 120 python3 -m pytest -v -rP -n 4 -p no:cacheprovider -o addopts="" --tb=short tests/test_triton_chunk_bwd.py -k "saved_final_state or (real_size_grads_vs_fla and delta) or (real_size_grouped and delta)" > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -2 $OUT/tests.log; grep -h "rel err" $OUT/tests.log; grep -h "FAILED\|Error" $OUT/tests.log | head -5
