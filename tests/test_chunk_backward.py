"""Gradients of the Triton chunk ops (triton/chunk.py's chunk_bwd and its stages, bwd_*.py) against float64
autograd of the PyTorch reference.

Every input gets a gradient check: q, k, v, g (scalar and per channel), beta, initial_state, and through the in-op
preludes the raw gate projection, A_log, dt_bias and the pre-L2-norm q, k; the loss reads the final state too
(gradient flowing in through it). Through the op the forward saves its stage 1 for the backward (the default);
direct calls of chunk_bwd take the recompute paths and plans with one field changed. Under the interpreter (CPU):
fp32 and fp16, small shapes. On the GPU: bf16 / fp16 at real size, no worse than fla where fla runs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given

import chunkwise
from chunkwise.triton.chunk import chunk_bwd, chunk_fwd
from chunkwise.triton.configs import backward_plan

from helpers import (CHUNK_OPS, DEVICE, HEAD_DIM_GRID, ON_GPU, PROPERTY_SHAPES, TOL, fla_ops,
                     make_inputs, per_family, property_inputs, reference, rel_err, skip_unless_sm90_builds)

FAMS = ("gdn", "kda", "delta", "gla")
GATED = ("gdn", "kda", "gla")
DELTA_FAMS = ("gdn", "kda", "delta")
NAMES = ("q", "k", "v", "g", "beta", "h0")
GATE = {"gdn": 1, "kda": 2, "delta": 0, "gla": 1}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """NaN-filled allocations: an element a kernel should have written but did not shows up in the gradients."""
    monkeypatch.setenv("CHUNKWISE_POISON", "1")


def _shape_id(fam, **kw) -> str:
    """A readable test id: gdn-B2-T130-H2-HV4-K32-V32, gdn-N3-T101-H1-HV2-K16-V32 (varlen)."""
    lengths = kw.get("lengths")
    bt = f"N{len(lengths)}-T{sum(lengths)}" if lengths else f"B{kw.get('B', 2)}-T{kw.get('T', 100)}"
    H = kw.get("H", 2)
    hv = f"-HV{kw['HV']}" if kw.get("HV", H) != H else ""
    return f"{fam}-{bt}-H{H}{hv}-K{kw.get('K', 32)}-V{kw.get('V', 32)}"


def _grads(inp, backend, dtype, transpose=False, final=True, seed=1, unread_final=False, outs=None, **op_kwargs):
    """Run the family's op on leaf copies of inp's tensors (cast to dtype, on the backend's device),
    loss = Σ o·dO + Σ h_T·dh_T (``final``; ``unread_final``: the final state asked for but not in the loss);
    return dict name -> gradient. ``outs``: a dict that gets the op's outputs o and h_T."""
    dev = DEVICE if backend == "triton" else "cpu"
    leaves = {}
    for n in NAMES:
        x = getattr(inp, n)
        if x is not None:   # q, k, v, beta in dtype; g and the state fp32 (float64 for the reference)
            want = dtype if n in ("q", "k", "v", "beta") or dtype == torch.float64 else torch.float32
            leaves[n] = x.detach().to(dev, want).clone().requires_grad_(True)
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    extra = {n: t.detach().to(dev, ct).clone().requires_grad_(True) for n, t in op_kwargs.pop("params", {}).items()}
    h0 = leaves.get("h0")
    h0_in = None if h0 is None else (h0.transpose(-1, -2) if transpose else h0)
    args = [leaves["q"], leaves["k"], leaves["v"]] + [leaves[n] for n in ("g", "beta") if n in leaves]
    cu = None if inp.cu_seqlens is None else inp.cu_seqlens.to(dev)
    o, ht = CHUNK_OPS[inp.fam](*args, initial_state=h0_in, output_final_state=final or unread_final, cu_seqlens=cu,
                               transpose_state_layout=transpose, backend=backend, **extra, **op_kwargs)
    if outs is not None:
        outs.update(o=o.detach(), ht=None if ht is None else ht.detach())
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    loss = (o.double() * do.to(o.device)).sum()
    if final:
        dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
        loss = loss + (ht.double() * dht.to(ht.device)).sum()
    loss.backward()
    out = {n: t.grad for n, t in leaves.items()}
    out.update({n: t.grad for n, t in extra.items()})
    for n, t in out.items():
        assert t is not None, f"no gradient for {n}"
    return out


def _compare(inp, tol, dtype=torch.float32, ours=None, scales=None, **kw):
    """Every gradient of the triton backend (``ours``: already computed with these arguments) within tol of the
    float64 reference's; returns the errors. ``scales``: name -> f(reference gradients), a tensor the error of that
    gradient is measured against instead of the gradient itself (a sum whose terms cancel)."""
    ours = _grads(inp, "triton", dtype, **kw) if ours is None else ours
    ref = _grads(inp, "torch", torch.float64, **kw)
    errs = {}
    for n, r in ref.items():
        t = ours[n]
        assert t.dtype == (dtype if n in ("q", "k", "v", "beta") else t.dtype)
        errs[n] = rel_err(t, r) if n not in (scales or {}) else \
            ((t.detach().double().cpu() - r.detach().double().cpu()).norm() / scales[n](ref).norm()).item()
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= tol}
    assert not bad, f"gradient rel errors above {tol:.0e}: {bad} (all: { {n: f'{e:.1e}' for n, e in errs.items()} })"
    return errs


def _direct(inp, dtype, plan=None, save=False, transpose=False, seed=1):
    """chunk_bwd called directly on inp (in dtype) with the loss of _grads (same dO, dh_T): ``save``, with what the
    saving forward keeps (chunk_fwd's saved_out), else recomputing stage 1; ``plan``: a launch plan, or a function
    of the default plan that returns one. Returns dict name -> gradient."""
    x = {n: getattr(inp, n) for n in NAMES}
    q, k, v = (x[n].detach().to(DEVICE, dtype) for n in ("q", "k", "v"))
    g = None if x["g"] is None else x["g"].detach().to(DEVICE, torch.float32)
    beta = None if x["beta"] is None else x["beta"].detach().to(DEVICE, dtype)
    h0 = None if x["h0"] is None else x["h0"].detach().to(DEVICE, torch.float32)
    h0 = None if h0 is None else (h0.transpose(-1, -2).contiguous() if transpose else h0)
    cu = None if inp.cu_seqlens is None else inp.cu_seqlens.to(DEVICE)
    scale = q.shape[-1] ** -0.5
    saved = {} if save else None
    o, ht = chunk_fwd(q, k, v, g, beta, scale, h0, True, cu, transpose_state_layout=transpose, saved_out=saved)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(DEVICE, torch.float32)
    if callable(plan):
        plan = plan(backward_plan(GATE[inp.fam], beta is not None, dtype, q.shape[-1], v.shape[-1]))
    grads = chunk_bwd(q, k, v, g, beta, scale, h0, do, dht, cu, transpose_state_layout=transpose, saved=saved or None,
                      plan=plan)
    out = {n: d for n, d in zip(NAMES, grads) if d is not None}
    if transpose and "h0" in out:
        out["h0"] = out["h0"].transpose(-1, -2)
    return out


def _close(a: dict, b: dict, tol: float, what: str):
    assert set(a) == set(b), what
    for n in a:
        e = rel_err(a[n], b[n])
        assert e <= tol, f"{what}: {n} differs by {e:.1e}"


# --------------------------------------------------------------------------------------------
# every gradient through the op, per family: layouts, gates, dtypes, head dims
# --------------------------------------------------------------------------------------------

LAYOUTS = [dict(B=2, T=130, H=2, K=32, V=32),                            # three chunks, the last partial
           dict(lengths=[1, 70, 30], H=1, HV=2, K=16, V=32),            # varlen with a 1-token sequence, grouped heads
           dict(B=1, T=40, H=2, K=32, V=16)]                            # one partial chunk
CASES = [(fam, kw) for fam in FAMS for kw in LAYOUTS]


@pytest.mark.parametrize("fam,kw", CASES, ids=[_shape_id(f, **kw) for f, kw in CASES])
def test_grads(fam, kw):
    """Every gradient against the float64 reference: carried-in state and the final state read by the loss (the
    varlen layout in the transposed [N, HV, V, K] state layout); the one-chunk layout without either (no dh0, dht
    None)."""
    one_chunk = kw.get("T") == 40
    inp = make_inputs(fam, seed=3, h0=not one_chunk, **kw)
    _compare(inp, TOL[torch.float32], transpose="lengths" in kw, final=not one_chunk)


@pytest.mark.parametrize("fam", GATED)
def test_grads_strong_gates(fam):
    """Very negative gates: chunks summing below -100 and a hard reset g = -1e4 (the per-token clamp, KDA's block and
    exact forms of the pairwise products); every gradient finite and right."""
    inp = make_inputs(fam, B=1, T=130, H=1, HV=1, K=16, V=16, gate="strong", seed=3)
    _compare(inp, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_grads_kda_steep_channels(dtype):
    """KDA with a few channels at g = -6 per token for 40 tokens (16-token blocks spanning -96: factored around
    their middle; two at -9.5: -152, near the most those factors take) and two at -12 for 40 more (spanning -192,
    past what the factored diagonal blocks take) among normal ones: those chunks leave the one-reference form, the
    far diagonal blocks take the exact column loops (the A / P recompute's and the pairwise gradients')."""
    inp = make_inputs("kda", B=1, T=100, H=1, HV=2, K=16, V=16, seed=4)
    inp.g[:, 10:50, :, 3:7] = -6.0
    inp.g[:, 20:60, :, 12:14] = -9.5
    inp.g[:, 55:95, :, 9:11] = -12.0
    _compare(inp, TOL[dtype], dtype=dtype)


def test_grads_kda_pair_blocks():
    """KDA's pair kernel over two 32-channel blocks, the first with steep channels (one reference does not fit its
    chunks: the flagged block form and the diagonal-block launch over all channels), the second normal (the
    one-reference launch alone), varlen: every gradient against the reference."""
    inp = make_inputs("kda", lengths=[100, 30], H=1, HV=2, K=64, V=16, seed=21)
    inp.g[:, 10:50, :, 3:7] = -6.0
    _compare(inp, TOL[torch.float32])


@pytest.mark.parametrize("fam", FAMS)
def test_grads_fp16(fam):
    """fp16 inputs (GDN and DeltaNet recompute stage 1 with the A / P, solve and W / U launches; the state passes' and
    the recompute's products from 16-bit operands, the intermediates stored in fp16): every gradient within fp16's
    bound, varlen with a 1-token sequence, grouped heads, gradients returned in fp16."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=5)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)


@pytest.mark.parametrize("fam,K,V,dtype", [("gdn", 18, 10, torch.float32), ("delta", 18, 10, torch.float32),
                                           ("gla", 18, 10, torch.float32), ("kda", 18, 10, torch.float32),
                                           ("kda", 40, 24, torch.float16), ("gdn", 40, 24, torch.float16)],
                         ids=["gdn-K18-V10-fp32", "delta-K18-V10-fp32", "gla-K18-V10-fp32", "kda-K18-V10-fp32",
                              "kda-K40-V24-fp16", "gdn-K40-V24-fp16"])
def test_grads_padded_head_dims(fam, K, V, dtype):
    """Head dims the kernels do not take as they are run zero-padded (fp32 rows to whole 16 bytes: 18 -> 20, 10 ->
    12; 16-bit to the next power of two: 40 -> 64, 24 -> 32; the forward saves nothing then, so KDA's backward
    recomputes stage 1): the gradients of the real channels, the initial state's included, in the transposed layout."""
    inp = make_inputs(fam, B=1, T=70, H=1, HV=2, K=K, V=V, seed=4)
    _compare(inp, TOL[dtype], dtype=dtype, transpose=True)


@pytest.mark.parametrize("fam", FAMS)
def test_grads_wide_keys(fam):
    """K = 160 in fp32 (a 256-wide key tile, masked: one pipeline stage, four 64-wide column blocks in the state-tile
    pass), two chunks, grouped heads."""
    inp = make_inputs(fam, B=1, T=70, H=1, HV=2, K=160, V=16, seed=6)
    _compare(inp, TOL[torch.float32])


@pytest.mark.parametrize("fam", ("gdn", "kda"))
def test_wide_16_bit_runs_in_fp32(fam):
    """16-bit inputs with K > 128 run the backward in fp32 (configs.WIDE_16BIT_K): every gradient equals, bit for bit,
    the fp32 run's on the same values, returned in the input dtype."""
    inp = make_inputs(fam, B=1, T=40, H=1, HV=2, K=160, V=16, seed=7)
    half = [x.to(DEVICE, torch.float16) for x in (inp.q, inp.k, inp.v)]
    g, h0, beta = inp.g.to(DEVICE), inp.h0.to(DEVICE, torch.float32), inp.beta.to(DEVICE, torch.float16)
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(1, 40, 2, 16, generator=gen).half().to(DEVICE)
    dht = torch.randn(h0.shape, generator=gen).to(DEVICE)
    d16 = chunk_bwd(*half, g, beta, 160 ** -0.5, h0, do, dht, None)
    d32 = chunk_bwd(*(x.float() for x in half), g, beta.float(), 160 ** -0.5, h0, do.float(), dht, None)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), d16, d32):
        assert a.dtype == (torch.float16 if name in ("dq", "dk", "dv", "dbeta") else b.dtype), name
        assert torch.equal(a, b.to(a.dtype)), name


def test_wide_keys_clear_error():
    """K > 256 has no triton kernels (shared memory): a clear error naming K, before anything runs."""
    inp = make_inputs("gdn", B=1, T=20, H=1, K=264, V=16, seed=6)
    with pytest.raises(ValueError, match="K=264"):
        _grads(inp, "triton", torch.float32)


@pytest.mark.parametrize("fam", ("gdn", "kda"))
def test_grads_in_op_preludes(fam):
    """In-op L2 norm of q, k, beta sigmoid, the gate from A_log / dt_bias: gradients of the raw inputs."""
    inp = make_inputs(fam, B=1, T=70, H=1, HV=2, K=16, V=16, seed=4)
    gen = torch.Generator().manual_seed(4)
    HV, K = 2, 16
    inp.q = inp.q * 3                                             # not unit norm before the op
    inp.k = inp.k * 2
    inp.g = torch.randn(inp.g.shape, generator=gen).to(inp.g)     # raw projection a
    inp.beta = torch.randn(inp.beta.shape, generator=gen).to(inp.beta)  # logits
    params = dict(A_log=torch.randn(HV, generator=gen) * 0.5,
                  dt_bias=torch.randn(HV if fam == "gdn" else HV * K, generator=gen) * 0.5)

    def a_log_terms(ref):
        # dA_log[h] = Σ_t,k dg ⊙ g with g = −e^{A_log} softplus(x), x = a + dt_bias: its terms da ⊙ softplus(x) / σ(x)
        # cancel (92x for one head), so its error is measured against Σ |terms| per head
        x = inp.g.detach().double().cpu() + params["dt_bias"].double().cpu().view(HV, -1).squeeze(-1)
        terms = ref["g"].detach().double().cpu() * torch.nn.functional.softplus(x) / torch.sigmoid(x)
        return terms.abs().sum(dim=tuple(d for d in range(terms.dim()) if d != 2))

    errs = _compare(inp, TOL[torch.float32], params=params, use_qk_l2norm_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, scales={"A_log": a_log_terms})
    assert {"A_log", "dt_bias"} <= set(errs)


@pytest.mark.parametrize("fam", FAMS)
def test_grads_fla_options(fam):
    """fla's spellings through the Triton op: β = 2·sigmoid(logits) (allow_neg_eigval) for the delta families, simple
    GLA's g_gamma [HV] (one decay per head): every gradient, g_gamma's included."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=16, seed=23)
    gen = torch.Generator().manual_seed(23)
    if fam == "gla":
        inp.g = None
        _compare(inp, TOL[torch.float32], params={"g_gamma": -torch.rand(2, generator=gen) * 0.5})
    else:
        inp.beta = (torch.randn(inp.beta.shape, generator=gen) * 2).to(inp.beta)      # logits
        _compare(inp, TOL[torch.float32], use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)


@pytest.mark.parametrize("fam", ("delta", "kda"))
def test_unread_final_state_reaches_the_backward_as_none(fam, monkeypatch):
    """A final state the loss does not read (output_final_state=True, loss on o alone) comes to the backward as None,
    not as a zero tensor autograd would fill first: chunk_bwd gets dht None, and the gradients equal the reference's
    without a final state."""
    import chunkwise.triton.chunk as chunk
    seen = []

    def spy(*a, **kw):
        seen.append(a[8])       # dht
        return chunk_bwd(*a, **kw)
    monkeypatch.setattr(chunk, "chunk_bwd", spy)
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=19)
    ours = _grads(inp, "triton", torch.float32, final=False, unread_final=True)
    _compare(inp, TOL[torch.float32], ours=ours, final=False)
    assert len(seen) == 1 and seen[0] is None


def _gate_terms(inp):
    """The scale dg's error is measured against: dg is a reverse cumsum over tokens of terms like q ⊙ dq − k ⊙ dk,
    which cancel to exactly 0 in float64 where the gate multiplies nothing (a lone token with no initial state, a
    gate of −1e4) and leave fp32 rounding of their own size there: ‖dg‖ + ‖|q ⊙ dq| + |k ⊙ dk|‖ (summed over K for
    a scalar gate; a key head's on each of its value heads), each token's terms once."""
    def terms(ref):
        q, k = inp.q.detach().double().cpu(), inp.k.detach().double().cpu()
        t = (q * ref["q"]).abs() + (k * ref["k"]).abs()                         # [B, T, H, K]
        t = t.repeat_interleave(inp.g.shape[2] // q.shape[2], dim=2)             # [B, T, HV, K]
        t = t if inp.g.dim() == 4 else t.sum(-1)
        return (ref["g"].norm() + t.norm()).reshape(1)
    return terms


@pytest.mark.parametrize("fam", FAMS)
@per_family(8)
@given(**PROPERTY_SHAPES)
def test_property_random_shapes_grads(fam, H, group, K, V, batch, lengths, gate, h0, final, transpose, seed):
    """Random shapes (sequence lengths around the 64-token chunk, empty and 1-token sequences in a varlen batch,
    grouped value heads, head dims that are no power of two) and options (initial state, final state in the loss,
    transposed state layout, zero / normal / very negative gates): the output, the final state and every gradient
    equal the float64 reference's. dg is measured against its cancelling terms (_gate_terms)."""
    inp = property_inputs(fam, H, group, K, V, batch, lengths, gate, h0, seed)
    fwd = {}
    ours = _grads(inp, "triton", torch.float32, final=final, transpose=transpose, outs=fwd)
    _compare(inp, TOL[torch.float32], ours=ours, final=final, transpose=transpose,
             scales={"g": _gate_terms(inp)} if inp.g is not None else None)
    o_ref, h_ref = reference(inp)
    assert rel_err(fwd["o"], o_ref) <= TOL[torch.float32], f"o: {rel_err(fwd['o'], o_ref):.2e}"
    if final:
        ht = fwd["ht"].transpose(-1, -2) if transpose else fwd["ht"]
        assert rel_err(ht, h_ref) <= TOL[torch.float32], f"final state: {rel_err(ht, h_ref):.2e}"


# --------------------------------------------------------------------------------------------
# stages and plans: chunk_bwd called directly
# --------------------------------------------------------------------------------------------

RECOMPUTE = [(fam, how) for fam in DELTA_FAMS for how in ("saved", "recompute")] + \
    [("gdn", "three-launches"), ("delta", "three-launches")]


@pytest.mark.parametrize("fam,how", RECOMPUTE, ids=[f"{f}-{h}" for f, h in RECOMPUTE])
def test_stage1_saved_or_recomputed(fam, how):
    """The backward's stage 1 operands (T, W, dR_local; R and the states): from what the saving forward kept (DeltaNet:
    its states formed backwards from the final state; KDA: W formed from T), recomputed (scalar / no gate: by stage
    1's kernel in one pass), or by the separate A / P, solve and W / U launches (fp16's recompute): every gradient
    against the reference, varlen with a 1-token sequence, grouped heads, carried-in and final states."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=12)
    plan = (lambda p: dataclasses.replace(p, fused_prep=False)) if how == "three-launches" else None
    ours = _direct(inp, torch.float32, plan=plan, save=how == "saved")
    _compare(inp, TOL[torch.float32], ours=ours)


# plan fields whose every value computes the same gradients (to rounding): the default's value against another
PLAN_FORMS = [("delta", "dh_ahead", 0), ("delta", "dh_ahead", 1), ("gdn", "dh_ahead", 1), ("gdn", "dh_ahead", 2),
              ("kda", "dh_ahead", 0), ("kda", "dh_ahead", 2), ("delta", "dqk_early", False), ("gdn", "dqk_early", True),
              ("gla", "dqk_early", True), ("kda", "dqk_early", True), ("delta", "wy_da_scr", True),
              ("gdn", "wy_da_scr", False), ("gdn", "full", frozenset()), ("kda", "full", frozenset()),
              ("delta", "full", frozenset({"fwd_h", "bwd_dh", "bwd_dqk"})), ("gla", "full", frozenset()),
              ("delta", "dqk_bk", 16), ("gdn", "dqk_bk", 16), ("kda", "dqk_bk", 16), ("gla", "dqk_bk", 16),
              ("gdn", "wy_bk", 16), ("kda", "pair_bk", 16), ("kda", "overlap", False)]


@pytest.mark.parametrize("fam,field,value", PLAN_FORMS, ids=[f"{f}-{n}={v}" if not isinstance(v, frozenset) else
                                                             f"{f}-{n}={'+'.join(sorted(v)) or 'none'}"
                                                             for f, n, v in PLAN_FORMS])
def test_plan_forms_agree(fam, field, value):
    """A launch-plan field at another value than the default's gives the same gradients to rounding (fp32, whole
    chunks so that ``full`` applies, K = 40 so that 16-wide column blocks leave a partial one, the saving forward's
    stage 1): the reverse pass's dR_local load forms, the state-tile pass's early loads, the WY pass's dAᵀ from its
    scratch or its products, the constant chunk length, the column blocks, KDA's second stream."""
    inp = make_inputs(fam, B=1, T=128, H=1, HV=2, K=40, V=24, seed=14)
    base = _direct(inp, torch.float32, save=True)
    other = _direct(inp, torch.float32, save=True, plan=lambda p: dataclasses.replace(p, **{field: value}))
    _close(other, base, TOL[torch.float32] / 4, f"{field}={value}")


@pytest.mark.skipif(ON_GPU, reason="their sm_90 builds at fp16 small tiles give wrong dk / dg (GDN, simple GLA): the "
                                   "plan takes these forms for bf16 at K = 128 only, which the real-size tests cover")
@pytest.mark.parametrize("fam", FAMS)
def test_16_bit_key_products(fam):
    """The plan of bf16 inputs at a 128-wide key tile (bf16 is wrong under the interpreter; fp16 inputs here, at
    K = 16): the WY pass's products of T, dW, X, dT, dA from 16-bit operands (key_lowp), the state-tile pass's pairwise
    products from dP split into two 16-bit parts (dqk_lowp 4; KDA's from 16-bit operands, 2), dk's state-tile share
    stored in 16 bits: every gradient within fp16's bound, stage 1 recomputed (and for KDA saved)."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=8)
    bf16_plan = backward_plan(GATE[fam], fam != "gla", torch.bfloat16, 128, 128)

    def plan(p):
        return dataclasses.replace(p, key_lowp=bf16_plan.key_lowp, dqk_lowp=bf16_plan.dqk_lowp)
    for save in (True, False) if fam == "kda" else (False,):     # (fp16 GDN / DeltaNet: nothing saved)
        _compare(inp, TOL[torch.float16], dtype=torch.float16, ours=_direct(inp, torch.float16, plan=plan, save=save))


def test_grads_repeatable():
    """The same inputs give the same gradients bit for bit: twice at the default plan, and with KDA's forward state
    pass on the main stream instead of beside the dR_local / W launch (on the GPU: B1-T4096-H32 bf16, 128 serial
    programs, where the two run side by side)."""
    kw = dict(B=1, T=4096, H=32, K=128, V=128, device=DEVICE) if ON_GPU else dict(B=1, T=130, H=1, HV=2, K=16, V=32)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    for fam in ("kda", "gdn") if ON_GPU else ("kda",):
        inp = make_inputs(fam, seed=31, **kw)
        first = _direct(inp, dtype, save=True)
        again = _direct(inp, dtype, save=True)
        serial = _direct(inp, dtype, save=True, plan=lambda p: dataclasses.replace(p, overlap=False, state_warps=4,
                                                                                   num_warps=4))
        for n in first:
            assert torch.equal(first[n], again[n]), f"{fam} {n}: not repeatable"
        if fam == "kda":
            beside = _direct(inp, dtype, save=True, plan=lambda p: dataclasses.replace(p, state_warps=4))
            for n in first:
                assert torch.equal(beside[n], serial[n]), f"{n}: beside != serial"


def test_group_sum():
    """Grouped value heads' dq / dk: group_sum adds each key head's value-head rows (in the input dtype, as the
    kernels store them, or fp32) in fp32 and stores the sum in the input dtype, as an fp32 sum rounded once (rows past
    a multiple of its row block, K not a power of two)."""
    from chunkwise.triton.bwd_tiles import group_sum
    gen = torch.Generator().manual_seed(7)
    B, T, H = 2, 37, 3
    for G, K, dtype, xdt in [(3, 100, torch.float16, torch.float16), (4, 16, torch.float32, torch.float32),
                             (2, 32, torch.float16, torch.float32)]:
        x = torch.randn(B, T, H * G, K, generator=gen).to(DEVICE, xdt)
        y = group_sum(x, H, dtype)
        assert y.shape == (B, T, H, K) and y.dtype == dtype
        torch.testing.assert_close(y, x.double().view(B, T, H, G, K).sum(3).to(dtype))


def test_kda_gate_cumsum_from_forward():
    """KDA's saving forward keeps stage 1's chunk-local cumulative gate G: it equals the backward's own gate cumsum to
    fp32 rounding (varlen with a 1-token sequence, gates below the per-token clamp)."""
    from chunkwise.triton.bwd_states import Problem, gate_cumsum
    x = make_inputs("kda", lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, dtype=torch.float32, seed=29)
    g = x.g.clone()
    g[0, 40:44] = -60.0
    saved = {}
    chunk_fwd(x.q, x.k, x.v, g, x.beta, 0.25, x.h0, True, x.cu_seqlens, saved_out=saved)
    p = Problem.of(x.q, x.v, g, x.beta, x.cu_seqlens, None)
    G = gate_cumsum(g, p, backward_plan(2, True, torch.float32, 16, 32))
    assert saved["G"].dtype == torch.float32
    torch.testing.assert_close(saved["G"], G, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("mag", [1e-39, 1e-6, 1.0, 1e6])
def test_wu_fp16_scaled_tiles(mag):
    """The W / dR_local launch with fp16 operands each scaled by a power of two (KDA's, where the forward kept T
    alone: W = T diag(β e^G) K, U = T diag(β) V and dR_local = scale Pᵀ dO): within fp16's rounding of the float64
    products whatever the magnitude of v and dO (1e-6: unscaled fp16 would flush them to subnormals; 1e6: it would
    overflow to inf; 1e-39: fp32 subnormals, whose log2 the GPU flushes to −inf), over two chunks, the second
    partial."""
    from chunkwise.triton.bwd_wy import _wu_kernel
    B, T, HV, K, V, C = 1, 100, 2, 32, 32, 64
    gen = torch.Generator().manual_seed(5)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)          # noqa: E731
    k = torch.nn.functional.normalize(rnd(B, T, 1, K), dim=-1)
    v, do = mag * rnd(B, T, HV, V), mag * rnd(B, T, HV, V)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    g = -0.3 * torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64)
    tri = torch.ones(C, C, dtype=torch.float64).tril()
    G = torch.empty_like(g)
    Tm, Pm = rnd(B, T, HV, C), rnd(B, T, HV, C)
    W, U, dR = torch.empty(B, T, HV, K, dtype=torch.float64), torch.empty(B, T, HV, V, dtype=torch.float64), \
        torch.empty(B, T, HV, V, dtype=torch.float64)
    for t0 in range(0, T, C):                       # chunk-local cumulative gates; T and P lower triangular per chunk
        L = min(C, T - t0)
        sl = slice(t0, t0 + L)
        G[:, sl] = g[:, sl].cumsum(1)
        m = tri[:L, :C][None, :, None, :]
        Tm[:, sl] = Tm[:, sl] * m
        Pm[:, sl] = Pm[:, sl] * m
        Tc, Pc = Tm[:, sl, :, :L], Pm[:, sl, :, :L]                                    # [B, L, HV, L]
        x = beta[:, sl, :, None] * G[:, sl].exp() * k[:, sl].expand(-1, -1, HV, -1)
        W[:, sl] = torch.einsum("bihj,bjhk->bihk", Tc, x)
        U[:, sl] = torch.einsum("bihj,bjhv->bihv", Tc, beta[:, sl, :, None] * v[:, sl])
        dR[:, sl] = 0.25 * torch.einsum("bjhi,bjhv->bihv", Pc, do[:, sl])
    f32 = lambda x: x.to(DEVICE, torch.float32).contiguous()                        # noqa: E731
    outs = [torch.full((B, T, HV, n), float("nan"), device=DEVICE) for n in (K, V, V)]
    _wu_kernel[(2, B * HV)](f32(k), f32(v), f32(beta), f32(G), f32(Tm), f32(Pm), f32(do), *outs, None, None, T, 0.25,
                            H=1, HV=HV, K=K, V=V, BK=K, BV=V, C=C, GATE=2, DELTA=True, IS_VARLEN=False,
                            PREC="ieee", LOWP=2)
    for name, ours, ref in zip(("W", "U", "dR_local"), outs, (W, U, dR)):
        e = rel_err(ours, ref)
        assert e <= 1e-3, f"{name}: {e:.2e} at magnitude {mag}"


# --------------------------------------------------------------------------------------------
# GPU only: 16 bits at real size against the float64 reference, next to fla; the sm_90 builds of other tiles
# --------------------------------------------------------------------------------------------

def _fla_grads(inp, do, dht):
    """fla's gradients on the same 16-bit inputs; None where fla is missing or refuses."""
    mods = fla_ops()
    if mods is None:
        return None
    fd, fg, fk, fs = mods
    leaves = {n: getattr(inp, n).detach().clone().requires_grad_(True) for n in NAMES if getattr(inp, n) is not None}
    kw = dict(initial_state=leaves["h0"], output_final_state=True)
    L = dict(leaves)
    G = inp.v.shape[2] // inp.q.shape[2]
    if G > 1:       # grouped value heads: fla takes q, k repeated over each group (autograd sums their gradients)
        L["q"], L["k"] = L["q"].repeat_interleave(G, 2), L["k"].repeat_interleave(G, 2)
    try:
        if inp.fam == "gdn":
            o, ht = fg.chunk_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], **kw)
        elif inp.fam == "kda":
            o, ht = fk.chunk_kda(L["q"], L["k"], L["v"], L["g"], L["beta"], **kw)
        elif inp.fam == "delta":
            o, ht = fd.chunk_delta_rule(L["q"], L["k"], L["v"], L["beta"], **kw)
        else:
            o, ht = fs.chunk_simple_gla(L["q"], L["k"], L["v"], g=L["g"], **kw)
        ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    except Exception as e:  # noqa: BLE001  (fla refuses GDN / simple GLA backward on Hopper + triton < 3.7.1)
        print(f"fla {inp.fam} backward: {e!r}"[:300])
        return None
    return {n: t.grad for n, t in leaves.items()}


def _grads_device64(inp, seed=1):
    leaves = {n: getattr(inp, n).detach().double().clone().requires_grad_(True) for n in NAMES
              if getattr(inp, n) is not None}
    args = [leaves["q"], leaves["k"], leaves["v"]] + [leaves[n] for n in ("g", "beta") if n in leaves]
    o, ht = CHUNK_OPS[inp.fam](*args, initial_state=leaves["h0"], output_final_state=True, backend="torch")
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(o.device)
    ((o * do).sum() + (ht * dht).sum()).backward()
    return {n: t.grad for n, t in leaves.items()}, do, dht


def _assert_grads_vs_fla(inp, dtype, label):
    """Our gradients of every input of ``inp`` (in ``dtype``) against the float64 reference: within the dtype's bound,
    and no worse than fla's on the same inputs where fla runs its backward. Prints both."""
    ours = _grads(inp, "triton", dtype)
    ref, do, dht = _grads_device64(inp)
    fla = _fla_grads(inp, do, dht)
    rows = [(n, rel_err(ours[n], r), None if fla is None else rel_err(fla[n], r)) for n, r in ref.items()]
    print(f"\n{label} grads rel err (ours / fla): " +
          ", ".join(f"{n} {e:.3e}/{'-' if f is None else f'{f:.3e}'}" for n, e, f in rows))
    for n, e, e_fla in rows:
        assert e <= TOL[dtype], f"{n}: {e:.2e}"
        if e_fla is not None:
            assert e <= e_fla * 1.05 + 1e-4, f"{n}: ours {e:.2e} > fla {e_fla:.2e}"


REAL = dict(B=2, T=1000, H=8, HV=8, K=128, V=128)


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fam", FAMS, ids=[_shape_id(f, **REAL) for f in FAMS])
def test_real_size_grads_vs_fla(fam, dtype):
    """Every gradient at real size in 16 bits against the float64 reference, no worse than fla's on the same inputs
    (where fla runs its backward)."""
    inp = make_inputs(fam, dtype=dtype, seed=11, device=DEVICE, **REAL)
    _assert_grads_vs_fla(inp, dtype, f"{fam} {dtype}")


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("fam", FAMS, ids=[_shape_id(f, B=2, T=1000, H=4, HV=8, K=128, V=128) for f in FAMS])
def test_real_size_grouped_grads_vs_fla(fam):
    """Grouped value heads at real size in bf16 (H = 4, HV = 8: Qwen3-Next's layout): each value head's dq / dk leave
    the kernels in bf16 and are summed over the group in fp32; no worse than fla's given q and k repeated."""
    inp = make_inputs(fam, B=2, T=1000, H=4, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=13, device=DEVICE)
    _assert_grads_vs_fla(inp, torch.bfloat16, f"{fam} grouped bf16")


@pytest.mark.skipif(not ON_GPU, reason="GPU only")
@pytest.mark.parametrize("fam", ("gdn", "gla"))
def test_hopper_triton36_gdn_gla(fam):
    """fla refuses GDN and simple-GLA backward on Hopper with triton < 3.7.1 (a miscompile of tl.trans of a dot
    accumulator, fla #640). This pins that our kernels are right on exactly that combination, at full size, with
    grouped heads, varlen and strong gates."""
    import triton
    if torch.cuda.get_device_capability() != (9, 0) or not triton.__version__.startswith("3.6"):
        pytest.skip(f"pins Hopper + triton 3.6 (here sm_{torch.cuda.get_device_capability()}, "
                    f"triton {triton.__version__})")
    inp = make_inputs(fam, lengths=[1, 1000, 64, 935], H=4, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=12,
                      device=DEVICE, gate="strong")
    ours = _grads(inp, "triton", torch.bfloat16)
    ref = _grads(inp, "torch", torch.float64)
    errs = {n: rel_err(ours[n], r) for n, r in ref.items()}
    print(f"\n{fam} Hopper/triton 3.6 varlen grads rel err: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    assert all(e <= TOL[torch.bfloat16] for e in errs.values()), errs


SMALL_TILES = [(torch.bfloat16, 16, 32), (torch.bfloat16, 128, 16), (torch.float16, 16, 32), (torch.float16, 128, 32)]


@pytest.mark.skipif(not ON_GPU, reason="bf16 is wrong under the interpreter; the sm_90 builds of small tiles")
@pytest.mark.parametrize("dtype,K,V", SMALL_TILES, ids=[f"{str(d)[6:]}-K{k}-V{v}" for d, k, v in SMALL_TILES])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_16_bit_small_tiles(fam, dtype, K, V):
    """16-bit inputs at small tiles, varlen with a 1-token sequence, grouped heads: the sm_90 builds of small tiles are
    not the real-size ones (fp16 gradients came out inf at K = 16 with forms since changed; the saving forward's
    stage 1 at K = 128, V <= 32 raised an illegal memory access)."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=K, V=V, seed=8)
    _compare(inp, TOL[dtype], dtype=dtype)


@skip_unless_sm90_builds
@pytest.mark.parametrize("K,V", HEAD_DIM_GRID[1:4])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_head_dim_grid(fam, K, V):
    """bf16 fwd + bwd at head-dim pairs that neither the real-size nor the small-tile tests build (padded K and V,
    K = 128 with narrow values), varlen with a 1-token sequence and grouped heads."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=K, V=V, seed=29)
    _compare(inp, TOL[torch.bfloat16], dtype=torch.bfloat16)


@pytest.mark.skipif(not ON_GPU, reason="2^31-element tensors: GPU only")
def test_offsets_past_2_31():
    """Token rows × H·K and chunk slots × HV·K·V pass 2^31 (int32 offsets would wrap): a varlen batch of 2^20 + 1000
    tokens at 16 heads of 128, bf16. Its last sequence, past element 2^31 of every [T, H, K] tensor, gets the same
    output and gradients as the same sequence run alone."""
    free, _ = torch.cuda.mem_get_info()
    if free < 100e9:
        pytest.skip(f"needs ~100 GB of free GPU memory, {free / 1e9:.0f} GB free")
    H, K, n_long, n_last = 16, 128, 1 << 20, 1000
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    T = n_long + n_last
    mk = lambda *s: torch.randn(*s, generator=gen, device=DEVICE)  # noqa: E731
    q = mk(1, T, H, K).bfloat16()
    k = torch.nn.functional.normalize(mk(1, T, H, K), dim=-1).bfloat16()
    v = mk(1, T, H, K).bfloat16()
    g = -torch.nn.functional.softplus(mk(1, T, H)) * 0.1
    beta = torch.sigmoid(mk(1, T, H)).bfloat16()
    do = mk(1, n_last, H, K).bfloat16()
    cu = torch.tensor([0, n_long, T], device=DEVICE, dtype=torch.int32)

    def run(xs, cu_seqlens):
        xs = [x.detach().requires_grad_(True) for x in xs]
        o, _ = chunkwise.chunk_gated_delta_rule(*xs, cu_seqlens=cu_seqlens, backend="triton")
        (o[:, -n_last:].float() * do.float()).sum().backward()
        return [o[:, -n_last:].detach().clone()] + [x.grad[:, -n_last:].clone() for x in xs]

    alone_inputs = [x[:, -n_last:].clone() for x in (q, k, v, g, beta)]
    whole = run((q, k, v, g, beta), cu)
    del q, k, v, g, beta
    torch.cuda.empty_cache()
    alone = run(alone_inputs, None)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), whole, alone):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-3, f"{name}: {rel_err(a, b):.2e}"
