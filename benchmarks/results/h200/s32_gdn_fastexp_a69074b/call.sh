# device call of session 32; .agents/common.sh is benchmarks/results/h200/s32_common.sh
source .agents/common.sh
S=B8-T4096-H32,B4-T8192-H16/HV32,B1-T32768-H32
for e in 1 0 1 0; do CHUNKWISE_FAST_EXP=$e timeout 60 python3 benchmarks/results/h200/s32_gdn_fastexp_a69074b/fexp.py $S 2>&1 | grep FAST_EXP; done
