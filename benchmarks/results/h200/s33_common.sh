# sourced by each device call
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
export GIT_COMMIT=$(cat .agents/commit)
mkdir -p /tmp/triton_cache_sm90
for f in benchmarks/fla_autotune/*.tgz; do tar xzf $f -C /tmp 2>/dev/null; done
export TRITON_CACHE_DIR=/tmp/triton_cache_sm90 TRITON_CACHE_AUTOTUNING=1
nvidia-smi -L; python3 -c "import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)"
