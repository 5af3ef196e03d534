"""Context-parallel benchmark: the chunk ops with ``cp_group`` over the ranks of a torchrun group (NCCL on GPUs, one
GPU per rank; gloo on the CPU) against the whole sequence on one device.

    torchrun --nproc_per_node 2 benchmarks/bench_cp.py --shapes B1-T131072-H32 --ops gdn,kda,delta,gla --out DIR
    torchrun --nproc_per_node 1 benchmarks/bench_cp.py --shapes B1-T131072-H32 --out DIR      # a group of one
    torchrun --nproc_per_node 2 benchmarks/bench_cp.py --device cpu --dtype fp32 --shapes smoke --reps 1

Every rank holds the whole batch (drawn on rank 0, broadcast) and passes its contiguous slice of the tokens to the
op (rank r of W: tokens [r·T/W, (r + 1)·T/W) of every row, or of the packed batch with the whole batch's cu_seqlens).
Per shape and op, in milliseconds (forward under no_grad; forward + backward with the gradients of q, k, v, g and
beta from o and the final state):

- whole: the op on the whole sequence on one device (each rank on its own; the scaling's baseline);
- cp: the op with cp_group on the rank's slice;
- local: the op on the rank's slice without cp_group, as if the slices were separate sequences: perfect scaling;
- collective: chunk_cp's exchanges alone, at its sizes: the all-gather of the arguments' summary (with its host
  sync) and of [P | Q] (rows x HV x K x (K + V), fp32), and in the backward the reduce-scatter;
- carry: the carried-in segment's call with V + K value columns, which also gives its transition (forward; zero on
  a rank where no sequence comes in from the left);
- correction = cp − local − collective: what context parallelism costs beyond the exchange (the wider carried
  segment, the fold and the correction of the carried-in tokens, and waiting for slower ranks).

Timing: the same fixed number of calls on every rank (the collectives inside must pair up; triton's do_bench picks a
count per process), after two warm-up calls; CUDA events around each call (perf_counter on the CPU); the median per
rank, and in the table the slowest rank's (every rank's in the JSON). Speed-up = whole / cp; efficiency = speed-up /
W. The split run is checked against the whole run: outputs, final states (summed over the ranks) and every
gradient, relative Frobenius errors over all ranks, within common.AGREE (two correct implementations).

Rank 0 writes bench_cp_w{W}.json and bench_cp_w{W}.png to --out and prints a markdown table last. Exit status 1 if
a check fails.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from shapes import make_inputs, resolve  # noqa: E402

COLUMNS = [("shape", "shape", ""), ("op", "op", ""), ("W", "world", "d"),
           ("one device fwd", "whole_fwd_ms", ".3f"), ("cp fwd", "cp_fwd_ms", ".3f"), ("x fwd", "x_fwd", ".2f"),
           ("one device fwd+bwd", "whole_ms", ".2f"), ("cp fwd+bwd", "cp_ms", ".2f"), ("x fwd+bwd", "x", ".2f"),
           ("local fwd / fwd+bwd", "local", ""), ("collective fwd / fwd+bwd", "collective", ""),
           ("carry fwd", "carry_fwd_ms", ".3f"), ("correction fwd / fwd+bwd", "correction", ""),
           ("max rel err", "max_err", ".1e"), ("ok", "ok", "")]
NAMES = ("q", "k", "v", "g", "beta")


# -- the group -----------------------------------------------------------------------------------------------------

def init_group(device_kind: str) -> tuple[int, int, torch.device, bool]:
    """(rank, world size, this rank's device, whether this call made the group). Under torchrun the group comes from
    its environment; a plain ``python bench_cp.py`` runs a group of one."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)      # before the group: NCCL's communicators bind to the current device
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device, False
    kw = dict(backend="nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=900))
    if device.type == "cuda":
        kw["device_id"] = device
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        kw.update(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dist.init_process_group(**kw)
    return dist.get_rank(), dist.get_world_size(), device, True


def per_rank(value: float, device) -> list[float]:
    """Every rank's value, in rank order."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [p.item() for p in parts]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int, leaves=()) -> list[float]:
    """Every rank's median ms of fn() over ``reps`` calls after two warm-up calls (the same count on every rank),
    the gradients of ``leaves`` reset before each call."""
    def call():
        for t in leaves:
            t.grad = None
        fn()
    call()
    call()
    sync(device)
    dist.barrier()
    times = []
    if device.type == "cuda":
        events = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for t in leaves:
                t.grad = None
            start.record()
            fn()
            end.record()
            events.append((start, end))
        sync(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(reps):
            for t in leaves:
                t.grad = None
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return per_rank(statistics.median(times), device)


# -- one row -------------------------------------------------------------------------------------------------------

def _leaves(x: dict, a: int, b: int) -> dict:
    """Leaf copies of x's q, k, v, g, beta (tokens a..b), the other entries as they are."""
    out = dict(x)
    for n in NAMES:
        if x[n] is not None:
            out[n] = x[n][:, a:b].detach().clone().requires_grad_(True)
    return out


def _fwd_bwd(run, do, dht):
    def step():
        o, ht = run()
        torch.autograd.backward([o, ht], [do, dht])
    return step


def _sq(x: torch.Tensor, y: torch.Tensor | None = None) -> float:
    """‖x − y‖² (‖x‖² without y), the difference taken in fp32."""
    d = x.detach().float() if y is None else x.detach().float() - y.detach().float()
    return float(torch.linalg.vector_norm(d)) ** 2


def bench_one(op: str, shape, args, rank: int, W: int, device) -> dict:
    import chunkwise.distributed as cpd
    from chunkwise import api, prepare_chunk_indices

    dtype, backend, group, reps = common.DTYPES[args.dtype], common.backend_of(args), dist.group.WORLD, args.reps
    x = make_inputs(op, shape, dtype, device)
    for n in NAMES:             # the same batch on every rank, whatever each device's generator gives
        if x[n] is not None:
            dist.broadcast(x[n], 0)
    B, T, HV, K, V = shape.B, shape.T, shape.HV, shape.K, shape.V
    bounds = [r * T // W for r in range(W + 1)]
    a, b = bounds[rank], bounds[rank + 1]
    cu = None if shape.cu_seqlens is None else list(shape.cu_seqlens)
    plan = cpd.plan_rank(rank, [bounds[r + 1] - bounds[r] for r in range(W)], cu, B)
    gen = torch.Generator(device).manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    dht = torch.randn(shape.sequences, HV, K, V, generator=gen, device=device)
    dist.broadcast(do, 0)
    dist.broadcast(dht, 0)
    row = dict(shape=shape.name, op=op, world=W)

    whole = _leaves(x, 0, T)
    run_whole = lambda: common.run_chunkwise(op, whole, backend)  # noqa: E731
    xs = _leaves(x, a, b)
    run_cp = lambda: common.run_chunkwise(op, xs, backend, cp_group=group)  # noqa: E731
    xl = _leaves(x, a, b)
    if cu is not None:          # the slice's own sequences (cut at the rank's boundaries)
        cu_l = torch.tensor(plan.local_cu, dtype=torch.int32)
        xl.update(cu_seqlens=cu_l.to(device), cu_seqlens_cpu=cu_l, chunk_indices=prepare_chunk_indices(cu_l).to(device))
    run_local = lambda: common.run_chunkwise(op, xl, backend)  # noqa: E731
    do_l = do[:, a:b]
    dht_l = dht[list(plan.seqs)]

    # the split run against the whole run
    o_w, ht_w = run_whole()
    torch.autograd.backward([o_w, ht_w], [do, dht])
    o_c, ht_c = run_cp()
    torch.autograd.backward([o_c, ht_c], [do_l, dht])
    ht_sum = ht_c.detach().clone()
    dist.all_reduce(ht_sum)
    pairs = {"o": (o_c, o_w[:, a:b])}
    pairs.update({f"d{n}": (xs[n].grad, whole[n].grad[:, a:b]) for n in NAMES if x[n] is not None})
    err, finite = {}, all(bool(torch.isfinite(c).all()) for c, _ in pairs.values())
    for name, (c, w) in pairs.items():
        num, den = (torch.tensor(v, dtype=torch.float64, device=device) for v in (_sq(c, w), _sq(w)))
        dist.all_reduce(num)
        dist.all_reduce(den)
        err[name] = float((num / den.clamp_min(1e-30)).sqrt())
    err["final_state"] = common.rel(ht_sum, ht_w.detach())
    finite = min(per_rank(finite and bool(torch.isfinite(ht_sum).all()), device)) > 0
    row.update({f"err_{n}": e for n, e in err.items()}, max_err=max(err.values()), finite=finite)
    del o_w, ht_w, o_c, ht_c, ht_sum, pairs
    for t in (*whole.values(), *xs.values()):
        if isinstance(t, torch.Tensor):
            t.grad = None

    # the times
    lv = lambda d: [d[n] for n in NAMES if d[n] is not None]  # noqa: E731
    with torch.no_grad():
        row["whole_fwd_ranks"] = timed(run_whole, device, reps)
        row["cp_fwd_ranks"] = timed(run_cp, device, reps)
        row["local_fwd_ranks"] = timed(run_local, device, reps)
    row["whole_ranks"] = timed(_fwd_bwd(run_whole, do, dht), device, reps, lv(whole))
    row["cp_ranks"] = timed(_fwd_bwd(run_cp, do_l, dht), device, reps, lv(xs))
    row["local_ranks"] = timed(_fwd_bwd(run_local, do_l, dht_l), device, reps, lv(xl))

    # chunk_cp's exchanges alone: the summary (8 integers) and [P | Q] for the carried rows
    rows = B if cu is None else 1
    X = torch.zeros(rows, HV, K, K + V, device=device, requires_grad=True)
    summary = [b - a, B, shape.H, HV, K, V, 0, 1]

    def exchange():
        cpd._gather_summary(summary, device, group)
        return cpd._AllGather.apply(X, group)
    with torch.no_grad():
        row["collective_fwd_ranks"] = timed(exchange, device, reps)
    ones = torch.ones(W, *X.shape, device=device)
    row["collective_ranks"] = timed(lambda: exchange().backward(ones), device, reps, [X])

    # the carried-in segment's wide call (what gives q̂ and P)
    if plan.carry_in:
        e, fam = plan.head, {"gdn": api.GDN, "kda": api.KDA, "delta": api.DELTA, "gla": api.GLA}[op]
        head = [None if x[n] is None else x[n][:, a:a + e] for n in NAMES]
        carry = lambda: cpd._carried_segment(fam, *head, K ** -0.5, 32, backend, torch.float32)  # noqa: E731
    else:
        carry = lambda: None  # noqa: E731
    with torch.no_grad():
        row["carry_fwd_ranks"] = timed(carry, device, reps)

    slowest = {k[:-len("_ranks")] + "_ms": max(v) for k, v in row.items() if k.endswith("_ranks")}
    slowest.update(whole_fwd_ms=row["whole_fwd_ranks"][0], whole_ms=row["whole_ranks"][0])   # rank 0's device
    row.update(slowest)
    for sfx in ("_fwd", ""):
        row[f"correction{sfx}_ms"] = row[f"cp{sfx}_ms"] - row[f"local{sfx}_ms"] - row[f"collective{sfx}_ms"]
        row[f"x{sfx}"] = row[f"whole{sfx}_ms"] / row[f"cp{sfx}_ms"]
        row[f"efficiency{sfx}"] = row[f"x{sfx}"] / W
    for what in ("local", "collective", "correction"):
        row[what] = f"{row[f'{what}_fwd_ms']:.3f} / {row[f'{what}_ms']:.2f}"
    row["ok"] = row["finite"] and row["max_err"] <= common.AGREE[dtype]
    return row


def main(argv=None) -> int:
    ap = common.parser(__doc__, shapes="cp", warmup=False)
    ap.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 10 on a GPU, 3 on "
                    "the CPU)")
    args = ap.parse_args(argv)
    ops, shapes = common.parse_ops(args.ops), resolve(args.shapes)
    kind = torch.device(args.device).type
    args.reps = args.reps or (10 if kind == "cuda" else 3)
    rank, W, device, made = init_group(kind)
    try:
        devices = [int(d) for d in per_rank(device.index or 0, device)]
        meta = common.metadata(args, benchmark="context parallel", world_size=W, process_group=dist.get_backend(),
                               devices=devices,
                               timing=f"{args.reps} calls per rank after 2 warm-up calls, CUDA events per call (CPU: "
                               "perf_counter), median per rank; tables: the slowest rank (whole: rank 0)")
        path = os.path.join(args.out, f"bench_cp_w{W}.json")
        rows, cut, start = [], False, time.monotonic()
        for s in shapes:
            if s.T < W:
                if rank == 0:
                    print(f"{s.name} skipped: {s.T} tokens cannot be split over {W} ranks", file=sys.stderr)
                continue
            for op in ops:
                late = args.time_limit is not None and time.monotonic() - start > args.time_limit
                if max(per_rank(late, device)):      # every rank stops at the same row
                    cut = True
                    break
                row = bench_one(op, s, args, rank, W, device)
                if rank == 0:
                    rows.append(row)
                    print(json.dumps(row, default=str), flush=True)
                    common.write_json(path, meta, rows)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if cut:
                break
        ok = rows and all(r["ok"] for r in rows) and not cut
        if rank == 0:
            meta["cut_short"] = cut
            common.write_json(path, meta, rows)
            common.plot_bars(rows, os.path.join(args.out, f"bench_cp_w{W}.png"),
                             f"Context parallel over {W} ranks, {args.dtype}, on {meta['device']}: forward + backward "
                             f"(chunkwise {str(meta['commit'])[:8]})",
                             [("one device", "whole_ms"), (f"{W} ranks", "cp_ms"), ("local op", "local_ms")])
            print(f"\nContext parallel, {W} ranks ({meta['process_group']}), {args.dtype}, {meta['device']}, torch "
                  f"{meta['torch']}, triton {meta['triton']}, commit {str(meta['commit'])[:10]}, {meta['date']}")
            print("ms, slowest rank; x = one device / cp; correction = cp - local - collective\n")
            print(common.markdown_table(rows, COLUMNS))
        ok = bool(min(per_rank(bool(ok) if rank == 0 else 1.0, device)))
        if made:
            dist.barrier()      # (both ranks past their last collective before either tears its group down)
    finally:
        if made:
            dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    # out without the interpreter's finalization: there gloo's threads, torn down by static destructors, aborted a
    # rank now and then on a loaded machine ("terminate called without an active exception") after its work was done
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
