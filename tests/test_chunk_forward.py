"""The Triton chunk forward, by stage: stage 1 (triton/stage1.py) against a float64 model of its per-chunk products,
stage 2 and the whole forward (triton/chunk.py) against the float64 token recurrence.

Under the interpreter (CPU): fp32 and fp16, small shapes, the sm_90 plans. On the GPU: the same cases, plus bf16 at
real sizes whose error must not exceed fla's on the same inputs. Every tensor the launchers allocate is pre-filled
with NaN (CHUNKWISE_POISON=1), so an element a kernel forgets to write fails the comparison. Forms that are the
default for some shape class (the transposed step at wide value blocks, W / U for the training forward, ...) are
reached by passing a plan (configs.ForwardPlan) to the launcher.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given

import chunkwise
from chunkwise.triton.chunk import chunk_fwd
from chunkwise.triton.common import BT, G_FLOOR, _exp_or, _rn_tf32, chunk_slots, padded_dims
from chunkwise.triton.configs import forward_plan, resolve_stage2, wu_lowp_ok
from chunkwise.triton.stage1 import chunk_prepare
from chunkwise.utils import prepare_chunk_indices
from helpers import (CHUNK_OPS, DEVICE, HEAD_DIM_GRID, INTERPRET, ON_GPU, PROPERTY_SETTINGS, PROPERTY_SHAPES, TOL,
                     fla_error, make_inputs, per_family, property_inputs, reference, rel_err, skip_unless_sm90_builds)

FAMS = ("gdn", "kda", "delta", "gla")
DELTA_FAMS = ("gdn", "kda", "delta")
GATED = ("gdn", "kda", "gla")
GATE_KIND = {"delta": 0, "gdn": 1, "gla": 1, "kda": 2}
F32 = TOL[torch.float32]

# small sizes under the interpreter, larger ones on the GPU (K = 80 / 100: KDA's stage 1 in several column chunks)
KS, VS, T_LONG = ((100, 128), (60, 128), 300) if ON_GPU else ((32, 80), (32, 48), 100)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("CHUNKWISE_POISON", "1")


def sid(B=None, T=None, H=1, HV=None, K=32, V=32, lengths=None, **_) -> str:
    """A readable id of make_inputs' shape arguments: B2-T130-H2-HV4-K64-V32, or N3-T201-... for varlen."""
    head = f"N{len(lengths)}-T{sum(lengths)}" if lengths else f"B{B}-T{T}"
    return f"{head}-H{H}-HV{HV or H}-K{K}-V{V}"


def _run(inp, transpose=False, final=True, scale=None, chunk_indices=None, cu_cpu=None):
    """The public op on the triton backend; the final state back in the [N, HV, K, V] layout."""
    h0 = inp.h0
    if h0 is not None and transpose:
        h0 = h0.transpose(-1, -2).contiguous()
    o, ht = CHUNK_OPS[inp.fam](*inp.args(), scale=scale, initial_state=h0, output_final_state=final,
                               cu_seqlens=inp.cu_seqlens, transpose_state_layout=transpose, backend="triton",
                               chunk_indices=chunk_indices, cu_seqlens_cpu=cu_cpu)
    if ht is not None and transpose:
        ht = ht.transpose(-1, -2)
    return o, ht


def _launch(inp, plan=None, transpose=False, h0=True, **kw):
    """chunk_fwd itself (with a plan), the final state back in the [N, HV, K, V] layout."""
    h = inp.h0 if h0 else None
    if h is not None and transpose:
        h = h.transpose(-1, -2).contiguous()
    o, ht = chunk_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.q.shape[-1] ** -0.5, h, True, inp.cu_seqlens,
                      transpose_state_layout=transpose, plan=plan, **kw)
    return o, (ht.transpose(-1, -2) if transpose else ht)


def _plan(inp, save=False, **fields):
    """The default plan of inp's forward, with ``fields`` replaced."""
    K, V = padded_dims(inp.q, inp.v)
    plan = forward_plan(inp.q.device, inp.q.dtype, GATE_KIND[inp.fam], inp.beta is not None, K, V, save=save)
    return dataclasses.replace(plan, **fields)


def _check(inp, o, ht, tol, final=True, ref=None):
    """o and the final state ht (None unless ``final``) against the float64 recurrence (``ref``: its result, when
    computed once for several checks)."""
    ref_o, ref_ht = ref or reference(inp)
    assert o.shape == inp.v.shape and o.dtype == inp.q.dtype
    assert torch.isfinite(o).all(), "an output element is NaN/inf (unwritten?)"
    e_o = rel_err(o, ref_o)
    assert e_o <= tol, f"o rel err {e_o:.2e} > {tol:.1e}"
    if final:
        assert ht.dtype == torch.float32 and tuple(ht.shape) == tuple(ref_ht.shape)
        e_h = rel_err(ht, ref_ht)
        assert e_h <= tol, f"final state rel err {e_h:.2e} > {tol:.1e}"
    else:
        assert ht is None


# ================================================================================================
# stage 1
# ================================================================================================

def _stage1_float64(inp, t_form: bool) -> dict:
    """Stage 1's outputs from a float64 model, chunk by chunk (tokens past a sequence's end as zero rows): w, u, p, t,
    KDA's qg, kg, G and e^{G_last} by slot (glast), a scalar gate's G and G_last by slot (gcum, glast); and ``slots``,
    the chunk slots in use."""
    q, k, v, beta = (x.detach().double().cpu() for x in (inp.q, inp.k, inp.v, inp.beta))
    g = None if inp.g is None else inp.g.detach().double().cpu()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    cu = None if inp.cu_seqlens is None else inp.cu_seqlens.tolist()
    N = B if cu is None else len(cu) - 1
    out = dict(w=torch.zeros(B, T, HV, K, dtype=torch.float64), p=torch.zeros(B, T, HV, BT, dtype=torch.float64),
               t=torch.zeros(B, T, HV, BT, dtype=torch.float64),
               u=torch.zeros(B, T, HV, BT if t_form else V, dtype=torch.float64))
    slots = chunk_slots(N, T, cu is not None)
    if gate == 2:
        out.update(qg=torch.zeros(B, T, HV, K, dtype=torch.float64), kg=torch.zeros(B, T, HV, K, dtype=torch.float64),
                   G=torch.zeros(B, T, HV, K, dtype=torch.float64),
                   glast=torch.zeros(slots, HV, K, dtype=torch.float64))
    elif gate == 1:
        out.update(gcum=torch.zeros(slots, HV, BT, dtype=torch.float64), glast=torch.zeros(slots, HV, dtype=torch.float64))
    used = []
    tri = torch.tril(torch.ones(BT, BT, dtype=torch.bool))
    for n in range(N):
        b, bos, eos = (n, 0, T) if cu is None else (0, cu[n], cu[n + 1])
        for c, t0 in enumerate(range(bos, eos, BT)):
            rows = min(BT, eos - t0)
            slot = n * -(-T // BT) + c if cu is None else n + t0 // BT
            used.append(slot)
            for hv in range(HV):
                hk = hv // (HV // H)

                def chunk(x, *shape):
                    z = torch.zeros(BT, *shape, dtype=torch.float64)
                    z[:rows] = x[b, t0:t0 + rows]
                    return z
                qc, kc, vc, bc = chunk(q[:, :, hk], K), chunk(k[:, :, hk], K), chunk(v[:, :, hv], V), chunk(beta[:, :, hv])
                if gate == 0:
                    G = torch.zeros(BT, 1, dtype=torch.float64)
                elif gate == 1:
                    G = chunk(g[:, :, hv]).clamp_min(G_FLOOR).cumsum(0)[:, None]
                else:
                    G = chunk(g[:, :, hv], K).clamp_min(G_FLOOR).cumsum(0)
                diff = torch.where(tri[:, :, None], G[:, None, :] - G[None, :, :], float("-inf"))   # [i, j, ·]
                gam = diff.exp()                                                       # e^{G_i − G_j}, i ≥ j
                kk = (kc[:, None, :] * kc[None, :, :] * gam).sum(-1) if gate == 2 else (kc @ kc.T) * gam[..., 0]
                qk = (qc[:, None, :] * kc[None, :, :] * gam).sum(-1) if gate == 2 else (qc @ kc.T) * gam[..., 0]
                A = torch.tril(bc[:, None] * kk, -1)
                Tm = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + A)
                eG = G.exp()
                sl = (b, slice(t0, t0 + rows), hv)
                out["p"][sl] = torch.tril(qk)[:rows]
                out["t"][sl] = Tm[:rows]
                if t_form:
                    out["u"][sl] = (Tm * bc[None, :])[:rows]
                    out["w"][sl] = (kc * eG)[:rows]
                else:
                    out["u"][sl] = (Tm @ (bc[:, None] * vc))[:rows]
                    out["w"][sl] = (Tm @ (bc[:, None] * eG * kc))[:rows]
                if gate == 2:
                    out["qg"][sl] = (qc * eG)[:rows]
                    out["kg"][sl] = (kc * (G[-1] - G).exp())[:rows]
                    out["G"][sl] = G[:rows]
                    out["glast"][slot, hv] = G[-1].exp()
                elif gate == 1:
                    out["gcum"][slot, hv] = G[:, 0]
                    out["glast"][slot, hv] = G[-1, 0]
    out["slots"] = used
    return out


STAGE1_CASES = [("gdn", "normal", "inference"), ("gdn", "strong", "training"), ("delta", "normal", "inference"),
                ("delta", "normal", "training"), ("kda", "normal", "inference"), ("kda", "normal", "training"),
                ("kda", "strong", "inference"), ("kda", "strong", "W/U"), ("kda", "steep", "training")]
SHAPE1 = dict(lengths=[1, 130, 70], H=1, HV=2, K=KS[1] if ON_GPU else 64, V=VS[0])     # (KDA: 2 column chunks)


@pytest.mark.parametrize("fam,gate,form", STAGE1_CASES, ids=["-".join(c) for c in STAGE1_CASES])
def test_stage1_vs_float64(fam, gate, form):
    """Stage 1 (w, u, P, T, the gate's G and G_last, KDA's q ⊙ e^G, k ⊙ e^{G_last − G}) against a float64 model of the
    same per-chunk products, varlen with a 1-token and a ragged sequence, grouped heads, fp32 inputs: the inference
    form (T diag(β) in u, KDA's K ⊙ e^G in w), the training form (forward_plan(save=True): W / U and T for GDN /
    DeltaNet, the T form and T for KDA) and W / U with T for KDA (its fp16 training form). KDA with "strong" gates
    (a hard reset and chunks summing below -100) and "steep" ones (channels falling 6 per token over 40 tokens: 16-token
    blocks spanning past SPAN_MAX, factored around their middle; 9.5 per token: 152, near the 2 SPAN_MAX those
    factors take; and 12 per token over 40 more: past 2 SPAN_MAX, the exact column loop) takes its second launch on
    the chunks the first flags."""
    inp = make_inputs(fam, dtype=torch.float32, gate="normal" if gate == "steep" else gate, seed=13, **SHAPE1)
    if gate == "steep":
        inp.g[:, 10:50, :, 3:7] = -6.0
        inp.g[:, 60:100, :, 12:14] = -9.5
        inp.g[:, 140:180, :, 9:11] = -12.0
    save = form != "inference"
    plan = _plan(inp, save=save) if form != "W/U" else _plan(inp, save=True, t_form=False)
    ci = prepare_chunk_indices(inp.cu_seqlens, BT)
    got = chunk_prepare(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_seqlens, ci, plan=plan, save_t=save,
                        store_p=True, save_g=save)
    want = _stage1_float64(inp, plan.t_form)
    names = ["u", "p"] + (["t"] if save else []) + (["w"] if fam == "kda" or not plan.t_form else [])
    names += {2: ["qg", "kg", "glast"] + (["G"] if save else []), 1: ["gcum", "glast"], 0: []}[GATE_KIND[fam]]
    for name in names:
        x = got["G" if name == "G" else name]
        ref = want[name]
        if name in ("glast", "gcum"):
            x, ref = x[want["slots"]], ref[want["slots"]]
        assert torch.isfinite(x).all(), f"{name}: NaN / inf (unwritten?)"
        assert rel_err(x, ref) <= F32, f"{name}: rel err {rel_err(x, ref):.2e}"


@pytest.mark.parametrize("fam,split", [("gdn", True), ("delta", False), ("kda", False)],
                         ids=["gdn-second-launch", "delta-inside", "kda-inside"])
def test_fp16_solve_redo(fam, split):
    """The inference solve from fp16 operands (bf16 inputs' plan; forced here for fp32 inputs) with its redo at the
    inputs' own precision where T leaves fp16's range, as a second launch over the flagged chunks or inside the
    first (KDA: always inside): with keys scaled until (I + A)⁻¹ leaves fp16's range, T diag(β) is finite and equals
    the plain solve's in those chunks; with the tests' keys, within fp16's rounding of it."""
    inp = make_inputs(fam, lengths=[1, 130, 70], H=1, HV=2, K=KS[0], V=VS[0], dtype=torch.float32, seed=5)
    ci = prepare_chunk_indices(inp.cu_seqlens, BT)
    plain = _plan(inp)
    fp16 = dataclasses.replace(plain, solve_prec="fp16", redo_split=split)

    def stage1(k, plan):
        return chunk_prepare(inp.q, k, inp.v, inp.g, inp.beta, inp.cu_seqlens, ci, plan=plan, store_p=True)["u"]
    big = inp.k * 6.0          # (I + A)⁻¹'s entries up to ~1e16-1e23: finite in fp32, past fp16's 65504
    ref, ref_big = stage1(inp.k, plain), stage1(big, plain)
    over = ref_big.abs().amax(-1) > 65504.0             # rows of chunks the fp16 solve cannot hold
    assert torch.isfinite(ref_big).all() and over.any()
    got_big = stage1(big, fp16)
    assert torch.isfinite(got_big).all()
    assert torch.equal(got_big[over], ref_big[over])
    assert 0 < rel_err(stage1(inp.k, fp16), ref) < 2e-3


def _correlated_keys(k_shape, beta_shape, seed=17):
    """Nearly parallel unit keys (one direction plus 0.2 noise) and β in [0.9, 0.99), float64 on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 1, 1, k_shape[-1], generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(base + 0.2 * torch.randn(*k_shape, generator=gen, dtype=torch.float64), dim=-1)
    return k, 0.9 + 0.09 * torch.rand(*beta_shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("keys", ["normal", "correlated"])
def test_solve_vs_float64(keys):
    """T = (I + A)⁻¹ (the training forward's, kept for the backward) against the float64 inverse of the same rounded
    inputs, chunk by chunk, within 2e-6 (fp32 inputs: tf32x3 products), also with nearly parallel keys and β near 1
    (A's entries near −1, the worst case for the products of the doubling solve)."""
    inp = make_inputs("delta", B=1, T=256, H=1, HV=1, K=KS[0], V=VS[0], dtype=torch.float64, seed=17)
    k, beta = inp.k, inp.beta
    if keys == "correlated":
        k, beta = _correlated_keys(k.shape, beta.shape)
    k, beta, v = k.to(DEVICE, torch.float32), beta.to(DEVICE, torch.float32), inp.v.to(DEVICE, torch.float32)
    plan = forward_plan(k.device, torch.float32, 0, True, k.shape[-1], v.shape[-1], save=True)
    t = chunk_prepare(k, k, v, None, beta, plan=plan, save_t=True)["t"][0, :, 0].double().cpu()
    kk, bb = k.double().cpu()[0, :, 0], beta.double().cpu()[0, :, 0]
    for c in range(256 // BT):
        rows = slice(c * BT, (c + 1) * BT)
        inv = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + torch.tril(bb[rows, None] * (kk[rows] @ kk[rows].T), -1))
        assert (t[rows] - inv).norm() / inv.norm() <= 2e-6


def _ready_slots(inp, ci):
    """The chunk slots stage 1's programs own: n·NT + i, or n + start_token // 64 with varlen."""
    if inp.cu_seqlens is None:
        B, T = inp.q.shape[:2]
        return list(range(B * -(-T // BT)))
    cu = inp.cu_seqlens.tolist()
    return sorted({int(n) + (cu[int(n)] + int(c) * BT) // BT for n, c in ci.tolist()})


@pytest.mark.parametrize("case", ["kda-strong", "gdn-fp16-redo", "gdn-B2-T130"])
def test_stage1_publishes_every_chunk(case):
    """Stage 1 beside stage 2 (chunk_prepare(ready=...)): the grid chunk-major and every program sets ready[slot,
    head] once its outputs are stored, also the programs a first launch flags to a second (KDA's one-reference
    launch with strong gates; the fp16 solve's redo launch with keys past fp16's range): every chunk's slot is 1
    for every value head, the varlen gaps' slots 0, and the outputs equal the launch without it."""
    fam = case.split("-")[0]
    if case == "gdn-B2-T130":
        inp = make_inputs(fam, B=2, T=130, H=1, HV=2, K=KS[0], V=VS[0], dtype=torch.float32, seed=3)
        ci = None
    else:
        inp = make_inputs(fam, lengths=[1, 130, 70], H=1, HV=2, K=KS[1] if fam == "kda" else KS[0], V=VS[0],
                          dtype=torch.float32, gate="strong" if fam == "kda" else "normal", seed=13)
        ci = prepare_chunk_indices(inp.cu_seqlens, BT)
    plan, k = _plan(inp), inp.k
    if case.endswith("redo"):
        plan, k = dataclasses.replace(plan, solve_prec="fp16", redo_split=True), inp.k * 6.0
    N = inp.q.shape[0] if inp.cu_seqlens is None else inp.cu_seqlens.numel() - 1
    ready = torch.zeros(chunk_slots(N, inp.q.shape[1], inp.cu_seqlens is not None), 2, dtype=torch.int32,
                        device=inp.q.device)
    run = lambda r: chunk_prepare(inp.q, k, inp.v, inp.g, inp.beta, inp.cu_seqlens, ci, plan=plan,  # noqa: E731
                                  store_p=True, ready=r)
    got, want = run(ready), run(None)
    expect = torch.zeros_like(ready)
    expect[_ready_slots(inp, ci)] = 1
    assert torch.equal(ready, expect)
    for name, x in want.items():
        if x is not None:
            assert torch.equal(torch.nan_to_num(got[name]), torch.nan_to_num(x)), name


def test_wu_16bit_only_at_128():
    """Stage 1 forms W / U from 16-bit operands only for 16-bit inputs at a 128-wide key tile (K = 65..128) and a
    value tile of at least 64 (V = 33..): narrower tiles' sm_90 builds of that form crashed or were wrong; the
    default plans follow the rule."""
    assert all(wu_lowp_ok(dt, K, V) for dt in (torch.bfloat16, torch.float16) for K in (100, 128) for V in (33, 64, 128))
    assert not any(wu_lowp_ok(dt, K, 128) for dt in (torch.bfloat16, torch.float16) for K in (16, 32, 40, 64))
    assert not any(wu_lowp_ok(dt, 128, V) for dt in (torch.bfloat16, torch.float16) for V in (8, 16, 32))
    assert not wu_lowp_ok(torch.float32, 128, 128)
    cpu = torch.device("cpu")
    assert forward_plan(cpu, torch.bfloat16, 1, True, 128, 128, save=True).wu_lowp
    assert not forward_plan(cpu, torch.bfloat16, 1, True, 64, 128, save=True).wu_lowp
    assert not forward_plan(cpu, torch.bfloat16, 2, True, 128, 128, save=True).wu_lowp      # (KDA: tf32 products)


@triton.jit
def _rn_tf32_kernel(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, _rn_tf32(tl.load(x + o)))


@pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
def test_round_to_nearest_tf32():
    """_rn_tf32: fp32 values (normal, tiny, large, both signs, exact ties) go to a tf32 value (low 13 mantissa
    bits zero) that is at least as near as either tf32 neighbour, never further than half a tf32 unit."""
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(400, generator=gen), torch.randn(50, generator=gen) * 1e-30,
                   torch.randn(50, generator=gen) * 1e30])
    ties = (torch.arange(12, dtype=torch.int32) * 0x2000 + 0x3F801000).view(torch.float32)   # halfway cases
    x = torch.cat([x, ties, -ties])[:512].contiguous().to(DEVICE)
    y = torch.empty_like(x)
    _rn_tf32_kernel[(1,)](x, y, N=512)
    x, y = x.cpu(), y.cpu()
    assert (y.view(torch.int32) & 0x1FFF == 0).all()
    lo = (x.view(torch.int32) & ~0x1FFF).view(torch.float32)                        # truncated toward zero
    hi = (x.view(torch.int32).to(torch.int64) + 0x2000 & ~0x1FFF).to(torch.int32).view(torch.float32)
    err = (y.double() - x.double()).abs()
    assert (err <= (lo.double() - x.double()).abs()).all() and (err <= (hi.double() - x.double()).abs()).all()
    assert (err <= x.double().abs() * 2.0 ** -11).all()


@triton.jit
def _exp_pair_kernel(X, Yf, Yt, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + o, mask=o < N, other=0.)
    tl.store(Yf + o, _exp_or(x, True), mask=o < N)
    tl.store(Yt + o, tl.exp(x), mask=o < N)


@pytest.mark.skipif(not ON_GPU, reason="ex2.approx.ftz runs on the GPU only (the interpreter takes tl.exp)")
def test_fast_exp_matches_tl_exp():
    """The kernels' gate factor (common._exp_or: ex2.approx.ftz.f32 of x·log2(e)) against tl.exp over the exponents
    the kernels form: the same value to 2 ulp wherever tl.exp's result is a normal number, 0 where it is subnormal,
    e^-inf = 0, and NaN stays NaN."""
    x = torch.cat([torch.linspace(-110., 40., 1 << 16), torch.tensor([-87.3, -87.4, -88.0, -103.9, float("-inf"),
                                                                       float("nan"), 0.])]).to(DEVICE)
    yf, yt = torch.empty_like(x), torch.empty_like(x)
    _exp_pair_kernel[(triton.cdiv(x.numel(), 1024),)](x, yf, yt, x.numel(), BLOCK=1024)
    normal = yt >= torch.finfo(torch.float32).tiny
    rel = ((yf[normal] - yt[normal]).abs() / yt[normal]).max().item()
    assert rel <= 2 * torch.finfo(torch.float32).eps, rel
    assert (yf[~normal & ~x.isnan()] == 0).all()
    assert yf[x.isnan()].isnan().all() and yf[x == float("-inf")].eq(0).all()


# ================================================================================================
# stage 2 and the whole forward, against the float64 recurrence
# ================================================================================================

CASES = [   # (make_inputs kwargs, run kwargs)
    (dict(B=2, T=T_LONG, H=1, HV=2, K=KS[0], V=VS[0]), {}),
    (dict(B=1, T=37, H=2, HV=2, K=KS[0], V=VS[0]), dict(transpose=True)),
    (dict(B=2, T=1, H=1, HV=1, K=KS[0], V=VS[0], h0=False), {}),
    (dict(B=1, T=70, H=1, HV=1, K=KS[1], V=VS[1]), dict(final=False)),
    (dict(lengths=[1, 70, 26], H=1, HV=2, K=KS[0], V=VS[0]), {}),
    (dict(lengths=[65, 1, 3], H=1, HV=1, K=KS[0], V=VS[0], h0=False), dict(transpose=True)),
    (dict(B=1, T=70, H=1, HV=1, K=256, V=256), {}),      # the widest head dims the kernels take
]
CASE_IDS = [sid(**mk) + ("-no-h0" if mk.get("h0") is False else "") + "".join(f"-{k}" for k in run)
            for mk, run in CASES]


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
@pytest.mark.parametrize("fam", FAMS)
def test_forward_vs_float64(fam, case):
    """The forward's output and final state against the float64 recurrence, fp32: chunk-ragged and one-token
    sequences, grouped heads, varlen with 1-token sequences, either state layout, no initial or final state, the
    widest heads."""
    mk, run = CASES[case]
    inp = make_inputs(fam, dtype=torch.float32, seed=case, **mk)
    o, ht = _run(inp, **run)
    _check(inp, o, ht, F32, final=run.get("final", True))


@pytest.mark.parametrize("fam", FAMS)
@per_family(min(PROPERTY_SETTINGS.max_examples, 10))
@given(**PROPERTY_SHAPES)
def test_property_random_shapes(fam, H, group, K, V, batch, lengths, gate, h0, final, transpose, seed):
    """The inference forward over random shapes and options (helpers.PROPERTY_SHAPES: lengths around the chunk,
    empty and 1-token sequences in a varlen batch, grouped value heads, head dims no power of two, zero / normal /
    very negative gates, states in and out, either layout): output and final state equal the float64 recurrence's."""
    inp = property_inputs(fam, H, group, K, V, batch, lengths, gate, h0, seed)
    with torch.no_grad():
        o, ht = _run(inp, transpose=transpose, final=final)
    _check(inp, o, ht, F32, final=final)


@pytest.mark.parametrize("gate", ["zero", "strong"])
@pytest.mark.parametrize("fam", GATED)
def test_gates(fam, gate):
    """g = 0 (no decay) and very negative gates: chunks summing below -100 and a hard reset g = -1e4."""
    inp = make_inputs(fam, B=1, T=T_LONG, H=1, HV=2, K=KS[1], V=VS[0], dtype=torch.float32, gate=gate, seed=3)
    _check(inp, *_run(inp), F32)


@pytest.mark.parametrize("fam", FAMS)
def test_fp16(fam):
    inp = make_inputs(fam, B=1, T=T_LONG, H=1, HV=2, K=KS[0], V=VS[0], dtype=torch.float16, seed=5)
    _check(inp, *_run(inp), TOL[torch.float16])


# the serial stage's forms, each the default for some shape class: the plain step (value blocks under 64), the
# transposed one (64 and up), W / U from stage 1 (GDN / DeltaNet's training forward, fp16 KDA's), the tiles through
# per-thread addresses (no TMA: GPUs other than sm_90), P from the other place (DeltaNet's training forward takes it
# from stage 1, simple GLA from its own kernel on a grid that leaves SMs idle)
STEP_FORMS = {
    "transposed": dict(bv=64), "transposed-W/U": dict(bv=64, t_form=False), "plain-W/U": dict(bv=32, t_form=False),
    "no-TMA": dict(bv=64, tma=False, tma_o=False), "P-other": dict(bv=32),
}
SHAPE2 = dict(lengths=[1, 70, 64], H=1, HV=2, K=KS[0], V=64)
# (simple GLA has one step: no T form, no transposed step; KDA always takes P from stage 1)
STEP_CASES = [(f, form) for f in FAMS for form in STEP_FORMS
              if not (f == "gla" and form not in ("no-TMA", "P-other")) and not (f == "kda" and form == "P-other")]


@pytest.mark.parametrize("fam,form", STEP_CASES, ids=[f"{f}-{form}" for f, form in STEP_CASES])
def test_stage2_forms(fam, form):
    """Each form of stage 2 (STEP_FORMS, by plan; the plain step at bv 32 with the default plan is every small
    shape's: test_forward_vs_float64) against the float64 recurrence, varlen with a 1-token and a one-chunk
    sequence, grouped heads, a carried-in state, the transposed state layout for the transposed forms."""
    inp = make_inputs(fam, dtype=torch.float32, seed=37, **SHAPE2)
    fields = dict(STEP_FORMS[form])
    if form == "P-other":
        fields["p_in"] = {"delta": True, "gla": True, "gdn": False}[fam]
    plan = _plan(inp, **fields)
    transpose = form.startswith("transposed")
    _check(inp, *_launch(inp, plan, transpose=transpose), F32)


@pytest.mark.parametrize("nseg,gate,transpose", [(2, "normal", False), (3, "strong", True), (8, "none", False)],
                         ids=["2-normal", "3-strong-transposed", "8-no-gate"])
def test_gla_segments(nseg, gate, transpose):
    """Simple GLA with each sequence split into segments run side by side (their local end states, then each
    segment from the earlier ones' decayed states) equals the float64 recurrence, output and final state, two
    sequences, grouped heads; 8 segments of 4 chunks leave four empty; also with the first pass's own value block
    and in sub-segments."""
    inp = make_inputs("gla", B=2, T=200, H=1, HV=2, K=KS[0], V=VS[0], dtype=torch.float32, seed=41,
                      gate="normal" if gate == "none" else gate, h0=gate != "none")
    if gate == "none":
        inp.g = None
    ref = reference(inp)
    runs = [dict(segments=nseg), dict(segments=nseg, seg_phase1=(16 if nseg == 3 else 128, 8)),
            dict(segments=nseg, seg_sub=2, seg_phase1=(128, 8) if nseg == 8 else None)]
    for r in runs:
        _check(inp, *_launch(inp, _plan(inp, **r), transpose=transpose, h0=inp.h0 is not None), F32, ref=ref)


# on the GPU: 128 programs of stage 2 (placed after stage 1's first programs) and 32 (placed first, stage 1 on a
# stream of its own: common._serial_first), at bf16 real size
BESIDE = {"stage1-first-128-programs": dict(lengths=[1000, 64, 1, 3031], H=16, HV=16),
          "stage2-first-32-programs": dict(lengths=[1000, 64, 1, 3031], H=2, HV=4)} if ON_GPU else \
    {"small": dict(lengths=[1, 130, 70], H=1, HV=2)}


@pytest.mark.parametrize("order", list(BESIDE))
@pytest.mark.parametrize("fam", DELTA_FAMS)
def test_stage2_beside_stage1(fam, order):
    """Stage 2 launched beside stage 1 (plan overlap: on the GPU its own stream, each step waiting for its chunk's
    ready flag, stage 1's grid chunk-major) gives the launches one after the other's output and final state bit for
    bit, and the float64 recurrence's: varlen with a 1-token sequence, grouped heads, the transposed state layout."""
    kw = dict(K=128, V=128, dtype=torch.bfloat16) if ON_GPU else dict(K=KS[0], V=VS[0], dtype=torch.float32)
    inp = make_inputs(fam, seed=23, device=DEVICE, **BESIDE[order], **kw)
    (o0, ht0), (o1, ht1) = (_launch(inp, _plan(inp, overlap=mode), transpose=True) for mode in (0, 1))
    assert torch.equal(o1, o0) and torch.equal(ht1, ht0)
    _check(inp, o1, ht1, TOL[inp.q.dtype])


def test_overlap_plans():
    """Where stage 2 runs beside stage 1 by default: 16-bit GDN at its own value block, 16-bit KDA at bv 64 and 2
    stages where that grid takes at most half the SMs (else after stage 1), never DeltaNet, simple GLA or fp32."""
    cpu = torch.device("cpu")
    plans = {(g, dt): forward_plan(cpu, dt, g, True, 128, 128) for g in (0, 1, 2)
             for dt in (torch.bfloat16, torch.float16, torch.float32)}
    assert [plans[g, torch.bfloat16].overlap for g in (0, 1, 2)] == [0, 1, 2]
    assert plans[1, torch.float16].overlap == 1 and all(plans[g, torch.float32].overlap == 0 for g in (0, 1, 2))
    assert forward_plan(cpu, torch.bfloat16, 1, False, 128, 128).overlap == 0
    kda = plans[2, torch.bfloat16]
    small = resolve_stage2(kda, 1, 32768, 32, 128, 128, 2, 2, True, False, 132)      # 64 programs at bv 64
    assert (small.overlap_mode, small.bv, small.num_stages) == (2, 64, 2)
    large = resolve_stage2(kda, 8, 4096, 32, 128, 128, 2, 2, True, False, 132)
    assert large.overlap_mode == 0


@pytest.mark.parametrize("fam", FAMS)
def test_varlen_equals_separate_calls(fam):
    """A varlen batch (a 1-token, a chunk-ragged and a 2-chunk sequence, each with its own initial state) equals the
    sequences run one by one: output and final states; and the precomputed chunk index and host copy of cu_seqlens
    change nothing."""
    lengths = [1, 70, 128]
    inp = make_inputs(fam, lengths=lengths, H=1, HV=2, K=KS[0], V=VS[0], dtype=torch.float32, seed=7)
    o, ht = _run(inp)
    cu = inp.cu_seqlens.tolist()
    for n in range(len(lengths)):
        part = dataclasses.replace(inp, cu_seqlens=None, h0=inp.h0[n:n + 1],
                                   **{x: None if getattr(inp, x) is None else getattr(inp, x)[:, cu[n]:cu[n + 1]]
                                      for x in ("q", "k", "v", "g", "beta")})
        o_n, ht_n = _run(part)
        assert rel_err(o[:, cu[n]:cu[n + 1]], o_n) <= F32 / 4 and rel_err(ht[n:n + 1], ht_n) <= F32 / 4
    cu_cpu = inp.cu_seqlens.cpu()
    o2, ht2 = _run(inp, chunk_indices=chunkwise.prepare_chunk_indices(cu_cpu).to(inp.q.device), cu_cpu=cu_cpu)
    assert torch.equal(o2, o) and torch.equal(ht2, ht)
    _check(inp, o, ht, F32)


@pytest.mark.parametrize("fam", FAMS)
def test_halves_equal_whole(fam):
    """The sequence in two parts (cut inside a chunk), the first's final state handed to the second as its initial
    state, equals the whole: output and final state."""
    inp = make_inputs(fam, B=2, T=T_LONG, H=1, HV=2, K=KS[0], V=VS[0], dtype=torch.float32, seed=9)
    o, ht = _run(inp)
    cut = 70
    first = dataclasses.replace(inp, **{x: None if getattr(inp, x) is None else getattr(inp, x)[:, :cut]
                                        for x in ("q", "k", "v", "g", "beta")})
    o1, ht1 = _run(first)
    second = dataclasses.replace(inp, h0=ht1, **{x: None if getattr(inp, x) is None else getattr(inp, x)[:, cut:]
                                                 for x in ("q", "k", "v", "g", "beta")})
    o2, ht2 = _run(second)
    assert rel_err(torch.cat([o1, o2], 1), o) <= F32 / 4 and rel_err(ht2, ht) <= F32 / 4


@pytest.mark.parametrize("fam", FAMS)
def test_grouped_heads_equal_repeated(fam):
    """Grouped value heads (HV = 2·H: value head h reads q / k head h // 2) equal the same q / k repeated per value
    head (H = HV)."""
    inp = make_inputs(fam, B=1, T=T_LONG, H=2, HV=4, K=KS[0], V=VS[0], dtype=torch.float32, seed=11)
    o, ht = _run(inp)
    rep = dataclasses.replace(inp, q=inp.q.repeat_interleave(2, 2), k=inp.k.repeat_interleave(2, 2))
    o_r, ht_r = _run(rep)
    assert rel_err(o, o_r) <= F32 / 4 and rel_err(ht, ht_r) <= F32 / 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fam", FAMS)
def test_padded_head_dims(fam, dtype):
    """Head dims the kernels do not take as they are (fp32 K = 18 / V = 10: rows not whole 16-byte units; fp16
    K = 100 / V = 60 on the GPU, 36 / 20 under the interpreter: not powers of two) run zero-padded and are cut back:
    output and final state against the float64 recurrence, a carried-in state, the transposed layout for fp16."""
    K, V = (18, 10) if dtype == torch.float32 else ((100, 60) if ON_GPU else (36, 20))
    inp = make_inputs(fam, B=1, T=T_LONG, H=1, HV=2, K=K, V=V, dtype=dtype, seed=21)
    assert padded_dims(inp.q, inp.v) != (K, V)
    _check(inp, *_run(inp, transpose=dtype == torch.float16), TOL[dtype])


@pytest.mark.parametrize("fam", FAMS)
def test_initial_state_dtypes(fam):
    """initial_state of any float dtype is read as fp32."""
    inp = make_inputs(fam, B=1, T=50, H=1, HV=1, K=KS[0], V=VS[0], dtype=torch.float32, seed=9)
    inp.h0 = inp.h0.to(torch.bfloat16)
    _check(inp, *_run(inp), F32)


@pytest.mark.parametrize("fam", DELTA_FAMS)
def test_correlated_keys(fam):
    """Nearly parallel keys and β near 1: A's entries near −1, the worst case for the (I + A)⁻¹ products."""
    inp = make_inputs(fam, B=1, T=T_LONG, H=1, HV=1, K=KS[0], V=VS[0], dtype=torch.float32, seed=17)
    k, beta = _correlated_keys(inp.k.shape, inp.beta.shape)
    inp.k, inp.beta = k.to(inp.k), beta.to(inp.beta)
    _check(inp, *_run(inp), F32)


def test_bad_input_named():
    """Inputs the forward cannot take are refused with a message naming the argument, before any kernel runs."""
    inp = make_inputs("gdn", B=1, T=20, H=2, HV=3, K=16, V=16, dtype=torch.float32, seed=3)
    with pytest.raises(ValueError, match="HV|head"):
        _run(inp)
    inp = make_inputs("gdn", B=1, T=20, H=1, HV=1, K=16, V=16, dtype=torch.float32, seed=3)
    with pytest.raises(ValueError, match="beta"):
        CHUNK_OPS["gdn"](inp.q, inp.k, inp.v, inp.g, inp.beta[:, :10], backend="triton")


@pytest.mark.skipif(not ON_GPU, reason="the refusal is for sm_90 builds; the interpreter runs them right")
def test_one_stage_16bit_narrow_block_refused():
    """Stage 2 at one pipeline stage with a 32-wide value block and 16-bit inputs (never planned) raised illegal
    memory accesses or gave a wrong output on sm_90 with triton 3.6: asked for by a plan, it is refused with a
    message naming num_stages."""
    inp = make_inputs("gdn", B=1, T=128, H=2, HV=2, K=64, V=64, dtype=torch.bfloat16, seed=3, device=DEVICE)
    with pytest.raises(ValueError, match="num_stages=1"):
        _launch(inp, _plan(inp, bv=32, num_stages=1))


def test_tma_allocator_kept():
    """The forward sets Triton's scratch allocator (for its tensor descriptors) only where none is set: a caller's
    own allocator is kept."""
    from triton.runtime import _allocation
    from chunkwise.triton import common
    before = _allocation._allocator.get()
    try:
        triton.set_allocator(_allocation.NullAllocator())
        common._ensure_allocator()
        assert _allocation._allocator.get() is common._torch_scratch
        mine = lambda size, alignment, stream: None  # noqa: E731
        triton.set_allocator(mine)
        common._ensure_allocator()
        assert _allocation._allocator.get() is mine
    finally:
        triton.set_allocator(before)


def test_launchers_run_on_the_tensors_device(monkeypatch):
    """The Triton launchers (chunk_fwd, chunk_bwd, recurrent_fwd) run with the CUDA current device set to their
    inputs' device (Triton launches on the current one): checked with a stand-in for a tensor on cuda:1 while
    cuda:0 is current, and with CPU tensors (left alone)."""
    import contextlib
    from chunkwise.triton import chunk, common, decode
    for launcher in (chunk.chunk_fwd, chunk.chunk_bwd, decode.recurrent_fwd):
        assert launcher.__wrapped__ is not None           # wrapped by on_tensor_device

    class OnCuda1(torch.Tensor):
        is_cuda = property(lambda self: True)
        device = property(lambda self: torch.device("cuda", 1))

    seen, current = [], [0]

    @contextlib.contextmanager
    def device(d):
        seen.append(torch.device(d))
        before, current[0] = current[0], torch.device(d).index
        yield
        current[0] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    inside = common.on_tensor_device(lambda x, *a, **kw: (current[0], a, kw))
    x = torch.zeros(2).as_subclass(OnCuda1)
    assert inside(x, 1, key=2) == (1, (1,), {"key": 2}) and seen == [torch.device("cuda", 1)]
    assert current[0] == 0
    current[0] = 1                                      # already current: no switch
    assert inside(x)[0] == 1 and len(seen) == 1
    assert inside(torch.zeros(2))[0] == 1 and len(seen) == 1      # CPU tensors: left alone


# ================================================================================================
# GPU only: real sizes in bf16 / fp16, error no worse than fla's on the same inputs
# ================================================================================================

def _assert_within_fla(inp, o):
    """Our output o within fla's error against the float64 recurrence on the same inputs (x 1.05; the dtype's
    tolerance at most, or alone where fla is not installed). Returns (ours, fla's)."""
    dtype = inp.q.dtype
    e_o, e_fla = rel_err(o, reference(inp)[0]), fla_error(inp)
    bound = TOL[dtype] if e_fla is None else max(e_fla, F32) * 1.05
    assert e_o <= min(bound, TOL[dtype]), f"o rel err {e_o:.2e} vs fla {e_fla}"
    return e_o, e_fla


REAL = dict(B=2, T=1000, H=8, HV=8, K=128, V=128)


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fam", FAMS)
def test_real_size_vs_fla(fam, dtype):
    """B2-T1000-H8-K128-V128: the output within fla's error against the float64 recurrence, the final state within
    the dtype's tolerance."""
    inp = make_inputs(fam, dtype=dtype, seed=11, device=DEVICE, **REAL)
    o, ht = _run(inp)
    e_o, e_fla = _assert_within_fla(inp, o)
    e_h = rel_err(ht, reference(inp)[1])
    print(f"{fam} {dtype}: ours o {e_o:.2e} ht {e_h:.2e}; fla o {e_fla}")
    assert e_h <= TOL[dtype]


@pytest.mark.skipif(not ON_GPU, reason="GPU only")
@pytest.mark.parametrize("fam", FAMS)
def test_real_size_grouped_varlen_bf16(fam):
    """N4-T2000-H2-HV8-K128-V128 bf16 (a 1-token sequence), strong gates, the transposed layout."""
    inp = make_inputs(fam, lengths=[1, 700, 64, 1235], H=2, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=13,
                      device=DEVICE, gate="strong" if fam in GATED else "normal")
    _check(inp, *_run(inp, transpose=True), TOL[torch.bfloat16])


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU")
@pytest.mark.parametrize("fam", FAMS)
def test_busy_shape_bf16_vs_fla(fam):
    """B4-T512-H32-K128-V128 bf16, 256 programs at bv 64 (the delta families' transposed step, GDN's at 2 pipeline
    stages, KDA's at 3; simple GLA plain): output within fla's error, final state within the dtype's tolerance."""
    inp = make_inputs(fam, B=4, T=512, H=32, HV=32, K=128, V=128, dtype=torch.bfloat16, seed=19, device=DEVICE)
    assert resolve_stage2(_plan(inp), 4, 512, 32, 128, 128, 2, GATE_KIND[fam], fam != "gla", False, 132).bv == 64
    o, ht = _run(inp)
    _assert_within_fla(inp, o)
    assert rel_err(ht, reference(inp)[1]) <= TOL[torch.bfloat16]


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU")
@pytest.mark.parametrize("fam", DELTA_FAMS)
def test_correlated_keys_bf16_vs_fla(fam):
    """Nearly parallel keys and β near 1 at real size in bf16 (an ill-conditioned I + A, where a less accurate solve
    shows; the inference solve from fp16 operands): the output within fla's error against the float64 recurrence."""
    inp = make_inputs(fam, dtype=torch.bfloat16, seed=101, device=DEVICE, **REAL)
    k, beta = _correlated_keys(inp.k.shape, inp.beta.shape, seed=201)
    inp.k, inp.beta = k.to(inp.k), beta.to(inp.beta)
    _assert_within_fla(inp, _run(inp)[0])


@pytest.mark.skipif(not ON_GPU, reason="the bf16 operands apply to bf16 inputs, which need the GPU")
def test_kda_a_from_bf16_operands():
    """KDA's inference stage 1 forms A from bf16 operands (plan ap_lowp): within bf16 rounding of the tf32 operands'
    output at real size, strong gates."""
    inp = make_inputs("kda", dtype=torch.bfloat16, seed=11, device=DEVICE, gate="strong", **REAL)
    o, _ = _launch(inp)
    o_tf32, _ = _launch(inp, _plan(inp, ap_lowp=0))
    assert rel_err(o, o_tf32) <= TOL[torch.bfloat16]
    _assert_within_fla(inp, o)


HEAD_DIM_CASES = [(FAMS[i % 4], (torch.bfloat16, torch.float16)[i % 2], K, V) for i, (K, V) in enumerate(HEAD_DIM_GRID)]


@skip_unless_sm90_builds
@pytest.mark.parametrize("fam,dtype,K,V", HEAD_DIM_CASES,
                         ids=[f"{f}-{str(d)[6:]}-K{K}-V{V}" for f, d, K, V in HEAD_DIM_CASES])
def test_head_dim_grid(fam, dtype, K, V):
    """The forward at each head-dim pair of HEAD_DIM_GRID (each a build of its own on the GPU; the families and
    dtypes taken in turn), 16-bit inputs, varlen with a 1-token sequence, grouped heads, both state layouts."""
    inp = make_inputs(fam, lengths=[1, 70, 130], H=1, HV=2, K=K, V=V, dtype=dtype, seed=31)
    for transpose in (False, True):
        _check(inp, *_run(inp, transpose=transpose), TOL[dtype])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need the GPU")
@pytest.mark.parametrize("fam", ("gdn", "kda"))
def test_stage2_beside_stage1_cuda_graph(fam):
    """The forward with stage 2 beside stage 1 (the default for GDN / KDA at B1-T4096-H32 bf16: a second stream
    forked from and joined to the caller's, the per-chunk flags zeroed in the call) captured in a CUDA graph: every
    replay, on inputs changed in place between replays, gives the eager call's output and final state."""
    inp = make_inputs(fam, B=1, T=4096, H=32, HV=32, K=128, V=128, dtype=torch.bfloat16, seed=37, device=DEVICE)
    args = [x.clone() for x in inp.args()]
    h0 = inp.h0.clone()

    def call():
        return CHUNK_OPS[fam](*args, initial_state=h0, output_final_state=True, backend="triton")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, ht_g = call()
    gen = torch.Generator(device=DEVICE).manual_seed(41)
    for _ in range(3):
        args[2].copy_(torch.randn(args[2].shape, generator=gen, device=DEVICE, dtype=args[2].dtype))
        graph.replay()
        o_e, ht_e = call()
        assert torch.equal(o_g, o_e) and torch.equal(ht_g, ht_e)


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU's hardware queues are what this checks")
def test_stage2_beside_stage1_on_one_hardware_queue():
    """The two tests above (stage 2 beside stage 1 against after it, eager against replayed from a CUDA graph) with
    one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron sets it) finish and pass: stage 1 is launched
    first, so it never queues behind stage 2's programs waiting on it."""
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    out = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          "-k", "stage2_beside_stage1 and not hardware_queue"], env=env, capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fam", FAMS)
def test_second_gpu_while_first_is_current(fam):
    """Inputs on cuda:1 while cuda:0 is current: the forward runs there and equals the float64 recurrence."""
    inp = make_inputs(fam, B=2, T=T_LONG, H=1, HV=2, K=KS[0], V=VS[0], dtype=torch.float32, seed=53, device="cuda:1")
    with torch.cuda.device(0):
        o, ht = _run(inp)
    assert o.device == torch.device("cuda", 1)
    _check(inp, o, ht, F32)
