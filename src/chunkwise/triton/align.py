"""Zero-padding of head dims whose rows are not whole 16-byte units.

On the H200 with triton 3.6 the chunk kernels gave wrong outputs (fp16, K = 100, V = 60: 0.17
relative error) or an illegal memory access for rows of 200 / 120 bytes, while the same shapes in
fp32 (400- / 240-byte rows) were right (benchmarks/NOTES.md, "GPU test status"). So a head dim
whose rows are not a multiple of 16 bytes is padded with zeros up to one that is, and the results
are cut back. Zero channels change nothing: q·k is unchanged, the state's extra rows and columns
stay zero, a zero gate is e^0 = 1, and the gradients of the padded channels are dropped.
"""
from __future__ import annotations

import torch.nn.functional as F


def aligned_dim(n: int, element_size: int) -> int:
    """n rounded up so that n elements are a whole number of 16-byte units."""
    unit = max(1, 16 // element_size)
    return -(-n // unit) * unit


def padded_dims(q, v) -> tuple[int, int]:
    """(K', V') the kernels run with for q [.., K] and v [.., V]."""
    return aligned_dim(q.shape[-1], q.element_size()), aligned_dim(v.shape[-1], v.element_size())


def pad_last(x, n: int):
    """x zero-padded along its last dim to n (x itself when already n; None stays None)."""
    return x if x is None or x.shape[-1] == n else F.pad(x, (0, n - x.shape[-1]))


def pad_state(s, K: int, V: int, transposed: bool):
    """A state [N, HV, K0, V0] ([N, HV, V0, K0] transposed) zero-padded to K × V."""
    if s is None:
        return None
    rows, cols = (V, K) if transposed else (K, V)
    if tuple(s.shape[-2:]) == (rows, cols):
        return s
    return F.pad(s, (0, cols - s.shape[-1], 0, rows - s.shape[-2]))


def cut_state(s, K: int, V: int, transposed: bool):
    """The K × V corner of a padded state, contiguous (None stays None)."""
    if s is None:
        return None
    return (s[..., :V, :K] if transposed else s[..., :K, :V]).contiguous()
