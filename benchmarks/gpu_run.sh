#!/usr/bin/env bash
# One GPU run on the device machine: check, test and time chunkwise next to fla, within 9.5 minutes.
#
#   bash benchmarks/gpu_run.sh [--commit SHA] [--budget PHASE=SECONDS ...] [PHASE ...]
#
# Phases, in order (default: all): check (`chunkwise check`), tests (`pytest tests -x`), forward, train, decode
# (benchmarks/bench_*.py on the standing and few-heads shapes, fla 0.6.0 beside). Each phase runs under its own time
# limit (BUDGET below, seconds; --budget tests=400 changes one); at the limit a benchmark gets SIGINT and writes the
# rows it has. Compiling (ours, and fla's configuration search) would take most of the benchmarks' time, so
# `--warmup` runs of the forward and training benchmarks compile their kernels beside check and tests (the "warm"
# budget), and the timed phases start once they have ended. The device copy of the tree has no git history: pass
# the commit with --commit.
#
# Carry (the device tool's `carry`): .whl for fla (`../shared/device/wheels.sh fla-core==0.6.0`, plus any pinned
# test dependency), and optionally .triton_sm90 (`python benchmarks/tools.py warm`: kernels built here for sm_90).
# Everything lands in $OUT (8 files: summary.txt, logs.tgz with every phase's log, bench_{forward,train,decode}
# .json / .png); the short tables are printed last.
set -u
# seconds per phase; warm runs beside check + tests (not added): ~20 s of set-up + 540 = 560 s
declare -A BUDGET=([check]=60 [tests]=200 [warm]=250 [forward]=150 [train]=100 [decode]=30)
PHASES=() COMMIT=""
while [ $# -gt 0 ]; do
  case $1 in
    --commit) COMMIT=$2; shift 2 ;;
    --budget) BUDGET[${2%%=*}]=${2#*=}; shift 2 ;;
    check|tests|forward|train|decode) PHASES+=("$1"); shift ;;
    *) echo "gpu_run.sh: unknown argument $1 (phases: check tests forward train decode)" >&2; exit 2 ;;
  esac
done
[ ${#PHASES[@]} -gt 0 ] || PHASES=(check tests forward train decode)
[ -n "$COMMIT" ] || COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)

OUT=$(realpath -m "${OUT:-bench_out}"); WORK=/tmp/gpu_run; rm -rf "$WORK"; mkdir -p "$OUT" "$WORK"
SUMMARY=$WORK/summary.txt
say() { echo "$*" | tee -a "$SUMMARY"; }
finish() {   # at exit, however the run ends: the logs packed, the benchmarks' files and the summary copied
  tar czf "$OUT/logs.tgz" -C "$WORK" --exclude='*.json' --exclude='*.png' . 2>/dev/null
  cp "$WORK"/bench_*.json "$WORK"/bench_*.png "$SUMMARY" "$OUT"/ 2>/dev/null
}
trap finish EXIT
START=$(date +%s)

# -- set-up: fla from the carried wheels, the package from src/, versions ---------------------------------------
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$WORK/pip.log" 2>&1 || say "pip install of .whl failed (see logs.tgz: pip.log)"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if [ -s .triton_sm90/cache.tgz ]; then      # the cache index holds absolute paths: unpacked where it was built
  tar xzf .triton_sm90/cache.tgz -C /tmp && export TRITON_CACHE_DIR=/tmp/triton_cache_sm90
fi
say "== $(date -u +%FT%TZ)  commit $COMMIT  phases: ${PHASES[*]}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
for m in ('fla', 'flashinfer', 'transformers'):
    try: print(m, __import__(m).__version__)
    except Exception as e: print(m, 'not importable:', type(e).__name__)" 2>&1 | paste -sd' ' | tee -a "$SUMMARY"
[ -n "${TRITON_CACHE_DIR:-}" ] && say "prebuilt Triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries"

# -- phases ------------------------------------------------------------------------------------------------------
# phase NAME COMMAND...: runs COMMAND under its budget (SIGINT at the limit, SIGKILL 20 s later), log in $WORK
phase() {
  local name=$1 t0; shift; t0=$(date +%s)
  timeout -s INT -k 20 "${BUDGET[$name]}" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  say "== $name: rc=$rc, $(( $(date +%s) - t0 )) s of ${BUDGET[$name]} s$([ $rc = 124 ] && echo ', cut at its limit')"
}
BENCH=(--out "$WORK" --commit "$COMMIT")
SHAPES=(--shapes standing,few-heads)
# the warm-up: per benchmark two processes (two ops each) compile in parallel; the tests keep enough GPU memory
WARM=()
for b in forward train; do
  [[ " ${PHASES[*]} " == *" $b "* ]] || continue
  for ops in gdn,kda delta,gla; do
    timeout -s INT -k 10 "${BUDGET[warm]}" python3 "benchmarks/bench_$b.py" --warmup --ops $ops "${SHAPES[@]}" \
      > "$WORK/warm_${b}_${ops/,/_}.log" 2>&1 &
    WARM+=($!)
  done
done
warm_wait() {   # before any timing: the warm-up processes ended (each is bounded by the warm budget)
  [ ${#WARM[@]} -gt 0 ] || return 0
  local t0=$(date +%s); wait "${WARM[@]}"; WARM=()
  say "== warm: ended $(( $(date +%s) - START )) s into the run (the timed phases waited $(( $(date +%s) - t0 )) s for it)"
}
for p in "${PHASES[@]}"; do
  case $p in forward|train|decode) warm_wait ;; esac
  case $p in
    check)   phase check python3 -m chunkwise check ;;
    tests)   phase tests python3 -m pytest tests -x -q -p no:cacheprovider -o addopts="" --durations=15 ;;
    forward) phase forward python3 benchmarks/bench_forward.py "${SHAPES[@]}" "${BENCH[@]}" ;;
    train)   phase train python3 benchmarks/bench_train.py "${SHAPES[@]}" "${BENCH[@]}" ;;
    decode)  phase decode python3 benchmarks/bench_decode.py "${BENCH[@]}" ;;
  esac
done
say "== total $(( $(date +%s) - START )) s"

# -- the short results last --------------------------------------------------------------------------------------
for p in "${PHASES[@]}"; do
  case $p in
    check) { echo; echo "== check"; tail -n 3 "$WORK/check.log"; } | tee -a "$SUMMARY" ;;
    tests) { echo; echo "== tests"; grep -E "passed|failed|error" "$WORK/tests.log" | tail -n 3;
             grep -E "^(FAILED|ERROR) " "$WORK/tests.log" | head -n 5; } | tee -a "$SUMMARY" ;;
    *)     { echo; awk '/^(Forward|Decode)[ ,]/ {buf=""; on=1} on {buf=buf $0 "\n"} END {printf "%s", buf}' \
               "$WORK/$p.log"; } | tee -a "$SUMMARY" ;;
  esac
done
