"""Context parallelism (chunkwise.distributed) on the CPU: gloo, 2 and 4 processes.

Every case runs the same op twice on every rank: once single-process on the whole batch, once with
``cp_group`` on the rank's slice of the tokens (slices of unequal lengths), and compares outputs,
final states and the gradients of every input (float64 to rounding; fp32, bf16, fp16 and the Triton
backend under the interpreter to their dtype's tolerance). One spawned group per world size runs all
cases; the test functions read its results.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import socket
import tempfile
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import CHUNK_OPS, INTERPRET, TOL, make_inputs, rel_err

WORLD_SIZES = (2, 4)
RANK_TOKENS = {2: [45, 38], 4: [25, 31, 20, 27]}        # tokens per rank (global T = 83 / 103)
# varlen batches: global sequence lengths (summing to the global T)
VARLEN = {
    2: {"cross": [4, 56, 2, 21],         # 4..60 crosses the boundary at 45; 60..62 lies inside rank 1
        "aligned": [1, 44, 0, 5, 33],    # length 1; a sequence ends exactly at 45; a zero-length one at 45
        "per-rank": [45, 38]},           # one sequence per rank: nothing crosses
    4: {"cross": [3, 77, 2, 21],         # 3..80 runs through all four ranks (boundaries 25, 56, 76); 80..82 inside rank 3
        # ends exactly at 25, zero-length at 25 and at the end, length 1 at 25; rank 2 both ends the sequence it
        # got from rank 1 and hands a new one (60..90) to rank 3
        "aligned": [25, 0, 1, 34, 30, 13, 0],
        # 10..30 crosses 25; 30..86 runs from rank 1 through rank 2 into rank 3 (not from rank 0)
        "middle": [10, 20, 56, 17]},
}
SHAPE = dict(H=2, HV=4, K=8, V=12)                      # grouped value heads, K != V
CHUNK = 16


def _cases():
    cases = {}
    for fam in ("gdn", "kda", "delta", "gla"):
        cases[f"{fam}-dense"] = dict(fam=fam)
        for pattern in dict.fromkeys(p for W in WORLD_SIZES for p in VARLEN[W]):
            cases[f"{fam}-varlen-{pattern}"] = dict(fam=fam, varlen=pattern,
                                                    worlds=tuple(W for W in WORLD_SIZES if pattern in VARLEN[W]))
    cases["gdn-prelude"] = dict(fam="gdn", varlen="cross", prelude=True)
    cases["kda-prelude-lower-bound"] = dict(fam="kda", varlen="cross", prelude=True, lower_bound=-5.0)
    cases["gla-prelude-dense"] = dict(fam="gla", prelude=True)
    cases["kda-strong-gates"] = dict(fam="kda", varlen="cross", gate="strong")
    cases["gdn-strong-gates-dense"] = dict(fam="gdn", gate="strong")
    cases["gdn-transposed-state"] = dict(fam="gdn", varlen="cross", transpose=True)
    cases["delta-no-state"] = dict(fam="delta", varlen="cross", h0=False, final=False)
    cases["gla-no-initial-state-dense"] = dict(fam="gla", h0=False)
    cases["gdn-fp32"] = dict(fam="gdn", varlen="cross", dtype="float32")
    cases["kda-fp32-dense"] = dict(fam="kda", dtype="float32")
    cases["gdn-bf16"] = dict(fam="gdn", varlen="cross", dtype="bfloat16")
    cases["delta-fp16-dense"] = dict(fam="delta", dtype="float16")
    cases["gdn-inference"] = dict(fam="gdn", varlen="cross", grad="none")            # under torch.no_grad
    cases["kda-only-v-requires-grad-dense"] = dict(fam="kda", grad="v")
    cases["gdn-single-rank-groups"] = dict(fam="gdn", varlen="cross", single=True)   # each rank its own group
    if INTERPRET:   # the Triton backend on CPU tensors (the interpreter: slow, so two processes and two families)
        small = dict(H=1, HV=1, K=8, V=12)
        cases["gdn-triton"] = dict(fam="gdn", varlen="cross", dtype="float32", backend="triton", worlds=(2,),
                                   shape=small)
        cases["kda-triton"] = dict(fam="kda", varlen="cross", dtype="float32", backend="triton", worlds=(2,),
                                   shape=small)
    return cases


CASES = _cases()
# bad arguments: the text of the error on rank 1 and on the other ranks; no rank may hang
ERROR_CASES = {
    "error-cu-seqlens-local": ("disagree on cu_seqlens", "disagree on cu_seqlens"),
    "error-cu-seqlens-wrong-total": ("the sum of the ranks' tokens", "the sum of the ranks' tokens"),
    "error-initial-state-local": ("initial_state must have shape", "initial_state must have shape"),
    "error-beta-shape-on-one-rank": ("beta must have shape", "rank(s) [1] of cp_group rejected"),
    "error-requires-grad-on-one-rank": ("disagree on requires_grad", "disagree on requires_grad"),
    "error-cu-seqlens-differ": ("disagree on cu_seqlens", "disagree on cu_seqlens"),
}


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------

def _bounds(W):
    return _bounds_of(RANK_TOKENS[W])


_SINGLE_GROUP = {}      # this rank's one-member group (set by _worker)


def _run_case(name, spec, W, rank):
    """One case on this rank: {quantity: relative error} plus the ownership check of the final states."""
    group, bounds = dist.group.WORLD, _bounds(W)
    lengths = VARLEN[W][spec["varlen"]] if "varlen" in spec else None
    if spec.get("single"):          # a group of one: the whole batch on this rank
        group, bounds, W, rank = _SINGLE_GROUP["group"], [0, bounds[-1]], 1, 0
    a, b = bounds[rank], bounds[rank + 1]
    fam = spec["fam"]
    dtype = getattr(torch, spec.get("dtype", "float64"))
    shape = spec.get("shape", SHAPE)
    inp = make_inputs(fam, B=2, T=bounds[-1], dtype=dtype, device="cpu", gate=spec.get("gate", "normal"),
                      h0=spec.get("h0", True), lengths=lengths, seed=zlib.crc32(name.encode()) % 1000, requires_grad=True,
                      **shape)
    HV, K = shape["HV"], shape["K"]
    gen = torch.Generator().manual_seed(7)
    kwargs = dict(chunk_size=CHUNK, output_final_state=spec.get("final", True))
    params = {}
    if spec.get("prelude"):
        kwargs.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
        if fam != "gla":
            kwargs["use_beta_sigmoid_in_kernel"] = True
        params["A_log"] = torch.randn(HV, generator=gen, dtype=torch.float64).mul(0.3).to(dtype)
        params["dt_bias"] = torch.randn(HV * K if fam == "kda" else HV, generator=gen,
                                        dtype=torch.float64).mul(0.3).to(dtype)
        if "lower_bound" in spec:
            kwargs["lower_bound"] = spec["lower_bound"]
        if inp.g is not None:                       # raw projections instead of log-decays
            with torch.no_grad():
                inp.g.copy_(torch.randn(inp.g.shape, generator=gen, dtype=torch.float64))
    h0 = inp.h0
    if spec.get("transpose") and h0 is not None:
        h0 = h0.detach().transpose(-1, -2).contiguous().requires_grad_()
        kwargs["transpose_state_layout"] = True
    op = CHUNK_OPS[fam]
    full_params = {n: p.clone().requires_grad_() for n, p in params.items()}

    # single process, the whole batch (the torch backend)
    o, ht = op(*inp.args(), initial_state=h0, cu_seqlens=inp.cu_seqlens, backend="torch", **full_params, **kwargs)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    loss = (o * do).sum()
    if ht is not None:
        dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.dtype)
        loss = loss + (ht * dht).sum()
    loss.backward()

    # context parallel: this rank's slice
    grad = spec.get("grad", "all")
    local = [x.detach()[:, a:b].clone().requires_grad_(grad == "all" or (grad == "v" and i == 2))
             for i, x in enumerate(inp.args())]
    h0_cp = None if h0 is None else h0.detach().clone().requires_grad_(grad == "all")
    cp_params = {n: p.clone().requires_grad_(grad == "all") for n, p in params.items()}
    with torch.set_grad_enabled(grad != "none"):
        o_cp, ht_cp = op(*local, initial_state=h0_cp, cu_seqlens=inp.cu_seqlens, cp_group=group,
                         backend=spec.get("backend", "torch"), **cp_params, **kwargs)
    if grad != "none":
        loss = (o_cp * do[:, a:b]).sum()
        if ht_cp is not None:
            loss = loss + (ht_cp * dht).sum()    # rows owned elsewhere are zero: the group's losses sum to one
        loss.backward()
    else:
        no_graph = not o_cp.requires_grad and (ht_cp is None or not ht_cp.requires_grad)

    def summed(x):
        x = x.detach().clone()
        dist.all_reduce(x, group=group)
        return x

    res = {"o": rel_err(o_cp, o.detach()[:, a:b]), "o_nan": bool(torch.isnan(o_cp).any())}
    if ht is not None:
        res["final_state (sum over ranks)"] = rel_err(summed(ht_cp), ht)
        if lengths is None:
            owned = [rank == W - 1] * ht.shape[0]
        else:
            cu = inp.cu_seqlens.tolist()
            owned = [a <= cu[n + 1] - 1 < b if cu[n + 1] > cu[n] else (a <= cu[n] < b or (cu[n] == b == bounds[-1]))
                     for n in range(len(cu) - 1)]
        own = torch.tensor(owned)
        res["owned rows"] = sum(owned)
        if own.any():
            res["final_state (owned rows)"] = rel_err(ht_cp[own], ht.detach()[own])
        res["final_state (other rows are zero)"] = bool((ht_cp[~own] == 0).all())
    else:
        res["final_state is None"] = ht_cp is None
    if grad == "none":
        res["no autograd graph under no_grad"] = no_graph
        return res
    names = ["q", "k", "v"] + (["g"] if inp.g is not None else []) + (["beta"] if inp.beta is not None else [])
    for name, x_cp, x in zip(names, local, inp.args()):
        if x_cp.requires_grad:
            res[f"d{name}"] = rel_err(x_cp.grad, x.grad[:, a:b])
        else:
            res[f"{name} has no gradient"] = x_cp.grad is None
    if h0 is not None and grad == "all":
        res["dinitial_state (sum over ranks)"] = rel_err(summed(_grad(h0_cp)), h0.grad)
    for n in params:
        res[f"d{n} (sum over ranks)"] = rel_err(summed(_grad(cp_params[n])), full_params[n].grad)
    return res


def _grad(x):
    return torch.zeros_like(x) if x.grad is None else x.grad


def _run_error_case(name, W, rank):
    """Bad arguments, on every rank or on one, must raise a clear error on every rank (no hang)."""
    bounds = _bounds(W)
    a, b = bounds[rank], bounds[rank + 1]
    inp = make_inputs("gdn", dtype=torch.float64, device="cpu", lengths=VARLEN[W]["cross"], **SHAPE)
    args = [x[:, a:b] for x in inp.args()]
    kw = dict(cu_seqlens=inp.cu_seqlens, initial_state=inp.h0)
    if name == "error-cu-seqlens-local":                 # offsets of the local slice instead of the whole batch
        kw.update(cu_seqlens=torch.tensor([0, b - a], dtype=torch.int32), initial_state=inp.h0[:1])
    elif name == "error-cu-seqlens-wrong-total":         # the same offsets everywhere, one token too many
        kw.update(cu_seqlens=inp.cu_seqlens + torch.arange(inp.cu_seqlens.numel()).eq(inp.cu_seqlens.numel() - 1))
    elif name == "error-initial-state-local":            # one state per local sequence instead of per global one
        kw.update(initial_state=inp.h0[:2])
    elif name == "error-beta-shape-on-one-rank" and rank == 1:
        args[-1] = args[-1][..., :1]
    elif name == "error-requires-grad-on-one-rank" and rank == 0:
        args[0] = args[0].clone().requires_grad_()
    elif name == "error-cu-seqlens-differ" and rank == 0:
        kw.update(cu_seqlens=torch.tensor([0, 1, T] if (T := bounds[-1]) > 1 else [0, T], dtype=torch.int32),
                  initial_state=inp.h0[:2])
    try:
        CHUNK_OPS["gdn"](*args, cp_group=dist.group.WORLD, chunk_size=CHUNK, **kw)
    except ValueError as e:
        return {"raised": True, "message": str(e)}
    return {"raised": False, "message": ""}


def _worker(rank, W, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    _SINGLE_GROUP["group"] = [dist.new_group([r]) for r in range(W)][rank]
    try:
        for name, spec in CASES.items():
            if W not in spec.get("worlds", WORLD_SIZES):
                continue
            try:
                results[name] = _run_case(name, spec, W, rank)
            except Exception:                # recorded; the test of this case fails with it
                results[name] = {"exception": traceback.format_exc()}
        for name in ERROR_CASES:
            results[name] = _run_error_case(name, W, rank)
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
    # leave without the interpreter's teardown: once in ~200 spawned groups (fresh-clone CI, 2 cores,
    # 4 ranks) a rank aborted there ("terminate called without an active exception", SIGABRT) after
    # its results were written, and spawn reported the whole group failed
    os._exit(0)


@functools.cache
def _results(W):
    """{case: [per-rank result]} from one spawned group of W processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(W, port, out_dir), nprocs=W, join=True)
        per_rank = []
        for r in range(W):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return {name: [p[name] for p in per_rank] for name in per_rank[0]}


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,W", [(c, W) for c, spec in CASES.items() for W in spec.get("worlds", WORLD_SIZES)])
def test_context_parallel_matches_single_process(case, W):
    spec = CASES[case]
    tol = TOL[getattr(torch, spec.get("dtype", "float64"))]
    for rank, res in enumerate(_results(W)[case]):
        assert "exception" not in res, f"rank {rank}:\n{res.get('exception')}"
        assert not res.pop("o_nan"), f"rank {rank}: NaN in o"
        for key, val in res.items():
            if key == "owned rows":
                continue
            if isinstance(val, bool):
                assert val, f"rank {rank}: {key} fails"
            else:
                assert val <= tol, f"rank {rank}: {key} relative error {val:.2e} > {tol:.0e}"


@pytest.mark.parametrize("W", WORLD_SIZES)
def test_context_parallel_final_state_owners(W):
    """Every final state is returned by exactly one rank (the one holding the sequence's last token)."""
    for case, spec in CASES.items():
        if not spec.get("final", True) or W not in spec.get("worlds", WORLD_SIZES) or spec.get("single"):
            continue
        counts = [res["owned rows"] for res in _results(W)[case]]
        N = len(VARLEN[W][spec["varlen"]]) if "varlen" in spec else 2
        assert sum(counts) == N, f"{case}: owned rows per rank {counts}, {N} sequences"


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_context_parallel_bad_arguments_raise_on_every_rank(case, W):
    for rank, res in enumerate(_results(W)[case]):
        assert res["raised"], f"rank {rank}: no ValueError"
        want = ERROR_CASES[case][0 if rank == 1 else 1]
        assert want in res["message"], f"rank {rank}: {res['message']}"


def test_plan_ranks():
    """The host-side plan (no processes): carries, local offsets and final-state owners."""
    from chunkwise.distributed import plan_ranks

    def cu(lengths):
        out = [0]
        for n in lengths:
            out.append(out[-1] + n)
        return out

    plans = plan_ranks(RANK_TOKENS[4], cu(VARLEN[4]["middle"]), 1)     # boundaries 25, 56, 76
    assert [(p.carry_in, p.carry_out, p.through) for p in plans] == [
        (False, True, False), (True, True, False), (True, True, True), (True, False, False)]
    assert [tuple(p.seqs) for p in plans] == [(0, 1), (1, 2), (2,), (2, 3)]
    assert [p.local_cu for p in plans] == [(0, 10, 25), (0, 5, 31), (0, 20), (0, 10, 27)]
    assert [p.head for p in plans] == [0, 5, 20, 10]
    assert [tuple(p.ends) for p in plans] == [(0,), (0,), (), (0, 1)]

    plans = plan_ranks(RANK_TOKENS[4], cu(VARLEN[4]["aligned"]), 1)    # zero-length sequences 1 and 6
    assert [tuple(p.seqs) for p in plans] == [(0,), (1, 2, 3), (3, 4), (4, 5, 6)]
    assert plans[1].local_cu == (0, 0, 1, 31) and plans[3].local_cu == (0, 14, 27, 27)
    assert [tuple(p.ends) for p in plans] == [(0,), (0, 1), (0,), (0, 1, 2)]

    plans = plan_ranks([3, 4, 5], None, 2)                              # dense: every row through every rank
    assert [(p.carry_in, p.carry_out, p.through, p.head, tuple(p.ends)) for p in plans] == [
        (False, True, False, 0, ()), (True, True, True, 4, ()), (True, False, False, 5, (0, 1))]


def test_plan_rank_matches_brute_force():
    """The bisection plan against the definitions, on random splits with zero-length sequences."""
    from chunkwise.distributed import _passes_through, plan_rank

    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        W = int(torch.randint(1, 6, (1,), generator=gen))
        lengths = (torch.randint(1, 9, (W,), generator=gen)).tolist()
        T = sum(lengths)
        cuts = sorted(torch.randint(0, T + 1, (int(torch.randint(0, 8, (1,), generator=gen)),), generator=gen).tolist())
        cu = [0, *cuts, T]
        bounds = _bounds_of(lengths)
        for r in range(W):
            a, b = bounds[r], bounds[r + 1]
            seqs = [n for n in range(len(cu) - 1)
                    if (cu[n] < cu[n + 1] and cu[n] < b and cu[n + 1] > a)
                    or (cu[n] == cu[n + 1] and (a <= cu[n] < b or (cu[n] == T and r == W - 1)))]
            p = plan_rank(r, lengths, cu, 1)
            assert tuple(p.seqs) == tuple(seqs), (lengths, cu, r)
            assert p.local_cu == tuple([min(max(cu[n] - a, 0), b - a) for n in seqs] + [min(cu[seqs[-1] + 1], b) - a])
            assert p.carry_in == (cu[seqs[0]] < a) and p.carry_out == (cu[seqs[-1] + 1] > b)
            assert tuple(p.ends) == tuple(i for i, n in enumerate(seqs) if cu[n + 1] <= b)
            assert p.through == (p.carry_in and p.carry_out and len(seqs) == 1) == _passes_through(r, lengths, cu)


def _bounds_of(lengths):
    b = [0]
    for n in lengths:
        b.append(b[-1] + n)
    return b
