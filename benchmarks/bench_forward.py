"""Forward (prefill) benchmark: chunkwise's chunk ops against fla 0.6.0 (and FlashInfer's GDN prefill where it is
importable) on the same inputs in the same process.

    python benchmarks/bench_forward.py                                   # standing + few-heads shapes, every op
    python benchmarks/bench_forward.py --shapes standing --ops gdn,kda --out bench_out
    python benchmarks/bench_forward.py --device cpu --shapes smoke --dtype fp32    # a CPU run (torch backend)
    python benchmarks/bench_forward.py --shapes standing --ops gdn,kda --no-peers --checkpoint-every 1024

Each op runs with its final state out (no autograd), varlen with the CPU copy of cu_seqlens and a precomputed chunk
index (no host sync in the timed call); ours also replayed from a CUDA graph ("in a graph": where it is well under
the eager time, the call is bound by the host's launches). Times are medians of triton.testing.do_bench (ms); fla
searches its configurations afresh before each timing (common.fla_fresh_search). The outputs and final states are
compared with the peers' (relative Frobenius norm; "agree" within common.AGREE for the dtype).

--checkpoint-every C also times each op writing prefix checkpoints every C tokens (chunkwise.prefill: an fp32
buffer of Σ ⌊len_n / C⌋ states) and reports the extra time ("ckpt +%") and the bytes it writes ("ckpt MB").

Writes bench_forward.json (device, versions, commit, date, every number) and bench_forward.png to --out, and prints
a markdown table last. Exit status 1 if an output is not finite or disagrees with a peer.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from shapes import make_inputs, resolve  # noqa: E402

COLUMNS = [("shape", "shape", ""), ("op", "op", ""), ("chunkwise ms", "ms", ".3f"), ("in a graph", "graph_ms", ".3f"),
           ("fla ms", "fla_ms", ".3f"),
           ("x fla", "x_fla", ".2f"), ("FlashInfer ms", "flashinfer_ms", ".3f"), ("o vs fla", "o_vs_fla", ".1e"),
           ("ok", "ok", "")]
CKPT_COLUMNS = [("ckpt ms", "ckpt_ms", ".3f"), ("ckpt +%", "ckpt_pct", ".1f"), ("ckpt MB", "ckpt_MB", ".1f")]


def bench_one(op: str, shape, args, peers: dict) -> dict:
    """One row: chunkwise's time, each peer's, and how their outputs compare."""
    dtype, dev, backend = common.DTYPES[args.dtype], args.device, common.backend_of(args)
    x = make_inputs(op, shape, dtype, dev, gate_scale=args.gate_scale)
    row = dict(shape=shape.name, op=op)
    with torch.no_grad():
        o, ht = common.run_chunkwise(op, x, backend)
        row["finite"] = bool(torch.isfinite(o).all() and torch.isfinite(ht).all())
        row["ms"] = common.time_ms(lambda: common.run_chunkwise(op, x, backend), dev)
        row["graph_ms"] = common.graph_ms(lambda: common.run_chunkwise(op, x, backend), dev)
        if args.checkpoint_every:
            every = args.checkpoint_every
            import chunkwise
            n = (shape.B * (shape.T // every) if x["cu_seqlens_cpu"] is None
                 else int(chunkwise.checkpoint_slots(x["cu_seqlens_cpu"], every)[-1]))
            ck = torch.empty(n, shape.HV, shape.K, shape.V, device=dev)
            with_ck = lambda: common.run_chunkwise(op, x, backend, checkpoint_every=every, checkpoints=ck)  # noqa: E731
            row["o_vs_no_ckpt"] = common.rel(with_ck()[0], o)
            row["ckpt_ms"] = common.time_ms(with_ck, dev)
            row.update(ckpt_pct=100 * (row["ckpt_ms"] / row["ms"] - 1), ckpt_MB=ck.numel() * 4 / 1e6)
        fla = peers.get(op)
        if fla is not None:
            try:
                common.fla_fresh_search()
                xf = common.fla_inputs(op, x)
                o_f, ht_f = common.run_fla(op, fla, xf)
                row["fla_ms"] = common.time_ms(lambda: common.run_fla(op, fla, xf), dev)
                row.update(x_fla=row["fla_ms"] / row["ms"], o_vs_fla=common.rel(o, o_f),
                           state_vs_fla=common.rel(ht, ht_f), fla_configs=common.fla_autotune_picks())
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = f"{type(e).__name__}: {e}"[:300]
        fi = peers.get("flashinfer") if op == "gdn" else None
        if fi is not None:
            try:
                xi = common.flashinfer_inputs(x)
                o_i, _ = common.run_flashinfer_gdn(fi, xi)
                row["flashinfer_ms"] = common.time_ms(lambda: common.run_flashinfer_gdn(fi, xi), dev)
                row["o_vs_flashinfer"] = common.rel(o, o_i)
            except Exception as e:  # noqa: BLE001
                row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:300]
    tol = common.AGREE[dtype]
    row["ok"] = row["finite"] and all(row.get(k, 0) <= tol for k in ("o_vs_fla", "state_vs_fla", "o_vs_flashinfer",
                                                                      "o_vs_no_ckpt"))
    return row


def main(argv=None) -> int:
    ap = common.parser(__doc__, shapes="standing,few-heads", gates=True)
    ap.add_argument("--checkpoint-every", type=int, default=None, metavar="C",
                    help="also time the forward writing prefix checkpoints every C tokens (a multiple of 64)")
    args = ap.parse_args(argv)
    common.COMPILE_ONLY = args.warmup
    ops, shapes = common.parse_ops(args.ops), resolve(args.shapes)
    peers = {}
    if not args.no_peers:
        peers = {op: common.fla_op(op) for op in ops}
        peers["flashinfer"] = common.flashinfer_gdn()
    meta = common.metadata(args, benchmark="forward", timing="triton.testing.do_bench median (ms), no autograd")
    path = os.path.join(args.out, "bench_forward.json")
    # kept as it goes: a run stopped at its time limit (a SIGINT that reaches a compiler process ends it with that
    # process's error, not KeyboardInterrupt) keeps the rows it timed
    keep = None if args.warmup else (lambda rows: common.write_json(path, meta, rows))
    rows, cut = common.collect((lambda s=s, op=op: bench_one(op, s, args, peers) for s in shapes for op in ops),
                               args.device, on_row=keep, time_limit=args.time_limit)
    if args.warmup:
        return 0
    meta["cut_short"] = cut
    common.write_json(path, meta, rows)
    common.plot_bars(rows, os.path.join(args.out, "bench_forward.png"),
                     f"Forward, {args.dtype}, on {meta['device']} (chunkwise {str(meta['commit'])[:8]}, "
                     f"fla {meta['fla']})",
                     [("chunkwise", "ms"), ("chunkwise, CUDA graph", "graph_ms"), ("fla", "fla_ms")])
    print(f"\nForward, {args.dtype}, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
          f"fla {meta['fla']}, commit {str(meta['commit'])[:10]}, {meta['date']}\n")
    print(common.markdown_table(rows, COLUMNS + (CKPT_COLUMNS if args.checkpoint_every else [])))
    return 0 if all(r["ok"] for r in rows) and not cut else 1


if __name__ == "__main__":
    sys.exit(main())
