"""The ``chunkwise`` command: ``chunkwise check`` (every op against the float64 recurrence) and
``chunkwise bench`` (timings over sequence lengths, fla side by side where installed).

Both run on the best device present: the Triton kernels on a CUDA GPU (backend "auto" picks them
for CUDA tensors), the PyTorch backend on the CPU.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field

import torch

# ----------------------------------------------------------------------------------------------
# what there is to run
# ----------------------------------------------------------------------------------------------

# family -> (chunk op, recurrent op, gate: none | scalar | channel, delta rule)
FAMILIES = {
    "gdn": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "scalar", True),
    "kda": ("chunk_kda", "fused_recurrent_kda", "channel", True),
    "delta": ("chunk_delta_rule", "fused_recurrent_delta_rule", "none", True),
    "gla": ("chunk_simple_gla", "fused_recurrent_simple_gla", "scalar", False),
}
# the same ops in flash-linear-attention (fla), for `bench`: (module, function)
FLA_OPS = {
    "gdn": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "kda": ("fla.ops.kda", "chunk_kda"),
    "delta": ("fla.ops.delta_rule", "chunk_delta_rule"),
    "gla": ("fla.ops.simple_gla", "chunk_simple_gla"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# relative error (‖x − ref‖ / ‖ref‖ against the float64 recurrence) each input dtype may cost
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def _op(name: str):
    """The public op by name, looked up at call time (so a patched op is what runs)."""
    import chunkwise
    return getattr(chunkwise, name)


def _device(arg: str) -> torch.device:
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(arg)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("chunkwise: --device cuda asked for, but torch sees no CUDA device")
    return dev


def _dtype(arg: str, device: torch.device) -> torch.dtype:
    if arg == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[arg]


def _backend_name(device: torch.device, K: int, V: int) -> str:
    from .api import _choose_backend
    return _choose_backend("auto", device, K, V)


# ----------------------------------------------------------------------------------------------
# random inputs
# ----------------------------------------------------------------------------------------------

@dataclass
class Case:
    """One op call: the op's name, its positional tensors and keyword arguments."""
    label: str            # e.g. "gdn chunk"
    op: str               # public function name
    shape: str            # for the table
    tokens: int           # tokens processed per call (for tokens/s)
    args: list            # q, k, v[, g][, beta]
    kwargs: dict = field(default_factory=dict)


def make_args(family: str, B: int, T: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype,
              device: torch.device, gen: torch.Generator, lengths=None):
    """Random, never-zero inputs of one family (drawn in float64 on the CPU, then cast).

    k is L2-normalised (as the models do, keeping the delta rule contractive); β ∈ (0.05, 0.95);
    g ∈ (−0.5, −0.001) per token and head (per channel for KDA); an initial state of N sequences.
    Returns (positional args, initial_state [N, HV, K, V] fp32, cu_seqlens or None).
    """
    _, _, gate, delta = FAMILIES[family]
    cu = None
    if lengths is not None:
        B, T = 1, sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    N = B if lengths is None else len(lengths)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, K)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, HV, V)
    args = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    if gate != "none":
        shape = (B, T, HV) if gate == "scalar" else (B, T, HV, K)
        g = -torch.rand(*shape, generator=gen, dtype=torch.float64) * 0.5 - 1e-3
        args.append(g.to(device=device, dtype=torch.float32))
    if delta:
        beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * 0.9 + 0.05
        args.append(beta.to(device=device, dtype=dtype))
    h0 = (rnd(N, HV, K, V) * 0.5).to(device=device, dtype=torch.float32)
    return args, h0, cu


def _unpack(family: str, args):
    """(q, k, v, g, beta) from a family's positional args."""
    _, _, gate, delta = FAMILIES[family]
    q, k, v, *rest = args
    g = rest.pop(0) if gate != "none" else None
    beta = rest.pop(0) if delta else None
    return q, k, v, g, beta


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------

def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, reps: int = 5, warmup: int = 1, grad_to_none=None) -> float:
    """Median milliseconds of ``fn()``: triton.testing.do_bench on a GPU, perf_counter on the CPU."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(max(1, reps)):
        if grad_to_none is not None:
            for x in grad_to_none:
                x.grad = None
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# ----------------------------------------------------------------------------------------------
# chunkwise check
# ----------------------------------------------------------------------------------------------

def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64; any NaN/inf in x gives inf."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_cases(device: torch.device, dtype: torch.dtype, quick: bool, seed: int,
                families: list[str] | None = None) -> list[Case]:
    """Every family in chunk and fused_recurrent form, a decode step (T = 1) and a varlen batch."""
    gen = torch.Generator().manual_seed(seed)
    gpu = device.type == "cuda"
    if quick:
        dense = dict(B=2, T=100, H=1, HV=2, K=32, V=32)
        recur = dict(B=2, T=50, H=1, HV=2, K=32, V=32)
        lengths = [1, 40, 70]
    elif gpu:
        dense = dict(B=2, T=2048, H=4, HV=8, K=128, V=128)
        recur = dict(B=2, T=512, H=4, HV=8, K=128, V=128)
        lengths = [1, 63, 500, 1000, 2000]
    else:
        dense = dict(B=2, T=1000, H=2, HV=4, K=64, V=64)
        recur = dict(B=2, T=300, H=2, HV=4, K=64, V=64)
        lengths = [1, 63, 200, 700]
    decode = dict(dense, B=8 if gpu else 4, T=1)
    cases = []

    def shape(s, lens=None):
        head = f"B={s['B']} T={s['T']}" if lens is None else f"varlen N={len(lens)} T={sum(lens)}"
        return f"{head} H={s['H']} HV={s['HV']} K={s['K']} V={s['V']}"

    for fam, (chunk_op, recur_op, _, _) in FAMILIES.items():
        if families is not None and fam not in families:
            continue
        for label, op, s, lens in ((f"{fam} chunk", chunk_op, dense, None),
                                   (f"{fam} recurrent", recur_op, recur, None),
                                   (f"{fam} decode", recur_op, decode, None),
                                   (f"{fam} varlen", chunk_op, dense, lengths)):
            args, h0, cu = make_args(fam, s["B"], s["T"], s["H"], s["HV"], s["K"], s["V"], dtype, device, gen,
                                     lengths=lens)
            kwargs = dict(initial_state=h0, output_final_state=True)
            if cu is not None:
                kwargs["cu_seqlens"] = cu
            tokens = args[0].shape[0] * args[0].shape[1]
            cases.append(Case(label, op, shape(s, lens), tokens, args, kwargs))
    return cases


def _reference(case: Case, family: str):
    """The float64 token recurrence on the case's device (chunkwise.reference.recurrent)."""
    from .reference.recurrent import recurrent_forward
    q, k, v, g, beta = _unpack(family, case.args)
    scale = q.shape[-1] ** -0.5
    return recurrent_forward(q, k, v, g, beta, scale, case.kwargs.get("initial_state"),
                             case.kwargs.get("cu_seqlens"), dtype=torch.float64)


def _grad_error(case: Case, family: str) -> float:
    """fwd+bwd of the case's op (autograd through whatever backend it runs on) against autograd of the PyTorch chunk
    form in float64 on the same inputs (its gradients equal the token recurrence's to 1e-9: tests/test_reference.py;
    autograd through the token loop itself took minutes on the CPU): the largest relative error over the gradients
    of q, k, v, g, beta and the initial state, for a random dO and dh_T (drawn in the output's dtype, so that both
    sides differentiate the same loss)."""
    from . import ops
    gen = torch.Generator().manual_seed(1)
    leaves = [a.detach().clone().requires_grad_(True) for a in case.args]
    h0 = case.kwargs["initial_state"].detach().clone().requires_grad_(True)
    o, ht = _op(case.op)(*leaves, **dict(case.kwargs, initial_state=h0))
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device=o.device, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(device=ht.device, dtype=ht.dtype)
    torch.autograd.backward((o, ht), (do, dht))
    refs = [a.detach().double().requires_grad_(True) for a in (*case.args, case.kwargs["initial_state"])]
    cu = case.kwargs.get("cu_seqlens")
    ref_o, ref_ht = getattr(ops, case.op)(*refs[:-1], initial_state=refs[-1], output_final_state=True,
                                          cu_seqlens=cu, backend="torch", chunk_size=64)
    torch.autograd.backward((ref_o, ref_ht), (do.double(), dht.double()))
    return max(rel_err(x.grad, r.grad) for x, r in zip((*leaves, h0), refs))


def _progress(items, desc: str):
    """tqdm when installed, else one line per item."""
    try:
        from tqdm import tqdm
    except ImportError:
        def plain():
            for i, x in enumerate(items):
                print(f"[{i + 1}/{len(items)}] {desc}: {getattr(x, 'label', x)}", file=sys.stderr, flush=True)
                yield x
        return plain(), None
    bar = tqdm(items, desc=desc, unit="op", file=sys.stderr, dynamic_ncols=True)
    return bar, bar


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def cmd_check(a: argparse.Namespace) -> int:
    device = _device(a.device)
    dtype = _dtype(a.dtype, device)
    tol = TOLERANCE[dtype] if a.tol is None else a.tol
    torch.manual_seed(a.seed)
    cases = check_cases(device, dtype, a.quick, a.seed, _families(a.ops, "check"))
    print(f"chunkwise check: {len(cases)} ops on {_device_name(device)}, {str(dtype).replace('torch.', '')}, "
          f"tolerance {tol:.0e} (relative error against the float64 recurrence)", flush=True)
    rows, failures = [], []
    items, bar = _progress(cases, "check")
    for case in items:
        if bar is not None:
            bar.set_postfix_str(case.label)
        family = case.label.split()[0]
        backend = _backend_name(device, case.args[0].shape[-1], case.args[2].shape[-1])
        try:
            fn = lambda: _op(case.op)(*case.args, **case.kwargs)  # noqa: E731
            o, ht = fn()
            ref_o, ref_ht = _reference(case, family)
            err = max(rel_err(o, ref_o), rel_err(ht, ref_ht))
            ms = time_ms(fn, device, reps=1 if a.quick else 3, warmup=0)
            # the chunk ops train: their gradients too (the recurrent ones serve decode)
            grad_err = _grad_error(case, family) if a.grads and case.op.startswith("chunk") else None
            ok = err < tol and (grad_err is None or grad_err < tol)
            rows.append([case.label, case.shape, backend, str(dtype).replace("torch.", ""), f"{err:.2e}",
                         "-" if grad_err is None else f"{grad_err:.2e}", f"{case.tokens / ms * 1e3:,.0f}",
                         "ok" if ok else "MISMATCH"])
            if err >= tol:
                failures.append(f"{case.label} ({case.op}): relative error {err:.3e} >= {tol:.0e}")
            if grad_err is not None and grad_err >= tol:
                failures.append(f"{case.label} ({case.op}): gradient relative error {grad_err:.3e} >= {tol:.0e}")
        except Exception as e:  # an op that cannot run is a failure, reported with the others
            rows.append([case.label, case.shape, backend, str(dtype).replace("torch.", ""), "-", "-", "-", "ERROR"])
            failures.append(f"{case.label} ({case.op}): {type(e).__name__}: {e}")
    if bar is not None:
        bar.close()
    print(_table(["op", "shape", "backend", "dtype", "max rel err", "grad rel err", "tokens/s", "status"], rows))
    if failures:
        bad = sum(r[-1] != "ok" for r in rows)
        print(f"\n{bad} of {len(cases)} ops FAILED:", file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1
    grads = " and gradients" if a.grads else ""
    print(f"\nall {len(cases)} ops match the float64 recurrence{grads} (max rel err < {tol:.0e})")
    return 0


# ----------------------------------------------------------------------------------------------
# chunkwise bench
# ----------------------------------------------------------------------------------------------

def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def _version(dist: str, module: str | None = None):
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        try:
            return importlib.import_module(module or dist).__version__
        except Exception:
            return None


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except Exception:
        return None


def _load_fla(ops: list[str], device: torch.device) -> tuple[dict, str]:
    """fla's functions for the requested ops, and a word on why there are none."""
    if device.type != "cuda":
        return {}, "not run (fla's kernels need a CUDA device)"
    if importlib.util.find_spec("fla") is None:
        return {}, "not installed"
    found = {}
    for op in ops:
        module, name = FLA_OPS[op]
        try:
            found[op] = getattr(importlib.import_module(module), name)
        except Exception as e:
            print(f"chunkwise bench: fla's {module}.{name} unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return found, f"fla {_version('fla-core', 'fla')}"


def _parse_list(text: str, kind=str) -> list:
    return [kind(x) for x in text.replace(" ", "").split(",") if x]


def _families(text: str, command: str) -> list[str]:
    ops = list(FAMILIES) if text == "all" else _parse_list(text)
    for op in ops:
        if op not in FAMILIES:
            raise SystemExit(f"chunkwise {command}: unknown op {op!r}; choose from {', '.join(FAMILIES)} or 'all'")
    return ops


def cmd_bench(a: argparse.Namespace) -> int:
    device = _device(a.device)
    dtype = _dtype(a.dtype, device)
    gpu = device.type == "cuda"
    ops = _families(a.ops, "bench")
    seqlens = _parse_list(a.seqlens, int) if a.seqlens else ([1024, 2048, 4096, 8192, 16384] if gpu else [256, 512, 1024])
    H = a.heads or (16 if gpu else 4)
    K = a.head_dim or (128 if gpu else 64)
    B = a.batch
    reps = a.reps or (20 if gpu else 3)
    fla, fla_note = ({}, "disabled (--no-fla)") if a.no_fla else _load_fla(ops, device)

    os.makedirs(a.out, exist_ok=True)
    mode = "fwd+bwd" if a.backward else "fwd"
    print(f"chunkwise bench: {mode}, {', '.join(ops)} over T = {seqlens}, B={B} H={H} K=V={K}, "
          f"{str(dtype).replace('torch.', '')} on {_device_name(device)}; fla: {fla_note}", flush=True)
    gen = torch.Generator().manual_seed(a.seed)
    results = []
    items, bar = _progress([(op, T) for op in ops for T in seqlens], "bench")
    for op, T in items:
        if bar is not None:
            bar.set_postfix_str(f"{op} T={T}")
        args, _, _ = make_args(op, B, T, H, H, K, K, dtype, device, gen)
        row = {"op": op, "chunkwise_fn": FAMILIES[op][0], "B": B, "T": T, "H": H, "HV": H, "K": K, "V": K,
               "backend": _backend_name(device, K, K)}
        impls = {"chunkwise": _op(FAMILIES[op][0])}
        if op in fla:
            impls["fla"] = fla[op]
        outputs = {}
        for name, fn in impls.items():
            try:
                ms, out = _time_op(fn, args, a.backward, device, reps)
                row[f"{name}_ms"] = ms
                row[f"{name}_tokens_per_s"] = B * T / ms * 1e3
                outputs[name] = out
            except Exception as e:
                row[f"{name}_ms"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"
                print(f"chunkwise bench: {name} {op} T={T} failed: {row[f'{name}_error']}", file=sys.stderr)
        if len(outputs) == 2:
            row["rel_err_chunkwise_vs_fla"] = rel_err(outputs["chunkwise"], outputs["fla"])
        if row.get("chunkwise_ms") and row.get("fla_ms"):
            row["speedup_vs_fla"] = row["fla_ms"] / row["chunkwise_ms"]
        results.append(row)
        del outputs
    if bar is not None:
        bar.close()

    report = {
        "mode": mode,
        "device": _device_name(device),
        "dtype": str(dtype).replace("torch.", ""),
        "versions": {"chunkwise": _version("chunkwise"), "torch": torch.__version__,
                     "triton": _version("triton"), "fla": _version("fla-core", "fla") if fla else None,
                     "python": platform.python_version()},
        "fla": fla_note,
        "git_commit": _git_commit(),
        "timing": "triton.testing.do_bench median" if gpu else f"time.perf_counter median of {reps} after 1 warmup",
        "shapes": {"B": B, "H": H, "HV": H, "K": K, "V": K, "seqlens": seqlens, "ops": ops},
        "results": results,
    }
    json_path = os.path.join(a.out, "bench.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)

    header = ["op", "T", "chunkwise ms", "tokens/s"] + (["fla ms", "fla tokens/s", "speedup", "rel err"] if fla else [])
    rows = []
    for r in results:
        cells = [r["op"], str(r["T"]), _fmt(r.get("chunkwise_ms"), ".3f"), _fmt(r.get("chunkwise_tokens_per_s"), ",.0f")]
        if fla:
            cells += [_fmt(r.get("fla_ms"), ".3f"), _fmt(r.get("fla_tokens_per_s"), ",.0f"),
                      _fmt(r.get("speedup_vs_fla"), ".2f"), _fmt(r.get("rel_err_chunkwise_vs_fla"), ".1e")]
        rows.append(cells)
    print(_table(header, rows))
    print(f"\nwrote {json_path}")
    if not a.no_plot:
        png = _plot(report, os.path.join(a.out, "bench.png"))
        if png:
            print(f"wrote {png}")
    failed = [r for r in results if r.get("chunkwise_ms") is None]
    return 1 if failed else 0


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _time_op(fn, args, backward: bool, device: torch.device, reps: int):
    """(median ms, forward output) of one op on ``args``: forward only, or forward + backward."""
    if not backward:
        with torch.no_grad():
            out = fn(*args)[0]
            ms = time_ms(lambda: fn(*args), device, reps=reps)
        return ms, out
    leaves = [x.detach().clone().requires_grad_(True) for x in args]
    out = fn(*leaves)[0]
    do = torch.randn_like(out)

    def step():
        fn(*leaves)[0].backward(do)
    ms = time_ms(step, device, reps=reps, grad_to_none=leaves)
    return ms, out.detach()


def _plot(report: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chunkwise bench: matplotlib is not installed, so no plot was drawn "
              "(pip install 'chunkwise[bench]' or pip install matplotlib); the JSON has every number", file=sys.stderr)
        return None
    fig = _figure(report, plt)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _figure(report: dict, plt):
    """One panel of tokens/s over T per op, chunkwise (and fla) as lines; the run in the title."""
    ops = report["shapes"]["ops"]
    width = max(4.2 * len(ops), 6.0)
    # constrained layout keeps the title inside the figure; the title is wrapped to the figure's width
    fig, axes = plt.subplots(1, len(ops), figsize=(width, 4.0), squeeze=False, layout="constrained")
    for ax, op in zip(axes[0], ops):
        rows = [r for r in report["results"] if r["op"] == op]
        for name, style in (("chunkwise", "o-"), ("fla", "s--")):
            pts = [(r["T"], r[f"{name}_tokens_per_s"]) for r in rows if r.get(f"{name}_tokens_per_s")]
            if pts:
                ax.plot(*zip(*pts), style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op} ({FAMILIES[op][0]})", fontsize=9)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("tokens / s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = report["shapes"]
    chars = int(width * 72 / (0.6 * 9))           # characters of 9-point text across the figure
    title = [f"{report['mode']}  B={s['B']} H={s['H']} K=V={s['K']} {report['dtype']}",
             *textwrap.wrap(report["device"], chars)]
    fig.suptitle("\n".join(title), fontsize=9)
    return fig


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chunkwise",
        description="chunkwise: chunkwise-parallel linear attention (Gated DeltaNet, KDA, DeltaNet, simple GLA / "
                    "Mamba2 SSD). Triton kernels on a CUDA GPU, PyTorch on the CPU.")
    sub = p.add_subparsers(dest="command", metavar="{check,bench}")

    c = sub.add_parser("check", help="run every op on random inputs and compare with the float64 recurrence",
                       description="Run every op (4 families x chunk / fused_recurrent, a T=1 decode step and a "
                                   "varlen batch) on random inputs on the best device present, compare with the "
                                   "float64 token recurrence (the chunk ops' gradients too) and print error and "
                                   "throughput. Exit status 1 on any mismatch.")
    c.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu, cuda or cuda:N")
    c.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="input dtype; auto: bfloat16 on a GPU, float32 on the CPU")
    c.add_argument("--ops", default="all", help=f"families to check: comma list of {', '.join(FAMILIES)} or 'all' (default)")
    c.add_argument("--quick", action="store_true", help="small shapes (a few seconds)")
    c.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default 0)")
    c.add_argument("--tol", type=float, default=None,
                   help="relative error allowed; default by dtype: float32 1e-4, float16 5e-3, bfloat16 1e-2")
    c.add_argument("--no-grads", dest="grads", action="store_false",
                   help="skip the gradient check (by default the chunk and varlen rows also run forward + "
                        "backward and compare every gradient with autograd of the float64 recurrence)")
    c.set_defaults(func=cmd_check)

    b = sub.add_parser("bench", help="time the chunk ops over sequence lengths (fla side by side if installed)",
                       description="Time the chunk ops over sequence lengths on one device and write bench.json "
                                   "(device, versions, git commit, shapes, times) and bench.png. On a GPU, fla's "
                                   "ops run on the same inputs when fla is installed.")
    b.add_argument("--ops", default="all", help=f"comma list of {', '.join(FAMILIES)} or 'all' (default)")
    b.add_argument("--seqlens", default=None,
                   help="comma list of T (default: 1024..16384 on a GPU, 256,512,1024 on the CPU)")
    b.add_argument("--heads", type=int, default=None, help="heads H = HV (default 16 on a GPU, 4 on the CPU)")
    b.add_argument("--head-dim", type=int, default=None, help="K = V (default 128 on a GPU, 64 on the CPU)")
    b.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    b.add_argument("--backward", action="store_true", help="time forward + backward instead of forward")
    b.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu, cuda or cuda:N")
    b.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="input dtype; auto: bfloat16 on a GPU, float32 on the CPU")
    b.add_argument("--reps", type=int, default=None, help="timed repetitions on the CPU (default 3)")
    b.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default 0)")
    b.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png (default bench_out)")
    b.add_argument("--no-fla", action="store_true", help="do not run fla even if installed")
    b.add_argument("--no-plot", action="store_true", help="write the JSON only")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.command is None:
        parser.print_help()
        return 2
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
