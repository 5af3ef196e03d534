"""Triton backend. The API (chunkwise.api.run) has already checked every argument and applied the
in-op preludes (L2 norm, beta sigmoid, gate from projections); kernels never validate. Autograd and
torch.compile reach the launchers through the custom ops of chunkwise._custom_ops: chunk.chunk_fwd
(the chunk forward, and the saving forward for the backward), chunk.chunk_bwd, decode.recurrent_fwd.

Canonical inputs of the launchers:
    q, k: [B, T, H, K]  fp16 / bf16 / fp32
    v:    [B, T, HV, V] same dtype; HV % H == 0
    g:    None | [B, T, HV] fp32 (scalar log-decay per token) | [B, T, HV, K] fp32 (per channel, KDA)
    beta: None (no delta rule: simple GLA) | [B, T, HV] (q's dtype or fp32)
    scale: float
    initial_state: None | [N, HV, K, V] ([N, HV, V, K] if transpose_state_layout), any float dtype
    cu_seqlens: None | [N + 1] int (then B == 1)
The forward launchers return (o [B, T, HV, V] in q's dtype, final_state fp32 in the chosen layout or None).
"""
from .decode import recurrent  # noqa: F401
