#!/usr/bin/env bash
# session 28 call 3: the K = 128, V <= 32 illegal access fixed? (wu_lowp_ok takes V); the head-dim grid
set -u
export TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 330 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_compile.py tests/test_triton_chunk_bwd.py tests/test_triton_chunk_fwd.py -k "fake_matches_real or bf16_small_tiles or (fp16_small_tiles and 128) or wu_16_bit or head_dim_grid" > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - S ))s"
grep -E "passed|failed" $OUT/tests.log | tail -2
F=$(grep -oE "^FAILED tests/test_triton_chunk_bwd.py::[^ ]+" $OUT/tests.log | sed 's/.*:://' | head -12 | paste -sd'|')
grep -E "^FAILED" $OUT/tests.log | cut -c1-150 | head -30
if [ -n "$F" ]; then
  timeout 200 python3 benchmarks/diag_bwd.py --cases "$F" --envs "default|CHUNKWISE_PREP_WU_LOWP=0|CHUNKWISE_BWD_LOWP=1" --jobs 12 --timeout 150 --out $OUT > $OUT/diag.log 2>&1
  cut -c1-220 $OUT/diag.log | tail -40
fi
