"""What the four benchmarks share: their options, the ops of chunkwise and of its peers (fla 0.6.0, FlashInfer) on
the same inputs, timing, the run's metadata, the JSON file, the plot and the markdown table.

Not a script: bench_forward.py, bench_train.py, bench_decode.py and bench_cpu.py import it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time

import torch

OPS = ("gdn", "kda", "delta", "gla")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
# ours against a peer: bf16 / fp16 outputs of two correct kernels differ by ~3e-3 (relative Frobenius norm)
AGREE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 2e-3}


def parser(doc: str, shapes: str, dtype: str = "bf16", warmup: bool = True,
           gates: bool = False) -> argparse.ArgumentParser:
    """The options every benchmark takes (``gates``: and --gate-scale, for those that draw the chunk ops' gates)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=shapes, help=f"set or shape names, comma separated (default {shapes}; "
                    "python benchmarks/shapes.py lists them)")
    ap.add_argument("--ops", default=",".join(OPS), help="ops, comma separated: gdn,kda,delta,gla")
    ap.add_argument("--out", default="bench_out", help="folder for the JSON file and the plot")
    ap.add_argument("--dtype", default=dtype, choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="chunkwise's backend (default: triton on a GPU, torch on the CPU)")
    ap.add_argument("--no-peers", action="store_true", help="time chunkwise alone")
    ap.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="start no further row after S seconds; write what was timed")
    if gates:
        ap.add_argument("--gate-scale", type=float, default=0.1, metavar="S",
                        help="the gates drawn as S·logsigmoid(randn) (default 0.1: about -0.08 per token, as fla's "
                        "benchmarks draw them; 4: about -3.2 per token, steep gates past KDA's one-reference span)")
    if warmup:
        ap.add_argument("--warmup", action="store_true", help="compile only: every op runs once per shape (fla with "
                        "its configuration search), nothing is timed or written; gpu_run.sh runs this beside the tests")
    return ap


def parse_ops(text: str) -> list[str]:
    ops = [o for o in text.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise SystemExit(f"unknown ops {bad}; choose from {','.join(OPS)}")
    return ops


def backend_of(args) -> str:
    return args.backend or ("triton" if torch.device(args.device).type == "cuda" else "torch")


# -- the ops ---------------------------------------------------------------------------------------------------

def _args(op: str, x: dict) -> list:
    return [x["q"], x["k"], x["v"]] + ([x["g"]] if op in ("gdn", "kda", "gla") else []) + \
        ([x["beta"]] if op != "gla" else [])


def chunkwise_op(op: str, mode: str = "chunk"):
    """chunkwise's public op: ``chunk_*`` or ``fused_recurrent_*``."""
    import chunkwise
    name = {"gdn": "gated_delta_rule", "kda": "kda", "delta": "delta_rule", "gla": "simple_gla"}[op]
    return getattr(chunkwise, f"{'chunk' if mode == 'chunk' else 'fused_recurrent'}_{name}")


def run_chunkwise(op: str, x: dict, backend: str, mode: str = "chunk", **kw):
    """(o, final state) of chunkwise on inputs x (shapes.make_inputs)."""
    return chunkwise_op(op, mode)(*_args(op, x), output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                  cu_seqlens_cpu=x["cu_seqlens_cpu"], chunk_indices=x["chunk_indices"],
                                  backend=backend, **kw)


_FLA = {"gdn": ("fla.ops.gated_delta_rule", "gated_delta_rule"), "kda": ("fla.ops.kda", "kda"),
        "delta": ("fla.ops.delta_rule", "delta_rule"), "gla": ("fla.ops.simple_gla", "simple_gla")}


def fla_op(op: str, mode: str = "chunk"):
    """fla's op of the same name, or None (with the reason on stderr) where fla is not importable."""
    module, name = _FLA[op]
    try:
        mod = __import__(module, fromlist=["_"])
        return getattr(mod, f"{'chunk' if mode == 'chunk' else 'fused_recurrent'}_{name}")
    except Exception as e:  # noqa: BLE001
        print(f"fla {op}: not importable ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def fla_inputs(op: str, x: dict) -> dict:
    """x as fla's op takes it: only fla's GDN takes grouped value heads, so the others get q and k repeated over each
    group (the same function); cu_seqlens as int64. The forward and decode benchmarks call this once, outside the
    timed call; the training benchmark lets run_fla repeat inside it (the repeat's backward sums the gradients)."""
    q, k, HV = x["q"], x["k"], x["v"].shape[2]
    if op != "gdn" and q.shape[2] != HV:
        q, k = q.repeat_interleave(HV // q.shape[2], 2), k.repeat_interleave(HV // k.shape[2], 2)
    cu = {} if x["cu_seqlens"] is None else dict(cu_seqlens=x["cu_seqlens"].long(),
                                                 cu_seqlens_cpu=x["cu_seqlens_cpu"].long())
    return dict(x, q=q, k=k, **cu)


def run_fla(op: str, fn, x: dict, **kw):
    """(o, final state) of fla's op on the same inputs (fla_inputs, if not done already)."""
    x = fla_inputs(op, x)
    if x["cu_seqlens"] is not None:
        kw.update(cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens_cpu"])
    # by keyword: fla's positional orders differ (its GDN decode takes gk, gv before beta)
    gates = {n: x[n] for n in ("g", "beta") if x[n] is not None}
    return fn(q=x["q"], k=x["k"], v=x["v"], **gates, output_final_state=True, **kw)


def flashinfer_gdn():
    """FlashInfer's GDN prefill (flashinfer.gdn_prefill.chunk_gated_delta_rule), or None where not importable."""
    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule
        return chunk_gated_delta_rule
    except Exception:  # noqa: BLE001
        return None


def flashinfer_inputs(x: dict) -> dict:
    """x as FlashInfer's GDN prefill takes it (made once, outside the timed call): packed tokens, the gate as
    alpha = exp(g) and beta in fp32, every batch row a sequence of cu_seqlens (int64)."""
    B, T = x["q"].shape[:2]
    cu = x["cu_seqlens"] if x["cu_seqlens"] is not None else torch.arange(0, (B + 1) * T, T, device=x["q"].device)
    return dict(q=x["q"].flatten(0, 1), k=x["k"].flatten(0, 1), v=x["v"].flatten(0, 1),
                g=x["g"].flatten(0, 1).exp().float(), beta=x["beta"].flatten(0, 1).float(), cu_seqlens=cu.long(),
                shape=(B, T))


def run_flashinfer_gdn(fn, xi: dict):
    """(o [B, T, HV, V], None) of FlashInfer's GDN prefill on flashinfer_inputs."""
    o = fn(xi["q"], xi["k"], xi["v"], g=xi["g"], beta=xi["beta"], cu_seqlens=xi["cu_seqlens"])
    o = o[0] if isinstance(o, tuple) else o
    return o.view(*xi["shape"], *o.shape[1:]), None


# -- fla's autotuning: a fresh search per timing --------------------------------------------------------------

def _fla_autotuners():
    """fla's autotuned kernels loaded in this process (also behind triton.heuristics and other wrappers)."""
    from triton.runtime.autotuner import Autotuner
    found = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.ops") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):
                if isinstance(obj, Autotuner) or not hasattr(obj, "fn"):
                    break
                obj = obj.fn
            if isinstance(obj, Autotuner):
                found[id(obj)] = obj
    return list(found.values())


# fla's configuration search times each candidate over this many ms of warm-up and repetitions (Triton's default,
# 25 / 100, makes a search ~10 s a row: a per-row search of every shape would not fit one GPU run)
FLA_SEARCH_MS = (5, 25)


def _compile_only_bench(fn, quantiles=None, **kw):
    fn()                        # compiles the candidate; every candidate ties, the first is kept
    return [1.0] * len(quantiles) if quantiles else 1.0


def fla_fresh_search():
    """Make fla's next call search its configurations afresh. fla's autotuners read Triton's kept results from disk
    (its FLA_CACHE_RESULTS default), and some of their keys leave T out, so a pick made at another shape or in
    another run would serve this one: fla would be timed at a configuration it did not choose for these inputs.
    Under --warmup the search only compiles each candidate."""
    import functools

    import triton
    bench = _compile_only_bench if COMPILE_ONLY else functools.partial(
        triton.testing.do_bench, warmup=FLA_SEARCH_MS[0], rep=FLA_SEARCH_MS[1])
    for at in _fla_autotuners():
        at.cache_results = False
        at.cache.clear()
        at.do_bench = bench         # (a cached_property of the autotuner: the instance's value wins)


def fla_autotune_picks() -> dict:
    """The configurations fla's autotuned kernels ran with in this process ({kernel: {key: config}})."""
    return {at.base_fn.__name__: {str(k): str(c) for k, c in at.cache.items()} for at in _fla_autotuners() if at.cache}


# -- timing and checks -----------------------------------------------------------------------------------------

# set by --warmup: time_ms and peak_mb call their function once and measure nothing (its kernels get compiled)
COMPILE_ONLY = False


def time_ms(fn, device, grad_to_none=None, reps: int = 3) -> float:
    """Median milliseconds of fn(): triton.testing.do_bench on a GPU (events, L2 flushed between calls), else
    time.perf_counter around ``reps`` calls after one warm-up."""
    if COMPILE_ONLY:
        fn()
        return float("nan")
    if torch.device(device).type == "cuda":
        import triton
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        for t in grad_to_none or ():
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def capture(fn) -> "torch.cuda.CUDAGraph":
    """fn() captured in a CUDA graph (after a warm-up call off the capturing stream, as torch.cuda.graphs asks)."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(fn, device) -> float | None:
    """Median milliseconds of fn() replayed from a CUDA graph (the GPU's time without the Python launch cost: where
    it is well under time_ms's, the call is bound by the host), None off CUDA or where fn cannot be captured."""
    if COMPILE_ONLY or torch.device(device).type != "cuda":
        return None
    import triton
    try:
        graph = capture(fn)
    except Exception as e:  # noqa: BLE001
        print(f"graph_ms: not captured ({type(e).__name__}: {e})"[:200], file=sys.stderr)
        return None
    return float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def peak_mb(fn, device) -> float | None:
    """Peak device memory of one fn() above what was allocated before it (MB); None on the CPU."""
    if torch.device(device).type != "cuda" or COMPILE_ONLY:
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# -- the run's record ------------------------------------------------------------------------------------------

def _version(module: str):
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None


def git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def metadata(args, **extra) -> dict:
    """Device, versions, commit and date of this run, and the options it ran with (the peers' versions None where
    they were not run: --no-peers)."""
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    peers = not getattr(args, "no_peers", False)
    return dict(device=name, torch=torch.__version__, triton=_version("triton"), fla=_version("fla") if peers else None,
                flashinfer=_version("flashinfer") if peers else None, chunkwise=_version("chunkwise"),
                commit=args.commit or git_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), dtype=args.dtype,
                backend=backend_of(args), gate_scale=getattr(args, "gate_scale", None),
                fla_search_ms=FLA_SEARCH_MS, **extra)


def collect(jobs, device, on_row=None, time_limit: float | None = None) -> tuple[list[dict], bool]:
    """Run each job (a callable returning a row) in order, printing each row as a JSON line as it comes. Past
    ``time_limit`` seconds no further job starts, and a SIGINT stops the loop too: then (rows so far, True)."""
    rows, start = [], time.monotonic()
    try:
        for job in jobs:
            if time_limit is not None and time.monotonic() - start > time_limit:
                print(f"time limit: keeping the {len(rows)} rows timed within {time_limit:.0f} s", file=sys.stderr)
                return rows, True
            rows.append(job())
            print(json.dumps(rows[-1], default=str), flush=True)
            if on_row is not None:
                on_row(rows)
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        print(f"interrupted: keeping the {len(rows)} rows timed so far", file=sys.stderr)
        return rows, True
    return rows, False


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Rows as a markdown table; columns are (header, key, format), a missing or None value printed as "-"."""
    def cell(r, key, fmt):
        v = r.get(key)
        return "-" if v is None else format(v, fmt)
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, k, f) for _, k, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_bars(rows: list[dict], path: str, title: str, series: list[tuple[str, str]], ylabel: str = "ms (median)"):
    """One panel per op, bars per shape for each (label, key) of ``series``; the title above all panels."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed", file=sys.stderr)
        return
    if not rows:
        return
    ops = list(dict.fromkeys(r["op"] for r in rows))
    series = [(label, key) for label, key in series if any(r.get(key) for r in rows)]
    n = max(len([r for r in rows if r["op"] == op]) for op in ops)
    # one panel per op, stacked: many shapes stay readable
    fig, axes = plt.subplots(len(ops), 1, figsize=(max(6.0, 0.8 * n + 2), 2.6 * len(ops) + 1), squeeze=False,
                             layout="constrained")
    width = 0.8 / len(series)
    for ax, op in zip(axes[:, 0], ops):
        rs = [r for r in rows if r["op"] == op]
        for i, (label, key) in enumerate(series):
            ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(rs))],
                   [r.get(key) or 0 for r in rs], width, label=label)
        ax.set_xticks(range(len(rs)), [r["shape"] for r in rs], rotation=20, ha="right", fontsize=7)
        ax.set_title(op, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=7)
    # wrapped to the figure's width: constrained layout makes room for the title's height, not its width
    fig.suptitle(textwrap.fill(title, width=int(fig.get_figwidth() * 9)), fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
