"""The Mamba2 adaptor (`chunkwise.mamba_chunk_scan_combined`) against SSD written the way the
Mamba2 paper states it (Dao & Gu 2024, "Transformers are SSMs", §3-§4): the quadratic
"attention" form per head, in float64, independent of any chunkwise code::

    y = (L ∘ C Bᵀ) · (dt ⊙ X),   L_ij = exp(Σ_{j<t≤i} A·dt_t) for j ≤ i, 0 above the diagonal

(the 1-semiseparable mask, built with the paper's `segsum`), plus the initial state's
contribution exp(Σ_{t≤i} A·dt_t) · h0 C_i, then y += D·x and y ← y·silu(z). dt is processed as
mamba_ssm does: dt + dt_bias, softplus (identity above 20) if dt_softplus, clamp to dt_limit.
"""
from __future__ import annotations

import pytest
import torch

from chunkwise import mamba_chunk_scan_combined
from helpers import DEVICE, TOL, rel_err

torch.set_num_threads(1)   # tiny tensors: one thread is faster (and far faster on a loaded machine)

F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# the paper's SSD, quadratic form
# ----------------------------------------------------------------------------------------------

def segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., T] -> [..., T, T] with entry (i, j) = Σ_{j<t≤i} a_t for j ≤ i, −inf above the diagonal
    (the paper's stable segsum: a cumulative sum of masked copies, no subtraction)."""
    T = a.shape[-1]
    x = a[..., None].expand(*a.shape, T)                                  # x[..., i, j] = a_i
    x = x.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1), 0)    # keep i > j
    s = x.cumsum(dim=-2)                                                  # Σ_{j<t≤i} a_t
    return s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(0), float("-inf"))


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    dt = dt.to(F64)
    if dt_bias is not None:
        dt = dt + dt_bias.to(F64)
    if dt_softplus:
        dt = torch.where(dt <= 20, torch.log1p(torch.exp(dt)), dt)
    return dt.clamp(dt_limit[0], dt_limit[1])


def ssd_reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, dt_softplus=False,
                  dt_limit=(0.0, float("inf"))):
    """Returns (y [b, l, h, p], final states [b, h, p, n]), float64."""
    x, A, B, C = (t.detach().to(F64) for t in (x, A, B, C))
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    b, l, h, p = x.shape
    G, n = B.shape[2], B.shape[3]
    y = torch.zeros(b, l, h, p, dtype=F64)
    final = torch.zeros(b, h, p, n, dtype=F64)
    for bi in range(b):
        for hi in range(h):
            gi = hi // (h // G)
            a = A[hi] * dt[bi, :, hi]                                     # [l]
            L = torch.exp(segsum(a))                                      # [l, l]
            Cg, Bg = C[bi, :, gi], B[bi, :, gi]                           # [l, n]
            xdt = x[bi, :, hi] * dt[bi, :, hi, None]                      # [l, p]
            y[bi, :, hi] = (L * (Cg @ Bg.T)) @ xdt
            final[bi, hi] = (xdt * L[-1][:, None]).T @ Bg                 # Σ_j L_{l-1, j} dt_j x_j B_jᵀ
            if initial_states is not None:
                h0 = initial_states[bi, hi].to(F64)                       # [p, n]
                y[bi, :, hi] += torch.exp(torch.cumsum(a, 0))[:, None] * (Cg @ h0.T)
                final[bi, hi] += torch.exp(a.sum()) * h0
    if D is not None:
        D = D.to(F64)
        y = y + x * (D if D.dim() == 2 else D[:, None])
    if z is not None:
        z = z.to(F64)
        y = y * z * torch.sigmoid(z)
    return y, final


def ssd_reference_autograd(**kw):
    """The same, differentiable (for the gradient test): no .detach()."""
    x, dt, A, B, C = kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"]
    dt = process_dt(dt, kw.get("dt_bias"), kw.get("dt_softplus", False), kw.get("dt_limit", (0.0, float("inf"))))
    b, l, h, p = x.shape
    G = B.shape[2]
    ys, finals = [], []
    for bi in range(b):
        yh, fh = [], []
        for hi in range(h):
            gi = hi // (h // G)
            a = A[hi] * dt[bi, :, hi]
            L = torch.exp(segsum(a))
            xdt = x[bi, :, hi] * dt[bi, :, hi, None]
            yy = (L * (C[bi, :, gi] @ B[bi, :, gi].T)) @ xdt
            ff = (xdt * L[-1][:, None]).T @ B[bi, :, gi]
            h0 = kw["initial_states"][bi, hi]
            yy = yy + torch.exp(torch.cumsum(a, 0))[:, None] * (C[bi, :, gi] @ h0.T)
            ff = ff + torch.exp(a.sum()) * h0
            yh.append(yy)
            fh.append(ff)
        ys.append(torch.stack(yh, 1))
        finals.append(torch.stack(fh))
    y, final = torch.stack(ys), torch.stack(finals)
    y = y + x * kw["D"]
    z = kw["z"]
    return y * z * torch.sigmoid(z), final


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------

def make(b=2, l=100, h=4, p=16, G=1, n=8, dtype=F64, D="hp", z=True, dt_bias=True, h0=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    kw = dict(x=r(b, l, h, p), dt=r(b, l, h) - 1.0, A=-torch.rand(h, generator=gen, dtype=F64) * 2 - 0.1,
              B=r(b, l, G, n), C=r(b, l, G, n))
    kw["D"] = None if D is None else (r(h, p) if D == "hp" else r(h))
    kw["z"] = r(b, l, h, p) if z else None
    kw["dt_bias"] = r(h) * 0.5 if dt_bias else None
    kw["initial_states"] = r(b, h, p, n) if h0 else None
    cast = {"x": dtype, "B": dtype, "C": dtype, "z": dtype}
    for name, t in kw.items():
        if t is not None:
            kw[name] = t.to(cast.get(name, torch.float32 if dtype != F64 else F64))
    return kw


def run(kw, chunk_size=32, **opts):
    return mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], chunk_size, D=kw["D"], z=kw["z"],
                                     dt_bias=kw["dt_bias"], initial_states=kw["initial_states"], backend="torch",
                                     **opts)


def assert_close(x, ref, tol, what):
    err = rel_err(x, ref)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.1e}"


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

CASES = {
    "plain": dict(D=None, z=False, dt_bias=False, h0=False),
    "all_inputs": dict(),
    "groups": dict(h=6, G=3),
    "D_per_head": dict(D="h"),
    "l_less_than_chunk": dict(l=20),
    "l_1": dict(l=1, b=3),
    "head_dims_60_100": dict(p=60, n=100, l=40, b=1, h=2),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("softplus", [False, True], ids=["raw_dt", "softplus"])
def test_adaptor_equals_ssd_quadratic_form(case, dtype, softplus):
    kw = make(dtype=dtype, **CASES[case])
    y_ref, h_ref = ssd_reference(**kw, dt_softplus=softplus)
    y, ht = run(kw, dt_softplus=softplus, return_final_states=True)
    assert y.dtype == dtype and y.shape == kw["x"].shape
    assert ht.dtype == (F64 if dtype == F64 else torch.float32) and ht.shape == h_ref.shape
    assert_close(y, y_ref, TOL[dtype], "y")
    assert_close(ht, h_ref, TOL[dtype], "final states")


def test_without_final_states_returns_y_only():
    kw = make(l=30)
    y = run(kw)
    assert isinstance(y, torch.Tensor)
    assert_close(y, ssd_reference(**kw)[0], TOL[F64], "y")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_low_precision(dtype):
    kw = make(dtype=dtype, l=80)
    y_ref, h_ref = ssd_reference(**kw, dt_softplus=True)
    y, ht = run(kw, dt_softplus=True, return_final_states=True)
    assert y.dtype == dtype and ht.dtype == torch.float32
    assert_close(y, y_ref, TOL[dtype], "y")
    assert_close(ht, h_ref, TOL[dtype], "final states")


def test_dt_limit_and_dt_processing_order():
    """dt_limit clamps after the softplus (both bounds active here); a negative raw dt is clamped to 0."""
    kw = make(l=60)
    limit = (0.2, 0.9)
    dt = process_dt(kw["dt"], kw["dt_bias"], True)
    assert (dt < limit[0]).any() and (dt > limit[1]).any()        # the clamp really acts
    y_ref, h_ref = ssd_reference(**kw, dt_softplus=True, dt_limit=limit)
    y, ht = run(kw, dt_softplus=True, dt_limit=limit, return_final_states=True)
    assert_close(y, y_ref, TOL[F64], "y")
    assert_close(ht, h_ref, TOL[F64], "final states")
    assert rel_err(y, ssd_reference(**kw, dt_softplus=True)[0]) > 1e-3
    # without softplus the raw dt (bias added) has negative entries: mamba_ssm clamps them to dt_min = 0
    assert (process_dt(kw["dt"], kw["dt_bias"], False, (-1e9, 1e9)) < 0).any()
    y_ref, _ = ssd_reference(**kw)
    assert_close(run(kw), y_ref, TOL[F64], "y, raw dt")


def test_softplus_is_the_identity_only_above_20():
    kw = make(l=40)
    kw["dt_bias"] = None
    kw["dt"][:, 5] = 8.0                            # softplus(8) = 8.000335: must not be treated as 8
    kw["dt"][:, 9] = 25.0                           # above 20: dt itself
    y_ref, h_ref = ssd_reference(**kw, dt_softplus=True)
    y, ht = run(kw, dt_softplus=True, return_final_states=True)
    assert_close(y, y_ref, TOL[F64], "y")
    assert_close(ht, h_ref, TOL[F64], "final states")


@pytest.mark.parametrize("chunk_size", [1, 16, 64, 256])
def test_chunk_size_independence(chunk_size):
    kw = make(l=130)
    y_ref, h_ref = ssd_reference(**kw, dt_softplus=True)
    y, ht = run(kw, chunk_size=chunk_size, dt_softplus=True, return_final_states=True)
    assert_close(y, y_ref, TOL[F64], "y")
    assert_close(ht, h_ref, TOL[F64], "final states")


def _pack(kws):
    """Concatenate b=1 inputs along seqlen (initial states stacked): a varlen batch."""
    out = {}
    for name in ("x", "dt", "B", "C", "z"):
        out[name] = torch.cat([k[name] for k in kws], 1)
    for name in ("A", "D", "dt_bias"):
        out[name] = kws[0][name]
    out["initial_states"] = torch.cat([k["initial_states"] for k in kws], 0)
    return out


def _pieces(lengths, **kw):
    base = make(b=1, l=max(lengths), **kw)
    pieces = []
    for i, n in enumerate(lengths):
        p = make(b=1, l=n, seed=100 + i, **kw)
        for name in ("A", "D", "dt_bias"):
            p[name] = base[name]
        pieces.append(p)
    return pieces


def test_cu_seqlens_equals_separate_sequences():
    lengths = [1, 50, 33, 64]
    pieces = _pieces(lengths, G=2)
    kw = _pack(pieces)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    y, ht = run(kw, cu_seqlens=cu, dt_softplus=True, return_final_states=True)
    assert ht.shape == (len(lengths), 4, 16, 8)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_ref, h_ref = ssd_reference(**pieces[i], dt_softplus=True)
        assert_close(y[:, s:e], y_ref, TOL[F64], f"y of sequence {i}")
        assert_close(ht[i:i + 1], h_ref, TOL[F64], f"final state of sequence {i}")


def test_return_varlen_states():
    """mamba_ssm's return_varlen_states: every packed sequence's final state, after y (and after the final
    states when both are asked for); with seq_idx one per sequence, not per row; an error without packing."""
    lengths = [1, 50, 33]
    pieces = _pieces(lengths, G=2)
    kw = _pack(pieces)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    y, vs = run(kw, cu_seqlens=cu, dt_softplus=True, return_varlen_states=True)
    y2, ht, vs2 = run(kw, cu_seqlens=cu, dt_softplus=True, return_final_states=True, return_varlen_states=True)
    assert vs.shape == (len(lengths), 4, 16, 8) and torch.equal(vs, vs2) and torch.equal(y, y2)
    for i in range(len(lengths)):
        y_ref, h_ref = ssd_reference(**pieces[i], dt_softplus=True)
        assert_close(vs[i:i + 1], h_ref, TOL[F64], f"varlen state of sequence {i}")
    # seq_idx on two rows: final states per row (its last sequence), varlen states per sequence
    row = dict(kw, initial_states=None)
    seq_idx = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)]], dtype=torch.int32)
    _, ht_s, vs_s = run(row, seq_idx=seq_idx, dt_softplus=True, return_final_states=True, return_varlen_states=True)
    assert ht_s.shape == (1, 4, 16, 8) and vs_s.shape == (3, 4, 16, 8)
    assert torch.equal(ht_s[0], vs_s[-1])
    with pytest.raises(ValueError, match="return_varlen_states"):
        run(make(l=20), return_varlen_states=True)


def test_seq_idx_resets_the_state_and_matches_cu_seqlens():
    """seq_idx (mamba_ssm's packing): the state restarts wherever it changes; rows are independent."""
    lengths = [[30, 1, 39], [70]]
    rows = [_pieces(ls, h0=False) for ls in lengths]
    for row in rows:
        for p in row:
            p["A"], p["D"], p["dt_bias"] = rows[0][0]["A"], rows[0][0]["D"], rows[0][0]["dt_bias"]
    packed = [_pack([dict(p, initial_states=torch.zeros(1)) for p in row]) for row in rows]
    kw = {name: (torch.cat([pk[name] for pk in packed], 0) if name in ("x", "dt", "B", "C", "z") else packed[0][name])
          for name in packed[0]}
    kw["initial_states"] = None
    seq_idx = torch.tensor([[i for i, n in enumerate(ls) for _ in range(n)] for ls in lengths], dtype=torch.int32)
    y, ht = run(kw, seq_idx=seq_idx, dt_softplus=True, return_final_states=True)
    assert ht.shape == (2, 4, 16, 8)
    for b, (ls, row) in enumerate(zip(lengths, rows)):
        s = 0
        for p, n in zip(row, ls):
            y_ref, h_ref = ssd_reference(**p, dt_softplus=True)
            assert_close(y[b:b + 1, s:s + n], y_ref, TOL[F64], f"row {b}, sequence at {s}")
            s += n
        assert_close(ht[b:b + 1], h_ref, TOL[F64], f"final state of row {b} (its last sequence)")
    # without seq_idx the rows are single sequences: a different result
    assert rel_err(run(kw, dt_softplus=True), y) > 1e-3
    # on a single row, seq_idx and the equivalent cu_seqlens agree (and may be given together)
    row0 = {name: (t[:1] if name in ("x", "dt", "B", "C", "z") else t) for name, t in kw.items()}
    cu = torch.tensor([0, 30, 31, 70])
    y_cu = run(row0, cu_seqlens=cu, dt_softplus=True)
    assert_close(y_cu, y[:1], 1e-12, "cu_seqlens vs seq_idx")
    assert_close(run(row0, cu_seqlens=cu, seq_idx=seq_idx[:1], dt_softplus=True), y_cu, 1e-12, "both")
    with pytest.raises(ValueError, match="seq_idx and cu_seqlens"):
        run(row0, cu_seqlens=torch.tensor([0, 31, 70]), seq_idx=seq_idx[:1])


def test_two_halves_with_state_hand_over():
    kw = make(l=120)
    y, ht = run(kw, dt_softplus=True, return_final_states=True)
    first = {n: (t[:, :50] if n in ("x", "dt", "B", "C", "z") else t) for n, t in kw.items()}
    second = {n: (t[:, 50:] if n in ("x", "dt", "B", "C", "z") else t) for n, t in kw.items()}
    y1, h1 = run(first, dt_softplus=True, return_final_states=True)
    y2, h2 = run(dict(second, initial_states=h1), dt_softplus=True, return_final_states=True)
    assert_close(torch.cat([y1, y2], 1), y, TOL[F64], "y")
    assert_close(h2, ht, TOL[F64], "final states")


def test_nan_propagates():
    kw = make(l=80)
    kw["x"][1, 40, 2, 3] = float("nan")
    y, ht = run(kw, return_final_states=True)
    assert torch.isfinite(y[0]).all() and torch.isfinite(ht[0]).all()
    assert all(y[1, t].isnan().any() for t in range(40, 80))
    assert ht[1].isnan().any()


# ----------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------

def test_gradients_equal_the_quadratic_form():
    kw = make(b=2, l=40, h=4, p=6, G=2, n=5)
    names = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"]
    for name in names:
        kw[name].requires_grad_(True)
    gen = torch.Generator().manual_seed(3)
    w_y = torch.randn(kw["x"].shape, generator=gen, dtype=F64)
    w_h = torch.randn(kw["initial_states"].shape, generator=gen, dtype=F64)
    y, ht = run(kw, chunk_size=16, dt_softplus=True, return_final_states=True)
    grads = torch.autograd.grad((y * w_y).sum() + (ht * w_h).sum(), [kw[n] for n in names])
    y_ref, h_ref = ssd_reference_autograd(**kw, dt_softplus=True)
    ref = torch.autograd.grad((y_ref * w_y).sum() + (h_ref * w_h).sum(), [kw[n] for n in names])
    assert_close(y, y_ref, TOL[F64], "y")
    for name, g, r in zip(names, grads, ref):
        assert r.norm() > 0
        assert_close(g, r, 1e-9, f"d{name}")


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------

def _bad(**over):
    kw = make(b=2, l=10, h=4, p=6, G=2, n=5, dtype=torch.float32)
    kw.update(over)
    return kw


BAD = {
    "x_dims": (dict(x=torch.randn(2, 10, 24)), ValueError, ["x", "(2, 10, 24)"]),
    "x_int": (dict(x=torch.zeros(2, 10, 4, 6, dtype=torch.int32)), TypeError, ["x", "torch.int32"]),
    "B_seqlen": (dict(B=torch.randn(2, 9, 2, 5)), ValueError, ["B", "(2, 9, 2, 5)", "(2, 10, 4, 6)"]),
    "groups_not_dividing_heads": (dict(B=torch.randn(2, 10, 3, 5), C=torch.randn(2, 10, 3, 5)), ValueError,
                                  ["nheads=4", "ngroups=3"]),
    "C_shape": (dict(C=torch.randn(2, 10, 2, 4)), ValueError, ["C", "(2, 10, 2, 4)", "[2, 10, 2, 5]"]),
    "dt_shape": (dict(dt=torch.randn(2, 10, 4, 1)), ValueError, ["dt", "(2, 10, 4, 1)", "[2, 10, 4]"]),
    "A_shape": (dict(A=torch.randn(4, 5)), ValueError, ["A", "(4, 5)", "[4]"]),
    "D_shape": (dict(D=torch.randn(4, 5)), ValueError, ["D", "(4, 5)", "[4, 6]"]),
    "z_shape": (dict(z=torch.randn(2, 10, 4, 5)), ValueError, ["z", "(2, 10, 4, 5)"]),
    "dt_bias_shape": (dict(dt_bias=torch.randn(2)), ValueError, ["dt_bias", "(2,)", "[4]"]),
    "initial_states_layout": (dict(initial_states=torch.randn(2, 4, 5, 6)), ValueError,
                              ["initial_states", "(2, 4, 5, 6)", "[2, 4, 6, 5]"]),
    "device": (dict(z=torch.randn(2, 10, 4, 6, device="meta")), ValueError, ["z on meta", "x on cpu"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments(case):
    over, exc, words = BAD[case]
    with pytest.raises(exc) as info:
        run(_bad(**over))
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} should mention {w!r}"


def test_bad_options():
    kw = _bad()
    with pytest.raises(ValueError, match="chunk_size"):
        run(kw, chunk_size=0)
    with pytest.raises(ValueError, match="dt_limit"):
        run(kw, dt_limit=(1.0, 0.5))
    seq_idx = torch.zeros(2, 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="initial_states with seq_idx"):
        run(kw, seq_idx=seq_idx)
    kw["initial_states"] = None
    with pytest.raises(TypeError, match="seq_idx"):
        run(kw, seq_idx=seq_idx.float())
    with pytest.raises(ValueError, match=r"seq_idx must have shape \[batch, seqlen\]"):
        run(kw, seq_idx=seq_idx[:, :5])
    with pytest.raises(ValueError, match="non-decreasing"):
        run(kw, seq_idx=torch.tensor([[0] * 5 + [1] * 3 + [0] * 2] * 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="batch size must be 1"):
        run(kw, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    kw1 = {n: (t[:1] if n in ("x", "dt", "B", "C", "z") else t) for n, t in kw.items()}
    with pytest.raises(ValueError, match=r"initial_states.*\[2, 4, 6, 5\]"):
        run(dict(kw1, initial_states=torch.randn(1, 4, 6, 5)), cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(TypeError):                      # positional dt_softplus: keyword-only, by design
        mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 16, None, None, None, None, None,
                                  True)


# ----------------------------------------------------------------------------------------------
# the triton backend (under the interpreter on CPU, or on the GPU)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_triton_backend_forward(dtype):
    lengths = [1, 30, 9]
    pieces = _pieces(lengths, h=2, p=16, n=16, dtype=dtype)
    kw = {n: (None if t is None else t.to(DEVICE)) for n, t in _pack(pieces).items()}
    cu = torch.tensor([0, 1, 31, 40], dtype=torch.int32, device=DEVICE)
    y, ht = mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 64, D=kw["D"], z=kw["z"],
                                      dt_bias=kw["dt_bias"], initial_states=kw["initial_states"], dt_softplus=True,
                                      return_final_states=True, cu_seqlens=cu, backend="triton")
    assert y.dtype == dtype and ht.dtype == torch.float32
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_ref, h_ref = ssd_reference(**pieces[i], dt_softplus=True)
        assert_close(y[:, s:e], y_ref, TOL[dtype], f"y of sequence {i}")
        assert_close(ht[i:i + 1], h_ref, TOL[dtype], f"final state of sequence {i}")


def test_triton_backend_gradients():
    kw = make(b=1, l=40, h=2, p=16, G=1, n=16)
    names = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"]
    for name in names:
        kw[name].requires_grad_(True)
    gen = torch.Generator().manual_seed(3)
    w_y = torch.randn(kw["x"].shape, generator=gen, dtype=F64)
    w_h = torch.randn(kw["initial_states"].shape, generator=gen, dtype=F64)
    y_ref, h_ref = ssd_reference_autograd(**kw, dt_softplus=True)
    ref = torch.autograd.grad((y_ref * w_y).sum() + (h_ref * w_h).sum(), [kw[n] for n in names])
    k32 = {n: (None if t is None else t.detach().to(DEVICE, torch.float32).requires_grad_(True)) for n, t in kw.items()}
    y, ht = mamba_chunk_scan_combined(k32["x"], k32["dt"], k32["A"], k32["B"], k32["C"], 64, D=k32["D"], z=k32["z"],
                                      dt_bias=k32["dt_bias"], initial_states=k32["initial_states"], dt_softplus=True,
                                      return_final_states=True, backend="triton")
    loss = (y * w_y.to(y)).sum() + (ht * w_h.to(ht)).sum()
    grads = torch.autograd.grad(loss, [k32[n] for n in names])
    for name, g, r in zip(names, grads, ref):
        assert_close(g, r, 1e-4, f"d{name}")
