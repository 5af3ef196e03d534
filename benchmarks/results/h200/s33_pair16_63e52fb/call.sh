source .agents/common.sh >/dev/null 2>&1
GIT_COMMIT=$(cat .agents/commit) bash benchmarks/gpu_session.sh pair16 2>&1 | tail -80
