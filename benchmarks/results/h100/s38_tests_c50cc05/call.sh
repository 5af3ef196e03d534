# session 38 call 2: the GPU test files at HEAD (16 workers), then the README's main job (chunkwise check)
source .agents/common.sh >/dev/null 2>&1; for f in .triton_sm90/*.tgz; do tar xzf $f -C /tmp; done
T0=$(date +%s)
( python3 -m pytest --collect-only -q -p no:cacheprovider -o addopts="" tests/test_triton_chunk_bwd.py tests/test_triton_chunk_fwd.py tests/test_triton_recurrent.py > $OUT/collected.txt 2>&1 ) &
( timeout ${TESTS_T:-400} python3 -m pytest -v -n 16 --dist loadgroup --max-worker-restart 32 -p no:cacheprovider -o addopts="" --tb=line -rfE \
   tests/test_triton_chunk_bwd.py tests/test_triton_chunk_fwd.py tests/test_triton_recurrent.py ) > $OUT/tests.log 2>&1
echo "== tests rc=$? $(( $(date +%s) - T0 ))s"; echo "passed $(grep -c ' PASSED' $OUT/tests.log) skipped $(grep -c ' SKIPPED' $OUT/tests.log)"
grep -E " FAILED| ERROR" $OUT/tests.log | sort -u | head; tail -2 $OUT/tests.log | cut -c1-300
python3 - <<'PY' > $OUT/unfinished.txt
import re, os
t = open(os.environ["OUT"] + "/tests.log").read()
started = set(re.findall(r"^(tests/\S+::\S+)$", open(os.environ["OUT"] + "/collected.txt").read(), re.M)); done = set(re.findall(r"(?:PASSED|FAILED|SKIPPED|ERROR) (tests/\S+)", t))
print("\n".join(sorted(started - done)))
PY
echo "unfinished: $(wc -l < $OUT/unfinished.txt)"; head -20 $OUT/unfinished.txt
left=$(( 500 - ($(date +%s) - T0) )); [ $left -gt 60 ] && { ( timeout $left python3 -m chunkwise check ) > $OUT/check.log 2>&1; echo "== check rc=$?"; tail -22 $OUT/check.log | cut -c1-160; }
