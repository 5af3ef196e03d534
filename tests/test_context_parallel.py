"""Context parallelism (chunkwise.distributed) in groups of 2 and 4 processes: gloo on the CPU, NCCL on GPUs.

Every case runs the same op twice on every rank: once single-process on the whole batch, once with
``cp_group`` on the rank's slice of the tokens (slices of unequal lengths), and compares outputs,
final states and the gradients of every input (float64 to rounding; fp32, bf16, fp16 and the Triton
backend under the interpreter to their dtype's tolerance). One spawned group per world size runs all
cases; the test functions read its results.

A world size with as many GPUs as ranks runs on NCCL instead, each rank on its own GPU (cuda:rank): every case
on CUDA tensors, plus GPU_CASES, the four families dense and varlen in bf16 through the Triton kernels at K = V =
128, judged as every bf16 Triton test is: against the float64 op on the whole batch, within TOL[bf16] (the
single-GPU bf16 op's own errors are shown beside a failure). The other world sizes stay on gloo and the CPU.
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
# world sizes with a GPU per rank: NCCL on CUDA tensors (the others: gloo on the CPU)
CUDA_WORLDS = tuple(W for W in WORLD_SIZES if torch.cuda.device_count() >= W)
# GPU_CASES: real head dims with grouped heads (V + K = 256: the carried segment's single wide call), the layouts
# above, and a longer one with several 64-token chunks per rank and boundaries inside chunks
GPU_SHAPE = dict(H=2, HV=4, K=128, V=128)
LONG_TOKENS = {2: [300, 213], 4: [130, 190, 77, 200]}    # boundaries 300 / 130, 320, 397
LONG_VARLEN = {2: [1, 250, 0, 200, 62],                  # 251..451 crosses 300; length 1 and 0 on rank 0
               4: [100, 1, 0, 400, 96]}                  # 101..501 runs from rank 1 through rank 2 into rank 3


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
    if CUDA_WORLDS:
        cases.update(_gpu_cases())
    if INTERPRET:   # the Triton backend on CPU tensors (the interpreter: slow, so two processes and two families)
        small = dict(H=1, HV=1, K=8, V=12)
        cases["gdn-triton"] = dict(fam="gdn", varlen="cross", dtype="float32", backend="triton", worlds=(2,),
                                   shape=small)
        cases["kda-triton"] = dict(fam="kda", varlen="cross", dtype="float32", backend="triton", worlds=(2,),
                                   shape=small)
    return cases


def _gpu_cases():
    """bf16 through the Triton kernels on GPUs (NCCL worlds only): every family dense and varlen, against float64."""
    cases = {}
    for fam in ("gdn", "kda", "delta", "gla"):
        base = dict(fam=fam, dtype="bfloat16", backend="triton", shape=GPU_SHAPE, ref="float64", worlds=CUDA_WORLDS)
        cases[f"{fam}-bf16-triton-dense"] = base
        for pattern in dict.fromkeys(p for W in CUDA_WORLDS for p in VARLEN[W]):
            cases[f"{fam}-bf16-triton-varlen-{pattern}"] = dict(
                base, varlen=pattern, worlds=tuple(W for W in CUDA_WORLDS if pattern in VARLEN[W]))
        cases[f"{fam}-bf16-triton-long-dense"] = dict(base, tokens=LONG_TOKENS)
        cases[f"{fam}-bf16-triton-long-varlen"] = dict(base, tokens=LONG_TOKENS, lengths=LONG_VARLEN)
    return cases


def _tokens(spec, W):
    """Tokens per rank of the case's layout."""
    return spec.get("tokens", RANK_TOKENS)[W]


def _lengths(spec, W):
    """The case's varlen sequence lengths (None: a dense batch)."""
    if "lengths" in spec:
        return spec["lengths"][W]
    return VARLEN[W][spec["varlen"]] if "varlen" in spec else None


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
# on NCCL only: CPU tensors on one rank (NCCL takes CUDA tensors; the summary exchange still runs on the GPU)
NCCL_ERROR_CASES = {
    "error-cpu-tensors-on-one-rank": ("NCCL, which takes CUDA tensors", "rank(s) [1] of cp_group rejected"),
}


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------

_SINGLE_GROUP = {}      # this rank's one-member group (set by _worker)


def _run_case(name, spec, W, rank, device):
    """One case on this rank: {quantity: relative error} plus the ownership check of the final states."""
    group, bounds = dist.group.WORLD, _bounds_of(_tokens(spec, W))
    lengths = _lengths(spec, W)
    if spec.get("single"):          # a group of one: the whole batch on this rank
        group, bounds, W, rank = _SINGLE_GROUP["group"], [0, bounds[-1]], 1, 0
    a, b = bounds[rank], bounds[rank + 1]
    fam = spec["fam"]
    dtype = getattr(torch, spec.get("dtype", "float64"))
    shape = spec.get("shape", SHAPE)
    inp = make_inputs(fam, B=2, T=bounds[-1], dtype=dtype, device=device, gate=spec.get("gate", "normal"),
                      h0=spec.get("h0", True), lengths=lengths, seed=zlib.crc32(name.encode()) % 1000, **shape)
    HV, K = shape["HV"], shape["K"]
    gen = torch.Generator().manual_seed(7)
    kwargs = dict(chunk_size=CHUNK, output_final_state=spec.get("final", True))
    params = {}
    if spec.get("prelude"):
        kwargs.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
        if fam != "gla":
            kwargs["use_beta_sigmoid_in_kernel"] = True
        params["A_log"] = torch.randn(HV, generator=gen, dtype=torch.float64).mul(0.3).to(device, dtype)
        params["dt_bias"] = torch.randn(HV * K if fam == "kda" else HV, generator=gen,
                                        dtype=torch.float64).mul(0.3).to(device, dtype)
        if "lower_bound" in spec:
            kwargs["lower_bound"] = spec["lower_bound"]
        if inp.g is not None:                       # raw projections instead of log-decays
            with torch.no_grad():
                inp.g.copy_(torch.randn(inp.g.shape, generator=gen, dtype=torch.float64).to(device))
    h0 = inp.h0
    if spec.get("transpose") and h0 is not None:
        h0 = h0.transpose(-1, -2).contiguous()
        kwargs["transpose_state_layout"] = True
    op = CHUNK_OPS[fam]
    backend = spec.get("backend", "torch")
    names = ["q", "k", "v"] + (["g"] if inp.g is not None else []) + (["beta"] if inp.beta is not None else [])

    def whole(cast, backend):
        """The single-process op on the whole batch, on leaf copies of the inputs cast by ``cast``: (o, final state,
        leaves of the op's arguments, of initial_state, of the parameters)."""
        args = [cast(x).clone().requires_grad_() for x in inp.args()]
        h = None if h0 is None else cast(h0).clone().requires_grad_()
        ps = {n: cast(p).clone().requires_grad_() for n, p in params.items()}
        o, ht = op(*args, initial_state=h, cu_seqlens=inp.cu_seqlens, backend=backend, **ps, **kwargs)
        return o, ht, args, h, ps

    def backward(o, ht):
        loss = (o * do.to(o.dtype)).sum()
        if ht is not None:
            loss = loss + (ht * dht.to(ht.dtype)).sum()
        loss.backward()

    # single process, the whole batch: the torch backend in the case's dtype, or in float64 (ref="float64")
    f64 = spec.get("ref") == "float64"
    o, ht, full_args, full_h0, full_params = whole(torch.Tensor.double if f64 else torch.Tensor.detach, "torch")
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device, dtype)
    if ht is not None:
        dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(device, ht.dtype if not f64 else
                                                                           torch.float32)
    backward(o, ht)

    # context parallel: this rank's slice
    grad = spec.get("grad", "all")
    local = [x.detach()[:, a:b].clone().requires_grad_(grad == "all" or (grad == "v" and i == 2))
             for i, x in enumerate(inp.args())]
    h0_cp = None if h0 is None else h0.detach().clone().requires_grad_(grad == "all")
    cp_params = {n: p.clone().requires_grad_(grad == "all") for n, p in params.items()}
    with torch.set_grad_enabled(grad != "none"):
        o_cp, ht_cp = op(*local, initial_state=h0_cp, cu_seqlens=inp.cu_seqlens, cp_group=group,
                         backend=backend, **cp_params, **kwargs)
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
    if f64:     # the single-device op in the case's dtype and backend, against the same float64 op (shown on failure)
        o1, ht1, args1, h1, _ = whole(torch.Tensor.detach, backend)
        backward(o1, ht1)
        single = {"o": rel_err(o1, o), **({} if ht is None else {"final_state": rel_err(ht1, ht)})}
        single.update({f"d{n}": rel_err(x1.grad, x.grad) for n, x1, x in zip(names, args1, full_args)})
        if h1 is not None:
            single["dinitial_state"] = rel_err(h1.grad, full_h0.grad)
        res["single-device op (not judged here)"] = single
    if ht is not None:
        res["final_state (sum over ranks)"] = rel_err(summed(ht_cp), ht)
        if lengths is None:
            owned = [rank == W - 1] * ht.shape[0]
        else:
            cu = inp.cu_seqlens.tolist()
            owned = [a <= cu[n + 1] - 1 < b if cu[n + 1] > cu[n] else (a <= cu[n] < b or (cu[n] == b == bounds[-1]))
                     for n in range(len(cu) - 1)]
        own = torch.tensor(owned, device=device)
        res["owned rows"] = sum(owned)
        if own.any():
            res["final_state (owned rows)"] = rel_err(ht_cp[own], ht.detach()[own])
        res["final_state (other rows are zero)"] = bool((ht_cp[~own] == 0).all())
    else:
        res["final_state is None"] = ht_cp is None
    if grad == "none":
        res["no autograd graph under no_grad"] = no_graph
        return res
    for name, x_cp, x in zip(names, local, full_args):
        if x_cp.requires_grad:
            res[f"d{name}"] = rel_err(x_cp.grad, x.grad[:, a:b])
        else:
            res[f"{name} has no gradient"] = x_cp.grad is None
    if h0 is not None and grad == "all":
        res["dinitial_state (sum over ranks)"] = rel_err(summed(_grad(h0_cp)), full_h0.grad)
    for n in params:
        res[f"d{n} (sum over ranks)"] = rel_err(summed(_grad(cp_params[n])), full_params[n].grad)
    return res


def _grad(x):
    return torch.zeros_like(x) if x.grad is None else x.grad


def _run_error_case(name, W, rank, device):
    """Bad arguments, on every rank or on one, must raise a clear error on every rank (no hang)."""
    bounds = _bounds_of(RANK_TOKENS[W])
    a, b = bounds[rank], bounds[rank + 1]
    inp = make_inputs("gdn", dtype=torch.float64, device=device, lengths=VARLEN[W]["cross"], **SHAPE)
    args = [x[:, a:b] for x in inp.args()]
    kw = dict(cu_seqlens=inp.cu_seqlens, initial_state=inp.h0)
    if name == "error-cu-seqlens-local":                 # offsets of the local slice instead of the whole batch
        kw.update(cu_seqlens=torch.tensor([0, b - a], dtype=torch.int32, device=device), initial_state=inp.h0[:1])
    elif name == "error-cu-seqlens-wrong-total":         # the same offsets everywhere, one token too many
        n = inp.cu_seqlens.numel()
        kw.update(cu_seqlens=inp.cu_seqlens + torch.arange(n, device=device).eq(n - 1))
    elif name == "error-initial-state-local":            # one state per local sequence instead of per global one
        kw.update(initial_state=inp.h0[:2])
    elif name == "error-beta-shape-on-one-rank" and rank == 1:
        args[-1] = args[-1][..., :1]
    elif name == "error-requires-grad-on-one-rank" and rank == 0:
        args[0] = args[0].clone().requires_grad_()
    elif name == "error-cu-seqlens-differ" and rank == 0:
        kw.update(cu_seqlens=torch.tensor([0, 1, T] if (T := bounds[-1]) > 1 else [0, T], dtype=torch.int32,
                                          device=device), initial_state=inp.h0[:2])
    elif name == "error-cpu-tensors-on-one-rank" and rank == 1:
        args = [x.cpu() for x in args]
        kw.update(cu_seqlens=inp.cu_seqlens.cpu(), initial_state=inp.h0.cpu())
    try:
        CHUNK_OPS["gdn"](*args, cp_group=dist.group.WORLD, chunk_size=CHUNK, **kw)
    except ValueError as e:
        return {"raised": True, "message": str(e)}
    return {"raised": False, "message": ""}


def _worker(rank, W, port, out_dir):
    torch.set_num_threads(1)
    nccl = W in CUDA_WORLDS
    if nccl:        # one GPU per rank, current before the group exists (NCCL's communicators bind to it)
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    # (NCCL: a rank compiling Triton kernels the others have compiled keeps them waiting in a collective)
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=W, timeout=datetime.timedelta(seconds=600 if nccl else 120))
    results = {}
    _SINGLE_GROUP["group"] = [dist.new_group([r]) for r in range(W)][rank]
    try:
        for name, spec in CASES.items():
            if W not in spec.get("worlds", WORLD_SIZES):
                continue
            try:
                results[name] = _run_case(name, spec, W, rank, device)
            except Exception:                # recorded; the test of this case fails with it
                results[name] = {"exception": traceback.format_exc()}
        for name in [*ERROR_CASES, *(NCCL_ERROR_CASES if nccl else ())]:
            results[name] = _run_error_case(name, W, rank, device)
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
        single = res.pop("single-device op (not judged here)", None)
        also = "" if single is None else f" (the single-device op against float64: {single})"
        for key, val in res.items():
            if key == "owned rows":
                continue
            if isinstance(val, bool):
                assert val, f"rank {rank}: {key} fails"
            else:
                assert val <= tol, f"rank {rank}: {key} relative error {val:.2e} > {tol:.0e}{also}"


@pytest.mark.parametrize("W", WORLD_SIZES)
def test_context_parallel_final_state_owners(W):
    """Every final state is returned by exactly one rank (the one holding the sequence's last token)."""
    for case, spec in CASES.items():
        if not spec.get("final", True) or W not in spec.get("worlds", WORLD_SIZES) or spec.get("single"):
            continue
        counts = [res["owned rows"] for res in _results(W)[case]]
        N = len(_lengths(spec, W) or [0, 0])
        assert sum(counts) == N, f"{case}: owned rows per rank {counts}, {N} sequences"


@pytest.mark.parametrize("case,W", [(c, W) for c in ERROR_CASES for W in WORLD_SIZES] +
                         [(c, W) for c in NCCL_ERROR_CASES for W in CUDA_WORLDS])
def test_context_parallel_bad_arguments_raise_on_every_rank(case, W):
    for rank, res in enumerate(_results(W)[case]):
        assert res["raised"], f"rank {rank}: no ValueError"
        want = {**ERROR_CASES, **NCCL_ERROR_CASES}[case][0 if rank == 1 else 1]
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
