"""Speculative decoding over the state pool: the rollback after a verify step.

A verify step runs the draft tokens of every sequence from its pool slot with
``intermediate_states`` (``fused_recurrent_*(..., state_indices=..., intermediate_states=buf)``):
the state after each draft token lands in ``buf[n, t]`` and the pool is left as it was. Once the
target model has decided how many tokens each sequence accepts, `rollback` copies the state after
the last accepted one into the pool slot. The accepted tokens are never recomputed.

Bytes moved, per sequence with T_draft draft tokens and a state of HV·K·V fp32 values:
    verify:   read the slot once (4·HV·K·V), write T_draft states (T_draft·HV·K·V·4)
    rollback: read one state and write the slot (2·4·HV·K·V)
against re-running the accepted tokens from the old slot (read + write 2·4·HV·K·V plus the inputs of
up to T_draft tokens) and a second launch on the critical path. In a 16-bit pool every 4 is a 2; in an 8-bit
pool the slot's 4 is a 1 (plus 4 bytes of scale per row), the per-token states stay fp32.
"""
from __future__ import annotations

import torch

from ._custom_ops import _eager_plain, rollback as rollback_op, rollback_impl
from .api import QUANT_DTYPES, _choose_backend, check_live_indices_unique


def rollback(pool: torch.Tensor, state_indices: torch.Tensor, intermediate_states: torch.Tensor,
             num_accepted_tokens: torch.Tensor, *, state_scales: torch.Tensor | None = None,
             backend: str = "auto") -> torch.Tensor:
    """Keep the state after each sequence's last accepted draft token: for every n with
    num_accepted_tokens[n] = a > 0, ``pool[state_indices[n]] = intermediate_states[n, a - 1]``.

    Args:
        pool: [P, HV, K, V] (or [P, HV, V, K]) the state pool the verify step read, any float dtype, or
            int8 / float8_e4m3fn with state_scales.
        state_indices: [N] int, the verify step's slots; -1 (or any index outside [0, P)) is skipped.
        intermediate_states: [N, T_draft, ...pool's slot shape] from the verify step (FlashInfer's
            intermediate_states_buffer), contiguous; fp32 for an 8-bit pool.
        num_accepted_tokens: [N] int, 0 to T_draft (vLLM's num_accepted_tokens). 0: slot untouched.
        state_scales: [P, HV, R] fp32 (R = K, or V transposed), the scales of an 8-bit pool, the decode and
            prefill ops' format: the kept fp32 state is requantized into the slot and its R scales.
        backend: "auto" (triton for CUDA tensors), "triton" or "torch".
    Returns the pool, updated in place. On the GPU: one small Triton launch, no host sync, CUDA-graph
    capturable. In plain eager mode duplicate live indices raise (a host sync: skipped under capture).
    Under torch.compile (fullgraph) it is the mutating custom op chunkwise::rollback.
    """
    if intermediate_states.dim() != pool.dim() + 1 or intermediate_states.shape[2:] != pool.shape[1:]:
        raise ValueError(f"intermediate_states must be [N, T_draft, {list(pool.shape[1:])}] for the pool "
                         f"{list(pool.shape)}, got {list(intermediate_states.shape)}")
    N = intermediate_states.shape[0]
    for name, x in (("state_indices", state_indices), ("num_accepted_tokens", num_accepted_tokens)):
        if x.dim() != 1 or x.numel() != N or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be [N={N}] int32/int64, got {list(x.shape)} {x.dtype}")
    if len({pool.device, state_indices.device, intermediate_states.device, num_accepted_tokens.device}) > 1:
        raise ValueError("pool, state_indices, intermediate_states and num_accepted_tokens must share one device")
    if not intermediate_states.is_contiguous() or not pool[0].is_contiguous():
        raise ValueError("rollback copies whole states: intermediate_states and each pool slot must be contiguous")
    _check_scales(pool, intermediate_states, state_scales)
    if state_indices.device.type == "cpu" and N and _eager_plain(state_indices):
        lo, hi = int(state_indices.min()), int(state_indices.max())
        if lo < -1 or hi >= pool.shape[0]:
            raise ValueError(f"state_indices must lie in [-1, P) = [-1, {pool.shape[0]}), got values from {lo} to {hi}")
    check_live_indices_unique(state_indices)
    args = (pool, state_indices, intermediate_states, num_accepted_tokens, state_scales,
            _choose_backend(backend, pool.device, pool.shape[-2], pool.shape[-1]))
    if _eager_plain(*args[:5]):
        rollback_impl(*args)            # the custom op's dispatch skipped (see _custom_ops._eager_plain)
    else:
        rollback_op(*args)              # chunkwise::rollback, a mutating custom op: torch.compile, opcheck
    return pool


def _check_scales(pool, intermediate_states, state_scales):
    """An 8-bit pool needs its scales [P, HV, R] fp32 and fp32 per-token states; any other pool takes no scales."""
    if pool.dtype not in QUANT_DTYPES:
        if state_scales is not None:
            raise ValueError(f"state_scales goes with an int8 / float8_e4m3fn pool, got a {pool.dtype} pool")
        return
    want = (pool.shape[0], *pool.shape[1:-1])
    if state_scales is None:
        raise TypeError(f"an 8-bit pool ({pool.dtype}) needs state_scales {list(want)} fp32")
    if (tuple(state_scales.shape) != want or state_scales.dtype != torch.float32 or not state_scales.is_contiguous()
            or state_scales.device != pool.device):
        raise ValueError(f"state_scales must be a contiguous fp32 {list(want)} on the pool's device, got "
                         f"{list(state_scales.shape)} {state_scales.dtype} on {state_scales.device}")
    if intermediate_states.dtype != torch.float32:
        raise TypeError(f"an 8-bit pool keeps fp32 intermediate_states (the verify step's), got {intermediate_states.dtype}")
