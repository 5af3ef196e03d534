source .agents/common.sh
S=B8-T4096-H32,B4-T8192-H16/HV32,B1-T32768-H32
for e in 1 0 1 0; do CHUNKWISE_FAST_EXP=$e timeout 60 python3 .agents/benchmarks/results/h200/s32_gdn_fastexp_a69074b/fexp.py $S 2>&1 | grep FAST_EXP; done
# sourced by each device call
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
export GIT_COMMIT=$(cat .agents/commit)
mkdir -p /tmp/triton_cache_sm90
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp 2>/dev/null; done
export TRITON_CACHE_DIR=/tmp/triton_cache_sm90 TRITON_CACHE_AUTOTUNING=1
nvidia-smi -L; python3 -c "import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)"
