"""The launch plans of the chunk kernels, as data: which form each stage takes and how it is launched, per GPU
architecture, family (gate kind), input dtype and head-dim bucket.

sm_90 (H100 / H200) holds the measured values; any other architecture takes the same values for now, except where
a value needs sm_90 (tensor descriptors, TMA). Each default carries one line of why; the figures behind them are in
docs/performance.md.
"""
from __future__ import annotations

import torch

from .common import _dim, builds_for_gpu

# 16-bit inputs with K above this run the chunk forward and backward in fp32 (inputs upcast, outputs and gradients
# returned in the input dtype): at K = 256 the sm_90 builds with 16-bit inputs raised illegal memory accesses or
# gave wrong gradients, where fp32 passed.
WIDE_16BIT_K = 128


def wu_lowp_ok(dtype: torch.dtype, K: int, V: int) -> bool:
    """Whether stage 1 (the forward's, or the backward's recompute) may form W / U with 16-bit product operands:
    16-bit inputs at a 128-wide key tile and a value tile of at least 64 only (narrower tiles' 16-bit builds raised
    illegal memory accesses or gave wrong gradients on sm_90 with triton 3.6)."""
    return dtype != torch.float32 and _dim(K) == 128 and _dim(V) >= 64


def fp16_kda_in_fp32(q, g) -> bool:
    """Whether chunk_bwd runs these inputs in fp32 and the forward saves nothing for it: fp16 with a per-channel gate,
    built for a GPU (its sm_90 fp16 build gave inf gradients on small varlen batches with grouped heads, where the
    interpreter and fp32 were right)."""
    return q.dtype == torch.float16 and g is not None and g.dim() == 4 and builds_for_gpu(q.device)
