"""Decode benchmark (one token per sequence): chunkwise's fused_recurrent ops against fla 0.6.0's on the same inputs
in the same process, with the device's copy bandwidth as the yardstick; and speculative decoding's verify step.

    python benchmarks/bench_decode.py                                    # the decode set, GDN and KDA
    python benchmarks/bench_decode.py --ops gdn,kda,delta,gla --shapes B256-T1-H32 --out bench_out
    python benchmarks/bench_decode.py --device cpu --shapes B1-T1-H32 --dtype fp32      # a CPU run

Modes (``--modes``, comma separated; default: state and pool on every T = 1 shape, int8 and e4m3 on the T = 1 shapes
of batch 256 and up, verify on every T > 1 shape; a mode named explicitly runs on every shape of its T):
  state  an fp32 initial state [B, HV, K, V] in, a new fp32 final state out (what fla's public op does)
  pool   a serving engine's fp32 state pool [B + 32, HV, K, V], one slot per sequence (state_indices; at B > 1 the
         last sixteenth padded with -1), updated in place (chunkwise only)
  int8, e4m3   the same pool in 8 bits with one fp32 scale per (slot, head, key row) (state_scales): read
         dequantized, written requantized
  verify speculative decoding's verify step, T draft tokens per sequence from the fp32 pool: the state after each
         token into intermediate_states [B, T, HV, K, V] fp32, the pool only read; then chunkwise.rollback of a
         random number of accepted tokens (0 to T) per sequence, timed on its own ("rb us", "rb graph us")
Bytes moved ("MB"), over the L live sequences (the floor of each mode is these bytes over the copy bandwidth):
  state, pool   2·L·HV·K·V·4                 the fp32 state read and written once
  int8, e4m3    2·L·HV·K·(V + 4)             1 byte per value and a 4-byte scale per row, read and written once
  verify        L·HV·K·V·4·(1 + T)           the slot read once, T per-token states written
(q, k, v and the gates are left out: T·(2·H·K + HV·V) 16-bit values per sequence, under 1 % of the state's bytes at
H = HV.) The rollback moves 2·A·HV·K·V·4 bytes for the A sequences that accepted a token. "% copy" is the mode's bytes
over its time against the same run's device-to-device copy bandwidth. "o vs ref" checks the mode's output against
the fp32 pool decode from the same state (verify: the pool decode of the same drafts; 8-bit: from the dequantized
pool).

Times in microseconds: "us" is the public op (its Python checks, dispatch and launch; do_bench median; in eager mode
the pool modes and the rollback include the duplicate-index check, a host sync), "graph us" the replay of a CUDA
graph of it (what a serving engine runs: GPU time only). Writes bench_decode.json and bench_decode.png to --out and
prints a markdown table last. Exit status 1 if an output disagrees with fla's or the reference.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from shapes import make_inputs, resolve  # noqa: E402

COLUMNS = [("shape", "shape", ""), ("op", "op", ""), ("mode", "mode", ""), ("us", "us", ".1f"),
           ("graph us", "graph_us", ".1f"), ("fla us", "fla_us", ".1f"), ("fla graph us", "fla_graph_us", ".1f"),
           ("MB", "MB", ".1f"), ("TB/s", "TBps", ".2f"), ("% copy", "pct_copy", ".0f"), ("rb us", "rb_us", ".1f"),
           ("rb graph us", "rb_graph_us", ".1f"), ("o vs fla", "o_vs_fla", ".1e"), ("o vs ref", "o_vs_ref", ".1e"),
           ("ok", "ok", "")]
MODES = ("state", "pool", "int8", "e4m3", "verify")
QUANT = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn}
QUANT_MIN_BATCH = 256       # the default runs the 8-bit modes here: where the state stream is the whole time


def modes_for(shape, modes: list[str] | None) -> list[str]:
    """The modes timed at ``shape``: those asked for (None: the default choice, see the docstring) that fit its T."""
    if modes is None:
        modes = ["state", "pool"] + (["int8", "e4m3"] if shape.B >= QUANT_MIN_BATCH else []) + ["verify"]
    return [m for m in modes if (m == "verify") == (shape.T > 1)]


def copy_tbps(device) -> float | None:
    """Device-to-device copy bandwidth (TB/s, bytes read + written) of 1 GiB; None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    ms = common.time_ms(lambda: dst.copy_(src), device)
    return 2 * (1 << 28) * 4 / (ms * 1e-3) / 1e12


def bench_one(op: str, shape, mode: str, args, fla, bw) -> dict:
    dtype, dev, backend = common.DTYPES[args.dtype], args.device, common.backend_of(args)
    x = make_inputs(op, shape, dtype, dev)
    B, T, HV, K, V = shape.B, shape.T, shape.HV, shape.K, shape.V
    gen = torch.Generator(dev).manual_seed(1)
    row = dict(shape=shape.name, op=op, mode=mode)
    fused = common.chunkwise_op(op, "recurrent")
    if mode == "state":
        h0 = torch.randn(B, HV, K, V, device=dev, generator=gen) * 0.1
        ours = lambda: common.run_chunkwise(op, x, backend, mode="recurrent", initial_state=h0)  # noqa: E731
        live = B
    else:
        pool = torch.randn(B + 32, HV, K, V, device=dev, generator=gen) * 0.1
        idx = torch.randperm(B + 32, device=dev, generator=gen)[:B].to(torch.int32)
        live = B if B == 1 else B - B // 16
        idx[live:] = -1
        kw = dict(state_indices=idx, backend=backend)
        if mode in QUANT:
            from chunkwise.reference.recurrent import dequantize, quantize
            pool, scales = quantize(pool, QUANT[mode])
            kw["state_scales"] = scales
            ref_pool = dequantize(pool, scales)        # the fp32 pool decode from the same values: "o vs ref"
        elif mode == "verify":
            kw["intermediate_states"] = buf = torch.empty(B, T, HV, K, V, device=dev)
            ref_pool = pool.clone()                    # the pool decode of the same drafts: "o vs ref"
        ours = lambda: fused(*common._args(op, x), initial_state=pool, **kw)  # noqa: E731
    with torch.no_grad():
        if mode in QUANT or mode == "verify":
            o_ref = fused(*common._args(op, x), initial_state=ref_pool, state_indices=idx, backend=backend)[0]
        o, ht = ours()[:2] if mode == "state" else (ours()[0], None)
        row["finite"] = bool(torch.isfinite(o).all())
        if mode in QUANT or mode == "verify":
            row["o_vs_ref"] = common.rel(o, o_ref)
        row["us"] = 1e3 * common.time_ms(ours, dev)
        g = common.graph_ms(ours, dev)
        row["graph_us"] = None if g is None else 1e3 * g
        if mode in QUANT:
            nbytes = 2 * live * HV * K * (V + 4)        # 8-bit values and an fp32 scale per row, read and written
        elif mode == "verify":
            nbytes = live * HV * K * V * 4 * (1 + T)    # the slot read once, T per-token states written
        else:
            nbytes = 2 * live * HV * K * V * 4          # fp32 state read and written once
        row["MB"] = nbytes / 1e6
        t = row["graph_us"] or row["us"]
        row["TBps"] = nbytes / (t * 1e-6) / 1e12
        row["pct_copy"] = None if bw is None else 100 * row["TBps"] / bw
        if mode == "verify":
            import chunkwise
            acc = torch.randint(0, T + 1, (B,), device=dev, generator=gen)
            rollback = lambda: chunkwise.rollback(pool, idx, buf, acc, backend=backend)  # noqa: E731
            row["rb_us"] = 1e3 * common.time_ms(rollback, dev)
            g = common.graph_ms(rollback, dev)
            row["rb_graph_us"] = None if g is None else 1e3 * g
            row["rb_MB"] = 2 * int(((acc > 0) & (idx >= 0)).sum()) * HV * K * V * 4 / 1e6
        if fla is not None and mode == "state":
            try:
                xf = common.fla_inputs(op, x)
                theirs = lambda: common.run_fla(op, fla, xf, initial_state=h0)  # noqa: E731
                o_f, ht_f = theirs()
                row["fla_us"] = 1e3 * common.time_ms(theirs, dev)
                g = common.graph_ms(theirs, dev)
                row["fla_graph_us"] = None if g is None else 1e3 * g
                row.update(o_vs_fla=common.rel(o, o_f), state_vs_fla=common.rel(ht, ht_f))
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = f"{type(e).__name__}: {e}"[:300]
    tol = common.AGREE[dtype]
    row["ok"] = row["finite"] and all(row.get(k, 0) <= tol for k in ("o_vs_fla", "state_vs_fla", "o_vs_ref"))
    return row


def main(argv=None) -> int:
    ap = common.parser(__doc__, shapes="decode")
    ap.set_defaults(ops="gdn,kda")
    ap.add_argument("--modes", default=None, help=f"modes, comma separated: {','.join(MODES)} (default: see above)")
    args = ap.parse_args(argv)
    modes = None if args.modes is None else [m for m in args.modes.split(",") if m]
    if modes is not None and set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(set(modes) - set(MODES))}; choose from {','.join(MODES)}")
    common.COMPILE_ONLY = args.warmup
    ops, shapes = common.parse_ops(args.ops), resolve(args.shapes)
    fla = {} if args.no_peers else {op: common.fla_op(op, "recurrent") for op in ops}
    bw = copy_tbps(args.device)
    rows, cut = common.collect((lambda s=s, op=op, mode=mode: bench_one(op, s, mode, args, fla.get(op), bw)
                                for s in shapes for op in ops for mode in modes_for(s, modes)), args.device,
                               time_limit=args.time_limit)
    if args.warmup:
        return 0
    meta = common.metadata(args, benchmark="decode", copy_TBps=bw, cut_short=cut,
                           timing="triton.testing.do_bench median (us); graph: CUDA graph replay")
    common.write_json(os.path.join(args.out, "bench_decode.json"), meta, rows)
    for r in rows:
        r["label"] = f"{r['op']} {r['mode']}"
    common.plot_bars([dict(r, op=r["label"]) for r in rows], os.path.join(args.out, "bench_decode.png"),
                     f"Decode (T = 1) and verify (T drafts), {args.dtype} inputs, on {meta['device']} "
                     f"(chunkwise {str(meta['commit'])[:8]}, fla {meta['fla']})",
                     [("chunkwise", "graph_us" if bw else "us"), ("fla", "fla_graph_us" if bw else "fla_us")], "us")
    bws = f", copy {bw:.2f} TB/s" if bw else ""
    print(f"\nDecode, {args.dtype}, {meta['device']}{bws}, torch {meta['torch']}, triton {meta['triton']}, "
          f"fla {meta['fla']}, commit {str(meta['commit'])[:10]}, {meta['date']}\n")
    print(common.markdown_table(rows, COLUMNS))
    return 0 if all(r["ok"] for r in rows) and not cut else 1


if __name__ == "__main__":
    sys.exit(main())
