"""The PyTorch backend against the float64 token recurrence (docs/design.md §1, §3).

Every public op runs with backend="torch": the chunk form (`chunk_*`) and the token form
(`fused_recurrent_*`) must both equal the recurrence for every family, dtype and case of the
case list; the recurrence itself is checked against an independent, literal implementation of
the Householder form S_t = (I − β_t k_t k_tᵀ) diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ.
"""
from __future__ import annotations

import math

import pytest
import torch
from chunkwise import api
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import (CHUNK_OPS, DEVICE, FAMILIES, RECURRENT_OPS, TOL, Inputs, make_inputs, reference,
                     rel_err)

# tiny tensors: one thread is faster, and far faster on a loaded machine (OpenMP spin-waits)
torch.set_num_threads(1)

FAMS = list(FAMILIES)
F64 = torch.float64


def call(op, inp: Inputs, *, scale=None, h0="inp", final=True, **kw):
    """Call a public op on an Inputs bundle with the torch backend: returns (o, final_state)."""
    h0 = inp.h0 if isinstance(h0, str) else h0
    return op(*inp.args(), scale=scale, initial_state=h0, output_final_state=final,
              cu_seqlens=inp.cu_seqlens, backend="torch", **kw)


def rnd(gen, *shape):
    """Standard normal float64 on DEVICE, drawn on the CPU from ``gen`` (reproducible everywhere)."""
    return torch.randn(*shape, generator=gen, dtype=F64).to(DEVICE)


def assert_close(x, ref, tol, what=""):
    err = rel_err(x, ref)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.1e}"


# ----------------------------------------------------------------------------------------------
# the cases every form must get right
# ----------------------------------------------------------------------------------------------

CASES = {
    "T_not_multiple_of_C": dict(B=2, T=100),
    "T_less_than_C": dict(B=2, T=23),
    "T_1": dict(B=3, T=1),
    "T_multiple_of_C": dict(B=1, T=128),
    "K60_V100": dict(B=1, T=70, K=60, V=100),
    "K100_V60": dict(B=1, T=70, K=100, V=60),
    "HV_gt_H": dict(B=2, T=80, H=2, HV=6),
    "HV_gt_H_single_qk_head": dict(B=1, T=50, H=1, HV=3),
    "varlen": dict(lengths=[1, 63, 64, 100, 5]),
    "varlen_grouped": dict(lengths=[30, 1, 70], H=1, HV=2),
    "no_initial_state": dict(B=2, T=90, h0=False),
    "gate_zero": dict(B=2, T=90, gate="zero"),
    "gate_very_negative": dict(B=2, T=150, gate="strong"),
    "varlen_gate_very_negative": dict(lengths=[1, 130, 20], gate="strong"),
}
GATED_ONLY = {"gate_zero", "gate_very_negative", "varlen_gate_very_negative"}
CASE_PARAMS = [pytest.param(fam, case, id=f"{fam}-{case}") for fam in FAMS for case in CASES
               if not (case in GATED_ONLY and FAMILIES[fam].gate == "none")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("fam,case", CASE_PARAMS)
def test_chunk_equals_recurrence(fam, case, dtype):
    inp = make_inputs(fam, dtype=dtype, **CASES[case])
    o_ref, h_ref = reference(inp)
    o, ht = call(CHUNK_OPS[fam], inp)
    assert o.shape == inp.v.shape and o.dtype == dtype
    assert_close(o, o_ref, TOL[dtype], "o")
    assert_close(ht, h_ref, TOL[dtype], "final state")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("case", ["T_not_multiple_of_C", "T_1", "HV_gt_H", "varlen", "K60_V100"])
def test_fused_recurrent_equals_reference(fam, case, dtype):
    inp = make_inputs(fam, dtype=dtype, **CASES[case])
    o_ref, h_ref = reference(inp)
    o, ht = call(RECURRENT_OPS[fam], inp)
    assert o.dtype == dtype
    assert_close(o, o_ref, TOL[dtype], "o")
    assert_close(ht, h_ref, TOL[dtype], "final state")


# ----------------------------------------------------------------------------------------------
# the ground truth against a literal, independent recurrence
# ----------------------------------------------------------------------------------------------

def literal_recurrence(inp: Inputs, scale: float):
    """Per sequence, per value head, token by token, with explicit K×K matrices (float64)."""
    q, k, v = (x.detach().double().cpu() for x in (inp.q, inp.k, inp.v))
    g = None if inp.g is None else inp.g.detach().double().cpu()
    beta = None if inp.beta is None else inp.beta.detach().double().cpu()
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if inp.cu_seqlens is None:
        seqs = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    else:
        cu = inp.cu_seqlens.tolist()
        seqs = [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    o = torch.zeros(*v.shape, dtype=F64)
    finals = torch.zeros(len(seqs), HV, K, V, dtype=F64)
    eye = torch.eye(K, dtype=F64)
    for n, (b, s, e) in enumerate(seqs):
        for hv in range(HV):
            hq = hv // (HV // H)
            S = inp.h0[n, hv].detach().double().cpu().clone() if inp.h0 is not None else torch.zeros(K, V, dtype=F64)
            for t in range(s, e):
                kt, vt, qt = k[b, t, hq], v[b, t, hv], q[b, t, hq]
                decay = torch.eye(K, dtype=F64)
                if g is not None:
                    gt = g[b, t, hv]
                    decay = torch.diag(gt.exp() * torch.ones(K, dtype=F64))
                if beta is not None:
                    bt = beta[b, t, hv]
                    S = (eye - bt * torch.outer(kt, kt)) @ decay @ S + bt * torch.outer(kt, vt)
                else:
                    S = decay @ S + torch.outer(kt, vt)
                o[b, t, hv] = scale * S.T @ qt
            finals[n, hv] = S
    return o, finals


@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("shape", [dict(B=2, T=9, H=1, HV=2, K=5, V=3),
                                   dict(lengths=[1, 6, 4], H=2, HV=4, K=4, V=6)], ids=["batch", "varlen"])
def test_recurrence_equals_literal_householder_form(fam, shape):
    inp = make_inputs(fam, dtype=F64, **shape)
    scale = 0.7
    o_ref, h_ref = literal_recurrence(inp, scale)
    o, ht = call(RECURRENT_OPS[fam], inp, scale=scale)
    assert_close(o, o_ref, 1e-12, "o")
    assert_close(ht, h_ref, 1e-12, "final state")


# ----------------------------------------------------------------------------------------------
# composition: varlen, state hand-over, layouts, grouped heads, chunk size
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("fam", FAMS)
def test_varlen_equals_separate_calls(fam, form):
    lengths = [1, 40, 64, 77]
    inp = make_inputs(fam, dtype=F64, lengths=lengths, gate="strong")
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    o, ht = call(op, inp)
    cu = inp.cu_seqlens.tolist()
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        part = Inputs(fam, *(None if x is None else x[:, s:e] for x in (inp.q, inp.k, inp.v, inp.g, inp.beta)),
                      inp.h0[n:n + 1], None)
        o_n, h_n = call(op, part)
        assert_close(o[:, s:e], o_n, TOL[F64], f"sequence {n} output")
        assert_close(ht[n:n + 1], h_n, TOL[F64], f"sequence {n} state")


@pytest.mark.parametrize("fam", FAMS)
def test_varlen_with_empty_sequence(fam):
    """A zero-length sequence passes its initial state through unchanged and writes nothing."""
    inp = make_inputs(fam, dtype=F64, lengths=[5, 0, 70])
    o_ref, h_ref = reference(inp)
    for op in (CHUNK_OPS[fam], RECURRENT_OPS[fam]):
        o, ht = call(op, inp)
        assert_close(o, o_ref, TOL[F64], "o")
        assert_close(ht, h_ref, TOL[F64], "final state")
        assert torch.equal(ht[1], inp.h0[1])


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("fam", FAMS)
def test_empty_sequence_length(fam, form):
    """T = 0: an empty output, and the initial state comes back as the final state."""
    inp = make_inputs(fam, B=2, T=0, dtype=torch.float32)
    o, ht = call((CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam], inp)
    assert o.shape == inp.v.shape and o.dtype == torch.float32
    assert torch.equal(ht, inp.h0)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("fam", FAMS)
def test_two_halves_with_state_hand_over_equal_the_whole(fam, form):
    inp = make_inputs(fam, dtype=F64, B=2, T=150, gate="strong")
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    o, ht = call(op, inp)
    cut = 70                                                      # not a chunk boundary

    def half(sl):
        return [None if x is None else x[:, sl] for x in (inp.q, inp.k, inp.v, inp.g, inp.beta)]

    o1, h1 = call(op, Inputs(fam, *half(slice(0, cut)), inp.h0, None))
    o2, h2 = call(op, Inputs(fam, *half(slice(cut, None)), h1, None))
    assert_close(torch.cat([o1, o2], 1), o, TOL[F64], "o")
    assert_close(h2, ht, TOL[F64], "final state")
    assert rel_err(h1, ht) > 1e-3                                  # the hand-over carries real information


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("fam", FAMS)
def test_transposed_state_layout(fam, form):
    inp = make_inputs(fam, dtype=torch.float32, lengths=[20, 1, 90], K=16, V=24)
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    o_ref, h_ref = reference(inp)
    o, ht = call(op, inp, h0=inp.h0.transpose(-1, -2).contiguous(), transpose_state_layout=True)
    N, HV, K, V = inp.h0.shape
    assert ht.shape == (N, HV, V, K) and ht.dtype == torch.float32
    assert_close(o, o_ref, TOL[torch.float32], "o")
    assert_close(ht, h_ref.transpose(-1, -2), TOL[torch.float32], "final state")
    # the [N, HV, K, V] call on the same state gives the same output, its final state untransposed
    o_kv, ht_kv = call(op, inp)
    assert_close(o_kv, o, TOL[torch.float32], "kv layout")
    assert ht_kv.shape == (N, HV, K, V)
    assert_close(ht_kv.transpose(-1, -2), ht, TOL[torch.float32], "kv layout final state")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("fam", FAMS)
def test_grouped_heads_equal_repeated_heads(fam, form):
    G = 3
    inp = make_inputs(fam, dtype=F64, B=2, T=70, H=2, HV=2 * G, requires_grad=True)
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    o, ht = call(op, inp)
    q_rep = inp.q.detach().repeat_interleave(G, dim=2).requires_grad_(True)
    k_rep = inp.k.detach().repeat_interleave(G, dim=2).requires_grad_(True)
    rep = Inputs(fam, q_rep, k_rep, inp.v, inp.g, inp.beta, inp.h0, None)
    o_rep, ht_rep = call(op, rep)
    assert_close(o, o_rep, 1e-12, "o")
    assert_close(ht, ht_rep, 1e-12, "final state")
    w = torch.randn_like(o)
    dq, dk = torch.autograd.grad((o * w).sum(), (inp.q, inp.k))
    dq_rep, dk_rep = torch.autograd.grad((o_rep * w).sum(), (q_rep, k_rep))
    B, T, H, K = inp.q.shape
    assert_close(dq, dq_rep.view(B, T, H, G, K).sum(3), 1e-12, "dq")
    assert_close(dk, dk_rep.view(B, T, H, G, K).sum(3), 1e-12, "dk")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("fam", FAMS)
def test_chunk_size_independence(fam, dtype):
    inp = make_inputs(fam, dtype=dtype, lengths=[1, 50, 100], gate="strong" if fam != "delta" else "normal")
    o_ref, h_ref = reference(inp)
    outs = {}
    for C in (16, 32, 64):
        o, ht = call(CHUNK_OPS[fam], inp, chunk_size=C)
        assert_close(o, o_ref, TOL[dtype], f"o, chunk_size={C}")
        assert_close(ht, h_ref, TOL[dtype], f"final state, chunk_size={C}")
        outs[C] = o
    assert_close(outs[16], outs[64], TOL[dtype], "chunk 16 vs 64")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fam=st.sampled_from(FAMS), B=st.integers(1, 2), T=st.integers(1, 90), H=st.integers(1, 2),
       group=st.integers(1, 3), K=st.integers(1, 40), V=st.integers(1, 40), C=st.sampled_from([4, 16, 64]),
       varlen=st.lists(st.integers(0, 40), min_size=1, max_size=4) | st.none(), h0=st.booleans(),
       seed=st.integers(0, 2**16))
def test_property_random_shapes(fam, B, T, H, group, K, V, C, varlen, h0, seed):
    if varlen is not None and sum(varlen) == 0:
        varlen = varlen + [1]
    inp = make_inputs(fam, B=B, T=T, H=H, HV=H * group, K=K, V=V, dtype=F64, h0=h0, lengths=varlen, seed=seed)
    o_ref, h_ref = reference(inp)
    o, ht = call(CHUNK_OPS[fam], inp, chunk_size=C)
    assert_close(o, o_ref, TOL[F64], "o")
    assert_close(ht, h_ref, TOL[F64], "final state")


# ----------------------------------------------------------------------------------------------
# gradients: chunk form == token form, both through autograd, float64
# ----------------------------------------------------------------------------------------------

def _grads(op, leaves: dict, kwargs: dict, w_o, w_h):
    o, ht = op(**{k: v for k, v in kwargs.items()}, **leaves)
    loss = (o * w_o).sum() + (ht * w_h).sum()
    names = [n for n, x in leaves.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    return dict(zip(names, grads))


GRAD_CASES = {
    "plain": dict(),
    "gate_very_negative": dict(gate="strong"),
    "varlen": dict(lengths=[1, 17, 22]),
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "gate_in_kernel": dict(use_gate_in_kernel=True),
    "gate_in_kernel_no_dt_bias": dict(use_gate_in_kernel=True, dt_bias=False),
    "kda_lower_bound": dict(use_gate_in_kernel=True, lower_bound=-5.0),
    "all_options": dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True),
    "transposed_state_varlen": dict(transpose_state_layout=True, lengths=[9, 31]),
    # fla 0.6.0's spellings
    "neg_eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "kda_lower_bound_no_a_log": dict(use_gate_in_kernel=True, lower_bound=-5.0, A_log=False),
    "gla_g_gamma": dict(g_gamma=True),
}


def _grad_params():
    for fam in FAMS:
        spec = FAMILIES[fam]
        for name, case in GRAD_CASES.items():
            if spec.gate == "none" and ("gate" in name or case.get("use_gate_in_kernel")):
                continue
            if not spec.delta and ("beta" in name or case.get("use_beta_sigmoid_in_kernel")):
                continue
            if name.startswith("kda_lower_bound") and spec.gate != "channel":
                continue
            if name.startswith("gla") and (spec.delta or spec.gate != "scalar"):
                continue
            yield pytest.param(fam, name, id=f"{fam}-{name}")


@pytest.mark.parametrize("fam,case", list(_grad_params()))
def test_gradients_chunk_equal_recurrence(fam, case):
    opts = dict(GRAD_CASES[case])
    spec = FAMILIES[fam]
    gen = torch.Generator().manual_seed(7)
    lengths = opts.pop("lengths", None)
    gate = opts.pop("gate", "normal")
    inp = make_inputs(fam, B=2, T=40, H=1, HV=2, K=12, V=10, dtype=F64, lengths=lengths, gate=gate, seed=3)
    HV, K = inp.v.shape[2], inp.q.shape[3]
    h0 = inp.h0.transpose(-1, -2).contiguous() if opts.get("transpose_state_layout") else inp.h0
    leaves = dict(q=inp.q, k=inp.k, v=inp.v, initial_state=h0)
    if opts.get("use_qk_l2norm_in_kernel"):                       # raw, unnormalised q and k
        leaves["q"] = rnd(gen, inp.q.shape) * 2
        leaves["k"] = rnd(gen, inp.k.shape) * 2
    if spec.delta:
        leaves["beta"] = (rnd(gen, inp.beta.shape)
                          if opts.get("use_beta_sigmoid_in_kernel") else inp.beta)
    if opts.pop("g_gamma", False):
        # simple GLA: the decay per head
        leaves["g_gamma"] = (-torch.rand(HV, generator=gen, dtype=F64) * 0.5).to(DEVICE)
    elif spec.gate != "none":
        leaves["g"] = inp.g
        if opts.get("use_gate_in_kernel"):
            leaves["g"] = rnd(gen, inp.g.shape)     # the raw projection a
            if opts.pop("A_log", True) is not False:
                leaves["A_log"] = rnd(gen, HV) * 0.5
            if opts.pop("dt_bias", True) is not False:
                leaves["dt_bias"] = rnd(gen, HV if spec.gate == "scalar" else HV * K)
    opts.pop("dt_bias", None)
    for x in leaves.values():
        x.requires_grad_(True)
    kwargs = dict(scale=0.4, output_final_state=True, cu_seqlens=inp.cu_seqlens, backend="torch", **opts)
    w_o = rnd(gen, inp.v.shape)
    w_h = rnd(gen, h0.shape)
    g_rec = _grads(RECURRENT_OPS[fam], leaves, kwargs, w_o, w_h)
    g_chunk = _grads(CHUNK_OPS[fam], leaves, dict(kwargs, chunk_size=16), w_o, w_h)
    assert set(g_chunk) == set(leaves)
    for name in leaves:
        assert g_rec[name].norm() > 0, f"d{name} is zero: the test would not see anything"
        assert_close(g_chunk[name], g_rec[name], 1e-9, f"d{name}")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_gradcheck_tiny(form):
    """Autograd of both torch forms against finite differences (GDN, all in-op options)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, HV, K, V = 1, 5, 1, 2, 3, 2
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64).requires_grad_(True)  # noqa: E731
    args = (r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), r(B, T, HV), r(B, T, HV), r(1, HV, K, V), r(HV), r(HV))

    def f(q, k, v, a, b, h0, A_log, dt_bias):
        op = CHUNK_OPS["gdn"] if form == "chunk" else RECURRENT_OPS["gdn"]
        o, ht = op(q, k, v, a, b, initial_state=h0, output_final_state=True, backend="torch",
                   use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, chunk_size=2)
        return o, ht

    assert torch.autograd.gradcheck(f, args)


# ----------------------------------------------------------------------------------------------
# in-op options == doing them by hand
# ----------------------------------------------------------------------------------------------

def by_hand_l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def by_hand_softplus(x):
    return torch.log1p(torch.exp(x))


# neg_eigval, kda_lower_bound_no_a_log, gla_g_gamma: fla 0.6.0's spellings (allow_neg_eigval, A_log=None with
# lower_bound, simple GLA's g_gamma)
OPTION_CASES = ["l2norm", "beta_sigmoid", "gate", "gate_no_dt_bias", "kda_dt_bias_2d", "kda_lower_bound",
                "neg_eigval", "kda_lower_bound_no_a_log", "gla_g_gamma"]


def _option_params():
    for fam in FAMS:
        spec = FAMILIES[fam]
        for case in OPTION_CASES:
            if case.startswith("gate") and spec.gate == "none":
                continue
            if case in ("beta_sigmoid", "neg_eigval") and not spec.delta:
                continue
            if case.startswith("kda") and spec.gate != "channel":
                continue
            if case.startswith("gla") and (spec.delta or spec.gate != "scalar"):
                continue
            yield pytest.param(fam, case, id=f"{fam}-{case}")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("fam,case", list(_option_params()))
def test_in_op_options_equal_doing_them_by_hand(fam, case, form):
    gen = torch.Generator().manual_seed(11)
    inp = make_inputs(fam, B=2, T=50, H=1, HV=2, K=16, V=8, dtype=F64, seed=5)
    HV, K = inp.v.shape[2], inp.q.shape[3]
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    raw = dict(q=inp.q, k=inp.k, v=inp.v)
    if inp.beta is not None:
        raw["beta"] = inp.beta
    if inp.g is not None:
        raw["g"] = inp.g
    kw = {}
    done = Inputs(fam, inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0, None)      # what the op must compute on
    if case == "l2norm":
        raw["q"] = rnd(gen, inp.q.shape) * 3
        raw["k"] = rnd(gen, inp.k.shape) * 3
        done.q, done.k = by_hand_l2(raw["q"]), by_hand_l2(raw["k"])
        kw["use_qk_l2norm_in_kernel"] = True
    elif case in ("beta_sigmoid", "neg_eigval"):
        raw["beta"] = rnd(gen, inp.beta.shape) * 2
        done.beta = (2 if case == "neg_eigval" else 1) / (1 + torch.exp(-raw["beta"]))
        kw["use_beta_sigmoid_in_kernel"] = True
        kw["allow_neg_eigval"] = case == "neg_eigval"
    elif case.startswith("gla"):
        del raw["g"]
        kw["g_gamma"] = (-torch.rand(HV, generator=gen, dtype=F64) * 0.5).to(DEVICE)
        done.g = kw["g_gamma"].expand(*inp.v.shape[:3])
    elif case == "kda_lower_bound_no_a_log":
        raw["g"] = rnd(gen, inp.g.shape) * 2
        bias2d = rnd(gen, HV, K)
        kw.update(use_gate_in_kernel=True, lower_bound=-5.0, dt_bias=bias2d.reshape(HV * K), safe_gate=True)
        done.g = -5.0 * torch.sigmoid(raw["g"] + bias2d)
    else:
        a = rnd(gen, inp.g.shape) * 2
        A_log = rnd(gen, HV) * 0.5
        raw["g"] = a
        kw.update(use_gate_in_kernel=True, A_log=A_log)
        A = torch.exp(A_log)
        if FAMILIES[fam].gate == "scalar":
            dt_bias = None if case == "gate_no_dt_bias" else rnd(gen, HV)
            x = a + (0 if dt_bias is None else dt_bias)
            done.g = -A * by_hand_softplus(x)
        else:
            if case == "gate_no_dt_bias":
                dt_bias, bias2d = None, 0
            else:
                bias2d = rnd(gen, HV, K)
                dt_bias = bias2d if case == "kda_dt_bias_2d" else bias2d.reshape(HV * K)
            x = a + bias2d
            if case == "kda_lower_bound":
                kw["lower_bound"] = -5.0
                done.g = -5.0 * torch.sigmoid(A[:, None] * x)
            else:
                done.g = -A[:, None] * by_hand_softplus(x)
        if dt_bias is not None:
            kw["dt_bias"] = dt_bias
    o_ref, h_ref = reference(done)
    o, ht = op(**raw, initial_state=inp.h0, output_final_state=True, backend="torch", **kw)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(ht, h_ref, 1e-10, "final state")
    if case in ("l2norm", "beta_sigmoid", "neg_eigval"):   # the option really does something: without it, another
        plain = dict(use_beta_sigmoid_in_kernel=True) if case == "neg_eigval" else {}
        o_plain, _ = op(**raw, initial_state=inp.h0, output_final_state=True, backend="torch", **plain)
        assert rel_err(o_plain, o_ref) > 1e-3


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("fam", FAMS)
def test_state_v_first_is_transpose_state_layout(fam, form):
    """fla 0.6.0 renamed transpose_state_layout to state_v_first: both take and give states as [N, HV, V, K]."""
    inp = make_inputs(fam, B=2, T=30, H=1, HV=2, K=8, V=6, dtype=F64, seed=9)
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    h0 = inp.h0.transpose(-1, -2).contiguous()
    o1, h1 = op(*inp.args(), initial_state=h0, output_final_state=True, backend="torch", state_v_first=True)
    o2, h2 = op(*inp.args(), initial_state=h0, output_final_state=True, backend="torch", transpose_state_layout=True)
    o_ref, h_ref = reference(inp)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    assert_close(h1.transpose(-1, -2), h_ref, 1e-10, "final state")


def test_fla_option_errors():
    """fla 0.6.0's options refused as fla refuses them, each error naming the argument."""
    gdn, kda, gla = (make_inputs(f, B=1, T=8, H=1, HV=2, K=8, V=4, dtype=F64) for f in ("gdn", "kda", "gla"))
    with pytest.raises(ValueError, match="allow_neg_eigval=True needs use_beta_sigmoid_in_kernel"):
        CHUNK_OPS["gdn"](*gdn.args(), allow_neg_eigval=True)
    with pytest.raises(ValueError, match="safe_gate=True with use_gate_in_kernel=True needs lower_bound in"):
        CHUNK_OPS["kda"](*kda.args(), use_gate_in_kernel=True, A_log=torch.zeros(2, dtype=F64, device=DEVICE),
                         safe_gate=True)
    with pytest.raises(ValueError, match="lower_bound in \\[-5, 0\\), got -6"):
        CHUNK_OPS["kda"](*kda.args(), use_gate_in_kernel=True, lower_bound=-6.0, safe_gate=True)
    with pytest.raises(ValueError, match="safe_gate is only available for KDA"):
        api.run(api.GDN, "chunk", *gdn.args(), None, None, False, None, safe_gate=True)
    with pytest.raises(ValueError, match="needs A_log"):
        CHUNK_OPS["kda"](*kda.args(), use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="or g_gamma \\[HV\\], not both"):
        CHUNK_OPS["gla"](*gla.args(), g_gamma=torch.zeros(2, dtype=F64, device=DEVICE))
    with pytest.raises(ValueError, match="g_gamma must have shape \\[HV\\] = \\[2\\]"):
        CHUNK_OPS["gla"](gla.q, gla.k, gla.v, g_gamma=torch.zeros(3, dtype=F64, device=DEVICE))
    with pytest.raises(ValueError, match="use_gate_in_kernel is not available with it"):
        CHUNK_OPS["gla"](gla.q, gla.k, gla.v, g_gamma=torch.zeros(2, dtype=F64, device=DEVICE),
                         use_gate_in_kernel=True, A_log=torch.zeros(2, dtype=F64, device=DEVICE))


# ----------------------------------------------------------------------------------------------
# the state pool (vLLM-style state_indices)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transpose", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["pool_f32", "pool_bf16"])
@pytest.mark.parametrize("lengths", [None, [2, 1, 3, 1]], ids=["decode", "varlen"])
@pytest.mark.parametrize("fam", FAMS)
def test_state_pool(fam, lengths, pool_dtype, transpose):
    P, idx = 6, [3, -1, 1, 5]                                       # slot 0 untouched: where a clamped -1 would write
    N = len(idx)
    inp = make_inputs(fam, B=N, T=1, H=1, HV=2, K=8, V=12, dtype=torch.float32, lengths=lengths, h0=False, seed=2)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(P, 2, 8, 12, generator=gen).to(DEVICE)       # [P, HV, K, V]
    pool = (pool.transpose(-1, -2).contiguous() if transpose else pool).to(pool_dtype)
    before = pool.clone()
    ptr = pool.data_ptr()
    state_indices = torch.tensor(idx, dtype=torch.int32, device=DEVICE)
    o, ret = RECURRENT_OPS[fam](*inp.args(), initial_state=pool, output_final_state=True, cu_seqlens=inp.cu_seqlens,
                                backend="torch", state_indices=state_indices, transpose_state_layout=transpose)
    assert ret is pool and pool.data_ptr() == ptr and pool.dtype == pool_dtype
    o = o.cpu()
    # the reference from the states read out of the pool (float32 of the pool's values)
    kv = lambda s: s.transpose(-1, -2) if transpose else s     # noqa: E731
    h0 = torch.stack([kv(before[max(i, 0)]).float() for i in idx])
    o_ref, h_ref = reference(Inputs(fam, inp.q, inp.k, inp.v, inp.g, inp.beta, h0, inp.cu_seqlens))
    live_tok = torch.ones(o.shape[:2], dtype=torch.bool)
    if lengths is None:
        live_tok[1] = False
    else:
        live_tok[0, 2:3] = False                                    # the tokens of sequence 1
    assert torch.equal(o[~live_tok], torch.zeros_like(o[~live_tok])), "padding slots must give zero output"
    assert_close(o[live_tok], o_ref[live_tok], TOL[torch.float32], "o")
    tol = TOL[torch.float32] if pool_dtype == torch.float32 else TOL[torch.bfloat16]
    for n, i in enumerate(idx):
        if i >= 0:
            assert_close(kv(pool[i]), h_ref[n], tol, f"slot {i}")
            assert rel_err(pool[i], before[i]) > 1e-2, f"slot {i} was not written"
    for i in set(range(P)) - {i for i in idx if i >= 0}:
        assert torch.equal(pool[i], before[i]), f"untouched slot {i} changed"


# ----------------------------------------------------------------------------------------------
# contract details: scale, dtypes (NaN: test_nan.py)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("fam", FAMS)
def test_scale_default_is_inverse_sqrt_K(fam, form):
    inp = make_inputs(fam, B=1, T=70, K=60, V=20, dtype=F64)
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    o_default, h_default = call(op, inp)
    o_one, h_one = call(op, inp, scale=1.0)
    assert_close(o_default, o_one * 60 ** -0.5, 1e-12, "o(scale=None) vs K^-0.5 · o(scale=1)")
    assert_close(h_default, h_one, 1e-12, "the state does not depend on scale")
    assert rel_err(o_default, o_one) > 0.5
    o_ref, _ = reference(inp, scale=1 / math.sqrt(60))
    assert_close(o_default, o_ref, TOL[F64], "o")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("fam", FAMS)
def test_output_dtypes(fam, form, dtype):
    inp = make_inputs(fam, lengths=[3, 70], dtype=dtype)
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    o, ht = call(op, inp)
    assert o.dtype == dtype and o.shape == inp.v.shape
    assert ht.dtype == (F64 if dtype == F64 else torch.float32) and ht.shape == inp.h0.shape
    o_ref, h_ref = reference(inp)
    assert_close(o, o_ref, TOL[dtype], "o")
    assert_close(ht, h_ref, TOL[dtype], "final state")
    # a state given in another dtype is read in the state's dtype (fp32; float64 with float64 q): the final
    # state comes back in that dtype, the same values as with the state given in it
    for h0_dtype in (torch.bfloat16, torch.float32, F64):
        o2, ht2 = call(op, inp, h0=inp.h0.to(h0_dtype))
        assert ht2.dtype == ht.dtype and o2.dtype == dtype
        if h0_dtype != torch.bfloat16:
            assert torch.equal(ht2, call(op, inp, h0=inp.h0.to(h0_dtype).to(ht.dtype))[1])
    _, none = call(op, inp, final=False)
    assert none is None


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("only", ["q", "k", "v", "g", "beta", "initial_state"])
def test_gradient_of_one_input_alone(form, only):
    """Only one input wants a gradient (a frozen projection, a LoRA-style adapter on q, ...): it gets the
    same gradient as when every input does, through the op's registered backward. With only q, the final
    state depends on nothing that wants a gradient (an output without a graph, once a crash)."""
    inp = make_inputs("gdn", B=2, T=40, H=1, HV=2, K=12, V=10, dtype=F64, seed=8)
    op = CHUNK_OPS["gdn"] if form == "chunk" else RECURRENT_OPS["gdn"]
    gen = torch.Generator().manual_seed(9)
    w_o, w_h = rnd(gen, inp.v.shape), rnd(gen, inp.h0.shape)

    def grad_of(names):
        leaves = {n: getattr(inp, "h0" if n == "initial_state" else n).detach().clone().requires_grad_(n in names)
                  for n in ("q", "k", "v", "g", "beta", "initial_state")}
        o, ht = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=0.4,
                   initial_state=leaves["initial_state"], output_final_state=True, backend="torch")
        ((o * w_o).sum() + (ht * w_h).sum()).backward()
        return leaves[only].grad

    alone, together = grad_of({only}), grad_of({"q", "k", "v", "g", "beta", "initial_state"})
    assert alone is not None and alone.norm() > 0
    assert_close(alone, together, 1e-12, f"d{only} alone vs with every input")


@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("lengths", [None, [1, 70, 99]], ids=["batch", "varlen"])
def test_blocks_of_chunks(fam, lengths):
    """The CPU chunk loop batches the state-independent work of `block` chunks at a time: 170 tokens in
    chunks of 16 run as blocks of 3, 3, 3, 1 chunks and a partial chunk of 10. Every block size gives
    the float64 recurrence, forward and (through autograd) gradients."""
    from chunkwise.reference.chunk import _chunk_forward
    inp = make_inputs(fam, B=2, T=170, H=2, HV=4, K=16, V=8, dtype=torch.float64, lengths=lengths,
                      gate="strong" if fam != "delta" else "normal", requires_grad=True)
    o_ref, h_ref = reference(inp)
    grads = {}
    run = lambda block: _chunk_forward(inp.q, inp.k, inp.v, inp.g, inp.beta, 16 ** -0.5, inp.h0,  # noqa: E731
                                       inp.cu_seqlens, chunk_size=16, dtype=torch.float64, block=block)
    for block in (1, 3, 64):
        for grad in (False, True):          # no autograd: the state and outputs are updated in place
            with torch.set_grad_enabled(grad):
                o, ht = run(block)
            assert_close(o, o_ref, TOL[torch.float64], f"o, block={block}, autograd={grad}")
            assert_close(ht, h_ref, TOL[torch.float64], f"final state, block={block}, autograd={grad}")
        leaves = [x for x in (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0) if x is not None]
        grads[block] = torch.autograd.grad((o * o_ref).sum() + (ht * h_ref).sum(), leaves)
    for block in (3, 64):
        for a, b in zip(grads[block], grads[1]):
            assert_close(a, b, TOL[torch.float64], f"gradient, block={block} vs 1")
