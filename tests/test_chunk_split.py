"""The sequence split (triton/split.py): the delta families' chunk forward and backward, and simple GLA's backward,
on a batch of segments, each segment from its entering state M·S + N, equal the unsplit ones and the float64
recurrence (autograd for the gradients).

Under the interpreter: fp32 (one fp16 case), small head dims, splits forced through the plan (ForwardPlan.delta_split,
BackwardPlan.split: chunks per segment) at 1-2 chunks per segment, so that every sequence runs as 2-5 segments, on
fixed layouts and on random ones (hypothesis; a 0.1 % error in the combine's N fails them in every family). Every
tensor the launchers allocate is pre-filled with NaN (CHUNKWISE_POISON=1), so an entering state or a transition the
split forgets to write fails the comparison. The automatic choice (configs.split_chunks) is checked on the benchmark's
shapes, and once end to end.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from chunkwise.triton.chunk import chunk_bwd, chunk_fwd
from chunkwise.triton.common import BT, _num_sms, cdiv, chunk_slots, padded_dims, target_arch
from chunkwise.triton.configs import (SPLIT_FILL, SPLIT_MIN_CHUNKS, SPLIT_MIN_SEQ, backward_plan, forward_plan,
                                      split_chunks)
import chunkwise.triton.chunk as chunk_mod
import chunkwise.triton.split as split_mod
from chunkwise.triton.split import decay_transitions, segment_grads, split_batch
from chunkwise.utils import prepare_chunk_indices
from helpers import (CHUNK_OPS, DEVICE, ON_GPU, PROPERTY_SETTINGS, PROPERTY_SHAPES, TOL, fla_error, make_inputs,
                     per_family, property_inputs, reference, rel_err)

GATE_KIND = {"delta": 0, "gdn": 1, "kda": 2}
F32 = TOL[torch.float32]
N_SM = 132


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("CHUNKWISE_POISON", "1")


def _plan(inp, seg, save=False):
    K, V = padded_dims(inp.q, inp.v)
    plan = forward_plan(inp.q.device, inp.q.dtype, GATE_KIND[inp.fam], True, K, V, save=save)
    return dataclasses.replace(plan, delta_split=seg)


def _fwd(inp, seg, transpose=False, saved=None, h0=True):
    """chunk_fwd at ``seg`` chunks per segment (0: unsplit), the final state back in the [N, HV, K, V] layout."""
    h = inp.h0 if h0 else None
    if h is not None and transpose:
        h = h.transpose(-1, -2).contiguous()
    o, ht = chunk_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.q.shape[-1] ** -0.5, h, True, inp.cu_seqlens,
                      transpose_state_layout=transpose, plan=_plan(inp, seg, saved is not None), saved_out=saved)
    return o, (ht.transpose(-1, -2) if transpose else ht)


# (id, make_inputs' shape, chunks per segment, transposed state): a dense view (256 tokens = 4 one-chunk segments),
# dense lengths no multiple of the chunk or the segment (300 tokens = 5 chunks = segments of 2, 2, 1: run as varlen),
# varlen with a long sequence beside empty, one-token and two-chunk ones
LAYOUTS = [("dense-view", dict(B=2, T=256), 1, False), ("dense-ragged", dict(B=2, T=300), 2, True),
           ("varlen", dict(lengths=[300, 0, 1, 70]), 1, False)]


@pytest.mark.parametrize("layout,shape,seg,transpose", LAYOUTS, ids=[c[0] for c in LAYOUTS])
@pytest.mark.parametrize("fam", ["gdn", "kda", "delta"])
def test_split_equals_unsplit_and_recurrence(fam, layout, shape, seg, transpose):
    """Output and final state of the split forward against the float64 recurrence and the unsplit forward, with an
    initial state, grouped heads (H = 1, HV = 2) and both state layouts."""
    inp = make_inputs(fam, H=1, HV=2, K=16, V=16, seed=3, **shape)
    ref_o, ref_h = reference(inp)
    o, ht = _fwd(inp, seg, transpose)
    o0, h0 = _fwd(inp, 0, transpose)
    for name, x, x0, ref in (("o", o, o0, ref_o), ("final state", ht, h0, ref_h)):
        e, e0 = rel_err(x, ref), rel_err(x0, ref)
        assert e <= F32, f"split {name} rel err {e:.2e} > {F32:.1e}"
        assert rel_err(x, x0) <= 2 * F32 and e <= 4 * e0 + 1e-6, f"split {name} {e:.2e} against unsplit {e0:.2e}"


def test_combine_launch_from_the_plan(monkeypatch):
    """The combines' launch is plan data (ForwardPlan.combine, BackwardPlan.combine): a 16-wide value block at 4
    warps, 1 stage (two programs per head, seen in the grids), where the default takes V = 32 in one block, gives the
    forward's output and final state and every gradient of the split backward within fp32 rounding of the
    default's."""
    kernel, grids = split_mod.segment_start_kernel, []

    class Seen:
        def __getitem__(self, grid):
            grids.append(grid[0])
            return kernel[grid]
    monkeypatch.setattr(split_mod, "segment_start_kernel", Seen())
    inp = make_inputs("gdn", H=1, HV=2, K=16, V=32, seed=9, lengths=[300, 0, 1, 70])
    scale = 16 ** -0.5
    outs = []
    for combine in (None, (16, 4, 1)):
        saved = {}
        plan = dataclasses.replace(_plan(inp, 1, save=True), combine=combine)
        o, ht = chunk_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, scale, inp.h0, True, inp.cu_seqlens, plan=plan,
                          saved_out=saved)
        assert saved["hs"] is not None
        gen = torch.Generator().manual_seed(8)
        do, dht = (torch.randn(x.shape, generator=gen).to(DEVICE) for x in (o, ht))
        bplan = dataclasses.replace(backward_plan(1, True, inp.q.dtype, 16, 32, target_arch(inp.q.device)),
                                    combine=combine)
        grads = chunk_bwd(inp.q, inp.k, inp.v, inp.g, inp.beta, scale, inp.h0, do, dht, inp.cu_seqlens, saved=saved,
                          plan=bplan)
        outs.append((o, ht, *grads))
    assert grids == [1, 1, 2, 2]        # (the forward's combine, then the backward's, per plan)
    for name, x, x0 in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), outs[1], outs[0]):
        assert rel_err(x, x0) <= F32, name


# random layouts with at least one sequence of two segments or more: dense (any length past one chunk, run as
# varlen where it is no multiple of the segment) or varlen with empty, 1-token and chunk-edge sequences beside
SPLIT_SHAPES = dict(
    H=PROPERTY_SHAPES["H"], group=PROPERTY_SHAPES["group"], K=PROPERTY_SHAPES["K"], V=PROPERTY_SHAPES["V"],
    layout=st.one_of(st.tuples(st.integers(1, 2), st.integers(BT + 1, 4 * BT + 8)),
                     st.lists(st.sampled_from([0, 1, 63, 64, 65, 130, 200, 257]), min_size=1, max_size=4)
                     .map(lambda ls: ls + [BT + 1] if max(ls) <= BT else ls)),
    gate=st.sampled_from(["normal", "zero", "strong"]), h0=st.booleans(), transpose=st.booleans(),
    seg=st.integers(1, 2), seed=st.integers(0, 2**16))


def _layout_inputs(fam, H, group, K, V, layout, gate, h0, seed):
    """property_inputs for SPLIT_SHAPES' layout: (B, T) a dense batch, a list the varlen batch's lengths."""
    dense = isinstance(layout, tuple)
    return property_inputs(fam, H, group, K, V, layout if dense else None, None if dense else layout, gate, h0, seed)


@pytest.mark.parametrize("fam", ["gdn", "kda", "delta"])
@per_family(min(PROPERTY_SETTINGS.max_examples, 24))
@given(**SPLIT_SHAPES)
def test_property_split_random_shapes(fam, H, group, K, V, layout, gate, h0, transpose, seg, seed):
    """The split forward (segments of ``seg`` chunks) over random layouts (SPLIT_SHAPES), grouped heads, head dims no
    power of two, zero / normal / very negative gates, with or without an initial state, either state layout: output
    and final state equal the float64 recurrence's."""
    inp = _layout_inputs(fam, H, group, K, V, layout, gate, h0, seed)
    ref_o, ref_h = reference(inp)
    o, ht = _fwd(inp, seg, transpose)
    for name, x, ref in (("o", o, ref_o), ("final state", ht, ref_h)):
        assert rel_err(x, ref) <= F32, f"split {name} rel err {rel_err(x, ref):.2e} > {F32:.1e}"


@pytest.mark.parametrize("fam", ["gdn", "kda"])
def test_split_hard_reset_and_steep_gates(fam):
    """Strong gates (a hard reset g = −1e4 and chunks summing below −100; KDA: some channels falling 6 per token over
    40 tokens inside a segment), no initial state (a first segment's end state is its N alone), one-chunk segments of
    a long sequence beside a short one."""
    inp = make_inputs(fam, H=2, HV=2, K=16, V=32, gate="strong", h0=False, lengths=[250, 40], seed=5)
    if fam == "kda":
        inp.g[:, 150:190, :, 2:9] = -6.0
    ref_o, ref_h = reference(inp)
    o, ht = _fwd(inp, 1, h0=False)
    assert rel_err(o, ref_o) <= F32 and rel_err(ht, ref_h) <= F32


def test_split_fp16():
    """fp16 inputs (16-bit products on the state, as stage 2's) within fp16's bound of the recurrence and near the
    unsplit forward's error (bf16 runs the same kernels; under the interpreter the bf16 forward is not exercised)."""
    inp = make_inputs("gdn", H=1, HV=2, K=32, V=32, dtype=torch.float16, lengths=[260, 3], seed=7)
    ref_o, ref_h = reference(inp)
    o, ht = _fwd(inp, 1)
    o0, h0 = _fwd(inp, 0)
    tol = TOL[torch.float16]
    for x, x0, ref in ((o, o0, ref_o), (ht, h0, ref_h)):
        e, e0 = rel_err(x, ref), rel_err(x0, ref)
        assert e <= tol and e <= 2 * e0 + 1e-5, (e, e0)


def _autograd(inp, do, dht, scale):
    """Gradients of Σ o·dO + Σ h_T·dh_T for q, k, v, g, β, h0 by float64 autograd of the PyTorch recurrence."""
    names = ("q", "k", "v", "g", "beta", "h0")
    leaves = {n: getattr(inp, n).detach().double().requires_grad_(True) for n in names if getattr(inp, n) is not None}
    args = [leaves[n] for n in ("q", "k", "v", "g", "beta") if n in leaves]
    o, ht = CHUNK_OPS[inp.fam](*args, scale=scale, initial_state=leaves.get("h0"), output_final_state=True,
                               cu_seqlens=inp.cu_seqlens, backend="torch")
    ((o * do.double()).sum() + (ht * dht.double()).sum()).backward()
    return [leaves[n].grad if n in leaves else None for n in names]


def _split_and_whole_grads(inp, seg, transpose, seed, saved=None):
    """(split, whole, ref): the gradients (dq, dk, dv, dg, dβ, dh0) of the saving forward at ``seg`` chunks per
    segment and unsplit, each through chunk_bwd, and float64 autograd's, for Σ o·dO + Σ h_T·dh_T with dO, dh_T drawn
    from ``seed`` (inputs with an initial state; the scale K^-0.5, as _fwd's). ``saved``: the two forwards' saved
    dicts (split, unsplit), to fill (default: fresh ones)."""
    s1, s0 = saved or ({}, {})
    _fwd(inp, seg, transpose, saved=s1)
    _fwd(inp, 0, transpose, saved=s0)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(inp.v.shape, generator=gen).to(DEVICE)
    dht = torch.randn(inp.h0.shape, generator=gen).to(DEVICE)
    h0, dht_in = (inp.h0, dht) if not transpose else (inp.h0.transpose(-1, -2).contiguous(),
                                                        dht.transpose(-1, -2).contiguous())
    scale = inp.q.shape[-1] ** -0.5
    a = (inp.q, inp.k, inp.v, inp.g, inp.beta, scale, h0, do, dht_in, inp.cu_seqlens)
    split = chunk_bwd(*a, transpose_state_layout=transpose, saved=s1)
    whole = chunk_bwd(*a, transpose_state_layout=transpose, saved=s0)
    return split, whole, _autograd(inp, do, dht, scale)


def _assert_split_grads(split, whole, ref, transpose=False, tol=F32, factor=4.0, slack=1e-6):
    """Each gradient of the split backward (dq, dk, dv, dg, dβ, dh0) within ``tol`` of float64 autograd's (ref) and
    within factor · the unsplit backward's error + slack; None where autograd has none."""
    for name, x, x0, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), split, whole, ref):
        if r is None:
            assert x is None, name
            continue
        if name == "dh0" and transpose:
            x, x0 = x.transpose(-1, -2), x0.transpose(-1, -2)
        e, e0 = rel_err(x, r), rel_err(x0, r)
        assert e <= tol and e <= factor * e0 + slack, f"split {name} rel err {e:.2e} (unsplit {e0:.2e})"


# (id, make_inputs' shape, gate, chunks per segment, transposed state): the forward's layouts; zero gates where the
# entering states' gradients would otherwise vanish over a few hundred tokens
BWD_LAYOUTS = [("dense-view", dict(B=2, T=256), "zero", 1, False),
               ("dense-ragged", dict(B=2, T=300), "normal", 2, True),
               ("varlen", dict(lengths=[300, 0, 1, 70]), "zero", 1, False)]


# each family on two of the layouts (DeltaNet, whose reverse pass forms the states from each segment's exiting one,
# on the dense view and varlen)
BWD_CASES = [(fam, *BWD_LAYOUTS[i]) for fam, pick in (("gdn", (0, 1)), ("kda", (1, 2)), ("delta", (0, 2)))
             for i in pick]


@pytest.mark.parametrize("fam,layout,shape,gate,seg,transpose", BWD_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in BWD_CASES])
def test_split_backward_equals_autograd(fam, layout, shape, gate, seg, transpose):
    """The backward of a split saving forward runs on its segments (each from its kept entering state, its exiting
    state's gradient from the reverse combine): every gradient (q, k, v, g, β, h0) within fp32's bound of float64
    autograd and near the unsplit backward's."""
    inp = make_inputs(fam, H=1, HV=2, K=16, V=16, gate=gate, seed=11, **shape)
    s1, s0 = {}, {}
    grads = _split_and_whole_grads(inp, seg, transpose, seed=1, saved=(s1, s0))
    assert s1["hs"] is not None and s1["mm"] is not None and s0.get("hs") is None
    _assert_split_grads(*grads, transpose)


@pytest.mark.parametrize("fam", ["gdn", "kda", "delta"])
@per_family(min(PROPERTY_SETTINGS.max_examples, 12))
@given(**{**SPLIT_SHAPES, "gate": st.sampled_from(["normal", "zero"])})
def test_property_split_backward_random_shapes(fam, H, group, K, V, layout, gate, h0, transpose, seg, seed):
    """The backward of a split saving forward over SPLIT_SHAPES' random layouts (always with an initial state and the
    final state's gradient; gates that leave every segment's entering state a gradient): every gradient within
    fp32's bound of float64 autograd and near the unsplit backward's."""
    inp = _layout_inputs(fam, H, group, K, V, layout, gate, True, seed)
    _assert_split_grads(*_split_and_whole_grads(inp, seg, transpose, seed=seed), transpose)


@pytest.mark.parametrize("fam", ["gdn", "kda"])
def test_split_backward_hard_reset(fam):
    """The backward of a split forward with a hard reset (g = −1e4) and chunks summing below −100 (KDA: some channels
    falling 6 per token inside a segment), no initial state, one-chunk segments of a long sequence beside a short one:
    the gradients within fp32's bound of float64 autograd."""
    inp = make_inputs(fam, H=2, HV=2, K=16, V=32, gate="strong", lengths=[250, 40], seed=5)
    if fam == "kda":
        inp.g[:, 150:190, :, 2:9] = -6.0
    s = {}
    _fwd(inp, 1, saved=s)
    gen = torch.Generator().manual_seed(2)
    do, dht = (torch.randn(x.shape, generator=gen).to(DEVICE) for x in (inp.v, inp.h0))
    grads = chunk_bwd(inp.q, inp.k, inp.v, inp.g, inp.beta, 0.25, inp.h0, do, dht, inp.cu_seqlens, saved=s)
    for name, x, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, _autograd(inp, do, dht, 0.25)):
        assert rel_err(x, r) <= F32, name


# simple GLA's backward splits on its own (its forward keeps nothing): the forward's layouts, a hard reset (g = −1e4)
# and steep gates with one-chunk segments of a long sequence beside a short one, and no initial state
GLA_BWD = [BWD_LAYOUTS[0], BWD_LAYOUTS[1], ("varlen", dict(lengths=[300, 0, 1, 70]), "normal", 1, False),
           ("hard-reset-no-h0", dict(lengths=[250, 40], h0=False), "strong", 1, False)]


@pytest.mark.parametrize("layout,shape,gate,seg,transpose", GLA_BWD, ids=[c[0] for c in GLA_BWD])
def test_gla_split_backward_equals_autograd(monkeypatch, layout, shape, gate, seg, transpose):
    """Simple GLA's backward on a batch of segments (BackwardPlan.split, chunks per segment), each segment's entering
    state from its end state from zero and its decay e^{Σ g} (the combine), its exiting state's gradient from the
    reverse combine: every gradient (q, k, v, g, h0) within fp32's bound of float64 autograd and near the unsplit
    backward's."""
    inp = make_inputs("gla", H=1, HV=2, K=16, V=16, gate=gate, seed=13, **shape)
    N = inp.q.shape[0] if inp.cu_seqlens is None else inp.cu_seqlens.numel() - 1
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(inp.v.shape, generator=gen).to(DEVICE)
    dht = torch.randn(N, 2, 16, 16, generator=gen).to(DEVICE)
    tr = (lambda x: x.transpose(-1, -2).contiguous()) if transpose else (lambda x: x)
    h0 = None if inp.h0 is None else tr(inp.h0)
    plan = backward_plan(1, False, inp.q.dtype, 16, 16, target_arch(inp.q.device))
    transitions = []        # the split's decays, seen formed
    monkeypatch.setattr(chunk_mod, "decay_transitions", lambda *a: transitions.append(1) or decay_transitions(*a))
    a = (inp.q, inp.k, inp.v, inp.g, None, 0.25, h0, do, tr(dht), inp.cu_seqlens)
    split = chunk_bwd(*a, transpose_state_layout=transpose, plan=dataclasses.replace(plan, split=seg))
    assert transitions == [1]
    whole = chunk_bwd(*a, transpose_state_layout=transpose, plan=dataclasses.replace(plan, split=0))
    assert transitions == [1]
    ref = _autograd(inp, do, dht, 0.25)
    _assert_split_grads(split, whole, ref, transpose)


def test_split_index_tensors():
    """split_batch's varlen index tensors against a host model: each sequence cut into ⌈chunks / L⌉ segments (one for
    an empty sequence), the segments' offsets, every chunk's (segment, chunk in it) row, the segments that have a
    transition (all but each sequence's last), and the unused tail (empty segments, −1) up to the most the shapes
    allow."""
    lengths, L = [0, 1, 64, 65, 200, 0, 129], 2
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    x = torch.zeros(1, int(cu[-1]), 1, 16, device=DEVICE)
    ci = prepare_chunk_indices(cu, BT)
    sb = split_batch(x, x, x, None, x[..., 0], cu, ci, L)
    cu1, pfirst, nl2p = [0], [], []
    for n, length in enumerate(lengths):
        pfirst.append(len(cu1) - 1)
        segs = max(1, cdiv(cdiv(length, BT), L))
        for j in range(segs):
            cu1.append(min(int(cu[n]) + (j + 1) * L * BT, int(cu[n + 1])))
            if j < segs - 1:
                nl2p.append(len(cu1) - 2)
    pfirst.append(len(cu1) - 1)
    assert sb.N == len(lengths) + (len(lengths) + int(cu[-1]) // BT) // L >= len(cu1) - 1
    assert sb.cu_seqlens.tolist() == cu1 + [cu1[-1]] * (sb.N + 1 - len(cu1))
    assert sb.pfirst.tolist() == pfirst
    assert sb.nl2p.tolist() == nl2p + [-1] * (sb.NL - len(nl2p))
    assert torch.equal(sb.chunk_indices, prepare_chunk_indices(sb.cu_seqlens, BT))


# the benchmark's shapes (benchmarks/shapes.py): (name, lengths, HV, whether the split is expected): the few-heads rows
# split (and the varlen batch with one long sequence), the rows whose stage 2 already has about a program per SM do not
BENCH = [("B1-T8192-H2-HV8", [8192], 8, False), ("B1-T32768-H2-HV8", [32768], 8, True),
         ("B1-T65536-H2-HV8", [65536], 8, True), ("B1-T32768-H32", [32768], 32, False),
         ("B1-T32768-H16-HV64", [32768], 64, False), ("B4-T8192-H8-HV32", [8192] * 4, 32, False),
         ("B8-T4096-H32", [4096] * 8, 32, False), ("B4-T8192-H16-HV32", [8192] * 4, 32, False),
         ("varlen-long-T32768-H2-HV8", [24576] + [512] * 16, 8, True)]


@pytest.mark.parametrize("name,lengths,HV,split", BENCH, ids=[b[0] for b in BENCH])
def test_split_choice(name, lengths, HV, split):
    """The automatic choice on 132 SMs (bf16, K = V = 128): segments of at least SPLIT_MIN_CHUNKS chunks; dense, as
    many per sequence as keep stage 2 within one wave of SPLIT_FILL programs per SM (64-wide value blocks); varlen,
    only the sequences longer than a segment split; none below SPLIT_MIN_SEQ chunks (8192 tokens)."""
    varlen = name.startswith("varlen")
    N, chunks = len(lengths), [cdiv(n, BT) for n in lengths]
    T = sum(lengths) if varlen else lengths[0]
    plan = forward_plan(torch.device("cpu"), torch.bfloat16, 1, True, 128, 128)
    L = split_chunks(plan, N, T, HV, 128, 128, varlen, chunk_slots(N, T, varlen), N_SM)
    assert (L > 0) == split
    if not split:
        return
    assert L >= SPLIT_MIN_CHUNKS
    segs = [max(1, cdiv(c, L)) for c in chunks]
    if varlen:
        assert segs[0] > 1 and segs[1:] == [1] * (N - 1)
    else:
        assert sum(segs) * HV * 2 <= SPLIT_FILL * N_SM < 2 * sum(segs) * HV * 2 or L < 2 * SPLIT_MIN_CHUNKS


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_split_floor(varlen):
    """A sequence of SPLIT_MIN_SEQ chunks (varlen: a batch of that many chunk slots, common.chunk_slots's bound)
    splits, one chunk fewer does not."""
    plan = forward_plan(torch.device("cpu"), torch.bfloat16, 1, True, 128, 128)
    for chunks, split in ((SPLIT_MIN_SEQ, True), (SPLIT_MIN_SEQ - 1, False)):
        assert (split_chunks(plan, 1, chunks * BT, 8, 128, 128, varlen, chunks, N_SM) > 0) == split


@pytest.mark.parametrize("fam", ["gdn", "gla"])
def test_split_automatic(monkeypatch, no_floor, fam):
    """The default plan splits a varlen batch whose one sequence is longer than the chunks an SM's share would be (two
    segments here): the forward's output and final state are the recurrence's, and through the op under autograd (the
    saving forward, then the split backward; simple GLA's backward splits on its own) every gradient is float64
    autograd's."""
    inp = make_inputs(fam, H=1, HV=2, K=16, V=16, gate="zero", lengths=[1100, 30], seed=2)
    plan = forward_plan(inp.q.device, inp.q.dtype, 1, fam != "gla", 16, 16, save=True)
    assert split_chunks(plan, 2, 1130, 2, 16, 16, True, chunk_slots(2, 1130, True), N_SM) == SPLIT_MIN_CHUNKS
    assert SPLIT_MIN_CHUNKS < cdiv(1100, BT)
    ref_o, ref_h = reference(inp)
    o, ht = chunk_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, 0.25, inp.h0, True, inp.cu_seqlens)
    assert rel_err(o, ref_o) <= F32 and rel_err(ht, ref_h) <= F32
    combines = []       # the split backward's reverse combine, seen running
    monkeypatch.setattr(chunk_mod, "segment_grads", lambda *a: combines.append(1) or segment_grads(*a))
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None
              for x in (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0)]
    o, ht = CHUNK_OPS[fam](*[x for x in leaves[:5] if x is not None], scale=0.25, initial_state=leaves[5],
                           output_final_state=True, cu_seqlens=inp.cu_seqlens, backend="triton")
    gen = torch.Generator().manual_seed(4)
    do, dht = (torch.randn(x.shape, generator=gen).to(DEVICE) for x in (o, ht))
    ((o * do).sum() + (ht * dht).sum()).backward()
    assert combines == [1]
    for name, x, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), leaves, _autograd(inp, do, dht, 0.25)):
        assert (x is None) == (r is None), name
        assert x is None or rel_err(x.grad, r) <= F32, name


# the GPU: real head dims in bf16, the automatic choice
REAL = [("dense", dict(B=1, T=4096)), ("varlen", dict(lengths=[3000, 1, 700, 64]))]


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("layout,shape", REAL, ids=[r[0] for r in REAL])
@pytest.mark.parametrize("fam", ["gdn", "kda", "delta"])
def test_split_real_size_bf16(no_floor, fam, layout, shape):
    """2 / 8 heads, K = V = 128, bf16, strong gates for the gated families: the default plan splits (4 segments of 16
    chunks; the varlen batch's 3000-token sequence in 3), and the output and final state are within bf16's bound of
    the float64 recurrence and within 5 % of the unsplit forward's error; the output within fla's (x 1.05, where
    fla is installed)."""
    inp = make_inputs(fam, H=2, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=23, device=DEVICE,
                      gate="strong" if fam != "delta" else "normal", **shape)
    varlen = inp.cu_seqlens is not None
    chunks = prepare_chunk_indices(inp.cu_seqlens, BT).shape[0] if varlen else cdiv(4096, BT)
    assert split_chunks(_plan(inp, None), inp.q.shape[0] if not varlen else 4, inp.q.shape[1], 8, 128, 128, varlen,
                        chunks, _num_sms(inp.q.device)) == SPLIT_MIN_CHUNKS
    ref_o, ref_h = reference(inp)
    o, ht = _fwd(inp, None)
    o0, h0 = _fwd(inp, 0)
    for x, x0, ref in ((o, o0, ref_o), (ht, h0, ref_h)):
        e, e0 = rel_err(x, ref), rel_err(x0, ref)
        assert e <= TOL[torch.bfloat16] and e <= 1.05 * e0, (e, e0)
    e_fla = fla_error(inp)
    assert e_fla is None or rel_err(o, ref_o) <= 1.05 * max(e_fla, F32), (rel_err(o, ref_o), e_fla)


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("layout,shape", REAL, ids=[r[0] for r in REAL])
@pytest.mark.parametrize("fam", ["gdn", "kda", "delta"])
def test_split_backward_real_size_bf16(no_floor, fam, layout, shape):
    """2 / 8 heads, K = V = 128, bf16: the default plan's saving forward splits and so does its backward; every
    gradient within bf16's bound of float64 autograd and within 5 % of the unsplit backward's error."""
    inp = make_inputs(fam, H=2, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=29, device=DEVICE,
                      gate="zero" if fam != "delta" else "normal", **shape)
    s1, s0 = {}, {}
    _fwd(inp, None, saved=s1)
    _fwd(inp, 0, saved=s0)
    assert s1["hs"] is not None and s0.get("hs") is None
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(inp.v.shape, generator=gen).to(DEVICE, inp.v.dtype)
    dht = torch.randn(inp.h0.shape, generator=gen).to(DEVICE)
    a = (inp.q, inp.k, inp.v, inp.g, inp.beta, 128 ** -0.5, inp.h0, do, dht, inp.cu_seqlens)
    split, whole = chunk_bwd(*a, saved=s1), chunk_bwd(*a, saved=s0)
    ref = _autograd(inp, do, dht, 128 ** -0.5)
    _assert_split_grads(split, whole, ref, tol=TOL[torch.bfloat16], factor=1.05, slack=1e-4)


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("layout,shape", REAL, ids=[r[0] for r in REAL])
def test_gla_split_backward_real_size_bf16(no_floor, layout, shape):
    """Simple GLA at 2 / 8 heads, K = V = 128, bf16: the default plan's backward splits; every gradient within bf16's
    bound of float64 autograd and within 5 % of the unsplit backward's error."""
    inp = make_inputs("gla", H=2, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=31, device=DEVICE, gate="zero",
                      **shape)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(inp.v.shape, generator=gen).to(DEVICE, inp.v.dtype)
    dht = torch.randn(inp.h0.shape, generator=gen).to(DEVICE)
    a = (inp.q, inp.k, inp.v, inp.g, None, 128 ** -0.5, inp.h0, do, dht, inp.cu_seqlens)
    plan = backward_plan(1, False, inp.q.dtype, 128, 128, target_arch(inp.q.device))
    split, whole = chunk_bwd(*a), chunk_bwd(*a, plan=dataclasses.replace(plan, split=0))
    ref = _autograd(inp, do, dht, 128 ** -0.5)
    _assert_split_grads(split, whole, ref, tol=TOL[torch.bfloat16], factor=1.05, slack=1e-4)


def test_gla_split_backward_nan_stays_in_its_sequence():
    """A NaN gate in one sequence of a varlen batch makes that sequence's segment transitions NaN and no other's: the
    split backward's gradients of the other sequences' inputs are finite and equal the unsplit backward's."""
    inp = make_inputs("gla", H=1, HV=2, K=16, V=16, gate="normal", lengths=[200, 300, 150], seed=17)
    inp.g[0, 260, 1] = float("nan")          # the second sequence's 60th token
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(inp.v.shape, generator=gen).to(DEVICE)
    dht = torch.randn(3, 2, 16, 16, generator=gen).to(DEVICE)
    plan = backward_plan(1, False, inp.q.dtype, 16, 16, target_arch(inp.q.device))
    a = (inp.q, inp.k, inp.v, inp.g, None, 0.25, inp.h0, do, dht, inp.cu_seqlens)
    split = chunk_bwd(*a, plan=dataclasses.replace(plan, split=1))
    whole = chunk_bwd(*a, plan=dataclasses.replace(plan, split=0))
    others = torch.cat([torch.arange(0, 200), torch.arange(500, 650)]).to(DEVICE)
    for name, x, x0 in zip(("dq", "dk", "dv", "dg"), split, whole):
        x, x0 = x[0].index_select(0, others), x0[0].index_select(0, others)
        assert torch.isfinite(x).all(), name
        assert rel_err(x, x0) <= F32, name
    assert torch.isfinite(split[5][[0, 2]]).all() and rel_err(split[5][[0, 2]], whole[5][[0, 2]]) <= F32
