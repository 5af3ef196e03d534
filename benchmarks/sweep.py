"""Sweep of launch-plan fields: times the chunk forward or backward at every combination of the values given, each
plan the default plan with those fields replaced, passed to the launcher as data (``plan=``).

    python benchmarks/sweep.py --stage fwd --list                        # the plan's fields and their defaults
    python benchmarks/sweep.py --stage fwd --ops gdn --shapes B1-T32768-H32 --set num_warps=4,8 --set bv=32,64
    python benchmarks/sweep.py --stage bwd --ops kda,delta --shapes standing --set <field>=<v1>,<v2> --out bench_out

The fields come from the plan dataclass itself (chunkwise.triton.configs.ForwardPlan / BackwardPlan), so a new field
can be swept without editing this file. Values are parsed by the field's type (bool: true / false, None: none).
Each plan's outputs (fwd: o and the final state; bwd: every gradient) are compared with the default plan's: a plan
changes how the work is launched, not what it computes. On a GPU each plan is timed eager and replayed from a CUDA
graph. Writes sweep_<stage>.json to --out and prints, per shape and op, the plans by time (the default marked *).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import os
import sys
import types
import typing

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from shapes import make_inputs, resolve  # noqa: E402


def plan_api(stage: str):
    """(plan class, default-plan function, launcher) of the stage, or a clear exit where the library has none."""
    try:
        from chunkwise.triton import chunk, configs
        cls = configs.ForwardPlan if stage == "fwd" else configs.BackwardPlan
        default = configs.forward_plan if stage == "fwd" else configs.backward_plan
        launcher = chunk.chunk_fwd if stage == "fwd" else chunk.chunk_bwd
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"sweep.py needs the launch plans as data (chunkwise.triton.configs.ForwardPlan / "
                         f"BackwardPlan, forward_plan / backward_plan, and chunkwise.triton.chunk.chunk_fwd / "
                         f"chunk_bwd taking plan=): {type(e).__name__}: {e}")
    return cls, default, launcher


def _parse(text: str, hint):
    """One value of a field whose type hint is ``hint`` (bool: true / false / 1 / 0; none: None; a collection or
    anything else: a Python literal, such as {"fwd_h", "bwd_dh"} for a frozenset)."""
    if text.lower() == "none":
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:        # X | None
        hint = args[0]
    if hint is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    if hint in (int, float, str):
        return hint(text)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    kind = typing.get_origin(hint) or hint
    if kind in (frozenset, tuple, list, set, dict) and isinstance(value, (set, tuple, list, dict)):
        return kind(() if value == {} and kind is not dict else value)       # {} is an empty set there
    return value


def parse_sets(cls, specs: list[str]) -> dict[str, list]:
    """``--set field=v1,v2`` options as {field: [values]}, each value parsed by the field's type (a tuple as
    ``--set tile=(64,32),(32,32)``)."""
    fields = [f.name for f in dataclasses.fields(cls)]
    hints = typing.get_type_hints(cls)
    sets = {}
    for spec in specs:
        name, _, values = spec.partition("=")
        if name not in fields:
            raise SystemExit(f"{cls.__name__} has no field {name!r}; its fields: {', '.join(fields)}")
        try:
            sets[name] = [_parse(v, hints.get(name)) for v in _split(values)]
        except ValueError:
            raise SystemExit(f"--set {spec}: a value does not parse as {hints.get(name)} for {name}") from None
    return sets


def _split(values: str) -> list[str]:
    """Comma-separated values, commas inside brackets kept (``(64, 32),(32, 32)``)."""
    out, depth, cur = [], 0, ""
    for ch in values:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()] if cur.strip() else out


def product(default, sets: dict[str, list]) -> list:
    """Every combination of the values in ``sets``, each the default plan with those fields replaced."""
    names = list(sets)
    return [dataclasses.replace(default, **dict(zip(names, combo))) for combo in itertools.product(*sets.values())]


def _unique(plans: list) -> list:
    """The plans in order, each once (by equality: a plan may hold a dict, so it need not hash)."""
    out = []
    for p in plans:
        if p not in out:
            out.append(p)
    return out


def _bind(fn, ctx: dict):
    """Call fn with the arguments its signature names, taken from ctx by name."""
    params = inspect.signature(fn).parameters
    missing = [n for n, p in params.items() if p.default is p.empty and n not in ctx and p.kind != p.VAR_KEYWORD]
    if missing:
        raise SystemExit(f"sweep.py cannot fill {fn.__qualname__}'s arguments {missing} (it knows {sorted(ctx)})")
    return fn(**{n: ctx[n] for n in params if n in ctx})


def target_arch(device) -> int | None:
    """The CUDA architecture the kernels are built for (the default plans depend on it)."""
    from chunkwise.triton.common import target_arch as arch
    return arch(torch.device(device))


def runner(stage: str, launcher, x: dict, op: str):
    """fn(plan) -> the stage's outputs (a tuple of tensors) on inputs x."""
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    scale, cu, ci = q.shape[-1] ** -0.5, x["cu_seqlens"], x["chunk_indices"]
    if stage == "fwd":
        return lambda plan: launcher(q, k, v, g, beta, scale, None, True, cu, chunk_indices=ci, plan=plan)
    from chunkwise.triton import chunk
    do = torch.randn_like(v)
    saved = {}
    if "saved_out" in inspect.signature(chunk.chunk_fwd).parameters:     # the backward as training runs it
        chunk.chunk_fwd(q, k, v, g, beta, scale, None, True, cu, chunk_indices=ci, saved_out=saved)
    return lambda plan: launcher(q, k, v, g, beta, scale, None, do, None, cu, chunk_indices=ci, saved=saved or None,
                                 plan=plan)


def main(argv=None) -> int:
    ap = common.parser(__doc__, shapes="B1-T32768-H32", warmup=False, gates=True)
    ap.set_defaults(ops="gdn")
    ap.add_argument("--stage", choices=("fwd", "bwd"), required=True)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=V1,V2", help="a plan field's values")
    ap.add_argument("--list", action="store_true", help="print the plan's fields and the default plans, then exit")
    args = ap.parse_args(argv)
    cls, default_fn, launcher = plan_api(args.stage)
    sets = parse_sets(cls, args.set)
    dtype, dev = common.DTYPES[args.dtype], args.device
    rows = []
    for s in resolve(args.shapes):
        for op in common.parse_ops(args.ops):
            x = make_inputs(op, s, dtype, dev, gate_scale=args.gate_scale)
            ctx = dict(x, op=op, family=op, dtype=dtype, device=torch.device(dev), K=s.K, V=s.V, H=s.H, HV=s.HV,
                       B=s.B, T=s.T, varlen=s.cu_seqlens is not None, stage=args.stage, arch=target_arch(dev),
                       gate={"delta": 0, "gdn": 1, "gla": 1, "kda": 2}[op], delta=op != "gla")
            default = _bind(default_fn, ctx)
            if args.list:
                print(f"{s.name} {op}: {default}")
                continue
            run = runner(args.stage, launcher, x, op)
            with torch.no_grad():
                ref = [t for t in run(default) if isinstance(t, torch.Tensor)]
                for plan in _unique([default, *product(default, sets)]):
                    row = dict(shape=s.name, op=op, default=plan == default,
                               plan={n: getattr(plan, n) for n in sets} or dataclasses.asdict(plan))
                    try:
                        out = [t for t in run(plan) if isinstance(t, torch.Tensor)]
                        row["vs_default"] = max((common.rel(a, b) for a, b in zip(out, ref)), default=0.0)
                        row["ms"] = common.time_ms(lambda: run(plan), dev)
                        # (a plan can move work between the GPU and the host: where launches overlap, an eager call
                        # and a graph's replay can differ in either direction)
                        row["graph_ms"] = common.graph_ms(lambda: run(plan), dev)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                    print(json.dumps(row, default=str), flush=True)
    if args.list:
        print(f"{cls.__name__} fields: " + ", ".join(f"{f.name}: {f.type}" for f in dataclasses.fields(cls)))
        return 0
    meta = common.metadata(args, benchmark=f"sweep {args.stage}",
                           sets={k: [str(v) for v in vs] for k, vs in sets.items()})
    common.write_json(os.path.join(args.out, f"sweep_{args.stage}.json"), meta, rows)
    print(f"\nsweep {args.stage}, {args.dtype}, {meta['device']}, commit {str(meta['commit'])[:10]}")
    for key in dict.fromkeys((r["shape"], r["op"]) for r in rows):
        group = sorted((r for r in rows if (r["shape"], r["op"]) == key), key=lambda r: r.get("ms", float("inf")))
        print(f"\n{key[0]} {key[1]}")
        for r in group:
            graph = f" ({r['graph_ms']:.3f} replayed)" if r.get("graph_ms") is not None else ""
            t = f"{r['ms']:.3f} ms{graph}  vs default {r['vs_default']:.1e}" if "ms" in r else r["error"]
            print(f"  {'*' if r['default'] else ' '} {r['plan']}  {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
