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
import warnings

import triton

# The Triton releases the kernels are tested on (CI runs the oldest and the newest).
TESTED_TRITON = ("3.6.0", "3.10")


class TritonVersionWarning(UserWarning):
    """The installed Triton is outside the range chunkwise's kernels are tested on."""


def _version_tuple(version: str) -> tuple:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def check_triton_version(version: str) -> bool:
    """Warn once (TritonVersionWarning) if `version` is outside [3.6.0, 3.10); return whether it is inside."""
    low, high = (_version_tuple(v) for v in TESTED_TRITON)
    inside = low <= _version_tuple(version) < high
    if not inside:
        warnings.warn(
            f"chunkwise: triton {version} is installed; the kernels are tested on triton "
            f">={TESTED_TRITON[0]},<{TESTED_TRITON[1]}", TritonVersionWarning, stacklevel=2)
    return inside


check_triton_version(triton.__version__)

from .decode import recurrent  # noqa: E402,F401
