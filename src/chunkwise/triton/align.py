"""Zero-padding of head dims the chunk kernels cannot take as they are.

Measured on the H200 with triton 3.6 (benchmarks/diag_gpu.py, one subprocess per case, forward vs the
float64 recurrence): with bf16 or fp16 inputs, K = 100 / V = 60 gave wrong outputs (GDN: 0.24-0.61
relative error) or an illegal memory access (simple GLA), also after padding to 104 / 64 (whole 16-byte
rows), while K, V in {64, 128} were right (3e-3 bf16, 5e-4 fp16), and so were fp32 inputs with
K = 100 / V = 60 (2e-7). So with 16-bit inputs a head dim that is not a power of two is padded up to
the next one (the kernels' tile width BK / BV then equals the dim: no masked channels); with fp32 a
head dim whose rows are not whole 16-byte units is padded to one that is. The results are cut back.
Zero channels change nothing: q·k is unchanged, the state's extra rows and columns stay zero, a
zero gate is e^0 = 1, and the gradients of the padded channels are dropped.
"""
from __future__ import annotations

import torch.nn.functional as F


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' host arithmetic (``triton.cdiv`` costs ~6 us a call on the host: a
    constexpr function's wrapper; a forward makes ~16 such calls)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as ``triton.next_power_of_2`` without its host cost."""
    return 1 << (n - 1).bit_length()


def aligned_dim(n: int, element_size: int) -> int:
    """The head dim the kernels run with for n channels of element_size bytes: the next power of two
    (at least 16) for 16-bit inputs, else n rounded up to whole 16-byte units."""
    if element_size <= 2:
        return max(16, next_pow2(n))
    unit = max(1, 16 // element_size)
    return cdiv(n, unit) * unit


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
