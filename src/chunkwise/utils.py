"""Constants and small pure-PyTorch helpers shared by every layer of the package.

This module imports nothing from chunkwise: the argument checks (``api``), the dispatch
(``_custom_ops``) and the kernels (``triton``, ``reference``) all import from here, never from each
other upwards.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The widest head dim (K or V) the Triton kernels take; the backward's tiles fit one SM's shared memory up to it.
TRITON_MAX_HEAD_DIM = 256


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """For varlen calls: [NT, 2] int32 rows (sequence n, chunk i within n) over all chunks.

    Compute it once per batch (it reads cu_seqlens on the host) and pass it with ``chunk_indices``
    so that the Triton kernels launch without a device-to-host sync.
    """
    cu = cu_seqlens.detach().to("cpu", torch.long)
    n_chunks = (cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size
    seq = torch.repeat_interleave(torch.arange(n_chunks.numel()), n_chunks)
    first = torch.cumsum(n_chunks, 0) - n_chunks
    within = torch.arange(int(n_chunks.sum())) - first[seq]
    return torch.stack([seq, within], 1).to(device=cu_seqlens.device, dtype=torch.int32)
