#!/usr/bin/env bash
# One GPU run on the device machine: check, test and time chunkwise next to fla, within 9.5 minutes.
#
#   bash benchmarks/gpu_run.sh [--commit SHA] [--budget PHASE=SECONDS ...] [PHASE ...]
#
# Phases (default: all but steep): check (`chunkwise check`), tests (`pytest tests`, stopping after 10 failures),
# serving (examples/serving.py: prefill into a pool, verify and roll back, a prefix checkpoint, in CUDA graphs),
# forward, train, decode (benchmarks/bench_*.py next to fla 0.6.0: forward on the standing and few-heads shapes,
# training on the standing shapes and GDN's 2/8 heads at 32k tokens, decode at batch 1-256 with 8-bit pools and a
# 4-token verify step), ckpt (the forward's cost of writing prefix checkpoints every 1024 tokens, GDN and KDA at
# B1-T32768-H32), steep (not in the default run: KDA's forward with steep gates, --gate-scale 4, beside fla at
# B1-T32768-H32 and 2 / 8 heads, 1 x 32768; writes bench_forward_steep.json). Every phase has a time limit (BUDGET
# below, in seconds; --budget tests=400 changes one): a benchmark starts no row past its limit less a margin and
# writes what it timed; a command still running at its limit is stopped (SIGINT, then SIGKILL 20 s later).
#
# Compiling (ours, and fla's configuration search) would take most of the benchmarks' time, so check, the tests
# and `--warmup` runs of the forward and training benchmarks (compile only) share the first window, side by side;
# the timed phases follow, one at a time. The device copy of the tree has no git history: pass --commit. The GPU test
# files at real size need a call of their own (`gpu_run.sh tests --budget tests=480`: about 350 s from a cold cache on
# an H100; leave the call's limit a minute for packing). From a cold cache
# fla's configuration searches do not fit one call beside ours either: time forward and decode in one call, train
# in the next (the second finds the first's cache when the machine is still warm).
#
# Carry (the device tool's `carry`): .whl for fla and the tests (`../shared/device/wheels.sh fla-core==0.6.0
# transformers==5.24.0 pytest-xdist==3.8.0 execnet==2.1.1`: the test extra's pins) and .triton_sm90, Triton's cache
# for sm_90 (made by `python benchmarks/tools.py warm` under the device's Python 3.12, or the triton_cache.tgz of the
# last run). Compiling is most of a first run's time: each run returns its cache (the compiled kernels: ours and every
# configuration fla searched), so save $OUT/triton_cache.tgz as .triton_sm90/cache.tgz for the next. $OUT receives 8
# files: logs.tgz (every phase's log and the summary), triton_cache.tgz, bench_{forward,train,decode}.{json,png} (and
# bench_forward_steep.json with steep). The short tables are printed last.
set -u
# first window (side by side): check, tests, serving, warm; then forward, train, decode, ckpt. ~15 s set-up + 240 +
# 300 = 555 s
# (decode: 24 rows, GDN and KDA, ~13 s timed with a warm Triton cache, ~20 s compiling its 8-bit and verify variants)
declare -A BUDGET=([check]=240 [tests]=240 [serving]=200 [warm]=220 [forward]=120 [train]=110 [decode]=45 [ckpt]=25 [steep]=90)
MARGIN=25                       # a benchmark's last row may run this long past its --time-limit
PHASES=() COMMIT=""
while [ $# -gt 0 ]; do
  case $1 in
    --commit) COMMIT=$2; shift 2 ;;
    --budget) BUDGET[${2%%=*}]=${2#*=}; shift 2 ;;
    check|tests|serving|forward|train|decode|ckpt|steep) PHASES+=("$1"); shift ;;
    *) echo "gpu_run.sh: unknown argument $1 (phases: check tests serving forward train decode ckpt steep)" >&2; exit 2 ;;
  esac
done
[ ${#PHASES[@]} -gt 0 ] || PHASES=(check tests serving forward train decode ckpt)
has() { [[ " ${PHASES[*]} " == *" $1 "* ]]; }
[ -n "$COMMIT" ] || COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)

OUT=$(realpath -m "${OUT:-bench_out}"); WORK=/tmp/gpu_run; rm -rf "$WORK"; mkdir -p "$OUT" "$WORK"
SUMMARY=$WORK/summary.txt
say() { echo "$*" | tee -a "$SUMMARY"; }
CACHE=/tmp/triton_cache_sm90        # tools.py warm's path: the cache index holds absolute paths
finish() {   # at exit, however the run ends: the cache packed, the benchmarks' files copied, the logs packed
  # what a cache hit reads (group index, metadata, cubin); past 15 MB only what this run compiled
  local find=(find "${CACHE##*/}" -type f \( -name '__grp__*' -o -name '*.json' -o -name '*.cubin' \))
  ( cd /tmp && "${find[@]}" > "$WORK/cache.list" && tar czf "$OUT/triton_cache.tgz" -T "$WORK/cache.list" \
    && [ "$(stat -c %s "$OUT/triton_cache.tgz")" -gt 15000000 ] && "${find[@]}" -newer "$WORK/start.mark" \
      > "$WORK/cache.list" && tar czf "$OUT/triton_cache.tgz" -T "$WORK/cache.list" \
    && echo "triton_cache.tgz holds this run's entries only (all of them passed 15 MB)" >> "$SUMMARY" ) 2>/dev/null
  cp "$WORK"/bench_*.json "$WORK"/bench_*.png "$OUT"/ 2>/dev/null
  cp "$WORK/steep/bench_forward.json" "$OUT/bench_forward_steep.json" 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$WORK" --exclude='*.json' --exclude='*.png' --exclude=cache.list . 2>/dev/null
}
trap finish EXIT
START=$(date +%s)

# -- set-up: fla (and pinned test dependencies) from the carried wheels, the package from src/, versions ----------
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$WORK/pip.log" 2>&1 || say "pip install of .whl failed (see logs.tgz: pip.log)"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# the package itself, for its console script (tests/test_cli.py), with the image's own setuptools (no network)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$WORK/pip_e.log" 2>&1 \
  || say "pip install -e . failed (see logs.tgz: pip_e.log)"
touch "$WORK/start.mark"                    # what the cache gains after this is this run's
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$CACHE
mkdir -p "$CACHE"
[ -s .triton_sm90/cache.tgz ] && tar xzf .triton_sm90/cache.tgz -C /tmp
say "== $(date -u +%FT%TZ)  commit $COMMIT  phases: ${PHASES[*]}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
for m in ('fla', 'flashinfer', 'transformers'):
    try: print(m, __import__(m).__version__)
    except Exception as e: print(m, 'not importable:', type(e).__name__)" 2>&1 | paste -sd' ' | tee -a "$SUMMARY"
say "Triton cache carried in: $(ls "$CACHE" | wc -l) entries"

# -- phases ------------------------------------------------------------------------------------------------------
# limited NAME LOG COMMAND...: COMMAND under NAME's budget, output to LOG; a subshell, so that a stopped command
# ends it with a status instead of a job notice from this shell
limited() { local name=$1 log=$2; shift 2; ( timeout -s INT -k 20 "${BUDGET[$name]}" "$@" > "$log" 2>&1; exit $? ); }
report() {   # report NAME RC T0
  say "== $1: rc=$2, $(( $(date +%s) - $3 )) s of ${BUDGET[$1]} s$([ "$2" = 124 ] || [ "$2" = 137 ] && echo ', stopped at its limit')"
}
phase() { local name=$1 t0; t0=$(date +%s); shift; limited "$name" "$WORK/$name.log" "$@"; report "$name" $? "$t0"; }
BENCH=(--out "$WORK" --commit "$COMMIT")
declare -A SHAPES=([forward]=standing,few-heads [train]=B1-T32768-H2-HV8,standing [decode]=decode)
limit() { echo $(( BUDGET[$1] - MARGIN )); }

# first window: check and the warm-up in the background, the tests in the foreground, then wait for all
T0=$(date +%s) JOBS=()
has check && { limited check "$WORK/check.log" python3 -m chunkwise check & JOBS+=("check:$!"); }
has serving && { limited serving "$WORK/serving.log" python3 examples/serving.py & JOBS+=("serving:$!"); }
for b in forward train; do
  has $b || continue
  for ops in gdn,kda delta,gla; do        # two processes per benchmark: compiles in parallel, GPU memory to spare
    limited warm "$WORK/warm_${b}_${ops/,/_}.log" python3 "benchmarks/bench_$b.py" --warmup --ops $ops \
      --shapes "${SHAPES[$b]}" --time-limit "$(limit warm)" &
    JOBS+=("warm:$!")
  done
done
# (not -x: one early failure would leave the rest of the GPU tests unrun in this window)
# (pytest-xdist where the carried wheels bring it, as many workers as tests/conftest.py gives -n auto: the tests are
# compile-bound)
XDIST=(); python3 -c "import xdist" 2>/dev/null && XDIST=(-n auto --dist worksteal --max-worker-restart=4)
has tests && phase tests python3 -m pytest tests --maxfail=10 -q -p no:cacheprovider -o addopts="" "${XDIST[@]}" \
  --faillog "$WORK/failures.log" --durations=15
for j in "${JOBS[@]}"; do
  wait "${j#*:}"; rc=$?
  [ "${j%%:*}" = warm ] && [ $rc = 0 ] || report "${j%%:*}" $rc "$T0"
done
[ ${#JOBS[@]} -gt 0 ] && say "== first window: $(( $(date +%s) - T0 )) s"

for p in forward train decode; do
  if has $p; then
    phase $p python3 "benchmarks/bench_$p.py" --shapes "${SHAPES[$p]}" --time-limit "$(limit $p)" "${BENCH[@]}"
  fi
done
has ckpt && phase ckpt python3 benchmarks/bench_forward.py --shapes B1-T32768-H32 --ops gdn,kda --no-peers \
  --checkpoint-every 1024 --out "$WORK/ckpt" --commit "$COMMIT"
has steep && phase steep python3 benchmarks/bench_forward.py --shapes B1-T32768-H32,B1-T32768-H2-HV8 --ops kda \
  --gate-scale 4 --time-limit "$(limit steep)" --out "$WORK/steep" --commit "$COMMIT"
say "== total $(( $(date +%s) - START )) s"

# -- the short results last --------------------------------------------------------------------------------------
if has check; then { echo; echo "== check"; tail -n 3 "$WORK/check.log"; } | tee -a "$SUMMARY"; fi
if has serving; then { echo; echo "== serving"; tail -n 4 "$WORK/serving.log"; } | tee -a "$SUMMARY"; fi
if has ckpt; then { echo; echo "== ckpt"; grep "^| B" "$WORK/ckpt.log"; } | tee -a "$SUMMARY"; fi
if has tests; then
  { echo; echo "== tests"; grep -E "passed|failed|error" "$WORK/tests.log" | tail -n 3
    grep -E "^(FAILED|ERROR) " "$WORK/tests.log" | head -n 5; } | tee -a "$SUMMARY"
fi
for p in forward train decode steep; do   # each benchmark's header line and markdown table (its last lines)
  if has $p; then
    { echo; awk '/^(Forward|Decode)[ ,]/ {buf=""; on=1} on {buf=buf $0 "\n"} END {printf "%s", buf}' "$WORK/$p.log"
    } | tee -a "$SUMMARY"
  fi
done
