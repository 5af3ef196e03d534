#!/usr/bin/env bash
# session 29 call 12: test_hf on the GPU with the pinned transformers 5.24.0 (carried in .whl)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
python3 -c "import transformers; print('transformers', transformers.__version__)"
S=$(date +%s)
timeout 120 python3 -m pytest -q -rf -p no:cacheprovider -n 8 tests/test_hf.py > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - S ))s"
grep -E "^FAILED|^E  .*Error|passed|failed" $OUT/tests.log | cut -c1-220 | sort -u | tail -8; echo "dots: $(grep -E '^[.sFEx]+( +\[)' $OUT/tests.log | tr -cd '.' | wc -c) F: $(grep -E '^[.sFEx]+( +\[)' $OUT/tests.log | tr -cd 'F' | wc -c)"
