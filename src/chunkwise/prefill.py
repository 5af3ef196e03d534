"""Serving features of the chunk (prefill) ops: a state pool and prefix-cache checkpoints.

The chunk ops (``chunk_gated_delta_rule``, ``chunk_kda``, ``chunk_delta_rule``, ``chunk_simple_gla``) route
here when given ``state_indices``. The argument names follow vLLM (``state_indices``, its ``ssm_state_indices``;
``has_initial_state``) and FlashInfer (``checkpoint_every`` for its ``checkpoint_every_n_tokens``).

Prefill into the pool is a gather, the plain chunk op, and a scatter, all on the device: no host sync and
CUDA-graph capturable. It moves 2·N·HV·K·V·4 bytes more than the plain op (the N states read and written
once more), small beside a prefill that reads T·(2K + V) activations per head.

Checkpoints (``checkpoint_every=C``, ``checkpoints=buf``; with or without a pool) are written by the forward
itself. The triton backend's stage-2 kernel, which carries each sequence's state through its chunks in
registers, stores it after every C / 64 chunks into ``buf[checkpoint_slots(cu_seqlens, C)[n] + j]`` (slots
computed on the device: no host sync, CUDA-graph capturable; a constexpr-gated store, absent from the kernel
built without checkpoints). It adds only that write: HV·K·V·4 bytes per checkpoint (fp32 buffer), i.e.
HV·K·V·4 / C per token, against about (2·H·K + 2·HV·V)·2 bytes per token of 16-bit q, k, v and o: at H = HV =
32, K = V = 128 that is 32 KiB per token at C = 64 (as much again as those), 2 KiB at C = 1024. The torch
backend runs the batch in C-token pieces instead (reference.chunk.chunk_forward_checkpoints; planned on the
host), exact since a piece boundary is a chunk boundary.
"""
from __future__ import annotations

import torch

from .api import checkpoint_slots  # noqa: F401  (chunkwise.checkpoint_slots)


def _host_visible(t: torch.Tensor) -> bool:
    """Indices the host can read without a device sync (CPU, eager): checked with a clear error."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _refuse_grad(tensors, what):
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError(f"{what} is an inference feature: call it under torch.no_grad() (or detach the inputs); "
                           "training passes initial_state directly")


def chunk_serving(op, tensors: tuple, scale, initial_state, output_final_state, cu_seqlens, *, state_indices=None,
                  has_initial_state=None, checkpoint_every=None, checkpoints=None, cu_seqlens_cpu=None,
                  state_scales=None, **kw):
    """A chunk op with a state pool and/or checkpoints. ``op`` is the plain public chunk op, ``tensors`` its
    per-token positional tensors (q, k, v, then g and/or beta as the family takes them). Returns (o, final
    state): the pool itself with ``state_indices`` (when output_final_state), else [N, ...] fp32.

    An 8-bit pool (int8 / float8_e4m3fn) comes with ``state_scales`` [P, HV, R] (one fp32 scale per state
    row, as the decode op takes it): rows are dequantized on the gather and requantized on the scatter."""
    q = tensors[0]
    B, T = q.shape[0], q.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if state_indices is not None:
        pool = initial_state
        _refuse_grad(tensors + (pool,), "state_indices")
        if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
            raise ValueError("state_indices needs initial_state: the state pool [P, HV, K, V]")
        if not isinstance(state_indices, torch.Tensor) or state_indices.dim() != 1 or state_indices.numel() != N:
            raise ValueError(f"state_indices must be a 1-D int tensor with one entry per sequence (N={N})")
        if state_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"state_indices must be int32 or int64, got {state_indices.dtype}")
        if has_initial_state is not None and (has_initial_state.shape != (N,) or has_initial_state.dtype != torch.bool):
            raise ValueError(f"has_initial_state must be a bool tensor [N] = [{N}]")
        P = pool.shape[0]
        if _host_visible(state_indices) and N:
            # visible without a sync: a clear error now (on a GPU the masks below make a bad index harmless)
            lo, hi = int(state_indices.min()), int(state_indices.max())
            if lo < -1 or hi >= P:
                raise ValueError(f"state_indices must lie in [-1, P) = [-1, {P}) for the pool initial_state "
                                 f"{list(pool.shape)}, got values from {lo} to {hi}")
            live_rows = state_indices[state_indices >= 0]
            if live_rows.unique().numel() != live_rows.numel():
                raise ValueError("state_indices names a pool row twice among live sequences: each needs its own row")
        idx = state_indices.to(pool.device, torch.long)
        live = (idx >= 0) & (idx < P)
        row = idx.clamp(0, max(P - 1, 0))
        # fp8 is copied and selected as bytes (not every device implements those ops for it)
        raw = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool
        old = raw.index_select(0, row).view(pool.dtype)
        if state_scales is not None:
            from .reference.recurrent import dequantize, quantize
            if pool.dtype not in (torch.int8, torch.float8_e4m3fn) or tuple(state_scales.shape) != (P, *pool.shape[1:3]):
                raise ValueError(f"state_scales [P, HV, R] = {[P, *pool.shape[1:3]]} goes with an int8 / float8_e4m3fn "
                                 f"pool, got {list(state_scales.shape)} for a {pool.dtype} pool")
            old_scales = state_scales.index_select(0, row)
            old_value = dequantize(old, old_scales)
        elif pool.dtype in (torch.int8, torch.float8_e4m3fn):
            raise TypeError(f"an 8-bit state pool ({pool.dtype}) needs state_scales [P, HV, R]")
        else:
            old_value = old
        start = live if has_initial_state is None else live & has_initial_state.to(pool.device)
        ct = torch.float64 if old.dtype == torch.float64 else torch.float32
        h0 = torch.where(start.view(-1, 1, 1, 1), old_value.to(ct), torch.zeros((), dtype=ct, device=pool.device))
    else:
        h0 = initial_state
        if has_initial_state is not None or state_scales is not None:
            raise ValueError("has_initial_state and state_scales go with state_indices (the pool)")

    o, ht = op(*tensors, scale, h0, state_indices is not None or output_final_state, cu_seqlens,
               cu_seqlens_cpu=cu_seqlens_cpu, checkpoint_every=checkpoint_every, checkpoints=checkpoints, **kw)

    if state_indices is None:
        return o, (ht if output_final_state else None)
    # Scatter without a race: a row named twice (a dead index clamped onto a live row) gets the same value
    # from every writer: the first live sequence's final state, or its old value when no live one owns it.
    own = (row[:, None] == row[None, :]) & live[None, :]            # [n, m]: m is live and writes n's row
    first = own.int().argmax(1)
    owned = own.any(1)
    if state_scales is None:
        new = torch.where(owned.view(-1, 1, 1, 1), ht.index_select(0, first).to(pool.dtype), old)
    else:
        stored, scales = quantize(ht.index_select(0, first), pool.dtype)
        new = torch.where(owned.view(-1, 1, 1, 1), stored.view(raw.dtype), old.view(raw.dtype))
        state_scales.index_copy_(0, row, torch.where(owned.view(-1, 1, 1), scales, old_scales))
    raw.index_copy_(0, row, new.view(raw.dtype))
    # a skipped sequence's output is zero, as in the decode op
    if cu_seqlens is None:
        token_live = live.to(q.device).view(B, 1, 1, 1)
    else:
        seq = torch.searchsorted(cu_seqlens[1:].to(q.device), torch.arange(T, device=q.device), right=True)
        token_live = live.to(q.device).index_select(0, seq.clamp(max=max(N - 1, 0))).view(1, T, 1, 1)
    o = torch.where(token_live, o, torch.zeros((), dtype=o.dtype, device=o.device))   # not o·0: NaN stays
    return o, (pool if output_final_state else None)
