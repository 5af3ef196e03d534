"""RMSNorm and the gated RMSNorm at the output of the linear-attention layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · weight over the last dim, computed in fp32 (fp64 for fp64 x), returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_compute_dtype(x))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """y = RMSNorm(x) · act(gate), act = SiLU (Qwen3-Next's GDN) or sigmoid (Kimi Linear's KDA).

    x, gate: [..., D] (same shape). Computed in fp32, returned in x's dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__(dim, eps)
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"activation must be 'silu' or 'sigmoid', got {activation!r}")
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gf = gate.to(_compute_dtype(x))
        act = F.silu(gf) if self.activation == "silu" else torch.sigmoid(gf)
        return (super().forward(x).to(gf.dtype) * act).to(x.dtype)
