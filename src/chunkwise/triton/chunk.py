"""Entry point of the Triton chunk ops: an autograd.Function over the forward and backward launchers.

Forward saves only its inputs (O(T·H·(K+V))); the backward recomputes what it needs.
"""
from __future__ import annotations

import torch

from .chunk_bwd import chunk_bwd
from .chunk_fwd import chunk_fwd


class ChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
                transpose_state_layout):
        o, final_state = chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                   chunk_indices=chunk_indices, transpose_state_layout=transpose_state_layout)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices)
        ctx.scale = scale
        ctx.transpose_state_layout = transpose_state_layout
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(
            q, k, v, g, beta, ctx.scale, initial_state, do, dht, cu_seqlens,
            chunk_indices=chunk_indices, transpose_state_layout=ctx.transpose_state_layout)
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None


def chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *, cu_seqlens_cpu=None,
          chunk_indices=None, transpose_state_layout=False):
    """See chunkwise.triton for the canonical inputs. Returns (o, final_state or None)."""
    if cu_seqlens is not None and chunk_indices is None:
        from ..api import prepare_chunk_indices
        chunk_indices = prepare_chunk_indices(cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens)
        chunk_indices = chunk_indices.to(q.device)
    return ChunkFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               chunk_indices, transpose_state_layout)
