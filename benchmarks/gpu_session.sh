#!/usr/bin/env bash
# One device call that tests and times everything on the GPU (H200), logs under $OUT.
# Usage (device tool, carry .whl for fla): GIT_COMMIT=<sha> bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD/src:${PYTHONPATH:-} || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)"
step() { local t=$1; shift; local name=$1; shift; local s=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - s ))s"; tail -n "${TAILN:-6}" "$OUT/$name.log"; }
# phase A: compile (forward, all families) in parallel with the GPU test files
( for f in gdn kda delta gla; do timeout 170 python3 benchmarks/bench_forward.py --warm --families $f > "$OUT/warm_$f.log" 2>&1 & done; wait ) &
TAILN=25 step 200 tests python3 -m pytest -q -n 8 -p no:benchmark -p no:cacheprovider -rf \
  tests/test_triton_chunk_fwd.py tests/test_triton_recurrent.py tests/test_triton_chunk_bwd.py
wait
# phase B: timings, one at a time
TAILN=24 step 100 bench_forward python3 benchmarks/bench_forward.py --out "$OUT"
TAILN=20 step 70 bench_decode python3 benchmarks/bench_decode.py --quick --out "$OUT"
TAILN=12 step 100 bench_train python3 benchmarks/bench_train.py --families gdn,delta,kda --shapes B1-T32768-H32 --out "$OUT"
TAILN=8 step 40 cuda_graph python3 examples/cuda_graph_decode.py
