"""CPU benchmark: chunkwise's PyTorch backend (chunk form, fp32) against Hugging Face transformers'
``torch_chunk_gated_delta_rule`` (Qwen3-Next's pure-PyTorch fallback) for GDN, on the same inputs in one run.

    python benchmarks/bench_cpu.py                                   # B1-T4096-H16 and B1-T1024-H16, GDN
    python benchmarks/bench_cpu.py --shapes B1-T1024-H16 --ops gdn,kda --reps 3 --threads 1 --out bench_out

Protocol: the same tensors for both (k already L2-normalised, an initial state); the calls alternate (chunkwise,
HF, chunkwise, ...) after one warm-up each, so a change of load on the machine hits both; medians of --reps timed
calls, wall time and process CPU time (with other processes on the machine, wall time at 2 threads is dominated by
OpenMP barriers waiting for a descheduled thread, while CPU time stays meaningful). HF's function is taken unwrapped
(inspect.unwrap), so that its own PyTorch code runs even where fla is installed. Ops other than GDN have no peer and
are timed alone. Every output and final state is checked against the float64 token recurrence
(chunkwise.reference.recurrent) on the first two value heads (heads are independent), and ours against HF's.

Writes bench_cpu.json and bench_cpu.png to --out and prints a markdown table last. Exit status 1 if an error
passes 1e-4.
"""
from __future__ import annotations

import inspect
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from shapes import make_inputs, resolve  # noqa: E402

COLUMNS = [("shape", "shape", ""), ("op", "op", ""), ("chunkwise ms", "ms", ".1f"), ("HF ms", "hf_ms", ".1f"),
           ("x HF", "x_hf", ".2f"), ("CPU s", "cpu_s", ".3f"), ("HF CPU s", "hf_cpu_s", ".3f"),
           ("tokens/s", "tokens_per_s", ",.0f"), ("o vs fp64", "o_vs_fp64", ".1e"), ("o vs HF", "o_vs_hf", ".1e"),
           ("ok", "ok", "")]
TOL = 1e-4


def hf_gdn():
    """transformers' torch_chunk_gated_delta_rule, unwrapped, or None (with the reason on stderr)."""
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
        return inspect.unwrap(torch_chunk_gated_delta_rule)
    except Exception as e:  # noqa: BLE001
        print(f"transformers' torch_chunk_gated_delta_rule not importable ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def timed(fns: dict, reps: int) -> tuple[dict, dict, dict]:
    """Alternating calls of each function after one warm-up: (outputs, median wall s, median CPU s)."""
    outs = {n: f() for n, f in fns.items()}
    wall, cpu = {n: [] for n in fns}, {n: [] for n in fns}
    for _ in range(reps):
        for n, f in fns.items():
            w, c = time.perf_counter(), time.process_time()
            f()
            wall[n].append(time.perf_counter() - w)
            cpu[n].append(time.process_time() - c)
    return outs, {n: statistics.median(v) for n, v in wall.items()}, {n: statistics.median(v) for n, v in cpu.items()}


def bench_one(op: str, shape, args, hf) -> dict:
    from chunkwise.reference.recurrent import recurrent_forward
    dtype, backend = common.DTYPES[args.dtype], common.backend_of(args)
    x = make_inputs(op, shape, dtype, "cpu")
    gen = torch.Generator().manual_seed(1)
    h0 = torch.randn(shape.sequences, shape.HV, shape.K, shape.V, generator=gen) * 0.5
    fns = {"chunkwise": lambda: common.run_chunkwise(op, x, backend, initial_state=h0)}
    if hf is not None and op == "gdn" and shape.H == shape.HV and shape.cu_seqlens is None:
        fns["hf"] = lambda: hf(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64, initial_state=h0,
                               output_final_state=True)
    with torch.no_grad():
        outs, wall, cpu = timed(fns, args.reps)
        hs = slice(0, min(2, shape.HV))          # two value heads of the float64 recurrence (their q / k heads)
        grp = shape.HV // shape.H
        sub = {n: (None if x[n] is None else x[n][:, :, hs]) for n in ("v", "g", "beta")}
        sub.update(q=x["q"][:, :, : max(1, 2 // grp)], k=x["k"][:, :, : max(1, 2 // grp)])
        o_ref, s_ref = recurrent_forward(sub["q"], sub["k"], sub["v"], sub["g"], sub["beta"], shape.K ** -0.5,
                                         h0[:, hs], cu_seqlens=x["cu_seqlens"], dtype=torch.float64)
    (o, s) = outs["chunkwise"][:2]
    row = dict(shape=shape.name, op=op, ms=1e3 * wall["chunkwise"], cpu_s=cpu["chunkwise"],
               tokens_per_s=shape.tokens / wall["chunkwise"], o_vs_fp64=common.rel(o[:, :, hs], o_ref),
               state_vs_fp64=common.rel(s[:, hs], s_ref))
    if "hf" in outs:
        o_h, s_h = outs["hf"]
        row.update(hf_ms=1e3 * wall["hf"], hf_cpu_s=cpu["hf"], x_hf=wall["hf"] / wall["chunkwise"],
                   o_vs_hf=common.rel(o, o_h), state_vs_hf=common.rel(s, s_h),
                   hf_o_vs_fp64=common.rel(o_h[:, :, hs], o_ref))
    row["ok"] = all(v <= TOL for k, v in row.items() if "_vs_" in k)
    return row


def main(argv=None) -> int:
    ap = common.parser(__doc__, shapes="cpu", dtype="fp32", warmup=False)
    ap.set_defaults(ops="gdn", device="cpu")
    ap.add_argument("--reps", type=int, default=5, help="timed calls of each function (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ops, shapes = common.parse_ops(args.ops), resolve(args.shapes)
    hf = None if args.no_peers else hf_gdn()
    load = os.getloadavg()
    rows, cut = common.collect((lambda s=s, op=op: bench_one(op, s, args, hf) for s in shapes for op in ops), "cpu",
                               time_limit=args.time_limit)
    meta = common.metadata(args, benchmark="cpu", torch_threads=torch.get_num_threads(), cores=os.cpu_count(),
                           transformers=common._version("transformers"), loadavg=[load, os.getloadavg()],
                           cut_short=cut, timing=f"time.perf_counter, {args.reps} alternating calls each after one warm-up, median")
    common.write_json(os.path.join(args.out, "bench_cpu.json"), meta, rows)
    common.plot_bars(rows, os.path.join(args.out, "bench_cpu.png"),
                     f"CPU forward, {args.dtype}, {meta['device']}, {meta['torch_threads']} threads "
                     f"(chunkwise {str(meta['commit'])[:8]}, transformers {meta['transformers']})",
                     [("chunkwise", "ms"), ("HF transformers", "hf_ms")])
    print(f"\nCPU forward, {args.dtype}, {meta['device']} ({meta['torch_threads']} threads, load "
          f"{load[0]:.1f} -> {os.getloadavg()[0]:.1f}), torch {meta['torch']}, transformers {meta['transformers']}, "
          f"commit {str(meta['commit'])[:10]}, {meta['date']}\n")
    print(common.markdown_table(rows, COLUMNS))
    return 0 if all(r["ok"] for r in rows) and not cut else 1


if __name__ == "__main__":
    sys.exit(main())
