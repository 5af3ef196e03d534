"""Serving on the decode side: speculative decoding's verify step (per-token states, pool untouched) and
chunkwise.rollback, and state indices that cannot corrupt the pool. Triton (interpreter on the CPU) and
torch backends; every family; both state layouts; fixed-length and varlen drafts."""
from __future__ import annotations

import pytest
import torch

import chunkwise
from chunkwise.reference.recurrent import pool_step
from chunkwise.triton.decode import recurrent_fwd, rollback as triton_rollback
from helpers import DEVICE, FAMILIES, RECURRENT_OPS, make_inputs

FAMS = list(FAMILIES)
P, HV, K, V = 6, 2, 20, 12          # K, V no powers of two


def _draft(fam, lengths, varlen, seed=0):
    """Inputs of a verify step: N sequences of draft tokens (varlen: packed, else all of lengths[0])."""
    if varlen:
        return make_inputs(fam, H=1, HV=HV, K=K, V=V, lengths=lengths, h0=False, seed=seed)
    return make_inputs(fam, B=len(lengths), T=lengths[0], H=1, HV=HV, K=K, V=V, h0=False, seed=seed)


def _bounds(inp, n):
    if inp.cu_seqlens is None:
        return n, 0, inp.q.shape[1]
    return 0, int(inp.cu_seqlens[n]), int(inp.cu_seqlens[n + 1])


def _prefix(inp, n, a):
    """The first a tokens of sequence n as a batch of one (positional args of the public op)."""
    b, s, _ = _bounds(inp, n)
    return [x[b:b + 1, s:s + a] for x in inp.args()]


def _pool(transpose, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shape = (P, HV, V, K) if transpose else (P, HV, K, V)
    return (torch.randn(shape, generator=gen) * 0.5).to(DEVICE)


CASES = [  # (lengths, varlen, slots, accepted): accept 0, some and all, a padding slot
    ([4, 4, 4], False, [3, 0, 5], [0, 2, 4]),
    ([4, 1, 3, 2], True, [2, -1, 0, 4], [4, 1, 0, 1]),
]


@pytest.mark.parametrize("transpose", [False, True], ids=["KV", "VK"])
@pytest.mark.parametrize("case", CASES, ids=["B3-T4", "varlen-4-1-3-2"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("fam", FAMS)
def test_verify_then_rollback_equals_running_the_accepted_tokens(fam, backend, case, transpose):
    lengths, varlen, slots, accepted = case
    inp = _draft(fam, lengths, varlen)
    op = RECURRENT_OPS[fam]
    idx = torch.tensor(slots, device=DEVICE)
    acc = torch.tensor(accepted, device=DEVICE)
    pool0 = _pool(transpose)
    kw = dict(cu_seqlens=inp.cu_seqlens, transpose_state_layout=transpose, backend=backend)

    # the verify step: per-token states into the buffer, the pool only read
    pool = pool0.clone()
    T_draft = max(lengths)
    buf = torch.full((len(slots), T_draft, *pool.shape[1:]), float("nan"), device=DEVICE)
    o, _ = op(*inp.args(), initial_state=pool, state_indices=idx, intermediate_states=buf, **kw)
    assert torch.equal(pool, pool0)

    # its outputs are the plain decode's, and its last state is what the plain decode leaves in the slot
    plain = pool0.clone()
    o_plain, _ = op(*inp.args(), initial_state=plain, state_indices=idx, **kw)
    torch.testing.assert_close(o, o_plain, rtol=1e-5, atol=1e-5)
    for n, s in enumerate(slots):
        if s >= 0:
            b, lo, hi = _bounds(inp, n)
            torch.testing.assert_close(buf[n, hi - lo - 1], plain[s], rtol=1e-5, atol=1e-5)

    # rollback: each slot holds the state after its last accepted token; 0 accepted: untouched
    chunkwise.rollback(pool, idx, buf, acc, backend=backend)
    expect = pool0.clone()
    for n, (s, a) in enumerate(zip(slots, accepted)):
        if s >= 0 and a > 0:
            op(*_prefix(inp, n, a), initial_state=expect, state_indices=idx[n:n + 1],
               transpose_state_layout=transpose, backend=backend)
    torch.testing.assert_close(pool, expect, rtol=1e-5, atol=1e-5)
    for s, a in zip(slots, accepted):
        if s >= 0 and a == 0:
            assert torch.equal(pool[s], pool0[s])
    untouched = [p for p in range(P) if p not in slots]
    assert torch.equal(pool[untouched], pool0[untouched])


def test_intermediate_states_argument_checks():
    inp = _draft("gdn", [2, 2], False)
    pool = _pool(False)
    idx = torch.tensor([0, 1], device=DEVICE)
    op = RECURRENT_OPS["gdn"]
    with pytest.raises(ValueError, match="intermediate_states needs state_indices"):
        op(*inp.args(), initial_state=pool[:2], intermediate_states=torch.zeros(2, 2, HV, K, V))
    with pytest.raises(ValueError, match="intermediate_states must have shape"):
        op(*inp.args(), initial_state=pool, state_indices=idx, intermediate_states=torch.zeros(2, 2, HV, V, K))
    with pytest.raises(ValueError, match="1 to 16 draft tokens"):
        op(*inp.args(), initial_state=pool, state_indices=idx, intermediate_states=torch.zeros(2, 17, HV, K, V))


# --- indices that cannot corrupt memory ---------------------------------------------------------

BAD = {"minus2": -2, "P": P, "P+5": P + 5, "huge": 2 ** 40}


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_public_ops_raise_on_a_bad_index(bad):
    inp = _draft("gdn", [1, 1, 1], False)
    idx = torch.tensor([0, BAD[bad], 2], device=DEVICE)
    if idx.device.type != "cpu":
        pytest.skip("the range check runs on CPU-visible indices (on the GPU the kernel masks instead)")
    with pytest.raises(ValueError, match="state_indices"):
        RECURRENT_OPS["gdn"](*inp.args(), initial_state=_pool(False), state_indices=idx)
    buf = torch.zeros(3, 1, HV, K, V, device=DEVICE)
    with pytest.raises(ValueError, match="state_indices"):
        chunkwise.rollback(_pool(False), idx, buf, torch.ones(3, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_duplicate_live_indices_raise_in_eager_mode(backend):
    inp = _draft("gdn", [1, 1, 1], False)
    idx = torch.tensor([4, -1, 4], device=DEVICE)
    with pytest.raises(ValueError, match="state_indices"):
        RECURRENT_OPS["gdn"](*inp.args(), initial_state=_pool(False), state_indices=idx, backend=backend)
    buf = torch.zeros(3, 1, HV, K, V, device=DEVICE)
    with pytest.raises(ValueError, match="state_indices"):
        chunkwise.rollback(_pool(False), idx, buf, torch.ones(3, dtype=torch.int64, device=DEVICE), backend=backend)
    # two padding sequences are no duplicate
    RECURRENT_OPS["gdn"](*inp.args(), initial_state=_pool(False), state_indices=torch.tensor([-1, 0, -1], device=DEVICE),
                         backend=backend)


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify+rollback"])
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_a_bad_index_touches_no_other_slot(impl, bad, verify):
    """Below the argument checks (what a compiled or captured call reaches): the kernels and the reference treat
    an index outside [0, P) as padding. Pool, plus guard rows around it, compared whole before and after."""
    inp = _draft("gdn", [2, 2, 2], False)
    slots = [1, BAD[bad], 4]
    idx = torch.tensor(slots, device=DEVICE)
    guarded = torch.randn(P + 2, HV, K, V, device=DEVICE)     # rows 0 and P + 1 guard the pool's ends
    pool, before = guarded[1:P + 1], guarded.clone()
    q, k, v, g, beta = inp.q, inp.k, inp.v, inp.g, inp.beta
    buf = torch.full((3, 2, HV, K, V), float("nan"), device=DEVICE) if verify else None
    if impl == "triton":
        o, _ = recurrent_fwd(q, k, v, g, beta, K ** -0.5, pool, False, None, state_indices=idx,
                             intermediate_states=buf)
    else:
        o, _ = pool_step(q, k, v, g, beta, K ** -0.5, pool, False, None, idx, False, torch.float32, buf)
    assert torch.equal(o[1], torch.zeros_like(o[1]))             # the bad sequence is padding: zero output
    if verify:
        assert torch.isnan(buf[1]).all()                           # ... and no per-token state
        rb = triton_rollback if impl == "triton" else chunkwise.reference.recurrent.rollback
        rb(pool, idx, buf, torch.tensor([2, 2, 1], device=DEVICE))
    changed = [p + 1 for p in (1, 4)]
    for r in range(P + 2):
        if r not in changed:
            assert torch.equal(guarded[r], before[r]), f"row {r} changed"
    for r in changed:
        assert not torch.equal(guarded[r], before[r])


# --- 8-bit state pools ----------------------------------------------------------------------------

from chunkwise.reference.recurrent import dequantize, quantize  # noqa: E402

ULP_AT_MAX = {torch.int8: 1.0, torch.float8_e4m3fn: 32.0}   # spacing of the format just below its QMAX (127, 448)


@pytest.mark.parametrize("transpose", [False, True], ids=["KV", "VK"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
@pytest.mark.parametrize("fam", FAMS)
def test_8bit_pool_triton_equals_torch(fam, dtype, transpose):
    """Decode over an int8 / e4m3 pool with per-row scales: the kernel dequantizes on load and requantizes on store
    like the reference (the stored values may differ by one step of the format where fp32 rounding differs)."""
    inp = _draft(fam, [3, 3, 3], False)
    stored, scales = quantize(_pool(transpose), dtype)
    idx = torch.tensor([4, -1, 0], device=DEVICE)
    out = {}
    for backend in ("triton", "torch"):
        p, s = stored.clone(), scales.clone()
        o, _ = RECURRENT_OPS[fam](*inp.args(), initial_state=p, state_indices=idx, state_scales=s,
                                  transpose_state_layout=transpose, backend=backend)
        out[backend] = o, p, s
    (o1, p1, s1), (o2, p2, s2) = out["triton"], out["torch"]
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-7)
    step = ULP_AT_MAX[dtype] * s2[..., None]
    assert ((dequantize(p1, s1) - dequantize(p2, s2)).abs() <= step + 1e-5).all()
    for r in (1, 2, 3, 5):                                   # slots no live sequence names: untouched
        assert torch.equal(p1[r], stored[r]) and torch.equal(s1[r], scales[r])


def _decode_error(dtype, kind, steps, checkpoints):
    """Relative error ‖S8 − S32‖ / ‖S32‖ of an 8-bit pool against the fp32 pool, decoding token by token."""
    gen = torch.Generator().manual_seed(0)
    N, K_, V_ = 2, 32, 32
    pool32 = torch.zeros(N, 2, K_, V_)
    stored, scales = quantize(pool32, dtype)
    idx = torch.arange(N)
    errors = {}
    for t in range(1, steps + 1):
        q = torch.nn.functional.normalize(torch.randn(N, 1, 1, K_, generator=gen), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(N, 1, 1, K_, generator=gen), dim=-1)
        v = torch.randn(N, 1, 2, V_, generator=gen)
        if kind == "random":
            g, beta = -torch.rand(N, 1, 2, generator=gen) * 0.5, torch.rand(N, 1, 2, generator=gen) * 0.9 + 0.05
        else:       # trained-like: normalised keys, gates near 0 (long memory), β about 0.5
            g, beta = -torch.rand(N, 1, 2, generator=gen) * 0.01, 0.5 + 0.05 * torch.randn(N, 1, 2, generator=gen)
        args = (q, k, v, g, beta, K_ ** -0.5)
        pool_step(*args, pool32, False, None, idx, False, torch.float32)
        pool_step(*args, stored, False, None, idx, False, torch.float32, None, scales)
        if t in checkpoints:
            errors[t] = ((dequantize(stored, scales) - pool32).norm() / pool32.norm()).item()
    return errors


# Bounds: one write rounds each element by at most half a step of its row, 0.5/127 = 0.4% of the row's absmax
# (int8) or 2^-4 = 6% of the value (e4m3, 3 mantissa bits). The recurrence forgets old rounding errors as it
# forgets old state, so the error settles at a few times the per-write error instead of growing with the steps:
# asserted as (a) below 10x the per-write bound relative to absmax for int8 / 3x for e4m3, (b) no growth from
# step 500 to step 1000 beyond 50%.
BOUND = {torch.int8: 0.04, torch.float8_e4m3fn: 0.2}


@pytest.mark.parametrize("kind", ["random", "trained-like"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_8bit_pool_error_after_1000_decode_steps(dtype, kind):
    errors = _decode_error(dtype, kind, 1000, (500, 1000))
    print(f"8-bit pool {dtype} {kind}: relative state error {errors}")
    assert errors[1000] < BOUND[dtype]
    assert errors[1000] < 1.5 * errors[500]


def _same_within_a_step(p1, s1, p2, s2, dtype):
    """Two 8-bit states: equal scales, stored values at most one step of the format apart (fp32 rounding)."""
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-7)
    step = ULP_AT_MAX[dtype] * s2[..., None]
    assert ((dequantize(p1, s1) - dequantize(p2, s2)).abs() <= step + 1e-5).all()


@pytest.mark.parametrize("transpose", [False, True], ids=["KV", "VK"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("fam", FAMS)
def test_8bit_pool_verify_then_rollback_equals_decoding_the_accepted_tokens(fam, backend, dtype, transpose):
    """Verify from an 8-bit pool (fp32 per-token states, pool and scales untouched), then rollback requantizes the
    kept state: the slot and its scales are what decoding only the accepted tokens into the same pool leaves."""
    lengths, varlen, slots, accepted = CASES[1]          # accept all, one, zero, one; a padding slot
    inp = _draft(fam, lengths, varlen)
    op = RECURRENT_OPS[fam]
    idx, acc = torch.tensor(slots, device=DEVICE), torch.tensor(accepted, device=DEVICE)
    stored, scales = quantize(_pool(transpose), dtype)
    kw = dict(transpose_state_layout=transpose, backend=backend)
    pool, sc = stored.clone(), scales.clone()
    buf = torch.full((len(slots), max(lengths), *pool.shape[1:]), float("nan"), device=DEVICE)
    op(*inp.args(), initial_state=pool, state_indices=idx, state_scales=sc, intermediate_states=buf,
       cu_seqlens=inp.cu_seqlens, **kw)
    assert torch.equal(pool.view(torch.uint8), stored.view(torch.uint8)) and torch.equal(sc, scales)

    chunkwise.rollback(pool, idx, buf, acc, state_scales=sc, backend=backend)
    want, want_sc = stored.clone(), scales.clone()
    for n, (s, a) in enumerate(zip(slots, accepted)):
        if s >= 0 and a > 0:
            op(*_prefix(inp, n, a), initial_state=want, state_indices=idx[n:n + 1], state_scales=want_sc, **kw)
    _same_within_a_step(pool, sc, want, want_sc, dtype)
    for r in range(P):                                   # 0 accepted, padding, or no sequence: bytes untouched
        if r not in [s for s, a in zip(slots, accepted) if s >= 0 and a > 0]:
            assert torch.equal(pool[r].view(torch.uint8), stored[r].view(torch.uint8)) and torch.equal(sc[r], scales[r])


@pytest.mark.parametrize("transpose", [False, True], ids=["KV", "VK"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_8bit_rollback_triton_equals_torch(dtype, transpose):
    """The kernel's requantization of a kept state is the reference's `quantize` (a zero row: scale 0)."""
    gen = torch.Generator().manual_seed(3)
    tail = (HV, V, K) if transpose else (HV, K, V)
    buf = torch.randn(4, 3, *tail, generator=gen).to(DEVICE) * torch.logspace(-3, 2, tail[1])[:, None].to(DEVICE)
    buf[2, 0, 1, 3] = 0.                                 # an all-zero row
    stored, scales = quantize(_pool(transpose), dtype)
    idx, acc = torch.tensor([5, 0, 2, 3], device=DEVICE), torch.tensor([3, 0, 1, 2], device=DEVICE)
    out = {}
    for impl, rb in (("triton", triton_rollback), ("torch", chunkwise.reference.recurrent.rollback)):
        p, s = stored.clone(), scales.clone()
        rb(p, idx, buf, acc, s)
        out[impl] = p, s
    _same_within_a_step(*out["triton"], *out["torch"], dtype)
    p, s = out["triton"]
    assert torch.equal(s[2, 1, 3], torch.tensor(0., device=DEVICE))
    assert torch.equal(p[0].view(torch.uint8), stored[0].view(torch.uint8)) and torch.equal(s[0], scales[0])
    kept = torch.stack([buf[0, 2], buf[2, 0], buf[3, 1]])
    assert ((dequantize(p[[5, 2, 3]], s[[5, 2, 3]]) - kept).abs() <= 0.5 * ULP_AT_MAX[dtype] * s[[5, 2, 3]][..., None]
            + 1e-6).all()                                # one rounding of half a step at most


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_8bit_rollback_with_a_bad_index_touches_no_other_slot(impl, bad):
    """Below the argument checks: an index outside [0, P) is skipped; pool and scales, each with guard rows around
    them, compared whole before and after."""
    dtype = torch.float8_e4m3fn
    stored, scales = quantize(torch.randn(P + 2, HV, K, V, device=DEVICE), dtype)
    pool, sc = stored[1:P + 1], scales[1:P + 1]
    before, before_sc = stored.clone(), scales.clone()
    buf = torch.randn(3, 2, HV, K, V, device=DEVICE) * 3
    idx, acc = torch.tensor([1, BAD[bad], 4], device=DEVICE), torch.tensor([2, 2, 1], device=DEVICE)
    rb = triton_rollback if impl == "triton" else chunkwise.reference.recurrent.rollback
    rb(pool, idx, buf, acc, sc)
    changed = [p + 1 for p in (1, 4)]
    for r in range(P + 2):
        same = torch.equal(stored[r].view(torch.uint8), before[r].view(torch.uint8)) and torch.equal(scales[r], before_sc[r])
        assert same == (r not in changed), f"row {r}"


def test_8bit_rollback_argument_checks():
    stored, scales = quantize(_pool(False), torch.int8)
    idx, acc = torch.tensor([0, 1], device=DEVICE), torch.tensor([1, 1], device=DEVICE)
    buf = torch.zeros(2, 1, HV, K, V, device=DEVICE)
    with pytest.raises(TypeError, match="state_scales"):
        chunkwise.rollback(stored, idx, buf, acc)
    with pytest.raises(ValueError, match="state_scales"):
        chunkwise.rollback(stored, idx, buf, acc, state_scales=scales[:, :, :-1])
    with pytest.raises(TypeError, match="fp32 intermediate_states"):
        chunkwise.rollback(stored, idx, buf.half(), acc, state_scales=scales)
    with pytest.raises(ValueError, match="state_scales goes with"):
        chunkwise.rollback(_pool(False), idx, buf, acc, state_scales=scales)


# --- rollback as a torch custom op ------------------------------------------------------------------

from chunkwise import _custom_ops  # noqa: E402


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rollback_opcheck(backend, pool_dtype):
    """chunkwise::rollback: schema (pool and state_scales mutated), fake implementation, AOT dispatch. (The schema
    does not depend on the dtype; opcheck's comparisons cannot take e4m3 tensors on the CPU.)"""
    pool, scales = _pool(False), None
    if pool_dtype != torch.float32:
        pool, scales = quantize(pool, pool_dtype)
    buf = torch.randn(3, 2, HV, K, V, device=DEVICE)
    idx, acc = torch.tensor([4, -1, 1], device=DEVICE), torch.tensor([2, 1, 0], device=DEVICE)
    torch.library.opcheck(_custom_ops.rollback, (pool, idx, buf, acc, scales, backend))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
def test_compile_fullgraph_verify_then_rollback(pool_dtype):
    """A verify step and its rollback in one torch.compile(fullgraph=True) graph: the pool (and scales) as eager."""
    inp = _draft("gdn", [3, 3, 3], False)
    pool0, scales0 = _pool(False), None
    if pool_dtype == torch.int8:
        pool0, scales0 = quantize(pool0, pool_dtype)
    idx, acc = torch.tensor([5, -1, 2], device=DEVICE), torch.tensor([2, 3, 3], device=DEVICE)

    def step(q, k, v, g, beta, pool, scales, buf, acc):
        o, _ = chunkwise.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=idx,
                                                          state_scales=scales, intermediate_states=buf)
        chunkwise.rollback(pool, idx, buf, acc, state_scales=scales)
        return o

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = {}
    for name, fn in (("compiled", compiled), ("eager", step)):
        pool, scales = pool0.clone(), None if scales0 is None else scales0.clone()
        buf = torch.zeros(3, 3, HV, K, V, device=DEVICE)
        o = fn(inp.q, inp.k, inp.v, inp.g, inp.beta, pool, scales, buf, acc)
        got[name] = o, pool, scales
    (o1, p1, s1), (o2, p2, s2) = got["compiled"], got["eager"]
    assert torch.equal(o1, o2) and torch.equal(p1.view(torch.uint8), p2.view(torch.uint8))
    assert s1 is None or torch.equal(s1, s2)
    changed = [r for r in range(P) if not torch.equal(p1[r].view(torch.uint8), pool0[r].view(torch.uint8))]
    assert changed == [2, 5]


# --- the decode benchmark's serving modes (CPU, torch backend, tiny shapes) ---------------------------------------

def test_bench_decode_verify_and_8bit_modes(tmp_path, capsys):
    """bench_decode.py's verify (with the rollback) and 8-bit pool rows: timed, outputs equal to the fp32 pool decode's,
    bytes as its docstring's formulas say; the default picks no 8-bit mode below batch 256."""
    import json
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    import bench_decode
    import shapes
    rc = bench_decode.main(["--device", "cpu", "--dtype", "fp32", "--no-peers", "--ops", "gdn", "--out", str(tmp_path),
                            "--commit", "x", "--shapes", "B2-T1-H2-HV4-K32,B2-T4-H2-HV4-K32",
                            "--modes", "pool,int8,e4m3,verify"])
    capsys.readouterr()
    assert rc == 0
    rows = {r["mode"]: r for r in json.load(open(tmp_path / "bench_decode.json"))["rows"]}
    assert sorted(rows) == ["e4m3", "int8", "pool", "verify"]
    HV_, K_, V_ = 4, 32, 32
    assert rows["pool"]["MB"] * 1e6 == 2 * 2 * HV_ * K_ * V_ * 4
    assert rows["int8"]["MB"] * 1e6 == 2 * 2 * HV_ * K_ * (V_ + 4)
    assert rows["verify"]["MB"] * 1e6 == 2 * HV_ * K_ * V_ * 4 * (1 + 4)
    assert rows["verify"]["rb_us"] > 0 and all(rows[m]["o_vs_ref"] < 1e-6 for m in ("int8", "e4m3", "verify"))
    assert bench_decode.modes_for(shapes.SHAPES["B64-T1-H32"], None) == ["state", "pool"]
    assert bench_decode.modes_for(shapes.SHAPES["B256-T1-H32"], None) == ["state", "pool", "int8", "e4m3"]
    assert bench_decode.modes_for(shapes.SHAPES["B256-T4-H32"], None) == ["verify"]
