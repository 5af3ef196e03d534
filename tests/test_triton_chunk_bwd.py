"""Gradients of the Triton chunk ops (triton/chunk_bwd.py through the autograd.Function of
triton/chunk.py) against autograd of the PyTorch backend in float64.

Every input gets a gradient check: q, k, v, g (scalar and per channel), beta, initial_state, and
through the in-op preludes the raw gate projection, A_log, dt_bias and the pre-L2-norm q, k. The
loss reads the final state too (gradient flowing in through it). Under the interpreter (CPU): fp32,
small shapes. On the GPU: bf16 at T=1000, HV=8, K=V=128, errors no larger than fla's where fla runs.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given

import chunkwise

from helpers import (CHUNK_OPS, DEVICE, HEAD_DIM_GRID, ON_GPU, PROPERTY_SETTINGS, PROPERTY_SHAPES, TOL, make_inputs,
                     property_inputs, reference, rel_err, skip_unless_sm90_builds)

FAMS = ("gdn", "kda", "delta", "gla")
GATED = ("gdn", "kda", "gla")
NAMES = ("q", "k", "v", "g", "beta", "h0")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("CHUNKWISE_POISON", "1")


def _grads(inp, backend, dtype, transpose=False, final=True, seed=1, unread_final=False, outs=None, **op_kwargs):
    """Run the family's op on leaf copies of inp's tensors (cast to dtype, on the backend's device),
    loss = Σ o·dO + Σ h_T·dh_T (``final``; ``unread_final``: the final state asked for but not in the loss);
    return (dict name -> gradient in float64 on the CPU, extra leaves' grads). ``outs``: a dict that gets the op's
    outputs o and h_T (None where not asked for)."""
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
    ref = _grads(inp, "torch", torch.float64, **{k: v for k, v in kw.items()})
    errs = {}
    for n, r in ref.items():
        t = ours[n]
        assert t.dtype == (dtype if n in ("q", "k", "v", "beta") else t.dtype)
        errs[n] = rel_err(t, r) if n not in (scales or {}) else \
            ((t.detach().double().cpu() - r.detach().double().cpu()).norm() / scales[n](ref).norm()).item()
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= tol}
    assert not bad, f"gradient rel errors above {tol:.0e}: {bad} (all: { {n: f'{e:.1e}' for n, e in errs.items()} })"
    return errs


def _count_launches(monkeypatch, name, arg=None):
    """Replace chunk_bwd's Triton kernel ``name`` by a spy that records each launch's grid (or, given ``arg``, that
    keyword argument of the launch) and launches it; returns the list of records."""
    import chunkwise.triton.chunk_bwd as cb
    launches = []
    orig = getattr(cb, name)

    class Spy:
        def __getitem__(self, grid):
            if arg is None:
                launches.append(grid)
                return orig[grid]

            def launch(*args, **kwargs):
                launches.append(kwargs[arg])
                return orig[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(cb, name, Spy())
    return launches


def _routed(fam, dtype):
    """Whether fp16 KDA's backward runs in fp32 here (on the GPU: chunk_fwd.FP16_KDA_FP32), its forward saving nothing."""
    return ON_GPU and fam == "kda" and dtype == torch.float16


def _keeps_stage1(fam, dtype):
    """Whether the saving forward keeps stage 1 for these small-tile tests (the rule test_saved_stage1_rule states)."""
    return not (dtype == torch.float16 and fam in ("gdn", "delta")) and not _routed(fam, dtype)


KS = dict(K=32, V=32)


@pytest.mark.parametrize("G,K,dtype,xdt", [(2, 128, torch.bfloat16, torch.bfloat16), (2, 128, torch.bfloat16, torch.float32),
                                           (3, 100, torch.float16, torch.float16), (4, 16, torch.float32, torch.float32)])
def test_group_sum(G, K, dtype, xdt):
    """Grouped value heads' dq / dk: group_sum adds each key head's G value-head rows (in the input dtype, as the
    kernels store them, or fp32) in fp32 and stores the sum in the input dtype, as an fp32 sum rounded once (rows past a
    multiple of its row block, K not a power of two)."""
    from chunkwise.triton.chunk_bwd import group_sum
    gen = torch.Generator().manual_seed(7)
    B, T, H = 2, 37, 3
    x = torch.randn(B, T, H * G, K, generator=gen).to(DEVICE, xdt)
    y = group_sum(x, H, dtype)
    assert y.shape == (B, T, H, K) and y.dtype == dtype
    ref = x.double().view(B, T, H, G, K).sum(3)
    torch.testing.assert_close(y, ref.to(dtype))


@pytest.mark.parametrize("fam", FAMS)
def test_grads_grouped_heads(fam):
    """Two chunks (the second partial), HV > H, carried-in state, loss on the final state."""
    inp = make_inputs(fam, B=2 if fam in ("gla", "delta") else 1, T=100, H=1, HV=2, seed=0, **KS)
    _compare(inp, TOL[torch.float32])


@pytest.mark.parametrize("fam", FAMS)
def test_grads_grouped_heads_16bit_shares(fam, monkeypatch):
    """Grouped value heads with each value head's dq / dk in the 16-bit input dtype before group_sum adds them
    (CHUNKWISE_BWD_GROUP_16=1, bf16's default; here fp16, which the interpreter runs): every gradient against the
    float64 reference at fp16's bound, varlen with a length-1 sequence, a carried-in state."""
    monkeypatch.setenv("CHUNKWISE_BWD_GROUP_16", "1")
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=23)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)


@pytest.mark.parametrize("fam", FAMS)
def test_grads_varlen_transposed(fam):
    """Varlen batch with a length-1 sequence, states in the [N, HV, V, K] layout."""
    inp = make_inputs(fam, lengths=[1, 70, 33], H=1, HV=2, K=16, V=32, seed=1)
    _compare(inp, TOL[torch.float32], transpose=True)


@pytest.mark.parametrize("fam", FAMS)
def test_grads_no_state(fam):
    """No initial state (no dh0), no final state in the loss (dht None), T < C."""
    inp = make_inputs(fam, B=1, T=40, H=2, HV=2, h0=False, seed=2, **KS)
    _compare(inp, TOL[torch.float32], final=False)


@pytest.mark.parametrize("fam", FAMS)
def test_unread_outputs_reach_the_backward_as_none(fam, monkeypatch):
    """A final state the loss does not read (output_final_state=True, loss on o alone), and the saving forward's
    stage-1 outputs, come to the backward as None, not as zero tensors autograd would fill first (the chunk op sets
    materialize_grads off): chunk_bwd gets dht None, and the gradients equal the reference's without a final state."""
    import chunkwise.triton.chunk_bwd as cb
    real, seen = cb.chunk_bwd, []

    def spy(*a, **kw):
        seen.append(a[8])       # dht
        return real(*a, **kw)
    monkeypatch.setattr(cb, "chunk_bwd", spy)
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=19)
    ours = _grads(inp, "triton", torch.float32, final=False, unread_final=True)
    _compare(inp, TOL[torch.float32], ours=ours, final=False)
    assert len(seen) == 1 and seen[0] is None


@pytest.mark.parametrize("fam", GATED)
def test_grads_strong_gates(fam):
    """Very negative gates: chunks summing below -100 and a hard reset g = -1e4; all finite."""
    inp = make_inputs(fam, B=1, T=130, H=1, HV=1, K=16, V=16, gate="strong", seed=3)
    _compare(inp, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grads_kda_steep_blocks(dtype):
    """KDA with a few channels at g = -6 per token for 40 tokens (16-token blocks spanning -96, beyond what
    the factored diagonal blocks take: e^96 leaves fp32) among normal ones: those blocks take the exact
    column loops of the diagonal kernels, the others the factored products; gradients of every input."""
    inp = make_inputs("kda", B=1, T=100, H=1, HV=2, K=16, V=16, seed=4)
    inp.g[:, 10:50, :, 3:7] = -6.0
    _compare(inp, TOL[dtype], dtype=dtype)


@pytest.mark.parametrize("flag", ["1", "0"])
def test_kda_pair_flags(flag, monkeypatch):
    """KDA's pairwise gradients over two 32-channel blocks, the first with steep channels (g = -6 per token for 40
    tokens: one reference does not fit that block's chunks) and the second normal: with the one-reference launch's
    flags steering the two launches after it (CHUNKWISE_BWD_PAIR_FLAG=1) or those launches testing the gate again
    (0), every gradient equals the reference's, and the two ways agree."""
    monkeypatch.setenv("CHUNKWISE_BWD_PAIR_FLAG", flag)
    inp = make_inputs("kda", lengths=[100, 30], H=1, HV=2, K=64, V=16, seed=21)
    inp.g[:, 10:50, :, 3:7] = -6.0
    ours = _grads(inp, "triton", torch.float32)
    _compare(inp, TOL[torch.float32], ours=ours)
    monkeypatch.setenv("CHUNKWISE_BWD_PAIR_FLAG", "0" if flag == "1" else "1")
    other = _grads(inp, "triton", torch.float32)
    for n in ours:
        assert rel_err(other[n], ours[n]) <= 1e-6, n


@pytest.mark.parametrize("fam", ("gdn", "gla"))
def test_grads_fp16(fam):
    """16-bit inputs: the recomputed intermediates are stored in fp16, gradients returned in fp16."""
    inp = make_inputs(fam, B=1, T=100, H=1, HV=2, K=16, V=32, seed=5)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)


def test_wide_keys_clear_error():
    """K > 256 has no triton kernels (shared memory): a clear error naming K, before anything runs."""
    inp = make_inputs("gdn", B=1, T=20, H=1, K=264, V=16, seed=6)
    with pytest.raises(ValueError, match="K=264"):
        _grads(inp, "triton", torch.float32)


@pytest.mark.parametrize("K,dtype", [(256, torch.float32), (160, torch.float32), (256, torch.float16)])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_wide_keys(fam, K, dtype):
    """K = 256 (four 64-wide column blocks on the key side, one pipeline stage in the state passes, fp32 and
    16-bit operands) and K = 160 (a 256-wide tile, masked), two chunks, grouped heads, against the float64
    reference."""
    inp = make_inputs(fam, B=1, T=70, H=1, HV=2, K=K, V=16, seed=6)
    _compare(inp, TOL[dtype], dtype=dtype)


@pytest.mark.parametrize("fam", ("kda", "gdn"))
def test_grads_fp32_full_tiles(fam):
    """fp32 inputs at K = V = 128 (the real-size tiles: BK 128, BV 32; fp16 KDA's backward runs there on the GPU):
    every kernel fits one SM's shared memory (the H200 refused KDA's reverse state pass at two pipeline stages,
    238080 B) and every gradient matches the float64 reference's, two chunks, grouped heads."""
    inp = make_inputs(fam, B=1, T=70, H=1, HV=2, K=128, V=128, seed=8)
    _compare(inp, TOL[torch.float32], dtype=torch.float32)


@pytest.mark.parametrize("fam", FAMS)
def test_wide_16_bit_runs_in_fp32(fam):
    """16-bit inputs with K > 128 run the chunk forward and backward in fp32 (chunk_fwd.WIDE_16BIT_K): output,
    final state and every gradient equal, bit for bit, the fp32 run's on the same values, in the input dtype."""
    from chunkwise.triton.chunk_bwd import chunk_bwd
    from chunkwise.triton.chunk_fwd import chunk_fwd
    inp = make_inputs(fam, B=1, T=40, H=1, HV=2, K=160, V=16, seed=7)
    dev = lambda x, dt=None: None if x is None else x.to(DEVICE, dt or x.dtype)  # noqa: E731
    half = [dev(x, torch.float16) for x in (inp.q, inp.k, inp.v)]
    g, h0, beta = dev(inp.g), dev(inp.h0, torch.float32), dev(inp.beta, torch.float16)
    scale = 160 ** -0.5
    o16, h16 = chunk_fwd(*half, g, beta, scale, h0, True, None)
    o32, h32 = chunk_fwd(*(x.float() for x in half), g, None if beta is None else beta.float(), scale, h0, True, None)
    assert o16.dtype == torch.float16 and torch.equal(o16, o32.half()) and torch.equal(h16, h32)
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(o16.shape, generator=gen).half().to(DEVICE)
    dht = torch.randn(h16.shape, generator=gen).to(DEVICE)
    d16 = chunk_bwd(*half, g, beta, scale, h0, do, dht, None)
    d32 = chunk_bwd(*(x.float() for x in half), g, None if beta is None else beta.float(), scale, h0, do.float(), dht,
                    None)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), d16, d32):
        if a is None:
            continue
        assert a.dtype == (torch.float16 if name in ("dq", "dk", "dv", "dbeta") else b.dtype), name
        assert torch.equal(a, b.to(a.dtype)), name


@pytest.mark.parametrize("fam", ("gdn", "kda"))
def test_grads_in_op_preludes(fam):
    """In-op L2 norm of q, k, beta sigmoid, gate from A_log / dt_bias: gradients of the raw inputs."""
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
        # dA_log[h] = Σ_t,k dg ⊙ g with g = −e^{A_log} softplus(x), x = a + dt_bias, da = dg ⊙ (−e^{A_log}) σ(x): the
        # terms are da ⊙ softplus(x) / σ(x). Their sum cancels (here 92x for one head: 0.12 of terms totalling 11),
        # so its error is measured against the terms' magnitudes, Σ |terms| per head
        x = inp.g.detach().double().cpu() + params["dt_bias"].double().cpu().view(HV, -1).squeeze(-1)
        terms = ref["g"].detach().double().cpu() * torch.nn.functional.softplus(x) / torch.sigmoid(x)
        return terms.abs().sum(dim=tuple(d for d in range(terms.dim()) if d != 2))

    errs = _compare(inp, TOL[torch.float32], params=params, use_qk_l2norm_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                    scales={"A_log": a_log_terms} if fam in ("gdn", "kda") else None)
    assert {"A_log", "dt_bias"} <= set(errs)


@pytest.mark.parametrize("fam", FAMS)
def test_grads_fla_options(fam):
    """fla 0.6.0's spellings through the Triton op: β = 2·sigmoid(logits) (allow_neg_eigval: β up to 2, the
    eigenvalues of I − β k kᵀ down to −1) for the delta families, simple GLA's g_gamma [HV] (one decay per head):
    every gradient, g_gamma's included, equals the reference's."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=16, seed=23)
    gen = torch.Generator().manual_seed(23)
    if fam == "gla":
        inp.g = None
        _compare(inp, TOL[torch.float32], params={"g_gamma": -torch.rand(2, generator=gen) * 0.5})
    else:
        inp.beta = (torch.randn(inp.beta.shape, generator=gen) * 2).to(inp.beta)      # logits
        _compare(inp, TOL[torch.float32], use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)


def _gate_terms(inp):
    """The scale dg's error is measured against: dg is a reverse cumsum over tokens of terms like q ⊙ dq − k ⊙ dk,
    which cancel to exactly 0 in float64 where the gate multiplies nothing (a lone token with no initial state, a
    gate of −1e4) and leave fp32 rounding of their own size there. The scale is ‖dg‖ + ‖|q ⊙ dq| + |k ⊙ dk|‖
    (summed over K for a scalar gate; a key head's on each of its value heads): each token's terms once, not
    their reverse cumsum, whose norm grows with T as dg's does not (100-500x ‖dg‖ at T = 70-150)."""
    def terms(ref):
        q, k = inp.q.detach().double().cpu(), inp.k.detach().double().cpu()
        t = (q * ref["q"]).abs() + (k * ref["k"]).abs()                         # [B, T, H, K]
        t = t.repeat_interleave(inp.g.shape[2] // q.shape[2], dim=2)             # [B, T, HV, K]
        t = t if inp.g.dim() == 4 else t.sum(-1)
        return (ref["g"].norm() + t.norm()).reshape(1)
    return terms


@PROPERTY_SETTINGS
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
# GPU only: bf16 at real size, against fp64 autograd of the torch backend, next to fla
# --------------------------------------------------------------------------------------------

def _fla_grads(inp, do, dht):
    """fla's gradients on the same 16-bit inputs; None where fla is missing or refuses."""
    try:
        import fla.ops.delta_rule as fd
        import fla.ops.gated_delta_rule as fg
        import fla.ops.kda as fk
        import fla.ops.simple_gla as fs
    except ImportError:
        return None
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


def _assert_grads_vs_fla(inp, dtype, label, digits=2):
    """Our gradients of every input of ``inp`` (in ``dtype``) against the float64 reference: within the dtype's bound,
    and no worse than fla's on the same inputs where fla runs its backward. Prints both (``label``, ``digits``)."""
    ours = _grads(inp, "triton", dtype)
    ref, do, dht = _grads_device64(inp)
    fla = _fla_grads(inp, do, dht)
    rows = [(n, rel_err(ours[n], r), None if fla is None else rel_err(fla[n], r)) for n, r in ref.items()]
    print(f"\n{label} grads rel err (ours / fla): " +
          ", ".join(f"{n} {e:.{digits}e}/{'-' if f is None else f'{f:.{digits}e}'}" for n, e, f in rows))
    for n, e, e_fla in rows:
        assert e <= TOL[dtype], f"{n}: {e:.2e}"
        if e_fla is not None:
            assert e <= e_fla * 1.05 + 1e-4, f"{n}: ours {e:.2e} > fla {e_fla:.2e}"


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fam", FAMS)
def test_real_size_grads_vs_fla(fam, dtype):
    """Gradients of every input at real size in 16 bits against the float64 reference, no worse than fla's
    on the same inputs (where fla runs its backward)."""
    inp = make_inputs(fam, B=2, T=1000, H=8, HV=8, K=128, V=128, dtype=dtype, seed=11, device=DEVICE)
    _assert_grads_vs_fla(inp, dtype, f"{fam} {dtype}")


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("fam", FAMS)
def test_real_size_grouped_grads_vs_fla(fam):
    """Grouped value heads at real size in bf16 (H = 4, HV = 8: Qwen3-Next's layout): each value head's dq / dk leave
    the kernels in bf16 and are summed over the group in fp32 (group_sum); every gradient against the float64
    reference, no worse than fla's given q and k repeated over the group."""
    inp = make_inputs(fam, B=2, T=1000, H=4, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=13, device=DEVICE)
    _assert_grads_vs_fla(inp, torch.bfloat16, f"{fam} grouped bf16")


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("fam,pair16,inplace", [("delta", 0, 0), ("delta", 1, 0), ("delta", 2, 0), ("gdn", 0, 0),
                                                ("gla", 0, 0), ("delta", 3, 1), ("gdn", 3, 1), ("gla", 3, 1)])
def test_real_size_pair16(fam, pair16, inplace, monkeypatch):
    """The state-tile pass's other pairwise forms (CHUNKWISE_BWD_DQK_PAIR16, the split one accumulated in place:
    CHUNKWISE_BWD_SPLIT_INPLACE; the default's are test_real_size_grads_vs_fla's) at real size in bf16, where level 4
    takes them: every gradient against the float64 reference within the bf16 bound, and no worse than fla's where fla
    runs its backward (DeltaNet)."""
    monkeypatch.setenv("CHUNKWISE_BWD_DQK_PAIR16", str(pair16))
    monkeypatch.setenv("CHUNKWISE_BWD_SPLIT_INPLACE", str(inplace))
    inp = make_inputs(fam, B=2, T=1000, H=8, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=11, device=DEVICE)
    _assert_grads_vs_fla(inp, torch.bfloat16, f"{fam} PAIR16 {pair16} INPLACE {inplace} bf16", digits=3)


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("fam", ("delta", "gdn"))
def test_real_size_wy_pair16(fam, monkeypatch):
    """The WY pass's split pairwise products (CHUNKWISE_BWD_WY_PAIR16=1) at real size in bf16, where level 4 takes
    them: every gradient against the float64 reference within the bf16 bound, and no worse than fla's where fla runs
    its backward (DeltaNet)."""
    monkeypatch.setenv("CHUNKWISE_BWD_WY_PAIR16", "1")
    inp = make_inputs(fam, B=2, T=1000, H=8, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=11, device=DEVICE)
    _assert_grads_vs_fla(inp, torch.bfloat16, f"{fam} WY_PAIR16 1 bf16", digits=3)


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU (bf16 is wrong under the interpreter)")
@pytest.mark.parametrize("fam,sides,env", [
    ("delta", 2, ""), ("delta", 3, ""), ("delta", 3, "CHUNKWISE_BWD_WARPS=bwd_dqk_sides:4"),
    ("delta", 3, "CHUNKWISE_BWD_WARPS=bwd_dqk_sides:4,CHUNKWISE_MAXNREG=bwd_dqk_sides:168"),
    ("gdn", 2, ""), ("gdn", 3, ""), ("gdn", 3, "CHUNKWISE_MAXNREG=bwd_dqk_sides:128"), ("gla", 2, ""),
    ("gla", 2, "CHUNKWISE_MAXNREG=bwd_dqk_sides:128")])
def test_real_size_sides(fam, sides, env, monkeypatch):
    """The state-tile pass by side (CHUNKWISE_BWD_DQK_SIDES) at real size in bf16, at the warps / register caps
    sweep_bwd's "sides" set times: every gradient against the float64 reference within the bf16 bound, and no worse
    than fla's where fla runs its backward (DeltaNet)."""
    monkeypatch.setenv("CHUNKWISE_BWD_DQK_SIDES", str(sides))
    for item in filter(None, env.split(",")):
        monkeypatch.setenv(*item.split("=", 1))
    inp = make_inputs(fam, B=2, T=1000, H=8, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=11, device=DEVICE)
    _assert_grads_vs_fla(inp, torch.bfloat16, f"{fam} SIDES {sides} {env} bf16", digits=3)


@pytest.mark.skipif(not ON_GPU, reason="GPU only")
@pytest.mark.parametrize("fam", ("gdn", "gla"))
def test_hopper_triton36_gdn_gla(fam):
    """fla refuses GDN and simple-GLA backward on Hopper with triton < 3.7.1 (a miscompile of
    tl.trans of a dot accumulator, fla #640). This pins that our kernels are right on exactly
    that combination (the H200 with triton 3.6.0), at full size, with grouped heads and varlen."""
    import triton
    if torch.cuda.get_device_capability() != (9, 0) or not triton.__version__.startswith("3.6"):
        pytest.skip(f"pins Hopper + triton 3.6 (here sm_{torch.cuda.get_device_capability()}, triton {triton.__version__})")
    inp = make_inputs(fam, lengths=[1, 1000, 64, 935], H=4, HV=8, K=128, V=128, dtype=torch.bfloat16, seed=12,
                      device=DEVICE, gate="strong")
    ours = _grads(inp, "triton", torch.bfloat16)
    ref = _grads(inp, "torch", torch.float64)
    errs = {n: rel_err(ours[n], r) for n, r in ref.items()}
    print(f"\n{fam} Hopper/triton 3.6 varlen grads rel err: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    assert all(e <= TOL[torch.bfloat16] for e in errs.values()), errs


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_unaligned_head_dims(fam, transpose):
    """K = 18, V = 10 in fp32 (72- and 40-byte rows) run zero-padded to 20 / 12 (triton/align.py): the
    gradients of the real channels, including the initial state's, equal the reference's."""
    inp = make_inputs(fam, B=1, T=70, H=1, HV=2, K=18, V=10, seed=4)
    _compare(inp, TOL[torch.float32], transpose=transpose)


@pytest.mark.parametrize("fam", FAMS)
def test_grads_key_side_in_column_blocks(fam, monkeypatch):
    """The key-side kernel's column-block variant (CHUNKWISE_BWD_KSPLIT = block width; here 16 of K = 40,
    three blocks, the last partial): every gradient equals the reference's, varlen and grouped heads."""
    monkeypatch.setenv("CHUNKWISE_BWD_KSPLIT", "16")
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=40, V=24, seed=6)
    _compare(inp, TOL[torch.float32])


@pytest.mark.skipif(not ON_GPU, reason="2^31-element tensors: GPU only")
def test_offsets_past_2_31():
    """Token rows × H·K and chunk ids × HV·K·V pass 2^31 (int32 offsets would wrap): a varlen batch of
    2^20 + 1000 tokens at 16 heads of 128, bf16. Its last sequence, which lies past element 2^31 of every
    [T, H, K] tensor, gets the same output and gradients as the same sequence run alone."""
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


@pytest.mark.parametrize("fused,dtype", [(0, torch.float32), (1, torch.float32), (0, torch.float16)])
@pytest.mark.parametrize("fam", ("gdn", "delta"))
def test_grads_recompute_paths(fam, fused, dtype, monkeypatch):
    """The backward's recompute of T, W, U and dR_local: in one pass with the forward's stage-1 kernel
    (CHUNKWISE_BWD_FUSED_PREP=1, the default for scalar / no gates with fp32 or bf16 inputs; bf16 is checked at
    real size on the GPU) or with the intra / solve / wu kernels (fp16 always takes these): gradients of every
    input, varlen with a length-1 sequence and grouped heads. (The forward under autograd saves stage 1 by
    default; CHUNKWISE_SAVE_STAGE1=0 makes the backward recompute it.)"""
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", "0")
    monkeypatch.setenv("CHUNKWISE_BWD_FUSED_PREP", str(fused))
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=9)
    _compare(inp, TOL[dtype], dtype=dtype)


@pytest.mark.parametrize("level,save", [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (0, 0), (2, 0)])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_16_bit_products(fam, level, save, monkeypatch):
    """Each level of 16-bit product operands (CHUNKWISE_BWD_LOWP=0: fp32 operands; 1: 16-bit in the two
    serial state passes; 2, the default: also the W / U / dR_local recompute; 3: also the key side; 4: the key
    side but its pairwise products), with the forward's stage 1 saved (the default) or recomputed
    (CHUNKWISE_SAVE_STAGE1=0): fp16 gradients of every input within the fp16 tolerance, varlen and grouped
    heads. (On the GPU levels 3 and 4 fall back to 2 here: test_16_bit_levels_on_the_gpu.)"""
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", str(save))
    monkeypatch.setenv("CHUNKWISE_BWD_LOWP", str(level))
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=8)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)


@pytest.mark.parametrize("fam,pair16,inplace", [("delta", 0, 0), ("delta", 1, 0), ("delta", 2, 0), ("delta", 3, 0),
                                                ("gdn", 3, 0), ("gla", 3, 0), ("delta", 3, 1), ("gdn", 3, 1)])
def test_state_tile_pair16(fam, pair16, inplace, monkeypatch):
    """Level 4 with the state-tile pass's pairwise products in 16 bits (CHUNKWISE_BWD_DQK_PAIR16: 0 neither, 1 dk's,
    2 dq's too, 3 both with dP / dPᵀ split into two 16-bit parts; the scalar gate takes 0 or 3), the split parts
    accumulated into dq / dk in place or not (CHUNKWISE_BWD_SPLIT_INPLACE): fp16 gradients of every input within the
    fp16 tolerance, varlen and grouped heads. Under the interpreter level 4 runs as asked; on the GPU it is refused at
    K = 16 (the default level runs; test_real_size_pair16 covers the forms there)."""
    monkeypatch.setenv("CHUNKWISE_BWD_LOWP", "4")
    monkeypatch.setenv("CHUNKWISE_BWD_DQK_PAIR16", str(pair16))
    monkeypatch.setenv("CHUNKWISE_BWD_SPLIT_INPLACE", str(inplace))
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=8)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)


@pytest.mark.parametrize("fam", ("delta", "gdn"))
def test_wy_pair16(fam, monkeypatch):
    """Level 4 with the WY pass's pairwise products dA K, dAᵀ (βK) from 16-bit K and dA, dAᵀ β split into two 16-bit
    parts (CHUNKWISE_BWD_WY_PAIR16=1), beside the state-tile pass's default form: fp16 gradients of every input within
    the fp16 tolerance, varlen and grouped heads. Under the interpreter level 4 runs as asked; on the GPU it is
    refused at K = 16 (test_real_size_wy_pair16 covers the form there)."""
    monkeypatch.setenv("CHUNKWISE_BWD_LOWP", "4")
    monkeypatch.setenv("CHUNKWISE_BWD_WY_PAIR16", "1")
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=8)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)


def _compare_sides(fam, level):
    """The by-side tests' batch (varlen with a 1-token sequence, grouped heads): every input's gradient within the
    tolerance of float64, fp32 at level 0 and fp16 otherwise. Returns the batch's chunk count."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=8)
    dtype = torch.float16 if level else torch.float32
    with warnings.catch_warnings():     # (the scalar gate warns for pair16 1 / 2 and takes 3)
        warnings.simplefilter("ignore", RuntimeWarning)
        _compare(inp, TOL[dtype], dtype=dtype)
    return 1 + 2 + 1


@pytest.mark.parametrize("fam,ns,level,pair16,dgam", [
    ("delta", 2, 0, None, 0), ("delta", 3, 0, None, 0), ("delta", 2, 4, 3, 0), ("delta", 3, 4, 3, 0),
    ("delta", 2, 4, 0, 0), ("delta", 2, 4, 1, 0), ("delta", 2, 4, 2, 0), ("gdn", 2, 0, None, 0), ("gdn", 3, 4, 3, 0),
    ("gdn", 2, 4, 3, 1), ("gla", 3, 4, 3, 0)])
def test_state_tile_sides(fam, ns, level, pair16, dgam, monkeypatch):
    """The state-tile pass by side (CHUNKWISE_BWD_DQK_SIDES=2: one program per chunk forms dP, dq and dW over all key
    columns, the other dPᵀ and dk1) instead of by key column blocks: launched, two programs a chunk, and every input's
    gradient within the tolerance of float64 (fp32 at level 0; fp16 at level 4 with each pairwise form), varlen with
    a 1-token sequence, grouped heads; with a gate also with ⟨S, dS'⟩ from the reverse pass (DGAM). With the delta rule
    3 puts dW in a third program (without it, no dW: two)."""
    monkeypatch.setenv("CHUNKWISE_BWD_DQK_SIDES", str(ns))
    monkeypatch.setenv("CHUNKWISE_BWD_DGAM_DH", str(dgam))
    monkeypatch.setenv("CHUNKWISE_BWD_LOWP", str(level))
    if pair16 is not None:
        monkeypatch.setenv("CHUNKWISE_BWD_DQK_PAIR16", str(pair16))
    sides = _count_launches(monkeypatch, "_bwd_dqk_sides_kernel")
    cols = _count_launches(monkeypatch, "_bwd_dqk_kernel")
    n_chunks = _compare_sides(fam, level)
    assert sides == [((ns if fam != "gla" else 2) * n_chunks, 2)] and not cols


def test_dqk_pair16_choice(monkeypatch):
    """Which state-tile pairwise form each gate kind takes: DeltaNet 3 by default and any of 0-3 when asked; the
    scalar gate 3 by default, 0 when asked, 1 / 2 refused with a warning and its default taken (its dg); KDA its
    default whatever is asked (its pairwise products are the pair kernel's); a malformed value names the variable."""
    import chunkwise.triton.chunk_bwd as cb
    monkeypatch.delenv("CHUNKWISE_BWD_DQK_PAIR16", raising=False)
    assert (cb.dqk_pair16(0), cb.dqk_pair16(1), cb.dqk_pair16(2)) == (3, 3, 0)
    for v in range(4):
        monkeypatch.setenv("CHUNKWISE_BWD_DQK_PAIR16", str(v))
        assert cb.dqk_pair16(0) == v and cb.dqk_pair16(2) == 0
        if v in (1, 2):
            with pytest.warns(RuntimeWarning, match="CHUNKWISE_BWD_DQK_PAIR16"):
                assert cb.dqk_pair16(1) == 3
        else:
            assert cb.dqk_pair16(1) == v
    monkeypatch.setenv("CHUNKWISE_BWD_DQK_PAIR16", "yes")
    for gate in (0, 1):
        with pytest.raises(ValueError, match="CHUNKWISE_BWD_DQK_PAIR16"):
            cb.dqk_pair16(gate)


def test_16_bit_levels_on_the_gpu(monkeypatch):
    """Off the interpreter, CHUNKWISE_BWD_LOWP takes only the levels that gave right gradients on the H200, or that
    are opt-in there: level 3 only for bf16 at a 128-wide key tile without a gate (BWD_LOWP3_OPT_IN), level 4 for
    bf16 at a 128-wide key tile; otherwise the default, with a warning. A malformed value names the variable."""
    import chunkwise.triton.chunk_bwd as cb
    monkeypatch.setattr(cb, "_INTERPRET", False)
    bf16, fp16 = torch.bfloat16, torch.float16
    monkeypatch.delenv("CHUNKWISE_BWD_LOWP", raising=False)
    assert (cb.bwd_lowp_level(bf16, 128), cb.bwd_lowp_level(bf16, 64), cb.bwd_lowp_level(fp16, 128)) == (4, 2, 2)
    assert cb.bwd_lowp_level(torch.float32, 128) == 0
    for level, dtype, BK, want in ((0, fp16, 16, 0), (1, bf16, 128, 1), (2, bf16, 128, 2), (4, bf16, 128, 4)):
        monkeypatch.setenv("CHUNKWISE_BWD_LOWP", str(level))
        assert cb.bwd_lowp_level(dtype, BK) == want
    for level, dtype, BK, want in ((3, bf16, 128, 4), (3, fp16, 16, 2), (4, fp16, 16, 2), (4, bf16, 64, 2)):
        monkeypatch.setenv("CHUNKWISE_BWD_LOWP", str(level))
        with pytest.warns(RuntimeWarning, match="CHUNKWISE_BWD_LOWP"):
            assert cb.bwd_lowp_level(dtype, BK) == want
    monkeypatch.setenv("CHUNKWISE_BWD_LOWP", "3")
    assert cb.bwd_lowp_level(bf16, 128, 0) == 3                  # opt-in without a gate
    with warnings.catch_warnings():     # and the forward's choice of T's dtype does not warn of it either
        warnings.simplefilter("error")
        assert cb.saved_t_dtype(bf16, 128, 0) == bf16
    for dtype, BK, gate, want in ((bf16, 128, 1, 4), (bf16, 128, 2, 4), (bf16, 64, 0, 2), (fp16, 128, 0, 2)):
        with pytest.warns(RuntimeWarning, match="CHUNKWISE_BWD_LOWP"):
            assert cb.bwd_lowp_level(dtype, BK, gate) == want
    monkeypatch.setenv("CHUNKWISE_BWD_LOWP", "high")
    with pytest.raises(ValueError, match="CHUNKWISE_BWD_LOWP"):
        cb.bwd_lowp_level(bf16, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fam", FAMS)
def test_saved_stage1_rule(fam, dtype):
    """Which inputs the forward keeps stage 1 for: the delta families, except GDN / DeltaNet with fp16 inputs
    (their saved stage 1 gave inf gradients on the H200 at small tiles; their backward recomputes it) and KDA with
    fp16 inputs on the GPU (its backward runs in fp32 there: chunk_fwd.FP16_KDA_FP32)."""
    from chunkwise.triton.chunk_fwd import saves_stage1
    inp = make_inputs(fam, B=1, T=8, H=1, HV=1, K=16, V=16, seed=0)
    q, v = inp.q.to(dtype), inp.v.to(dtype)
    want = fam != "gla" and not (dtype == torch.float16 and fam in ("gdn", "delta")) and \
        not (dtype == torch.float16 and fam == "kda" and q.is_cuda)
    assert saves_stage1(q, v, inp.g, inp.beta) == want


BF16_SMALL = {"k16": ([1, 70, 30], 16, 32), "k16-nolen1": ([70, 30], 16, 32), "k64": ([1, 70, 30], 64, 32),
              "k128-v16": ([1, 70, 30], 128, 16), "k128-v32": ([70, 30], 128, 32)}


@pytest.mark.skipif(not ON_GPU, reason="bf16 is wrong under the interpreter")
@pytest.mark.parametrize("shape", list(BF16_SMALL))
@pytest.mark.parametrize("save", [1, 0])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_bf16_small_tiles(fam, save, shape, monkeypatch):
    """bf16 at small tiles (K = 16 or 64 with V = 32; K = 128 with V = 16 or 32), varlen (with or without a length-1
    sequence) and grouped heads, stage 1 saved by the forward (the default) or recomputed: the sm_90 builds of small
    tiles are not the real-size ones (fp16 GDN / DeltaNet gave inf gradients there with the saved stage 1, session 8;
    the saving forward's stage 1 at K = 128, V <= 32 raised an illegal memory access, session 28)."""
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", str(save))
    lengths, K, V = BF16_SMALL[shape]
    inp = make_inputs(fam, lengths=lengths, H=1, HV=2, K=K, V=V, seed=8)
    _compare(inp, TOL[torch.bfloat16], dtype=torch.bfloat16)


@pytest.mark.parametrize("K", [16, 32, 64, 128])
@pytest.mark.parametrize("save", [1, 0])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_fp16_small_tiles(fam, save, K, monkeypatch):
    """fp16 at key tiles under 128 (K = 16 / 32 / 64, V = 32) and at K = 128 with V = 32, varlen with a length-1
    sequence, grouped heads, stage 1 saved by the forward (where the family saves it in fp16) or recomputed: every
    gradient within the fp16 tolerance of the float64 reference's. On the H200 the sm_90 builds of small tiles are
    not the real-size ones (KDA's fp16 gradients came out inf at K = 16, sessions 20 and 23)."""
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", str(save))
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=K, V=32, seed=21)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)


@skip_unless_sm90_builds
@pytest.mark.parametrize("K,V", HEAD_DIM_GRID)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_head_dim_grid(fam, dtype, K, V):
    """fwd + bwd at each head-dim pair of HEAD_DIM_GRID, 16-bit inputs, varlen with a length-1 sequence and grouped
    heads (stage 1 saved where the family saves it): every gradient within the dtype's tolerance of the float64
    reference's."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=K, V=V, seed=29)
    _compare(inp, TOL[dtype], dtype=dtype)


def test_bwd_full_rule(monkeypatch):
    """CHUNKWISE_BWD_FULL names the chunk-parallel launches that take a constant chunk length (their row masks folded):
    only where every chunk is whole (no varlen, T a multiple of 64); by default (BWD_FULL) the serial state passes for
    scalar and per-channel gates and the state-tile pass for per-channel ones, none without a gate; an unknown kernel
    name is an error that names the variable."""
    from chunkwise.triton.chunk_bwd import bwd_full
    monkeypatch.delenv("CHUNKWISE_BWD_FULL", raising=False)
    kernels = ("bwd_wy", "bwd_dqk", "fwd_h", "bwd_dh")
    assert [k for k in kernels if bwd_full(k, 0, 128, False)] == []
    assert [k for k in kernels if bwd_full(k, 1, 128, False)] == ["fwd_h", "bwd_dh"]
    assert [k for k in kernels if bwd_full(k, 2, 128, False)] == ["bwd_dqk", "fwd_h", "bwd_dh"]
    assert not any(bwd_full(k, g, T, varlen) for k in kernels for g in range(3) for T, varlen in ((100, False), (128, True)))
    monkeypatch.setenv("CHUNKWISE_BWD_FULL", "bwd_wy")
    assert bwd_full("bwd_wy", 1, 128, False) and not bwd_full("bwd_dqk", 1, 128, False)
    monkeypatch.setenv("CHUNKWISE_BWD_FULL", "fwd_h+bwd_dh")
    assert bwd_full("fwd_h", 1, 128, False) and bwd_full("bwd_dh", 1, 128, False)
    assert not bwd_full("bwd_wy", 1, 128, False)
    monkeypatch.setenv("CHUNKWISE_BWD_FULL", "bwd_wy")
    assert not bwd_full("bwd_wy", 1, 130, False) and not bwd_full("bwd_wy", 1, 128, True)
    monkeypatch.setenv("CHUNKWISE_BWD_FULL", "0")
    assert not bwd_full("bwd_wy", 1, 128, False)
    monkeypatch.setenv("CHUNKWISE_BWD_FULL", "bwd_wy+wu")
    with pytest.raises(ValueError, match="CHUNKWISE_BWD_FULL"):
        bwd_full("bwd_wy", 1, 128, False)


@pytest.mark.parametrize("T", [128, 100])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_full_chunks_same(fam, T, monkeypatch):
    """The WY pass, the state-tile pass and the two serial state passes with the chunk length a constant
    (CHUNKWISE_BWD_FULL) give the masked build's gradients bit for bit where every chunk is whole (T = 128), and take
    the masked build where not (T = 100); both within the reference's tolerance."""
    inp = make_inputs(fam, B=2, T=T, H=1, HV=2, seed=33, **KS)
    got = []
    for full in ("0", "bwd_wy,bwd_dqk,fwd_h,bwd_dh"):
        monkeypatch.setenv("CHUNKWISE_BWD_FULL", full)
        got.append(_grads(inp, "triton", torch.float32))
    for n in got[0]:
        assert torch.equal(got[0][n], got[1][n]), n
    _compare(inp, TOL[torch.float32], ours=got[1])


def test_fp16_kda_route(monkeypatch):
    """The rule that sends fp16 KDA to the fp32 backward on the GPU (FP16_KDA_FP32): fp16, per-channel gate, a CUDA
    tensor outside the interpreter, the switch on; nothing else (bf16, scalar gates, no gate, CPU tensors)."""
    import chunkwise.triton.chunk_fwd as cf

    class Cuda:     # a stand-in with the attributes the rule reads
        def __init__(self, dtype, K, cuda=True):
            self.dtype, self.shape, self.is_cuda = dtype, (1, 8, 1, K), cuda
    g4, g3 = torch.zeros(1, 8, 1, 16), torch.zeros(1, 8, 1)
    monkeypatch.delenv("CHUNKWISE_WARM_SM90", raising=False)
    monkeypatch.setattr(cf, "_INTERPRET", False)
    for K in (16, 64, 100, 128):
        assert cf.fp16_kda_in_fp32(Cuda(torch.float16, K), g4)
    for q, g in ((Cuda(torch.bfloat16, 16), g4), (Cuda(torch.float16, 16), g3), (Cuda(torch.float16, 16), None),
                 (Cuda(torch.float16, 16, False), g4)):
        assert not cf.fp16_kda_in_fp32(q, g)
    monkeypatch.setenv("CHUNKWISE_BWD_FP16_KDA_FP32", "0")
    assert not cf.fp16_kda_in_fp32(Cuda(torch.float16, 16), g4)
    monkeypatch.setattr(cf, "_INTERPRET", True)
    monkeypatch.delenv("CHUNKWISE_BWD_FP16_KDA_FP32")
    assert not cf.fp16_kda_in_fp32(Cuda(torch.float16, 16), g4)


@pytest.mark.parametrize("prec", ["tf32", "other"])
@pytest.mark.parametrize("fam", FAMS)
def test_grads_fp16_product_precisions(fam, prec, monkeypatch):
    """The backward's products of fp32 operands for 16-bit inputs at the other precisions
    CHUNKWISE_BWD_PREC16 offers (the fp16 default, tf32x3 for KDA and tf32rn otherwise, is every other fp16
    test; "other" is the one of the two that is not the family's default): fp16 gradients of every input
    within the fp16 tolerance, varlen and grouped heads; an unknown value is an error naming the variable."""
    if prec == "other":
        prec = "tf32rn" if fam == "kda" else "tf32x3"
    monkeypatch.setenv("CHUNKWISE_BWD_PREC16", prec)
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=8)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)
    monkeypatch.setenv("CHUNKWISE_BWD_PREC16", "fp8")
    with pytest.raises(ValueError, match="CHUNKWISE_BWD_PREC16"):
        _grads(inp, "triton", torch.float16)


@pytest.mark.parametrize("split,diag,one_ref", [(0, 1, 0), (16, 1, 0), (16, 0, 0), (16, 0, 1), (0, 0, 1), (16, 0, 2),
                                                (0, 0, 2), (16, 0, "1-kloop")])
def test_grads_kda_pair_split(split, diag, one_ref, monkeypatch):
    """KDA's pairwise gradients (through P and A) in their own kernel split over key channels
    (CHUNKWISE_BWD_PAIR_SPLIT = channels per program; 16 of K = 40: three blocks, the last partial), with the
    diagonal blocks in the same programs or (CHUNKWISE_BWD_PAIR_DIAG=0) in a second launch, or in one
    program over all channels (0), and with one reference per chunk (CHUNKWISE_BWD_ONE_REF=1: a launch of its
    own, one program per block or, CHUNKWISE_BWD_PAIR_KLOOP=1, per chunk over the blocks; 2: in the key side, whose column blocks (CHUNKWISE_BWD_KSPLIT, here the split) the pair kernel then
    takes; the steep channels' blocks take the block form): every gradient equals the reference's, varlen with
    a length-1 sequence, grouped heads, and a few steep channels whose diagonal blocks take the exact loops."""
    monkeypatch.setenv("CHUNKWISE_BWD_PAIR_SPLIT", str(split))
    monkeypatch.setenv("CHUNKWISE_BWD_KSPLIT", str(split))
    monkeypatch.setenv("CHUNKWISE_BWD_PAIR_DIAG", str(diag))
    monkeypatch.setenv("CHUNKWISE_BWD_ONE_REF", str(one_ref)[0])
    monkeypatch.setenv("CHUNKWISE_BWD_PAIR_KLOOP", str(int(str(one_ref).endswith("kloop"))))
    inp = make_inputs("kda", lengths=[1, 70, 30], H=1, HV=2, K=40, V=24, seed=10)
    inp.g[:, 20:60, :, 33:36] = -6.0
    _compare(inp, TOL[torch.float32])


@pytest.mark.parametrize("one_ref", ["0", "1", "2"])
def test_grads_kda_16_bit_finished_in_pair_kernel(one_ref, monkeypatch):
    """KDA with fp16 inputs and as many value heads as key heads: the launch that finishes dq / dk (the
    one-reference programs, the block form's diagonal pass) stores them in fp16 itself (CHUNKWISE_BWD_ONE_REF 0 /
    1; at 2 the key side finishes some and the cast stays). Steep channels in one chunk take the block form next
    to one-reference programs; every gradient equals the reference's, in the inputs' dtype."""
    monkeypatch.setenv("CHUNKWISE_BWD_ONE_REF", one_ref)
    monkeypatch.setenv("CHUNKWISE_BWD_PAIR_SPLIT", "16")
    inp = make_inputs("kda", lengths=[70, 30], H=2, HV=2, K=32, V=16, seed=15)
    inp.g[:, 5:45, :, 20:23] = -6.0
    _compare(inp, TOL[torch.float16], dtype=torch.float16)


def test_kda_pair_one_reference_taken(monkeypatch):
    """The one-reference pairwise gradients run where the chunk gate allows them: with normal gates the
    gradients differ (in rounding only) between the block form and CHUNKWISE_BWD_ONE_REF=1 (the pair kernel)
    or 2 (the key side); a value outside 0 / 1 / 2 is refused."""
    inp = make_inputs("kda", B=1, T=130, H=1, HV=1, K=32, V=16, seed=12)
    grads = []
    for one_ref in ("0", "1", "2"):
        monkeypatch.setenv("CHUNKWISE_BWD_ONE_REF", one_ref)
        grads.append(_grads(inp, "triton", torch.float32))
    for other in grads[1:]:
        assert not torch.equal(grads[0]["g"], other["g"])
        for n in grads[0]:
            torch.testing.assert_close(other[n], grads[0][n], rtol=1e-3, atol=1e-4)
    monkeypatch.setenv("CHUNKWISE_BWD_ONE_REF", "3")
    with pytest.raises(ValueError, match="CHUNKWISE_BWD_ONE_REF"):
        _grads(inp, "triton", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fam", ("gdn", "kda", "delta"))
def test_grads_saved_stage1(fam, dtype, monkeypatch):
    """The default (CHUNKWISE_SAVE_STAGE1 unset or 1): the forward keeps stage 1 (w, u, p and T = (I + A)⁻¹) and
    the backward uses it instead of recomputing T, W, U: every gradient equals the reference's (varlen with a
    length-1 sequence, grouped heads, the final state read by the loss), and equals the recomputing backward's
    (CHUNKWISE_SAVE_STAGE1=0); the saving path was taken (chunk_bwd got ``saved``)."""
    import chunkwise.triton.chunk_bwd as cb
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=12)
    seen = []
    orig = cb.chunk_bwd

    def spy(*a, **kw):
        seen.append(kw.get("saved") is not None)
        return orig(*a, **kw)

    monkeypatch.setattr(cb, "chunk_bwd", spy)
    monkeypatch.delenv("CHUNKWISE_SAVE_STAGE1", raising=False)          # the default saves
    saved = _compare(inp, TOL[dtype], dtype=dtype)
    # on the GPU fp16 KDA's backward calls itself again in fp32 and its forward saves nothing (FP16_KDA_FP32)
    routed, keeps = _routed(fam, dtype), _keeps_stage1(fam, dtype)

    def calls(with_saved):
        return [with_saved] + ([False] if routed else [])
    assert seen == calls(keeps)
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", "0")
    again = _grads(inp, "triton", dtype)
    ours = _grads(inp, "triton", dtype)
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", "1")
    with_saved = _grads(inp, "triton", dtype)
    assert seen == calls(keeps) + calls(False) + calls(False) + calls(keeps)
    # the two paths round differently where fp16's backward takes tf32rn products (the saved stage 1 is the
    # forward's, in tf32x3; the interpreter runs tf32 / tf32x3 in fp32 but applies tf32rn's rounding)
    bound = TOL[dtype] / (2 if dtype == torch.float16 else 4)
    for n in ours:
        assert rel_err(with_saved[n], ours[n]) <= bound, n
    assert set(saved) == set(again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if ON_GPU else torch.float16])
def test_kda_gate_cumsum_from_forward(dtype, monkeypatch):
    """KDA's training forward keeps stage 1's chunk-local cumulative gate G (CHUNKWISE_SAVE_GATE_CUMSUM=1, the
    default): it equals the backward's own _gate_cumsum_kernel's G to fp32 rounding (varlen with a length-1
    sequence, gates steep enough to reach the −40 clamp), the backward then does not launch that kernel, and every
    gradient equals the reference's and, to rounding, the backward that forms G itself (=0). 16 bits: bf16 on the
    GPU, fp16 in the interpreter (bf16 is wrong there; fp16 KDA's backward runs in fp32 on the GPU)."""
    import chunkwise.triton.chunk_bwd as cb
    from chunkwise.triton.chunk_fwd import chunk_fwd
    inp = make_inputs("kda", lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=29)
    x = make_inputs("kda", lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, dtype=dtype, seed=29)
    g = x.g.clone()
    g[0, 40:44] = -60.0         # below the per-token clamp
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", "1")
    saved = {}
    chunk_fwd(x.q, x.k, x.v, g, x.beta, 0.25, x.h0, True, x.cu_seqlens, saved_out=saved)
    if _routed("kda", dtype):
        assert saved == {}
        return
    G = torch.empty_like(g)
    chunk_indices = chunkwise.prepare_chunk_indices(x.cu_seqlens.cpu()).to(g.device)
    cb._gate_cumsum_kernel[(chunk_indices.shape[0], 2)](g, G, x.cu_seqlens, chunk_indices, g.shape[1],
                                                        floor=cb.GATE_FLOOR, HV=2, K=16, BK=16, C=64, PER_CHANNEL=True,
                                                        IS_VARLEN=True)
    assert saved["G"].dtype == torch.float32
    torch.testing.assert_close(saved["G"], G, rtol=1e-6, atol=1e-5)
    launches = _count_launches(monkeypatch, "_gate_cumsum_kernel")
    kept = _grads(inp, "triton", dtype)
    _compare(inp, TOL[dtype], dtype=dtype, ours=kept)
    assert launches == []
    monkeypatch.setenv("CHUNKWISE_SAVE_GATE_CUMSUM", "0")
    formed = _grads(inp, "triton", dtype)
    assert len(launches) == 1
    for n in formed:
        assert rel_err(kept[n], formed[n]) <= TOL[dtype] / 4, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fam", ("gdn", "kda", "delta"))
def test_grads_saved_t_form(fam, dtype, monkeypatch):
    """The training forward under T_FORM (CHUNKWISE_SAVE_T_FORM=1, KDA's default): stage 1 keeps P and T alone (the
    op's w, u come back empty), stage 2 forms R from T diag(β), and the backward forms W and U from T beside dR_local
    (_wu_kernel with the delta rule): the forward's output and final state equal the inference forward's, every
    gradient equals the reference's (varlen with a length-1 sequence, grouped heads, a carried-in state, the final
    state read by the loss) and the W / U-keeping forward's (=0). fp16 inputs keep W and U even so (on the H200 their
    gradients through the T form came out inf at these small tiles)."""
    from chunkwise.triton.chunk_fwd import chunk_fwd, saves_final_state, saves_r
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=19)
    if dtype == torch.float16 and fam in ("gdn", "delta"):
        pytest.skip("GDN / DeltaNet with fp16 inputs save no stage 1 (test_saved_stage1_rule)")
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", "1")
    monkeypatch.setenv("CHUNKWISE_SAVE_T_FORM", "1")
    x = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, dtype=dtype, seed=19)     # inp in dtype, on the device
    args = (x.q, x.k, x.v, x.g, x.beta, 0.25, x.h0, True, x.cu_seqlens)
    saved = {}
    o, ht = chunk_fwd(*args, saved_out=saved)
    scaled = {"qg", "kg", "G"} if fam == "kda" else set()   # (KDA: q ⊙ e^G, k ⊙ e^{G_last − G}, G from stage 1)
    scaled |= {"r"} if saves_r() else set()                 # (R = U − W S from stage 2: chunk_fwd.SAVE_R)
    scaled |= {"ht"} if saves_final_state(x.g, x.beta) else set()     # (DeltaNet's final state: chunk_fwd.SAVE_HT)
    if _routed(fam, dtype):
        # fp16 KDA's backward runs in fp32 on the GPU (chunk_fwd.fp16_kda_in_fp32): its forward saves nothing
        assert set(saved) == set()
        return
    if dtype == torch.float16:      # fp16 keeps W and U (chunk_fwd.save_t_form: inf gradients on the H200); U only
        # where R is not kept (R = U − W S is all the backward reads U for)
        assert set(saved) == {"w", "p", "t"} | scaled | ({"u"} if "r" not in scaled else set())
        return
    assert set(saved) == {"p", "t"} | scaled and saved["t"].dtype == torch.float32
    o_inf, ht_inf = chunk_fwd(*args)
    assert torch.equal(o, o_inf) and torch.equal(ht, ht_inf)
    wu = _count_launches(monkeypatch, "_wu_kernel")
    with_t = _grads(inp, "triton", dtype)
    _compare(inp, TOL[dtype], dtype=dtype, ours=with_t)
    assert len(wu) == 1
    monkeypatch.setenv("CHUNKWISE_SAVE_T_FORM", "0")
    with_wu = _grads(inp, "triton", dtype)
    for n in with_wu:
        assert rel_err(with_t[n], with_wu[n]) <= TOL[dtype] / 4, n


@pytest.mark.parametrize("fam", ("gdn", "kda", "delta", "gla"))
def test_grads_repeatable(fam, monkeypatch):
    """The same inputs give the same gradients bit for bit: twice at the defaults, and once with every launch one after
    the other (CHUNKWISE_FWD_OVERLAP=0, CHUNKWISE_BWD_OVERLAP=0; the forward state pass at 4 warps in both). On the GPU
    at B1-T4096-H32 bf16, where the forward's stage 2 runs beside stage 1 and the backward's forward state pass beside
    the W / U launch (128 serial programs). In session 24's sweeps (H200, B1-T32768-H32) GDN's gradients differed by
    up to 7.6e-3 (relative) between settings that should not change them: the state-tile pass's S / dS' tiles were
    overwritten under running products (triton #6691; fixed in session 25, tests/test_triton_pipeline.py)."""
    kw = dict(B=1, T=4096, H=32, K=128, V=128, dtype=torch.bfloat16) if ON_GPU else dict(B=1, T=130, H=1, HV=2, K=16,
                                                                                         V=32)
    inp = make_inputs(fam, seed=31, **kw)
    dtype = inp.q.dtype if ON_GPU else torch.float32
    monkeypatch.setenv("CHUNKWISE_BWD_WARPS", "fwd_h:4")
    first = _grads(inp, "triton", dtype)
    again = _grads(inp, "triton", dtype)
    monkeypatch.setenv("CHUNKWISE_FWD_OVERLAP", "0")
    monkeypatch.setenv("CHUNKWISE_BWD_OVERLAP", "0")
    serial = _grads(inp, "triton", dtype)
    for n in first:
        assert torch.equal(first[n], again[n]), f"{n}: not repeatable, rel diff {rel_err(again[n], first[n]):.1e}"
        assert torch.equal(first[n], serial[n]), f"{n}: beside != serial, rel diff {rel_err(serial[n], first[n]):.1e}"


def test_saved_t_dtype_rule(monkeypatch):
    """The training forward stores T = (I + A)⁻¹ in the 16-bit input dtype only where the backward's WY pass rounds
    it to that dtype before every product (bf16 at a 128-wide key tile: level 4) and the gate kind takes it
    (SAVE_T_16: DeltaNet by default; GDN with CHUNKWISE_SAVE_T_16=1), else fp32: fp32 inputs, per-channel gates (KDA
    forms W / U from T in fp16-scaled operands) even when asked, other key tiles (level 2: fp32 operands), the old key
    side (CHUNKWISE_BWD_DQK=0), and CHUNKWISE_SAVE_T_16=0."""
    from chunkwise.triton.chunk_bwd import saved_t_dtype
    for var in ("CHUNKWISE_SAVE_T_16", "CHUNKWISE_BWD_DQK", "CHUNKWISE_BWD_LOWP"):
        monkeypatch.delenv(var, raising=False)
    bf, f32 = torch.bfloat16, torch.float32
    assert saved_t_dtype(bf, 128, 0) == bf and saved_t_dtype(bf, 100, 0) == bf and saved_t_dtype(bf, 128, 1) == f32
    assert saved_t_dtype(bf, 128, 2) == f32 and saved_t_dtype(f32, 128, 0) == f32 and saved_t_dtype(bf, 64, 0) == f32
    monkeypatch.setenv("CHUNKWISE_SAVE_T_16", "1")
    assert saved_t_dtype(bf, 128, 1) == bf and saved_t_dtype(bf, 128, 2) == f32
    monkeypatch.setenv("CHUNKWISE_BWD_DQK", "0")
    assert saved_t_dtype(bf, 128, 0) == f32
    monkeypatch.delenv("CHUNKWISE_BWD_DQK")
    monkeypatch.setenv("CHUNKWISE_SAVE_T_16", "0")
    assert saved_t_dtype(bf, 128, 0) == f32


@pytest.mark.skipif(not ON_GPU, reason="bf16 at K = 128 (the 16-bit T's only case) needs the GPU: bf16 is wrong under "
                                       "the interpreter")
@pytest.mark.parametrize("fam", ("gdn", "delta"))
def test_saved_t_16bit_same_gradients(fam, monkeypatch):
    """T saved in bf16 (CHUNKWISE_SAVE_T_16=1: DeltaNet's default) gives the same gradients bit for bit as T saved in
    fp32: the backward rounds it to bf16 before each product either way (B1-T4096-H32, K = V = 128, bf16)."""
    from chunkwise.triton.chunk_fwd import chunk_fwd
    monkeypatch.setenv("CHUNKWISE_SAVE_T_16", "1")
    inp = make_inputs(fam, B=1, T=4096, H=32, K=128, V=128, dtype=torch.bfloat16, seed=37, device=DEVICE)
    saved = {}
    chunk_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, 0.125, None, False, None, saved_out=saved)
    assert saved["t"].dtype == torch.bfloat16
    ours = _grads(inp, "triton", torch.bfloat16)
    monkeypatch.setenv("CHUNKWISE_SAVE_T_16", "0")
    saved = {}
    chunk_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, 0.125, None, False, None, saved_out=saved)
    assert saved["t"].dtype == torch.float32
    ref = _grads(inp, "triton", torch.bfloat16)
    for n in ours:
        assert torch.equal(ours[n], ref[n]), f"{n}: rel diff {rel_err(ours[n], ref[n]):.1e}"


@pytest.mark.parametrize("save_r", ["0", "1"])
@pytest.mark.parametrize("t_form", ["1", "0"])
@pytest.mark.parametrize("fam", ("gdn", "kda", "delta"))
def test_state_pass_beside_wu(fam, t_form, save_r, monkeypatch):
    """The backward's forward state pass beside its W / U launch (CHUNKWISE_BWD_OVERLAP=1, chunk_bwd's ``beside``):
    under the T form without R saved (CHUNKWISE_SAVE_R=0) the W / U launch runs chunk-major and publishes each chunk,
    and each step of the state pass waits for the W / U it reads; with W / U saved, or R (the pass then reads no W / U),
    the two run side by side unsynchronised. Every gradient equals the reference's (varlen with a length-1 sequence,
    grouped heads, a carried-in state, the final state read by the loss) and is bit-identical to the
    one-after-the-other backward's (=0); the chunk-major grid was launched where flagged."""
    inp = make_inputs(fam, lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=23)
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", "1")
    monkeypatch.setenv("CHUNKWISE_SAVE_T_FORM", t_form)
    monkeypatch.setenv("CHUNKWISE_SAVE_R", save_r)
    monkeypatch.setenv("CHUNKWISE_SAVE_HT", "0")        # (with it DeltaNet launches no forward state pass)
    monkeypatch.setenv("CHUNKWISE_BWD_OVERLAP", "1")
    wu = _count_launches(monkeypatch, "_wu_kernel")
    beside = _grads(inp, "triton", torch.float32)
    n_chunks, rows = 1 + 2 + 1, 1 * 2      # chunks of the three sequences, B·HV
    assert wu == [(rows, n_chunks) if t_form == "1" and save_r == "0" else (n_chunks, rows)]
    _compare(inp, TOL[torch.float32], ours=beside)
    monkeypatch.setenv("CHUNKWISE_BWD_OVERLAP", "0")
    after = _grads(inp, "triton", torch.float32)
    assert wu[1:] == [(n_chunks, rows)]
    for n in after:
        assert torch.equal(beside[n], after[n]), n


@pytest.mark.parametrize("kept", ["0", "1"])
@pytest.mark.parametrize("kd_in", ["1", "0"])
@pytest.mark.parametrize("save", ["1", "0"])
def test_kda_state_passes_from_scaled_keys(save, kd_in, kept, monkeypatch):
    """KDA's backward with the serial state passes taking q ⊙ e^G and k ⊙ e^{G_last − G} from the chunk-parallel
    _gate_scaled_kernel (CHUNKWISE_BWD_KD_IN=1, the default; fp16: the passes' 16-bit operands) or forming them
    per chunk (0): every gradient equals the reference's (varlen with a length-1 sequence, grouped heads, the
    final state read by the loss), with stage 1 saved and recomputed. With stage 1 saved and
    CHUNKWISE_SAVE_GATE_SCALED=1 the forward hands its own q ⊙ e^G and k ⊙ e^{G_last − G} over (saved qg, kg) and
    _gate_scaled_kernel does not run."""
    monkeypatch.setenv("CHUNKWISE_SAVE_GATE_SCALED", kept)
    monkeypatch.setenv("CHUNKWISE_BWD_KD_IN", kd_in)
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", save)
    launches = _count_launches(monkeypatch, "_gate_scaled_kernel")
    inp = make_inputs("kda", lengths=[1, 70, 30], H=1, HV=2, K=16, V=32, seed=14)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)
    # (on the GPU fp16 KDA's backward runs in fp32, chunk_bwd.FP16_KDA_FP32, which takes no scaled keys)
    fp16_path = not _routed("kda", torch.float16)
    assert len(launches) == (1 if fp16_path and kd_in == "1" and (save == "0" or kept == "0") else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fam", ("gdn", "kda", "delta"))
def test_grads_saved_states(fam, dtype, monkeypatch):
    """CHUNKWISE_SAVE_STATES=1: the saving forward's stage 2 also keeps each chunk's entering state and R, and the
    backward skips its forward state pass: every gradient equals the reference's and the recomputing backward's,
    over a varlen batch with a 1-token, a mid-chunk and a 2-chunk sequence, grouped heads and a carried-in state
    (h by slots: chunk_slots), and the pass ran only without saved states."""
    inp = make_inputs(fam, lengths=[1, 70, 128, 30], H=1, HV=2, K=16, V=32, seed=18)
    monkeypatch.setenv("CHUNKWISE_SAVE_HT", "0")        # (DeltaNet's states from its final state: their own test)
    launches = _count_launches(monkeypatch, "_fwd_h_kernel")
    keeps = _keeps_stage1(fam, dtype)
    monkeypatch.setenv("CHUNKWISE_SAVE_STATES", "1")
    with_states = _grads(inp, "triton", dtype)
    _compare(inp, TOL[dtype], dtype=dtype, ours=with_states)
    assert len(launches) == (0 if keeps else 1)
    monkeypatch.setenv("CHUNKWISE_SAVE_STATES", "0")
    without = _grads(inp, "triton", dtype)
    assert len(launches) == (1 if keeps else 2)
    for n in without:
        assert rel_err(with_states[n], without[n]) <= TOL[dtype] / 4, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fam", ("gdn", "kda", "delta"))
def test_grads_saved_r(fam, dtype, monkeypatch):
    """CHUNKWISE_SAVE_R=1 (the default): the saving forward's stage 2 keeps R = U − W S, and the backward's forward state
    pass forms the per-chunk states from it as the no-delta pass does from V (no W / U read; its launch takes
    DELTA=False): every gradient equals the reference's and the recomputing backward's, over a varlen batch with a
    1-token, a mid-chunk and a 2-chunk sequence, grouped heads and a carried-in state."""
    inp = make_inputs(fam, lengths=[1, 70, 128, 30], H=1, HV=2, K=16, V=32, seed=19)
    monkeypatch.setenv("CHUNKWISE_SAVE_HT", "0")        # (DeltaNet's states from its final state: their own test)
    deltas = _count_launches(monkeypatch, "_fwd_h_kernel", arg="DELTA")
    keeps = _keeps_stage1(fam, dtype)
    monkeypatch.setenv("CHUNKWISE_SAVE_R", "1")
    with_r = _grads(inp, "triton", dtype)
    _compare(inp, TOL[dtype], dtype=dtype, ours=with_r)
    assert deltas == [not keeps]
    monkeypatch.setenv("CHUNKWISE_SAVE_R", "0")
    without = _grads(inp, "triton", dtype)
    assert deltas == [not keeps, True]
    for n in without:
        assert rel_err(with_r[n], without[n]) <= TOL[dtype] / 4, n


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if ON_GPU else []))
@pytest.mark.parametrize("final,transpose", [(True, False), (False, False), (True, True)])
def test_grads_saved_final_state(final, transpose, dtype, monkeypatch):
    """CHUNKWISE_SAVE_HT=1 (the default; DeltaNet with R kept): the saving forward also keeps its final state (fp32,
    the state layout; also when the caller does not ask for it), and the reverse state pass forms each chunk's
    entering state backwards from it, S_c = S_{c+1} − K_cᵀ R_c, with no forward state pass launched: every gradient
    equals the reference's and, to rounding, the backward with that pass (=0), over a varlen batch with a 1-token, a
    mid-chunk and a 2-chunk sequence, grouped heads and a carried-in state; the final state read by the loss or not
    asked for, in either state layout."""
    inp = make_inputs("delta", lengths=[1, 70, 128, 30], H=1, HV=2, K=16, V=32, seed=23)
    fwd_h = _count_launches(monkeypatch, "_fwd_h_kernel")
    rev = _count_launches(monkeypatch, "_bwd_dh_kernel", arg="REV_H")
    monkeypatch.setenv("CHUNKWISE_SAVE_HT", "1")
    kept = _grads(inp, "triton", dtype, final=final, transpose=transpose)
    _compare(inp, TOL[dtype], dtype=dtype, ours=kept, final=final, transpose=transpose)
    assert fwd_h == [] and rev == [True]
    monkeypatch.setenv("CHUNKWISE_SAVE_HT", "0")
    formed = _grads(inp, "triton", dtype, final=final, transpose=transpose)
    assert len(fwd_h) == 1 and rev == [True, False]
    for n in formed:
        assert rel_err(kept[n], formed[n]) <= TOL[dtype] / 4, n


@pytest.mark.parametrize("ahead", ["0", "1", "2"])
@pytest.mark.parametrize("fam", ["delta", "gdn", "kda"])
def test_reverse_pass_load_forms(fam, ahead, monkeypatch):
    """The reverse state pass with dR_local (and KDA's G_last) loaded in the step (CHUNKWISE_BWD_DH_AHEAD=0), a step
    ahead (1) or in the step with K dS' unfused (2): every gradient equals the reference's, over a varlen batch whose
    sequences end mid-chunk, take one chunk, and one token (the step ahead past the first chunk loads nothing);
    fp16, the 16-bit state passes (and KDA's scaled keys) that the GPU takes."""
    monkeypatch.setenv("CHUNKWISE_BWD_DH_AHEAD", ahead)
    inp = make_inputs(fam, lengths=[1, 130, 64, 30], H=1, HV=2, K=16, V=32, seed=15)
    _compare(inp, TOL[torch.float16], dtype=torch.float16)


def test_reverse_pass_load_form_checked(monkeypatch):
    """CHUNKWISE_BWD_DH_AHEAD outside 0 / 1 / 2 is refused with its name."""
    monkeypatch.setenv("CHUNKWISE_BWD_DH_AHEAD", "3")
    inp = make_inputs("delta", B=1, T=20, H=1, HV=1, K=16, V=16, seed=16)
    with pytest.raises(ValueError, match="CHUNKWISE_BWD_DH_AHEAD"):
        _grads(inp, "triton", torch.float32)


def test_grads_saved_stage1_padded_dims(monkeypatch):
    """Head dims the kernels pad (fp32 K = 18, V = 10): the forward saves nothing and the backward
    recomputes stage 1; gradients equal the reference's."""
    import chunkwise.triton.chunk_bwd as cb
    inp = make_inputs("gdn", lengths=[40, 25], H=1, HV=2, K=18, V=10, seed=13)
    seen = []
    orig = cb.chunk_bwd
    monkeypatch.setattr(cb, "chunk_bwd", lambda *a, **kw: seen.append(kw.get("saved") is not None) or orig(*a, **kw))
    monkeypatch.setenv("CHUNKWISE_SAVE_STAGE1", "1")
    _compare(inp, TOL[torch.float32])
    assert seen == [False]          # the op returned empty stage-1 tensors


def test_bwd_lowp_default_level(monkeypatch):
    """The backward's 16-bit product level: 4 (the key side in 16 bits but its pairwise products) for bf16 at
    a 128-wide key tile, the one measured on the H200; 2 for fp16 and other tiles; fp32 none; the
    environment variable overrides 16-bit inputs only."""
    from chunkwise.triton.chunk_bwd import bwd_lowp_level
    monkeypatch.delenv("CHUNKWISE_BWD_LOWP", raising=False)
    assert bwd_lowp_level(torch.bfloat16, 128) == 4
    assert [bwd_lowp_level(torch.bfloat16, bk) for bk in (16, 32, 64, 256)] == [2, 2, 2, 2]
    assert bwd_lowp_level(torch.float16, 128) == 2 and bwd_lowp_level(torch.float32, 128) == 0
    monkeypatch.setenv("CHUNKWISE_BWD_LOWP", "1")
    assert bwd_lowp_level(torch.bfloat16, 128) == 1 and bwd_lowp_level(torch.float32, 128) == 0


_FORMS = ["dqk", "dqk_bk16", "old", "early_dk32_wy16", "dgam_dh", "wy_plain", "wy_da_other"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fam, form", [(f, m) for f in ("delta", "gdn", "gla", "kda") for m in _FORMS
                                       if not (f == "kda" and m.startswith("wy_"))])
def test_value_key_side_forms(fam, form, dtype, monkeypatch):
    """The value and key sides as the state tiles' pass by key column blocks and the WY pass (CHUNKWISE_BWD_DQK=1,
    the default; per-channel gates then the pair kernel) or as the value-side and key-side kernels (0), in each
    variant: at 16-wide blocks (the dg shares of two blocks summed); q, k and the gate loaded before the V loop, dk1
    kept in fp32 and the WY pass's key loops at 16 columns; the gate's ⟨S, dS'⟩ from the reverse pass
    (CHUNKWISE_BWD_DGAM_DH=1); the WY pass with T loaded twice and dk1 loaded where it is used
    (CHUNKWISE_BWD_WY_T_TRANS=0 / _DK1_AHEAD=0); its dAᵀ through the scratch or through products, whichever is not
    the family's default (CHUNKWISE_BWD_WY_DA_SCR). Every gradient equals the reference's, on a varlen batch whose
    sequences end mid-chunk, take one chunk and one token, with grouped heads; and the two forms agree with each
    other. The default and ⟨S, dS'⟩ forms run at V = 64 (two value blocks of the reverse pass)."""
    from chunkwise.triton.chunk_bwd import BWD_WY_DA_SCR
    monkeypatch.setenv("CHUNKWISE_BWD_DQK", "0" if form == "old" else "1")
    if form == "dqk_bk16":
        monkeypatch.setenv("CHUNKWISE_BWD_DQK_BK", "16")
    if form == "early_dk32_wy16":
        monkeypatch.setenv("CHUNKWISE_BWD_DQK_EARLY", "1")
        monkeypatch.setenv("CHUNKWISE_BWD_DK1_16", "0")
        monkeypatch.setenv("CHUNKWISE_BWD_WY_BK", "16")
    if form == "dgam_dh":
        monkeypatch.setenv("CHUNKWISE_BWD_DGAM_DH", "1")
    if form == "wy_plain":
        monkeypatch.setenv("CHUNKWISE_BWD_WY_T_TRANS", "0")
        monkeypatch.setenv("CHUNKWISE_BWD_WY_DK1_AHEAD", "0")
    if form == "wy_da_other":
        monkeypatch.setenv("CHUNKWISE_BWD_WY_DA_SCR", str(1 - BWD_WY_DA_SCR[1 if fam == "gdn" else 0]))
    inp = make_inputs(fam, lengths=[1, 130, 64, 30], H=1, HV=2, K=32, V=64 if form in ("dqk", "dgam_dh") else 32,
                      seed=17)
    ours = _grads(inp, "triton", dtype)
    _compare(inp, TOL[dtype], dtype=dtype, ours=ours)
    monkeypatch.setenv("CHUNKWISE_BWD_DQK", "1" if form == "old" else "0")
    other = _grads(inp, "triton", dtype)
    for n in ours:
        assert rel_err(ours[n], other[n]) <= TOL[dtype] / 4, n


def test_value_key_side_form_checked(monkeypatch):
    """CHUNKWISE_BWD_DQK outside 0 / 1 is refused with its name."""
    monkeypatch.setenv("CHUNKWISE_BWD_DQK", "2")
    inp = make_inputs("delta", B=1, T=20, H=1, HV=1, K=16, V=16, seed=16)
    with pytest.raises(ValueError, match="CHUNKWISE_BWD_DQK"):
        _grads(inp, "triton", torch.float32)


@pytest.mark.parametrize("p_in_dh", ["1", "0"])
@pytest.mark.parametrize("fam", ["delta", "gdn"])
def test_reverse_pass_forms_dr_local(fam, p_in_dh, monkeypatch):
    """With the forward's stage 1 saved, the reverse state pass forms dR_local = scale Pᵀ dO from the saved P
    (CHUNKWISE_BWD_P_IN_DH=1) or reads it from a chunk-parallel launch (0, the default): every gradient equals the
    reference's and the other form's, over a varlen batch (1-token, mid-chunk, 2-chunk sequences, grouped heads);
    the launch runs only in form 0."""
    inp = make_inputs(fam, lengths=[1, 70, 128, 30], H=1, HV=2, K=16, V=32, seed=19)
    launches = _count_launches(monkeypatch, "_wu_kernel")
    monkeypatch.setenv("CHUNKWISE_BWD_P_IN_DH", p_in_dh)
    ours = _grads(inp, "triton", torch.float32)
    _compare(inp, TOL[torch.float32], ours=ours)
    assert len(launches) == (0 if p_in_dh == "1" else 1)
    monkeypatch.setenv("CHUNKWISE_BWD_P_IN_DH", "0" if p_in_dh == "1" else "1")
    other = _grads(inp, "triton", torch.float32)
    for n in ours:
        assert rel_err(ours[n], other[n]) <= TOL[torch.float32] / 4, n


@pytest.mark.parametrize("mag", [1e-39, 1e-6, 1.0, 1e6])
def test_wu_fp16_scaled_tiles(mag):
    """_wu_kernel at LOWP 2 (KDA's default where the training forward kept T alone: W = T diag(β e^G) K,
    U = T diag(β) V and dR_local = scale Pᵀ dO from fp16 operands, each tile scaled by a power of two): within
    fp16's rounding of the float64 products whatever the magnitude of v and dO (1e-6: unscaled fp16 would flush
    them to subnormals; 1e6: it would overflow to inf; 1e-39: fp32 subnormals, whose log2 the GPU flushes to
    −inf), over two chunks, the second partial."""
    from chunkwise.triton.chunk_bwd import _wu_kernel
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
    dev = DEVICE
    f32 = lambda x: x.to(dev, torch.float32).contiguous()                            # noqa: E731
    outs = [torch.full((B, T, HV, n), float("nan"), device=dev) for n in (K, V, V)]
    _wu_kernel[(2, B * HV)](f32(k), f32(v), f32(beta), f32(G), f32(Tm), f32(Pm), f32(do), *outs, None, None, T, 0.25,
                            H=1, HV=HV, K=K, V=V, BK=K, BV=V, C=C, GATE=2, DELTA=True, IS_VARLEN=False,
                            PREC="ieee", LOWP=2)
    for name, ours, ref in zip(("W", "U", "dR_local"), outs, (W, U, dR)):
        e = rel_err(ours, ref)
        assert e <= 1e-3, f"{name}: {e:.2e} at magnitude {mag}"
