#!/usr/bin/env bash
# One device call that tests and times everything on the GPU (H200), logs under $OUT.
# Usage (device tool, carry .whl for fla): GIT_COMMIT=<sha> bash benchmarks/gpu_session.sh
#   TESTS="<pytest args>" overrides the GPU test selection; SKIP_TRAIN=1 skips the MQAR example.
set -u
# every log goes to $LOG; at exit it is packed into $OUT/run.tgz (the device tool returns 8 files at most)
FINAL=${OUT:-bench_out}; LOG=/tmp/gpu_session; mkdir -p "$FINAL" "$LOG"; OUT=$LOG
trap 'tar czf "$FINAL/run.tgz" -C "$LOG" . ; cp "$LOG"/*.png "$LOG"/*.json "$FINAL"/ 2>/dev/null' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} || exit 1
export PYTHONUNBUFFERED=1 CHUNKWISE_FAILLOG=$OUT/failures.txt
nvidia-smi -L; python3 -c "import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)"
step() { local t=$1; shift; local name=$1; shift; local s=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - s ))s"; tail -n "${TAILN:-6}" "$OUT/$name.log"; }
# phase A: compile the stage-1 variants (CPU, in parallel), then time them alone and take the pick
( for f in gdn kda delta; do for w in 4 8; do
    timeout 100 python3 benchmarks/sweep_stage1.py --warm --fams $f --warps $w > "$OUT/warm_s1_${f}_$w.log" 2>&1 & done; done
  wait )
TAILN=32 step 80 sweep_stage1 python3 benchmarks/sweep_stage1.py --out "$OUT"
[ -s "$OUT/prep_config.txt" ] && export CHUNKWISE_PREP_CONFIG=$(cat "$OUT/prep_config.txt") && echo "CHUNKWISE_PREP_CONFIG=$CHUNKWISE_PREP_CONFIG"
# phase B: the GPU tests and the MQAR training example (with the pick), while the forward benchmark compiles
( for f in gdn kda delta gla; do timeout 190 python3 benchmarks/bench_forward.py --warm --families $f > "$OUT/warm_$f.log" 2>&1 & done
  wait ) &
( [ "${SKIP_TRAIN:-0}" = 1 ] || timeout 190 python3 examples/train_mqar.py --config gpu --backend triton \
    --plot "$OUT/mqar_loss_gpu.png" --json "$OUT/mqar_gpu.json" > "$OUT/mqar_gpu.log" 2>&1 ) &
TAILN=4 step 190 tests python3 -m pytest -q -n 6 -p no:cacheprovider -o addopts="" --tb=line -rf \
  ${TESTS:-tests/test_compile.py tests/test_triton_chunk_fwd.py tests/test_triton_chunk_bwd.py -k "fp16 or unaligned or real_size or grads or compile or opcheck or hopper or wide or gradients"}
wait
echo "== mqar"; tail -n 4 "$OUT/mqar_gpu.log"
[ -s "$OUT/failures.txt" ] && { echo "== failures"; grep "^===" "$OUT/failures.txt" | sort -u | head -20; grep "^E " "$OUT/failures.txt" | sort | uniq -c | sort -rn | head -8; }
# phase C: timings, one at a time
TAILN=20 step 110 bench_forward python3 benchmarks/bench_forward.py --out "$OUT"
TAILN=12 step 100 bench_train python3 benchmarks/bench_train.py --families gdn,delta,kda --shapes B1-T32768-H32 --out "$OUT"
