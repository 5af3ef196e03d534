# .agents/common.sh of these session-33 calls is benchmarks/results/h200/s32_common.sh, unchanged
source .agents/common.sh >/dev/null 2>&1
GIT_COMMIT=$(cat .agents/commit) bash benchmarks/gpu_session.sh pair16 2>&1 | tail -80
