"""Short causal depthwise convolution over time, with the state that incremental decoding carries."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def last_token_end(attention_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """[B, T] mask (1 = token, 0 = padding) -> [B] one past each row's last real token (0 if none).

    With left padding (or none) that is T for every row; with right padding, the row's length.
    Computed on the device (no host sync).
    """
    if attention_mask is None:
        return None
    pos = torch.arange(1, T + 1, device=attention_mask.device)
    return (attention_mask[:, -T:].to(pos.dtype) * pos).amax(-1)


class ShortConvolution(nn.Conv1d):
    """y_t[d] = act(Σ_{i<W} w[d, i] · x_{t−W+1+i}[d] + bias[d]), causal and depthwise.

    The W − 1 inputs before the first token come from ``conv_state`` ([B, D, W − 1], the last
    inputs of the previous call) or are zero. The weight is nn.Conv1d's [D, 1, W], so weights of
    transformers' Qwen3-Next ``conv1d`` and fla's ``ShortConvolution`` load as they are.

    Args:
        dim: D channels. kernel_size: W. bias: add a bias. activation: "silu" or None.
    """

    def __init__(self, dim: int, kernel_size: int = 4, bias: bool = False, activation: str | None = "silu"):
        super().__init__(dim, dim, kernel_size, groups=dim, bias=bias, padding=0)
        if activation not in (None, "silu"):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        self.activation = activation

    @property
    def state_len(self) -> int:
        return self.kernel_size[0] - 1

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor | None = None,
                ends: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, D]; conv_state: None | [B, D, W − 1]; ends: None | [B] (see `last_token_end`):
        the new state is taken from the W − 1 inputs before ``ends`` (padding on the right is not
        carried into the state).

        Returns (y [B, T, D] in x's dtype, new conv state [B, D, W − 1] in x's dtype).
        """
        B, T, D = x.shape
        W1 = self.state_len
        xt = x.transpose(1, 2)                                                     # [B, D, T]
        prev = xt.new_zeros(B, D, W1) if conv_state is None else conv_state.to(xt.dtype)
        full = torch.cat([prev, xt], dim=-1)                                       # [B, D, W − 1 + T]
        y = F.conv1d(full, self.weight.to(xt.dtype), None if self.bias is None else self.bias.to(xt.dtype),
                     groups=D)                                                     # [B, D, T]
        if self.activation == "silu":
            y = F.silu(y)
        if ends is None:
            state = full[..., full.shape[-1] - W1:]
        else:
            idx = ends[:, None] + torch.arange(W1, device=x.device)                # [B, W − 1] into `full`
            state = full.gather(-1, idx[:, None, :].expand(B, D, W1))
        return y.transpose(1, 2), state.contiguous()
