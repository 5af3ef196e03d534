"""The triangular solve of stage 1: T = (I + A)⁻¹ for a chunk's strictly lower triangular A.

Its product precision (PREC, one of _mm's) is the plan's ``solve_prec`` (triton/configs.py): tf32x3 for fp32
inputs, tf32 for 16-bit ones (tf32x3 for fp16), or, in the bf16 inference forward, fp16 operands with the chunk's
solve redone at the input dtype's own precision where T comes out non-finite (stage 1 checks, the plan's
``redo_prec``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _mm


@triton.jit
def _solve_unit_lower(A, PREC: tl.constexpr, BTc: tl.constexpr, BCc: tl.constexpr):
    """T = (I + A)⁻¹ for A [BT, BT] fp32 strictly lower triangular (BT = 4 BC). Returns [BT, BT] fp32.

    With D the 16×16 diagonal blocks of A and L = A − D (strictly block-lower):
        I + A = (I + D)(I + M),   M = (I + D)⁻¹ L,   M⁴ = 0
        (I + D)⁻¹: three doubling levels X_2s = X_s − X_s L_s X_s over the 2×2, 4×4, 8×8 solved blocks (two
                   products each, batched over the 4 blocks, [4, 16, 16])
        (I + M)⁻¹ = (I − M)(I + M²)
        T = (I + M)⁻¹ (I + D)⁻¹
    The doubling levels are the exact inverse of a 2×2 block-lower matrix, [[I_a, 0], [L, I_b]]⁻¹ =
    [[I_a⁻¹, 0], [−I_b⁻¹ L I_a⁻¹, I_b⁻¹]] (recursive triangular inversion, as stable as substitution), in 6 dependent
    products instead of the 14 of a row-by-row substitution. Powers of D are never formed: with nearly parallel keys
    (D ≈ −0.97 below the diagonal) the product form (I − D)(I + D²)(I + D⁴)(I + D⁸) costs far more accuracy than a
    triangular solve. M's powers stop at M² (4 block steps). Every product is a dot (tensor cores).
    """
    NB: tl.constexpr = BTc // BCc
    o_t = tl.arange(0, BTc)
    o_b = tl.arange(0, NB)
    o_c = tl.arange(0, BCc)
    same = (o_t // BCc)[:, None] == (o_t // BCc)[None, :]
    eye = tl.where(o_t[:, None] == o_t[None, :], 1., 0.)
    on_diag = (o_b[:, None] == o_b[None, :])[:, :, None, None]                          # [NB, NB, 1, 1]
    A4 = tl.permute(tl.reshape(A, [NB, BCc, NB, BCc]), (0, 2, 1, 3))                   # [b, c, i, j]
    Dd = tl.sum(tl.where(on_diag, A4, 0.), 1)                                          # [NB, BC, BC]
    eye_b = tl.where(o_c[:, None] == o_c[None, :], 1., 0.)[None, :, :]
    # (I + D)⁻¹ by doubling the solved block: with X_s the inverses of the s×s diagonal blocks, a 2s×2s block
    # [[I_a, 0], [L_s, I_b]] has the inverse X_2s = X_s − X_s L_s X_s (L_s: D's lower-left s×s block in each
    # 2s×2s block). Exact, no powers of D; 2 log2(BC / 2) products in sequence instead of BC − 2.
    s_rows = o_c[:, None]
    s_cols = o_c[None, :]
    m1 = (s_rows == s_cols + 1) & (s_rows % 2 == 1)
    X = eye_b - tl.where(m1[None, :, :], Dd, 0.)
    tl.static_assert(BCc == 16, "the doubling solve is written for 16×16 diagonal blocks")
    for lvl in tl.static_range(1, 4):
        m = ((s_rows >> lvl) % 2 == 1) & ((s_cols >> lvl) % 2 == 0) & (s_rows >> (lvl + 1) == s_cols >> (lvl + 1))
        Ls = tl.where(m[None, :, :], Dd, 0.)
        XL = _mm(X, Ls, PREC)                                                          # [NB, BC, BC] @ [NB, BC, BC]
        X = X - _mm(XL, X, PREC)                                                       # [NB, BC, BC] @ [NB, BC, BC]
    Dinv = tl.reshape(tl.permute(tl.where(on_diag, tl.expand_dims(X, 1), 0.), (0, 2, 1, 3)), [BTc, BTc])
    L = tl.where(same, 0., A)
    M = _mm(Dinv, L, PREC)                                                             # [BT, BT] @ [BT, BT]
    M2 = _mm(M, M, PREC)                                                               # [BT, BT] @ [BT, BT]
    Y = eye - M
    Y = Y + _mm(Y, M2, PREC)                                                           # [BT, BT] @ [BT, BT]
    return _mm(Y, Dinv, PREC)                                                          # [BT, BT] @ [BT, BT]

