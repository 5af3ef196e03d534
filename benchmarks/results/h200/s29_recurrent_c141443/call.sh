#!/usr/bin/env bash
# session 29 call 11: the recurrent test file on the GPU after the pool-case fix; the device's transformers version
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
python3 -c "import transformers, torch, triton; print('transformers', transformers.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
S=$(date +%s)
timeout 150 python3 -m pytest -q -rf -p no:cacheprovider -n 16 tests/test_triton_recurrent.py > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - S ))s"
grep -E "^FAILED|passed|failed" $OUT/tests.log | cut -c1-220 | tail -8; echo "dots: $(grep -E '^[.sFEx]+( +\[)' $OUT/tests.log | tr -cd '.' | wc -c) F: $(grep -E '^[.sFEx]+( +\[)' $OUT/tests.log | tr -cd 'F' | wc -c)"
