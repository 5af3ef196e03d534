"""Input checking: every bad argument gets a ValueError / TypeError whose message
names the argument and, where shapes are involved, the shapes. One test per kind of mistake.

Each case starts from a valid call (checked to run) and breaks one thing.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import CHUNK_OPS, DEVICE, FAMILIES, RECURRENT_OPS

from chunkwise.triton.chunk import chunk_bwd, chunk_fwd
from chunkwise.triton.configs import backward_plan, forward_plan

torch.set_num_threads(1)   # tiny tensors: one thread is faster (and far faster on a loaded machine)

B, T, H, HV, K, V = 2, 10, 2, 4, 8, 6


def valid(fam: str, **over):
    """Keyword arguments of a valid call of the family's ops (CPU, float32, torch backend)."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    spec = FAMILIES[fam]
    kw = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), initial_state=r(B, HV, K, V),
              output_final_state=True, backend="torch")
    if spec.gate == "scalar":
        kw["g"] = -r(B, T, HV).abs()
    elif spec.gate == "channel":
        kw["g"] = -r(B, T, HV, K).abs()
    if spec.delta:
        kw["beta"] = r(B, T, HV).sigmoid()
    kw.update(over)
    return kw


def varlen(fam: str, cu=(0, 3, 10), **over):
    """A valid varlen call: B = 1, two sequences of 3 and 7 tokens."""
    kw = valid(fam)
    for name in ("q", "k", "v", "g", "beta"):
        if name in kw:
            kw[name] = kw[name][:1]
    kw["initial_state"] = kw["initial_state"][:1].repeat(len(cu) - 1, 1, 1, 1)
    kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    kw.update(over)
    return kw


def expect(op, kw, exc, *words):
    with pytest.raises(exc) as info:
        op(**kw)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"message {msg!r} should mention {w!r}"
    return msg


ALL = list(FAMILIES)
BOTH = [pytest.param(f, m, id=f"{f}-{m}") for f in ALL for m in ("chunk", "recurrent")]


def op_of(fam, mode):
    return (CHUNK_OPS if mode == "chunk" else RECURRENT_OPS)[fam]


@pytest.mark.parametrize("fam,mode", BOTH)
def test_valid_calls_run(fam, mode):
    """The starting points of every case below are valid (so each case breaks exactly one thing)."""
    o, ht = op_of(fam, mode)(**valid(fam))
    assert o.shape == (B, T, HV, V) and ht.shape == (B, HV, K, V)
    o, ht = op_of(fam, mode)(**varlen(fam))
    assert o.shape == (1, T, HV, V) and ht.shape == (2, HV, K, V)


# ---------------------------------------------------------------------------------------------- q, k, v

@pytest.mark.parametrize("fam,mode", BOTH)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_a_tensor(fam, mode, name):
    kw = valid(fam)
    kw[name] = kw[name].tolist()
    expect(op_of(fam, mode), kw, TypeError, name, "list")


@pytest.mark.parametrize("fam,mode", BOTH)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_wrong_number_of_dims(fam, mode, name):
    kw = valid(fam)
    kw[name] = kw[name][0]
    expect(op_of(fam, mode), kw, ValueError, name, str(tuple(kw[name].shape)))


@pytest.mark.parametrize("fam,mode", BOTH)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_integer_dtype(fam, mode, name):
    kw = valid(fam)
    kw[name] = kw[name].to(torch.int32)
    expect(op_of(fam, mode), kw, TypeError, name, "torch.int32")


@pytest.mark.parametrize("fam,mode", BOTH)
def test_mixed_qkv_dtypes(fam, mode):
    kw = valid(fam)
    kw["v"] = kw["v"].to(torch.float16)
    expect(op_of(fam, mode), kw, TypeError, "v", "torch.float16", "torch.float32")


@pytest.mark.parametrize("fam,mode", BOTH)
def test_k_shape_differs_from_q(fam, mode):
    kw = valid(fam)
    kw["k"] = kw["k"][..., :-1]
    expect(op_of(fam, mode), kw, ValueError, "k", str(tuple(kw["q"].shape)), str(tuple(kw["k"].shape)))


@pytest.mark.parametrize("fam,mode", BOTH)
def test_v_batch_or_length_differs(fam, mode):
    kw = valid(fam)
    kw["v"] = kw["v"][:, :-1]
    expect(op_of(fam, mode), kw, ValueError, "v", str(tuple(kw["q"].shape)), str(tuple(kw["v"].shape)))


@pytest.mark.parametrize("fam,mode", BOTH)
def test_value_heads_not_a_multiple_of_qk_heads(fam, mode):
    kw = valid(fam, v=torch.randn(B, T, 3, V))
    for name, shape in (("g", (B, T, 3) + ((K,) if FAMILIES[fam].gate == "channel" else ())), ("beta", (B, T, 3))):
        if name in kw:
            kw[name] = -torch.rand(shape) if name == "g" else torch.rand(shape)
    kw["initial_state"] = torch.randn(B, 3, K, V)
    expect(op_of(fam, mode), kw, ValueError, "HV=3", "H=2", str(tuple(kw["v"].shape)), str(tuple(kw["q"].shape)))


@pytest.mark.parametrize("fam,mode", BOTH)
def test_zero_head_dim(fam, mode):
    kw = valid(fam)
    kw["v"] = kw["v"][..., :0]
    kw["initial_state"] = kw["initial_state"][..., :0]
    expect(op_of(fam, mode), kw, ValueError, "V=0")


@pytest.mark.parametrize("fam,mode", BOTH)
@pytest.mark.parametrize("name", ["k", "v", "g", "beta", "initial_state"])
def test_tensors_on_different_devices(fam, mode, name):
    kw = valid(fam)
    if name not in kw:                       # the family has no such input: use the state instead
        name = "initial_state"
    kw[name] = kw[name].to("meta")
    expect(op_of(fam, mode), kw, ValueError, "device", f"{name} on meta", "q on cpu")


def test_head_dim_too_large_for_triton():
    kw = valid("gdn", q=torch.randn(B, T, H, 300), k=torch.randn(B, T, H, 300),
               initial_state=torch.randn(B, HV, 300, V), backend="triton")
    expect(CHUNK_OPS["gdn"], kw, ValueError, "K=300", "256")


def test_float64_on_triton():
    kw = {n: (x.to(DEVICE, torch.float64) if isinstance(x, torch.Tensor) else x)
          for n, x in valid("gdn", backend="triton").items()}
    expect(CHUNK_OPS["gdn"], kw, TypeError, "float64", "backend='torch'")


def test_triton_backend_on_cpu_tensors_without_interpreter(monkeypatch):
    """On a GPU machine, CPU tensors with backend='triton' outside the interpreter are refused by name."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    expect(CHUNK_OPS["gdn"], valid("gdn", backend="triton"), ValueError, "backend='triton'", "cpu")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float64_initial_state_gives_fp32_final_state(backend):
    """With fp32 q a float64 initial state is read in fp32, on either backend: the final state is fp32 (and
    its gradient comes back in float64, the dtype it was given in)."""
    kw = valid("gdn", backend=backend)
    if backend == "triton":
        kw = {n: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    h0 = kw["initial_state"].double().requires_grad_()
    o, ht = CHUNK_OPS["gdn"](**{**kw, "initial_state": h0})
    assert ht.dtype == torch.float32
    o32, ht32 = CHUNK_OPS["gdn"](**{**kw, "initial_state": kw["initial_state"].float()})
    assert torch.equal(o, o32) and torch.equal(ht, ht32)
    (o.sum() + ht.sum()).backward()
    assert h0.grad.dtype == torch.float64


# ---------------------------------------------------------------------------------------------- g, beta

@pytest.mark.parametrize("fam,mode", [p for p in BOTH if FAMILIES[p.values[0]].gate != "none"])
def test_gate_wrong_shape(fam, mode):
    kw = valid(fam)
    kw["g"] = kw["g"][:, :, :1]
    msg = expect(op_of(fam, mode), kw, ValueError, "g", str(tuple(kw["g"].shape)))
    assert "HV" in msg


@pytest.mark.parametrize("fam,mode", [p for p in BOTH if FAMILIES[p.values[0]].gate == "scalar"])
def test_scalar_gate_given_per_channel(fam, mode):
    kw = valid(fam)
    kw["g"] = -torch.rand(B, T, HV, K)
    expect(op_of(fam, mode), kw, ValueError, "g", str((B, T, HV, K)))


@pytest.mark.parametrize("fam,mode", [p for p in BOTH if FAMILIES[p.values[0]].gate != "none"])
def test_gate_missing_or_integer(fam, mode):
    kw = valid(fam, g=None)
    expect(op_of(fam, mode), kw, ValueError, "g")
    kw = valid(fam)
    kw["g"] = kw["g"].to(torch.int64)
    expect(op_of(fam, mode), kw, TypeError, "g", "torch.int64")


@pytest.mark.parametrize("fam,mode", [p for p in BOTH if FAMILIES[p.values[0]].delta])
def test_beta_wrong_shape_missing_or_integer(fam, mode):
    kw = valid(fam)
    kw["beta"] = kw["beta"][..., None]
    expect(op_of(fam, mode), kw, ValueError, "beta", str(tuple(kw["beta"].shape)))
    expect(op_of(fam, mode), valid(fam, beta=None), ValueError, "beta")
    kw = valid(fam)
    kw["beta"] = kw["beta"].to(torch.int32)
    expect(op_of(fam, mode), kw, TypeError, "beta", "torch.int32")


# ---------------------------------------------------------------------------------------------- options

@pytest.mark.parametrize("fam,mode", BOTH)
def test_bad_scale_backend_chunk_size(fam, mode):
    expect(op_of(fam, mode), valid(fam, scale="0.5"), TypeError, "scale", "str")
    expect(op_of(fam, mode), valid(fam, backend="cuda"), ValueError, "backend", "'cuda'")
    expect(op_of(fam, mode), valid(fam, chunk_size=0), ValueError, "chunk_size", "0")


@pytest.mark.parametrize("fam,mode", [p for p in BOTH if FAMILIES[p.values[0]].gate != "none"])
def test_gate_in_kernel_parameters(fam, mode):
    op, spec = op_of(fam, mode), FAMILIES[fam]
    expect(op, valid(fam, use_gate_in_kernel=True), ValueError, "A_log")
    expect(op, valid(fam, use_gate_in_kernel=True, A_log=torch.zeros(HV + 1)), ValueError, "A_log", str((HV + 1,)))
    bad_bias = torch.zeros(HV + 1)
    msg = expect(op, valid(fam, use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=bad_bias), ValueError,
                 "dt_bias", str((HV + 1,)))
    assert ("[HV * K]" in msg) == (spec.gate == "channel")
    expect(op, valid(fam, A_log=torch.zeros(HV)), ValueError, "A_log", "use_gate_in_kernel")
    expect(op, valid(fam, dt_bias=torch.zeros(HV)), ValueError, "dt_bias", "use_gate_in_kernel")
    if spec.gate == "channel":
        expect(op, valid(fam, lower_bound=-5.0), ValueError, "lower_bound", "use_gate_in_kernel")


def test_lower_bound_only_for_kda():
    """GDN's ops do not take lower_bound at all; the API itself refuses it for a scalar gate."""
    from chunkwise.api import GDN, run
    kw = valid("gdn")
    with pytest.raises(ValueError, match="lower_bound"):
        run(GDN, "chunk", kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], None, None, False, None,
            use_gate_in_kernel=True, A_log=torch.zeros(HV), lower_bound=-5.0, backend="torch")
    with pytest.raises(TypeError):
        CHUNK_OPS["gdn"](**valid("gdn", lower_bound=-5.0))


def test_no_kwargs_swallow_typos():
    with pytest.raises(TypeError, match="use_qk_l2_norm"):
        CHUNK_OPS["gdn"](**valid("gdn", use_qk_l2_norm=True))


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gate_options_on_families_without_them(mode):
    from chunkwise.api import DELTA, GLA, run
    kw = valid("delta")
    with pytest.raises(ValueError, match="no gate"):
        run(DELTA, mode, kw["q"], kw["k"], kw["v"], None, kw["beta"], None, None, False, None,
            use_gate_in_kernel=True, A_log=torch.zeros(HV), backend="torch")
    with pytest.raises(ValueError, match="takes no gate"):
        run(DELTA, mode, kw["q"], kw["k"], kw["v"], -torch.rand(B, T, HV), kw["beta"], None, None, False, None,
            backend="torch")
    with pytest.raises(ValueError, match="takes no beta"):
        run(GLA, mode, kw["q"], kw["k"], kw["v"], -torch.rand(B, T, HV), kw["beta"], None, None, False, None,
            backend="torch")


# ---------------------------------------------------------------------------------------------- cu_seqlens

CU_CASES = {
    "not_starting_at_0": ((1, 3, 10), ValueError, ["cu_seqlens", "start at 0", "got 1"]),
    "not_increasing": ((0, 6, 3, 10), ValueError, ["cu_seqlens", "non-decreasing", "[0, 6, 3, 10]"]),
    "not_ending_at_T": ((0, 3, 9), ValueError, ["cu_seqlens", "T=10", "got 9"]),
    "past_T": ((0, 3, 11), ValueError, ["cu_seqlens", "T=10", "got 11"]),
    "too_short": ((0,), ValueError, ["cu_seqlens", "(1,)"]),
}


@pytest.mark.parametrize("fam,mode", BOTH)
@pytest.mark.parametrize("case", list(CU_CASES))
def test_bad_cu_seqlens(fam, mode, case):
    cu, exc, words = CU_CASES[case]
    kw = varlen(fam)
    kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    kw["initial_state"] = kw["initial_state"][:1].repeat(max(len(cu) - 1, 1), 1, 1, 1)
    expect(op_of(fam, mode), kw, exc, *words)


@pytest.mark.parametrize("fam,mode", BOTH)
def test_cu_seqlens_with_batch_not_1(fam, mode):
    kw = valid(fam, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    expect(op_of(fam, mode), kw, ValueError, "cu_seqlens", "B=2")


@pytest.mark.parametrize("fam,mode", BOTH)
def test_cu_seqlens_dtype_and_dims(fam, mode):
    expect(op_of(fam, mode), varlen(fam, cu_seqlens=torch.tensor([0.0, 3.0, 10.0])), TypeError,
           "cu_seqlens", "torch.float32")
    expect(op_of(fam, mode), varlen(fam, cu_seqlens=torch.tensor([[0, 3, 10]])), ValueError,
           "cu_seqlens", "(1, 3)")


@pytest.mark.parametrize("fam,mode", BOTH)
def test_cu_seqlens_cpu_mismatch(fam, mode):
    kw = varlen(fam, cu_seqlens_cpu=torch.tensor([0, 10], dtype=torch.int32))
    expect(op_of(fam, mode), kw, ValueError, "cu_seqlens_cpu", "(2,)", "(3,)")
    kw = valid(fam, cu_seqlens_cpu=torch.tensor([0, 10], dtype=torch.int32))
    expect(op_of(fam, mode), kw, ValueError, "cu_seqlens_cpu", "cu_seqlens is None")


# ---------------------------------------------------------------------------------------------- states

@pytest.mark.parametrize("fam,mode", BOTH)
@pytest.mark.parametrize("transpose", [False, True], ids=["kv", "vk"])
def test_wrong_state_shape(fam, mode, transpose):
    op = op_of(fam, mode)
    layout = "[N, HV, V, K]" if transpose else "[N, HV, K, V]"
    want = [B, HV, V, K] if transpose else [B, HV, K, V]
    # the other layout (K != V): the classic mistake
    other = torch.randn(B, HV, K, V) if transpose else torch.randn(B, HV, V, K)
    expect(op, valid(fam, initial_state=other, transpose_state_layout=transpose), ValueError,
           "initial_state", layout, str(want), str(tuple(other.shape)))
    # one state for a batch of two
    one = torch.randn(1, *want[1:])
    expect(op, valid(fam, initial_state=one, transpose_state_layout=transpose), ValueError,
           "initial_state", str(want), str(tuple(one.shape)))
    # varlen: N = number of sequences, not B
    kw = varlen(fam, transpose_state_layout=transpose)
    kw["initial_state"] = torch.randn(1, *want[1:])
    expect(op, kw, ValueError, "initial_state", str([2] + want[1:]))
    # missing head dimension
    expect(op, valid(fam, initial_state=torch.randn(B, K, V)), ValueError, "initial_state", "4 dimensions")
    expect(op, valid(fam, initial_state=torch.zeros(B, HV, K, V, dtype=torch.int32)), TypeError,
           "initial_state", "torch.int32")


@pytest.mark.parametrize("fam", ALL)
def test_state_pool_arguments(fam):
    op = RECURRENT_OPS[fam]
    pool = torch.randn(5, HV, K, V)
    expect(op, valid(fam, initial_state=pool, state_indices=torch.tensor([0.0, 1.0])), TypeError,
           "state_indices", "torch.float32")
    expect(op, valid(fam, initial_state=pool, state_indices=torch.tensor([0, 1, 2])), ValueError,
           "state_indices", "N=2", "(3,)")
    expect(op, valid(fam, initial_state=None, state_indices=torch.tensor([0, 1])), ValueError,
           "state_indices", "initial_state")
    expect(op, valid(fam, initial_state=torch.randn(5, HV, V + 1, K), state_indices=torch.tensor([0, 1])),
           ValueError, "initial_state", "pool", str((5, HV, V + 1, K)))
    # a pool with any number of slots is fine
    o, ret = op(**valid(fam, initial_state=pool, state_indices=torch.tensor([4, -1])))
    assert ret is pool


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_plan_block_not_a_power_of_two(stage):
    """A launch plan passed by the caller (benchmarks/sweep.py) with a block size the kernels cannot tile is refused
    before any launch, by its field."""
    kw = valid("gdn", backend="triton")
    q, k, v, g, beta = (kw[n].to(DEVICE) for n in ("q", "k", "v", "g", "beta"))
    if stage == "forward":
        plan = replace(forward_plan(q.device, q.dtype, 1, True, q.shape[-1], v.shape[-1]), bv=24)
        with pytest.raises(ValueError, match=r"ForwardPlan\.bv = 24: block sizes must be powers of 2"):
            chunk_fwd(q, k, v, g, beta, 0.25, None, False, None, plan=plan)
    else:
        plan = replace(backward_plan(1, True, q.dtype, q.shape[-1], v.shape[-1], 90), wy_bk=48)
        with pytest.raises(ValueError, match=r"BackwardPlan\.wy_bk = 48: block sizes must be powers of 2"):
            chunk_bwd(q, k, v, g, beta, 0.25, None, torch.ones_like(v), None, None, plan=plan)
