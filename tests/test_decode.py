"""The Triton recurrent (decode) kernel against the float64 token recurrence.

Under the interpreter (CPU): fp32 and fp16, small shapes, K/V not powers of two. On the GPU the same
tests run, plus bf16 at real sizes. Covers T = 1 (decode), small T (speculative decoding), longer T,
varlen with length-1 and empty sequences, grouped value heads, both state layouts, the vLLM-style
state pool with -1 padding slots (fp32 and bf16 pool), and the autograd fallback.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given

from chunkwise.reference.recurrent import recurrent_forward
from chunkwise.triton.decode import recurrent, recurrent_fwd
from helpers import (DEVICE, FAMILIES, INTERPRET, ON_GPU, PROPERTY_SETTINGS, PROPERTY_SHAPES, RECURRENT_OPS, TOL,
                     make_inputs, per_family, property_inputs, reference, rel_err)

FAMS = list(FAMILIES)


def _run(inp, **kw):
    return RECURRENT_OPS[inp.fam](*inp.args(), initial_state=inp.h0, output_final_state=True,
                                  cu_seqlens=inp.cu_seqlens, backend="triton", **kw)


def _nan_outputs(inp, transpose=False):
    """NaN-filled output buffers for `recurrent_fwd` (an unwritten element fails)."""
    B, T, HV, V = inp.v.shape
    K = inp.q.shape[-1]
    N = B if inp.cu_seqlens is None else inp.cu_seqlens.numel() - 1
    o = torch.full((B, T, HV, V), float("nan"), dtype=inp.q.dtype, device=inp.q.device)
    ht = torch.full((N, HV, V, K) if transpose else (N, HV, K, V), float("nan"), device=inp.q.device)
    return o, ht


def _canonical(inp):
    """The positional (q, k, v, g, beta) of `recurrent_fwd`."""
    return inp.q, inp.k, inp.v, inp.g, inp.beta


@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("T", [1, 3, 50])
def test_fp32_against_float64(fam, T):
    """T = 1 decode, T = 3 speculative decoding, T = 50 with a hard reset; HV > H; K, V not powers of 2."""
    inp = make_inputs(fam, B=2 if T < 50 else 1, T=T, H=1, HV=2, K=40, V=36, gate="strong" if T == 50 else "normal",
                      seed=T)
    o, ht = _run(inp)
    ro, rht = reference(inp)
    assert o.dtype == inp.q.dtype and ht.dtype == torch.float32 and ht.shape == rht.shape
    assert rel_err(o, ro) < TOL[torch.float32]
    assert rel_err(ht, rht) < TOL[torch.float32]


@pytest.mark.parametrize("fam", FAMS)
@per_family(PROPERTY_SETTINGS.max_examples * 2 // 3)   # (the slowest loop)
@given(**PROPERTY_SHAPES)
def test_property_random_shapes(fam, H, group, K, V, batch, lengths, gate, h0, final, transpose, seed):
    """The decode kernel over random shapes and options (helpers.PROPERTY_SHAPES: 1-200 tokens, varlen batches with
    empty and 1-token sequences, grouped value heads, head dims no power of two, zero / normal / very negative gates,
    states in and out, either layout): the output and the final state equal the float64 recurrence's."""
    inp = property_inputs(fam, H, group, K, V, batch, lengths, gate, h0, seed)
    h0_in = None if inp.h0 is None else (inp.h0.transpose(-1, -2).contiguous() if transpose else inp.h0)
    with torch.no_grad():
        o, ht = RECURRENT_OPS[fam](*inp.args(), initial_state=h0_in, output_final_state=final,
                                   cu_seqlens=inp.cu_seqlens, transpose_state_layout=transpose, backend="triton")
    ro, rht = reference(inp)
    assert rel_err(o, ro) <= TOL[torch.float32], f"o: {rel_err(o, ro):.2e}"
    if final:
        ht = ht.transpose(-1, -2) if transpose else ht
        assert rel_err(ht, rht) <= TOL[torch.float32], f"final state: {rel_err(ht, rht):.2e}"
    else:
        assert ht is None


@pytest.mark.parametrize("fam", FAMS)
def test_fp16_inputs(fam):
    inp = make_inputs(fam, B=2, T=3, H=2, HV=4, K=24, V=20, dtype=torch.float16, seed=1)
    o, ht = _run(inp)
    ro, rht = reference(inp)
    assert o.dtype == torch.float16
    assert rel_err(o, ro) < TOL[torch.float16]
    assert rel_err(ht, rht) < TOL[torch.float16]


@pytest.mark.parametrize("fam", FAMS)
def test_nan_poisoned_outputs_and_split_v(fam):
    """Every element of o and the final state is written; V split into blocks of 8 (last one partial)."""
    inp = make_inputs(fam, B=2, T=2, H=1, HV=2, K=20, V=36, seed=2)
    o, ht = _nan_outputs(inp)
    o2, ht2 = recurrent_fwd(*_canonical(inp), 20 ** -0.5, inp.h0, True, None, o=o, final_state=ht, BV=8)
    assert o2 is o and ht2 is ht
    ro, rht = reference(inp)
    assert rel_err(o, ro) < TOL[torch.float32]
    assert rel_err(ht, rht) < TOL[torch.float32]


@pytest.mark.parametrize("fam", FAMS)
def test_varlen_with_length_one_and_empty(fam):
    inp = make_inputs(fam, H=1, HV=2, K=24, V=40, lengths=[3, 1, 0, 6], seed=3)
    o, ht = _run(inp)
    ro, rht = reference(inp)
    assert rel_err(o, ro) < TOL[torch.float32]
    assert rel_err(ht, rht) < TOL[torch.float32]
    # the empty sequence passes its initial state through
    assert torch.equal(ht[2].cpu(), inp.h0[2].float().cpu())


@pytest.mark.parametrize("fam", FAMS)
def test_transposed_state_layout(fam):
    inp = make_inputs(fam, B=2, T=3, H=1, HV=2, K=24, V=40, seed=4)
    h0_vk = inp.h0.transpose(-1, -2).contiguous()                      # [N, HV, V, K]
    o, ht = RECURRENT_OPS[fam](*inp.args(), initial_state=h0_vk, output_final_state=True,
                               transpose_state_layout=True, backend="triton")
    ro, rht = reference(inp)
    assert ht.shape == (2, 2, 40, 24)
    assert rel_err(o, ro) < TOL[torch.float32]
    assert rel_err(ht.transpose(-1, -2), rht) < TOL[torch.float32]


def test_no_initial_state_no_final_state():
    inp = make_inputs("gdn", B=2, T=3, H=1, HV=2, K=16, V=16, h0=False, seed=5)
    o, ht = RECURRENT_OPS["gdn"](*inp.args(), backend="triton")
    assert ht is None
    assert rel_err(o, reference(inp)[0]) < TOL[torch.float32]


def test_low_precision_initial_state_is_read_not_downcast():
    """A bf16 initial state is read as it is (converted to fp32 in the kernel); the final state is fp32."""
    inp = make_inputs("kda", B=2, T=2, H=1, HV=2, K=16, V=24, seed=6)
    inp.h0 = inp.h0.to(torch.bfloat16)
    o, ht = _run(inp)
    ro, rht = reference(inp)                                              # from the same bf16 values
    assert ht.dtype == torch.float32
    assert rel_err(o, ro) < TOL[torch.float32]
    assert rel_err(ht, rht) < TOL[torch.float32]


@pytest.fixture
def loop_bounds_from_tensors(monkeypatch):
    """The GPU path's pipelined `tl.range(bos, eos)` token loop under the interpreter: triton 3.6's
    interpreter calls int() on a 1-element array for tensor loop bounds, which numpy 2 refuses;
    patch that one conversion for the test (on the GPU nothing is patched)."""
    if INTERPRET:
        import triton.runtime.interpreter as interp
        orig = interp._patch_lang_tensor

        def patched(tensor, scope):
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        monkeypatch.setattr(interp, "_patch_lang_tensor", patched)


@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_loop_and_fused_variants(fam, fused, loop_bounds_from_tensors):
    """The pipelined token loop (the GPU default) and the one-pass `fused` step, on fixed-length and
    varlen batches (with an empty sequence) and on a pool with a padding slot."""
    for kw in (dict(B=2, T=3), dict(lengths=[3, 1, 0, 4])):
        inp = make_inputs(fam, H=1, HV=2, K=20, V=12, gate="strong", seed=50, **kw)
        o, ht = _nan_outputs(inp)
        recurrent_fwd(*_canonical(inp), 20 ** -0.5, inp.h0, True, inp.cu_seqlens, o=o, final_state=ht, BV=8,
                      fused=fused, pipeline=2)
        ro, rht = reference(inp)
        assert rel_err(o, ro) < TOL[torch.float32] and rel_err(ht, rht) < TOL[torch.float32]
    inp, pool, idx = _pool_case(fam, 2, torch.float32, False, False, seed=51)
    before = pool.clone()
    o, _ = recurrent_fwd(*_canonical(inp), 24 ** -0.5, pool, False, None, state_indices=idx, fused=fused, pipeline=2)
    live = idx >= 0
    inp.h0 = before[idx.long().clamp_min(0)] * live[:, None, None, None]     # on the inputs' device (the GPU's too)
    ro, rht = reference(inp)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert rel_err(o[live], ro[live.to(ro.device)]) < TOL[torch.float32]
    assert rel_err(pool[idx[live].long()], rht[live.to(rht.device)]) < TOL[torch.float32]
    untouched = [s for s in range(pool.shape[0]) if s not in set(idx.tolist())]
    assert torch.equal(pool[untouched], before[untouched])


# ----------------------------------------------------------------------------------------------
# the state pool (vLLM-style state_indices)
# ----------------------------------------------------------------------------------------------

def _pool_case(fam, T, pool_dtype, transpose, varlen, seed):
    lengths = [T, 1, T + 1, 2] if varlen else None
    inp = make_inputs(fam, B=4, T=T, H=1, HV=2, K=24, V=20, h0=False, lengths=lengths, seed=seed)
    P = 7
    gen = torch.Generator().manual_seed(seed)
    pool_kv = (torch.randn(P, 2, 24, 20, generator=gen) * 0.5).to(pool_dtype)
    pool = pool_kv.transpose(-1, -2).contiguous() if transpose else pool_kv
    pool = pool.to(inp.q.device)
    idx = torch.tensor([5, -1, 0, 3], dtype=torch.int32, device=inp.q.device)
    return inp, pool, idx


@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("T,pool_dtype,transpose,varlen", [
    (1, torch.float32, False, False),
    (3, torch.float32, True, False),
    (1, torch.bfloat16, False, True),
    (2, torch.bfloat16, True, False),
])
def test_state_pool_in_place(fam, T, pool_dtype, transpose, varlen):
    inp, pool, idx = _pool_case(fam, T, pool_dtype, transpose, varlen, seed=10 + T)
    before = pool.clone()
    o = torch.full_like(inp.v, float("nan"), dtype=inp.q.dtype)
    o, ret = recurrent_fwd(*_canonical(inp), 24 ** -0.5, pool, True, inp.cu_seqlens, state_indices=idx,
                           transpose_state_layout=transpose, o=o)
    assert ret is pool

    # reference: sequence n starts from pool[idx[n]] (zeros for a padding slot)
    kv = lambda x: x.transpose(-1, -2) if transpose else x  # noqa: E731
    live = (idx >= 0).cpu()
    h0 = kv(before).cpu()[idx.long().clamp_min(0).cpu()].double() * live[:, None, None, None]
    ro, rht = recurrent_forward(*(None if x is None else x.cpu() for x in _canonical(inp)), 24 ** -0.5, h0,
                                None if inp.cu_seqlens is None else inp.cu_seqlens.cpu())

    # untouched slots stay bit-identical; touched slots hold the final state in the pool's dtype
    touched = set(idx[idx >= 0].tolist())
    for s in range(pool.shape[0]):
        if s not in touched:
            assert torch.equal(pool[s], before[s]), f"slot {s} was not addressed but changed"
    for n, s in enumerate(idx.tolist()):
        if s >= 0:
            assert pool.dtype == pool_dtype
            assert rel_err(kv(pool)[s], rht[n]) < TOL[pool_dtype]

    # outputs: the padding sequence's are exactly zero, the others match
    tok = (torch.arange(4)[:, None].expand(4, T).reshape(-1) if inp.cu_seqlens is None else
           torch.repeat_interleave(torch.arange(4), (inp.cu_seqlens[1:] - inp.cu_seqlens[:-1]).cpu()))
    o_flat, ro_flat = o.reshape(-1, *o.shape[2:]).cpu(), ro.reshape(-1, *ro.shape[2:])
    assert torch.equal(o_flat[tok == 1], torch.zeros_like(o_flat[tok == 1]))
    assert rel_err(o_flat[tok != 1], ro_flat[tok != 1]) < TOL[torch.float32]


@pytest.mark.parametrize("output_final_state", [True, False])
def test_state_pool_matches_torch_backend(output_final_state):
    """The public op with state_indices: same pool update and outputs as the torch backend."""
    inp, pool, idx = _pool_case("gdn", 2, torch.float32, False, False, seed=20)
    pool_t = pool.clone()
    o, ret = RECURRENT_OPS["gdn"](*inp.args(), initial_state=pool, output_final_state=output_final_state,
                                  state_indices=idx, backend="triton")
    o_t, ret_t = RECURRENT_OPS["gdn"](*inp.args(), initial_state=pool_t, output_final_state=output_final_state,
                                      state_indices=idx, backend="torch")
    assert (ret is pool) == output_final_state and (ret_t is pool_t) == output_final_state
    if not output_final_state:
        assert ret is None
    assert rel_err(o, o_t) < TOL[torch.float32] and rel_err(pool, pool_t) < TOL[torch.float32]
    assert torch.equal(o[1], torch.zeros_like(o[1]))               # the padding sequence


# ----------------------------------------------------------------------------------------------
# autograd fallback
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("via", ["public_op", "triton_entry"])
@pytest.mark.parametrize("fam", ["gdn", "kda", "gla"])
def test_gradient_fallback(fam, via):
    """With inputs that require grad, the triton recurrent path gives the gradients of the recurrence
    (it runs the fp32 PyTorch recurrence), through the public op and through chunkwise.triton.decode.recurrent."""
    inp = make_inputs(fam, B=2, T=4, H=1, HV=2, K=12, V=10, requires_grad=True, seed=30)
    if via == "public_op":
        o, ht = _run(inp)
    else:
        o, ht = recurrent(*_canonical(inp), 12 ** -0.5, inp.h0, True, None)
    gen = torch.Generator().manual_seed(31)
    wo = torch.randn(o.shape, generator=gen).to(o.device)
    wh = torch.randn(ht.shape, generator=gen).to(ht.device)
    grads = torch.autograd.grad((o * wo).sum() + (ht * wh).sum(), inp.tensors())

    ref_in = [x.detach().cpu().double().requires_grad_(True) for x in inp.tensors()]
    q, k, v = ref_in[:3]
    rest = iter(ref_in[3:])
    g = next(rest) if inp.g is not None else None
    beta = next(rest) if inp.beta is not None else None
    h0 = next(rest)
    ro, rht = recurrent_forward(q, k, v, g, beta, 12 ** -0.5, h0, None, dtype=torch.float64)
    rgrads = torch.autograd.grad((ro * wo.cpu().double()).sum() + (rht * wh.cpu().double()).sum(), ref_in)
    for x, rx in zip(grads, rgrads):
        assert rel_err(x, rx) < TOL[torch.float32]


def test_no_grad_context_uses_the_kernel():
    """Under torch.no_grad the kernel runs even for leaf tensors that require grad (decode in a model)."""
    inp = make_inputs("gdn", B=1, T=1, H=1, HV=2, K=16, V=16, requires_grad=True, seed=32)
    with torch.no_grad():
        o, ht = _run(inp)
    assert not o.requires_grad
    assert rel_err(o, reference(inp)[0]) < TOL[torch.float32]


# ----------------------------------------------------------------------------------------------
# real sizes, bf16 (GPU only: the interpreter cannot do bf16 arithmetic and is too slow)
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU")
@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("K,V,T,B", [(128, 128, 1, 64), (128, 128, 4, 8), (100, 100, 2, 8), (256, 256, 1, 4),
                                     (128, 16, 1, 8), (128, 48, 3, 8), (64, 100, 1, 8), (16, 64, 2, 8)])
def test_gpu_bf16_real_size(fam, K, V, T, B):
    inp = make_inputs(fam, B=B, T=T, H=4, HV=8, K=K, V=V, dtype=torch.bfloat16, seed=40)
    o, ht = _nan_outputs(inp)
    recurrent_fwd(*_canonical(inp), K ** -0.5, inp.h0, True, None, o=o, final_state=ht)
    ro, rht = reference(inp)
    assert rel_err(o, ro) < TOL[torch.bfloat16]
    assert rel_err(ht, rht) < TOL[torch.bfloat16]


@pytest.mark.skipif(not ON_GPU, reason="real sizes and bf16 need the GPU")
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transpose", [False, True])
def test_gpu_pool_decode_real_size(pool_dtype, transpose):
    B, HV, K, V, P = 64, 8, 128, 128, 96
    inp = make_inputs("gdn", B=B, T=1, H=4, HV=HV, K=K, V=V, dtype=torch.bfloat16, h0=False, seed=41)
    gen = torch.Generator().manual_seed(42)
    pool = (torch.randn(P, HV, K, V, generator=gen) * 0.5).to(pool_dtype)
    pool = (pool.transpose(-1, -2).contiguous() if transpose else pool).to(DEVICE)
    idx = torch.randperm(P, generator=gen)[:B].to(torch.int32)
    idx[::7] = -1
    idx = idx.to(DEVICE)
    before = pool.clone()
    o, _ = recurrent_fwd(*_canonical(inp), K ** -0.5, pool, False, None, state_indices=idx,
                         transpose_state_layout=transpose, o=torch.full_like(inp.v, float("nan")))
    kv = lambda x: x.transpose(-1, -2) if transpose else x  # noqa: E731
    live = idx >= 0
    inp.h0 = kv(before)[idx.long().clamp_min(0)] * live[:, None, None, None]
    ro, rht = reference(inp)
    untouched = torch.ones(P, dtype=torch.bool, device=DEVICE)
    untouched[idx[live].long()] = False
    assert torch.equal(pool[untouched], before[untouched])
    assert rel_err(kv(pool)[idx[live].long()], rht[live.cpu()]) < TOL[torch.bfloat16]
    assert torch.equal(o[~live], torch.zeros_like(o[~live]))
    assert rel_err(o[live], ro[live.cpu()]) < TOL[torch.bfloat16]


def test_state_pool_index_out_of_range():
    """An index outside [-1, P): the public op refuses CPU indices with a ValueError naming state_indices;
    the kernel itself (whose GPU callers get no host-side check: it would cost a sync per step) treats
    it as padding, so it never writes outside the pool, and the other sequences are unaffected."""
    inp, pool, idx = _pool_case("gdn", 1, torch.float32, False, False, seed=30)
    if not ON_GPU:
        for bad in (7, -2):
            wrong = idx.clone()
            wrong[2] = bad
            with pytest.raises(ValueError, match="state_indices must lie in"):
                RECURRENT_OPS["gdn"](*inp.args(), initial_state=pool.clone(), state_indices=wrong, backend="triton")
    wrong = idx.clone()
    wrong[2] = 7                                                      # P = 7: one past the end
    guard = torch.cat([pool.clone(), torch.full_like(pool[:1], 123.)])  # a slot right after the pool
    pool_view = guard[:7]
    before = pool_view.clone()
    o = torch.full_like(inp.v, float("nan"))
    recurrent_fwd(*_canonical(inp), 24 ** -0.5, pool_view, True, None, state_indices=wrong, o=o)
    assert torch.equal(guard[7], torch.full_like(guard[7], 123.)), "a write past the pool"
    assert torch.equal(pool_view[0], before[0]), "the out-of-range sequence changed a slot"
    assert torch.equal(o[2], torch.zeros_like(o[2])), "the out-of-range sequence got an output"
    o_ok = torch.full_like(inp.v, float("nan"))
    pool_ok = before.clone()
    recurrent_fwd(*_canonical(inp), 24 ** -0.5, pool_ok, True, None, state_indices=idx, o=o_ok)
    for n in (0, 3):
        assert torch.equal(o[n], o_ok[n])
        assert torch.equal(pool_view[idx[n]], pool_ok[idx[n]])
