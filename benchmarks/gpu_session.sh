#!/usr/bin/env bash
# Device calls that test and time everything on the GPU (H200); logs packed into $OUT/run.tgz.
# Usage (device tool, carry .whl for fla and .triton_sm90 for kernels built by benchmarks/warm_cache.py):
#   .whl: `../shared/device/wheels.sh fla-core==0.6.0 transformers==5.24.0` (the test extra's pin: the device's own
#   transformers 5.17.0 takes no grouped heads in the functions tests/test_hf.py compares against; NOTES session 29)
#   GIT_COMMIT=<sha> bash benchmarks/gpu_session.sh [fwd] [tests] [bwd]      (default: fwd tests; <= 9.6 min)
#   env: TESTS_T / TRAIN_T / FWD_T step timeouts (s), NPROC xdist workers, SKIP_TRAIN=1 skips the MQAR example;
#   FWD_SHAPES the forward table's shapes (one process each: fla's fresh search, ~50-250 s a shape)
#   fwd:   stage-1 sweep (picks CHUNKWISE_PREP_CONFIG), forward benchmark vs fla (FWD_FAMS=gdn,kda,delta,gla)
#   fwdonly: the forward benchmark vs fla at the defaults (no stage-1 sweep)
#   tests: GPU tests (TESTS="<files>" and TESTS_K="<-k expr>" override the selection) and the MQAR example (SKIP_TRAIN=1 skips it)
#   bwd:   backward warps sweep, fwd+bwd benchmark vs fla (~6 min)
#   train: fwd+bwd benchmark vs fla alone (FAMS=delta,kda,gdn; FLA_FAMS=delta times fla for those only; TRAIN_SHAPES
#          comma-separated bench_forward shape names, default B1-T32768-H32)
#   verify: the real-size bf16 tests (fwd, bwd, Hopper pin, >2^31 offsets), again with CHUNKWISE_BWD_LOWP=$VERIFY_LOWP (4)
#   kdaverify: KDA's real-size gradient tests alone (bf16, fp16), then bf16 with CHUNKWISE_SAVE_WU_LOWP=1 (~2 x 280 s)
#   diag:  backward test failures, each test x launch setting in its own process (benchmarks/diag_bwd.py)
#   pair16: the state-tile pass's pairwise forms (CHUNKWISE_BWD_DQK_PAIR16 0 / 1 / 3 for DeltaNet, 0 / 3 for GDN and
#          simple GLA): fwd+bwd per kernel, then their real-size errors against float64 and fla; then the WY pass
#          capped at 168 / 128 registers (sweep_bwd --variants wyregs) (~8 min)
#   sides: the state-tile pass by side, with the WY pass's work in its key side, and the column blocks' split products
#          in place: their real-size errors against float64 and fla while every variant compiles, then sweep_bwd
#          --variants sides per family (SIDES_FAMS, default "delta gdn"); ~8 min with a prebuilt cache
#   leads: session 33's untimed leads (sweep_bwd --variants leads: the WY split form, level 3, P_IN_DH on SAVE_HT),
#          per family of SIDES_FAMS; with sides in the same call the compiles share one parallel warm-up
#   pair:  KDA's pairwise-gradient kernel variants (sweep_bwd.py PAIR_VARIANTS: channels per program, warps, diagonal launch)
#   ncu:   Nsight Compute reports of the largest kernels (NCU_TARGETS; NCU_EXTRA more ncu arguments; summary by benchmarks/ncu_summary.py)
#   save:  fwd+bwd with the forward's stage 1 kept for the backward (CHUNKWISE_SAVE_STAGE1=1) against the default
#   lowp:  fwd+bwd with the key side's 16-bit operands but its pairwise products (CHUNKWISE_BWD_LOWP=4) against the default 2
#   regs:  registers per thread capped (CHUNKWISE_MAXNREG) in the chunk-parallel kernels, fwd+bwd per kernel
#   ahead: the reverse state pass's dR_local in the step / a step ahead / in the step unfused (CHUNKWISE_BWD_DH_AHEAD 0 / 1 / 2)
#   kdasplit: KDA fwd+bwd with its stage 1 in one launch or two (CHUNKWISE_KDA_ONE_REF 1 / 2)
#   tform: fwd+bwd with the training forward under T_FORM or keeping W / U (CHUNKWISE_SAVE_T_FORM), 16-bit W / U, 8 warps
#   pairregs: KDA's one-reference pair launch at 16 / 32 channels and capped registers (REG_FAMS=kda)
#   dqk:   scalar / no gate: the value and key sides as _bwd_dqk_kernel + _bwd_wy_kernel (warps, column block) against the two older kernels
#   states: fwd+bwd with the forward keeping the per-chunk states and R (CHUNKWISE_SAVE_STATES=1) against recomputing them
#   oneref: KDA's one-reference products off / forward / both / with scaled keys / pair at 64 channels (sweep_bwd.py ONEREF_VARIANTS)
#   variants: stage-2 launch variants (VAR_FAMS, default gla,gdn; VAR_SHAPES; VARIANT_SET=seg: only GLA's segment split, pfree: P in stage 2) (BV x warps x stages) of GLA and GDN at B1 / B8 (~3 min)
set -u
PARTS=${*:-fwd tests}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
# every log goes to $LOG; at exit it is packed into $FINAL/run.tgz (the device tool returns 8 files at most)
FINAL=$(realpath -m "${OUT:-bench_out}"); LOG=/tmp/gpu_session; mkdir -p "$FINAL" "$LOG"; OUT=$LOG
touch /tmp/gpu_session_start
# the Triton cache entries this run added (fla's autotuning results and kernels, ours compiled here) come back
# in $FINAL/new_cache.tgz, or only the autotuning results where all of it passes 15 MB: merged into the
# prebuilt cache here with `python benchmarks/warm_cache.py --merge <new_cache.tgz>`, the next run skips them
harvest() { local d=${TRITON_CACHE_DIR:-}; [ -d "$d" ] || return 0
  ( cd "$(dirname "$d")" && find "$(basename "$d")" -type f -newer /tmp/gpu_session_start \( -name '*.json' -o -name '*.cubin' \
      -o -name '__grp__*' \) > /tmp/new_cache.list && [ -s /tmp/new_cache.list ] || exit 0
    tar czf "$FINAL/new_cache.tgz" -T /tmp/new_cache.list
    if [ "$(stat -c %s "$FINAL/new_cache.tgz")" -gt 15000000 ]; then
      grep 'autotune.json$' /tmp/new_cache.list > /tmp/new_cache_at.list; tar czf "$FINAL/new_cache.tgz" -T /tmp/new_cache_at.list; fi
    echo "new cache entries: $(wc -l < /tmp/new_cache.list) files, packed $(stat -c %s "$FINAL/new_cache.tgz") B" ) }
trap 'tar czf "$FINAL/run.tgz" -C "$LOG" . ; cp "$LOG"/*.png "$LOG"/*.json "$FINAL"/ 2>/dev/null; harvest' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} || exit 1
export PYTHONUNBUFFERED=1 CHUNKWISE_FAILLOG=$OUT/failures.txt
# fla's kernels autotune per process: keep each result on disk so that the next process (test worker) with the same
# key skips the search. The benchmarks do not use kept results for fla's timings: bench_forward / bench_train make
# fla search afresh before each (fla_fresh_search; kept picks made fla's GDN forward at B1 9 % slower, session 30)
export TRITON_CACHE_AUTOTUNING=1
# kernels compiled for sm_90 off the device (benchmarks/warm_cache.py; carry .triton_sm90): cache hits skip compiling
if [ -s .triton_sm90/cache.tgz ]; then
  tar xzf .triton_sm90/cache.tgz -C /tmp && export TRITON_CACHE_DIR=/tmp/triton_cache_sm90 \
    && echo "prebuilt triton cache: $(ls /tmp/triton_cache_sm90 | wc -l) kernels"
fi
nvidia-smi -L; python3 -c "import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)"
ncache() { ls "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" 2>/dev/null | wc -l; }
step() { local t=$1; shift; local name=$1; shift; local s=$(date +%s) c0=$(ncache)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  # kernels compiled here during the step (cache entries added): 0 means the prebuilt cache held them all
  echo "== $name rc=$rc $(( $(date +%s) - s ))s, $(( $(ncache) - c0 )) new cache entries"; tail -n "${TAILN:-6}" "$OUT/$name.log"; }
warm_bwd() { for f in gdn delta kda; do for w in 4 8; do
  timeout 200 python3 benchmarks/sweep_bwd.py --warm --fams $f --warps $w > "$OUT/warm_bwd_${f}_$w.log" 2>&1 & done; done; wait; }

VAR_FAMS=${VAR_FAMS:-gla,gdn} VARIANT_SET=${VARIANT_SET:-all}   # the variants part (bench_forward --variant-set)
FWD_FAMS=${FWD_FAMS:-gdn,kda,delta,gla}       # the families of the fwd part (stage-1 sweep: those with a stage 1)
S1_FAMS=$(echo "$FWD_FAMS" | tr , '\n' | grep -v gla | paste -sd, -)
warm_variants() { for f in ${VAR_FAMS//,/ }; do timeout 150 python3 benchmarks/bench_forward.py --warm --variants --families $f \
      --variant-set "$VARIANT_SET" --shapes "${VAR_SHAPES:-B1-T32768-H32,B8-T4096-H32}" > "$OUT/warm_var_$f.log" 2>&1 & done; wait; }
if has fwd; then
  # the stage-1 variants compile in parallel (CPU), then are timed alone; the pick is used from here on
  ( has variants && warm_variants &
    has tests || for f in ${FWD_FAMS//,/ }; do
      timeout 190 python3 benchmarks/bench_forward.py --warm --families $f > "$OUT/warm_$f.log" 2>&1 & done
    for f in ${S1_FAMS//,/ }; do for w in 4 8; do
      timeout 100 python3 benchmarks/sweep_stage1.py --warm --fams $f --warps $w > "$OUT/warm_s1_${f}_$w.log" 2>&1 & done; done
    wait )
  [ -n "$S1_FAMS" ] && TAILN=32 step 120 sweep_stage1 python3 benchmarks/sweep_stage1.py --fams "$S1_FAMS" --out "$OUT"
  [ -s "$OUT/prep_config.txt" ] && export CHUNKWISE_PREP_CONFIG=$(cat "$OUT/prep_config.txt") && echo "CHUNKWISE_PREP_CONFIG=$CHUNKWISE_PREP_CONFIG"
fi
if has tests; then
  # GPU tests and the MQAR example while the forward benchmark (and the backward sweep) compile
  ( has fwd && for f in ${FWD_FAMS//,/ }; do timeout 190 python3 benchmarks/bench_forward.py --warm --families $f > "$OUT/warm_$f.log" 2>&1 & done
    has bwd && warm_bwd; wait ) &
  ( [ "${SKIP_TRAIN:-0}" = 1 ] || timeout 190 python3 examples/train_mqar.py --config gpu --backend triton \
      --plot "$OUT/mqar_loss_gpu.png" --json "$OUT/mqar_gpu.json" > "$OUT/mqar_gpu.log" 2>&1 ) &
  # TESTS_FIRST="<pytest args>": a selection run to completion before the rest (its own step, TESTS_FIRST_T)
  [ -n "${TESTS_FIRST:-}" ] && TAILN=4 step ${TESTS_FIRST_T:-150} tests_first python3 -m pytest -v -n ${NPROC:-6} \
    --max-worker-restart 32 -p no:cacheprovider -o addopts="" --tb=line -rf --durations=15 $TESTS_FIRST
  TAILN=4 step ${TESTS_T:-190} tests python3 -m pytest -v -n ${NPROC:-6} --dist loadgroup --max-worker-restart 32 -p no:cacheprovider -o addopts="" --tb=line -rf \
    ${TESTS:-tests/test_compile.py tests/test_triton_chunk_fwd.py tests/test_triton_chunk_bwd.py tests/test_layers.py} \
    -k "${TESTS_K:-fp16 or unaligned or real_size or grads or compile or opcheck or hopper or wide or gradients or cuda_graph or decode_step or prefill}"
  wait
  echo "== mqar"; tail -n 2 "$OUT/mqar_gpu.log"
  TAILN=14 step 180 chunkwise_check python3 -m chunkwise check     # the README's main job, on the GPU (gradients too: their backward builds compile here)
  [ -s "$OUT/failures.txt" ] && { echo "== failures"; grep "^===" "$OUT/failures.txt" | sort -u | head -20; grep "^E " "$OUT/failures.txt" | sort | uniq -c | sort -rn | head -8; }
elif has bwd; then
  warm_bwd
fi
# the forward table, one process per shape (FWD_SHAPES; FWD_T s each): fla searches its configurations afresh before
# each timing (bench_forward.fla_fresh_search), ~250 s at B1 for all four families on the H200, 50-180 s elsewhere
fwd_table() { for s in ${FWD_SHAPES:-B1-T32768-H32 B8-T4096-H32 B4-T8192-H16/HV32 varlen16-T32768-H32}; do
  TAILN=6 step ${FWD_T:-300} "bench_forward_${s%%-*}" python3 benchmarks/bench_forward.py --families "$FWD_FAMS" \
    --shapes "$s" --out "$OUT/fwd_${s%%-*}"; done; }
if has fwdonly; then     # the forward benchmark at the defaults (no stage-1 sweep), FWD_FAMS
  for f in ${FWD_FAMS//,/ }; do timeout 190 python3 benchmarks/bench_forward.py --warm --families $f > "$OUT/warm_$f.log" 2>&1 & done; wait
  fwd_table
fi
if has fwd; then
  fwd_table
fi
if has bwd; then
  TAILN=40 step 150 sweep_bwd python3 benchmarks/sweep_bwd.py --out "$OUT"
  TAILN=12 step ${TRAIN_T:-200} bench_train python3 benchmarks/bench_train.py --families gdn,delta,kda --shapes B1-T32768-H32 --profile --out "$OUT"
fi
if has verify; then    # the real-size bf16 GPU tests alone (no small fp32 ones), then the 16-bit key-side variant's errors
  TAILN=6 step ${VERIFY_T:-240} verify python3 -m pytest -v -n ${NPROC:-12} --dist loadgroup --max-worker-restart 32 -p no:cacheprovider \
    -o addopts="" --tb=line -rP --durations=20 tests/test_triton_chunk_fwd.py tests/test_triton_chunk_bwd.py \
    -k "real_size or hopper or unaligned or offsets_past"
  grep -h "rel err" "$OUT/verify.log" | sort | head -20
  CHUNKWISE_BWD_LOWP=${VERIFY_LOWP:-4} TAILN=6 step ${VERIFY_LOWP_T:-${VERIFY_T:-240}} verify_lowp python3 -m pytest -v -n ${NPROC:-12} --dist loadgroup -p no:cacheprovider \
    -o addopts="" --tb=line -rP tests/test_triton_chunk_bwd.py -k "real_size or hopper"
  grep -h "rel err" "$OUT/verify_lowp.log" | sort | head -20
fi
if has kdaverify; then   # KDA's real-size gradients against fla and float64 at the defaults, then bf16 with 16-bit W / U
  # (CHUNKWISE_SAVE_WU_LOWP=1, chunk_bwd.SAVE_WU_LOWP); alone, -v: behind other tests fla's backward autotuning ran out
  # the step twice in session 20
  TAILN=8 step ${KV_T:-280} kdaverify python3 -m pytest -v -n 2 -p no:cacheprovider -o addopts="" --tb=short -rP \
    tests/test_triton_chunk_bwd.py -k "kda and real_size"
  grep -h "rel err" "$OUT/kdaverify.log" | sort -u
  CHUNKWISE_SAVE_WU_LOWP=1 TAILN=8 step ${KV_T:-280} kdaverify_lowp python3 -m pytest -v -p no:cacheprovider -o addopts="" \
    --tb=short -rP tests/test_triton_chunk_bwd.py -k "kda and real_size and bf16"
  grep -h "rel err" "$OUT/kdaverify_lowp.log" | sort -u
fi
if has train; then     # fwd+bwd against fla alone (FAMS, default delta,kda,gdn; TRAIN_SHAPES, default B1 only)
  TAILN=12 step ${TRAIN_T:-200} bench_train python3 benchmarks/bench_train.py --families ${FAMS:-delta,kda,gdn} \
    --shapes "${TRAIN_SHAPES:-B1-T32768-H32}" --profile --fla-families "${FLA_FAMS:-}" --out "$OUT"
fi
if has diag; then       # backward test failures bisected by launch knobs (benchmarks/diag_bwd.py)
  TAILN=70 step ${DIAG_T:-400} diag python3 benchmarks/diag_bwd.py --preset "${DIAG_PRESET:-session5}" --jobs ${NPROC:-12} --out "$OUT"
fi
if has pair16; then     # the state-tile pass's pairwise forms (CHUNKWISE_BWD_DQK_PAIR16, session 32): time, then errors
  TAILN=10 step ${PAIR16_T:-200} pair16_delta python3 benchmarks/sweep_bwd.py --fams delta --out "$OUT/pair16_delta" \
    --variants "p1:;p0:CHUNKWISE_BWD_DQK_PAIR16=0;p3:CHUNKWISE_BWD_DQK_PAIR16=3"
  TAILN=20 step ${PAIR16_T:-200} pair16_gated python3 benchmarks/sweep_bwd.py --fams gdn,gla --out "$OUT/pair16_gated" \
    --variants "p0:;p3:CHUNKWISE_BWD_DQK_PAIR16=3"
  TAILN=8 step ${PAIR16_TESTS_T:-200} pair16_tests python3 -m pytest -v -s -p no:cacheprovider -o addopts="" --tb=line \
    tests/test_triton_chunk_bwd.py -k "real_size_pair16 or (real_size_grads_vs_fla and (delta or gdn or gla))"
  grep -h "rel err" "$OUT/pair16_tests.log"
  # the WY pass at a third / fourth program per SM (register caps)
  TAILN=20 step ${PAIR16_T:-200} wyregs python3 benchmarks/sweep_bwd.py --fams delta,gdn --out "$OUT/wyregs" --variants wyregs
fi
if has sides || has leads; then   # the state-tile pass by side (sessions 34-35) and session 33's untimed leads
  # the real-size errors of every sides setting (GPU tests, 4 workers) while every (family, variant) compiles in a
  # process of its own (~30 processes on 16 cores; a prebuilt .triton_sm90 cache makes them hits), then each family
  # timed alone: ~8 min with the prebuilt cache (`python benchmarks/warm_cache.py --bench --bench-only "variants
  # sides|variants leads" tests/test_triton_chunk_bwd.py -k real_size_sides`: 80 s here, 3-4 MB)
  SETS=$(for p in sides leads; do has $p && echo $p; done | paste -sd' ')
  ( has sides && timeout ${SIDES_TESTS_T:-200} python3 -m pytest -v -rP -n 4 -p no:cacheprovider -o addopts="" \
      --tb=line tests/test_triton_chunk_bwd.py -k "real_size_sides" > "$OUT/sides_tests.log" 2>&1 ) &
  for set in $SETS; do for f in ${SIDES_FAMS:-delta gdn}; do
    while read -r v; do     # (not a pipe: the jobs must be this shell's for the wait)
      timeout 150 python3 benchmarks/sweep_bwd.py --warm --fams $f --variants "$v" > "$OUT/warm_${set}_${f}_${v%%:*}.log" 2>&1 &
    done < <(python3 -c "from sweep_bwd import NAMED; print('\n'.join(NAMED['$set'].split(';')))"); done; done; wait
  has sides && { echo "== sides_tests"; grep -hE "rel err|passed|failed" "$OUT/sides_tests.log" | tail -30; }
  for set in $SETS; do for f in ${SIDES_FAMS:-delta gdn}; do    # one process per family and set
    TAILN=15 step ${SIDES_T:-110} ${set}_$f python3 benchmarks/sweep_bwd.py --fams $f --out "$OUT/${set}_$f" --variants $set
  done; done
fi
if has pair; then       # KDA's pairwise-gradient kernel: channels per program x warps
  TAILN=16 step ${PAIR_T:-150} sweep_pair python3 benchmarks/sweep_bwd.py --fams kda --out "$OUT" --variants "${PAIR_VARIANTS:-pair}"
fi
# regs: registers per thread capped in the chunk-parallel kernels; save: the forward keeps stage 1 for the backward
# (CHUNKWISE_SAVE_STAGE1=1); sweep_bwd.py's named variant sets, each against the defaults (REG_FAMS, REGS_T)
for set in regs save lowp oneref ahead states dqk kdasplit tform pairregs; do
  has $set && TAILN=40 step ${REGS_T:-200} sweep_$set python3 benchmarks/sweep_bwd.py --fams "${REG_FAMS:-kda,delta,gdn}" \
    --out "$OUT/$set" --variants $set
done
if has ncu; then        # Nsight Compute on the kernels NOTES.md asks about (benchmarks/ncu_run.py; NCU_TARGETS
  # "fam:mode:kernel-regex:launches per call ..."), the second call's launches only (-s skips the first's); text reports in ncu_*.log
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for tgt in ${NCU_TARGETS:-kda:fwd:chunk_prepare_kernel|chunk_state_output_kernel:2 gla:fwd:chunk_state_output_kernel:2 gdn:fwd:chunk_prepare_kernel|chunk_state_output_kernel:2 delta:train:_bwd_grad_kernel|_bwd_dv_kernel|_bwd_dh_kernel:3 kda:train:_bwd_pair_kernel|_bwd_grad_kernel:3}; do
    IFS=: read -r fam mode rx cnt <<< "$tgt"
    TAILN=0 step ${NCU_T:-150} "ncu_${fam}_$mode" "$NCU" --clock-control none ${NCU_EXTRA:-} \
      -k "regex:$rx" -s "$cnt" -c "$cnt" --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section InstructionStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 benchmarks/ncu_run.py --fam "$fam" --mode "$mode"
    python3 benchmarks/ncu_summary.py "$OUT/ncu_${fam}_$mode.log"
  done
fi
if has variants; then
  has fwd || warm_variants
  TAILN=4 step ${VAR_T:-120} bench_variants python3 benchmarks/bench_forward.py --variants --families "$VAR_FAMS" \
    --variant-set "$VARIANT_SET" --shapes "${VAR_SHAPES:-B1-T32768-H32,B8-T4096-H32}" --out "$OUT/variants"
  grep -h '"variants"' "$OUT/bench_variants.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); v = {k: x for k, x in r['variants'].items() if isinstance(x, float)}
    best = sorted(v.items(), key=lambda kv: kv[1])[:3]
    print(r['shape'], r['family'], 'default %.3f' % r['ours_ms'], 'best', ', '.join('%s %.3f' % kv for kv in best))"
fi
