source .agents/common.sh
cd $PWD
( timeout 260 python3 benchmarks/sweep_bwd.py --fams delta --out $OUT/sweep --variants "l4:;lowp3:CHUNKWISE_BWD_LOWP=3" ) > $OUT/sweep.log 2>&1
tail -12 $OUT/sweep.log
( timeout 150 python3 -m pytest -q -s -o addopts="" -p no:cacheprovider tests/test_triton_chunk_bwd.py -k "real_size and delta" ) > $OUT/tests_l4.log 2>&1
grep -E "rel err|passed|failed" $OUT/tests_l4.log
( CHUNKWISE_BWD_LOWP=3 timeout 150 python3 -m pytest -q -s -o addopts="" -p no:cacheprovider tests/test_triton_chunk_bwd.py -k "real_size and delta" ) > $OUT/tests_l3.log 2>&1
grep -E "rel err|passed|failed|Warn" $OUT/tests_l3.log
# sourced by each device call
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
export GIT_COMMIT=$(cat .agents/commit)
mkdir -p /tmp/triton_cache_sm90
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp 2>/dev/null; done
export TRITON_CACHE_DIR=/tmp/triton_cache_sm90 TRITON_CACHE_AUTOTUNING=1
nvidia-smi -L; python3 -c "import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)"
