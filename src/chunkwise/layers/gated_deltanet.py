"""Gated DeltaNet layer, as in Qwen3-Next (and Qwen3.5).

    [q k v z] = in_proj_qkvz(x), [b a] = in_proj_ba(x)         (grouped per q/k head, Qwen3-Next's layout)
    q, k, v   = SiLU(causal depthwise conv(q k v))             (ShortConvolution, width W)
    β = sigmoid(b),  g = −exp(A_log) · softplus(a + dt_bias)    (per token and value head)
    o = GatedDeltaRule(l2norm(q), l2norm(k), v, g, β)           (chunkwise ops; scale K^-½)
    y = out_proj(RMSNorm(o) · SiLU(z))                          (per value head)

Parameter names and shapes follow transformers' Qwen3NextGatedDeltaNet, so its state dict loads
as it is.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from ._common import DeltaRuleLayer, inverse_softplus_dt
from .conv import ShortConvolution
from .norm import GatedRMSNorm


class GatedDeltaNet(DeltaRuleLayer):
    """Args:
        hidden_size: model width.
        num_k_heads: H, the q/k heads; num_v_heads: HV, a multiple of H (grouped value heads).
        head_k_dim: K; head_v_dim: V.
        conv_size: W, the short convolution's width.
        norm_eps: epsilon of the gated RMSNorm.
        layer_idx: the key of this layer's states in a `LinearAttentionCache`.
        mode, backend, recurrent_max_len, chunk_size: see `DeltaRuleLayer` and the ops.
    """

    def __init__(self, hidden_size: int, num_k_heads: int = 4, num_v_heads: int | None = None, head_k_dim: int = 64,
                 head_v_dim: int | None = None, conv_size: int = 4, norm_eps: float = 1e-6, layer_idx: int = 0,
                 mode: str = "auto", backend: str = "auto", recurrent_max_len: int = 64, chunk_size: int = 32):
        super().__init__()
        self._init_heads(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, "num_k_heads")
        self._init_dispatch(layer_idx, mode, backend, recurrent_max_len, chunk_size)
        self.num_k_heads = num_k_heads
        num_v_heads, head_v_dim = self.num_v_heads, self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.conv1d = ShortConvolution(self.conv_dim, conv_size, bias=False, activation="silu")
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(inverse_softplus_dt(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps, activation="silu")
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def state_shapes(self, batch_size: int):
        """(conv state [B, 2·H·K + HV·V, W − 1], recurrent state [B, HV, K, V])."""
        return ((batch_size, self.conv_dim, self.conv1d.state_len),
                (batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def _split(self, qkvz, ba):
        """Qwen3-Next's grouped layout: per q/k head [q, k, v (G heads), z (G heads)] and [b (G), a (G)]."""
        B, T, _ = qkvz.shape
        H, G, K, V = self.num_k_heads, self.num_v_heads // self.num_k_heads, self.head_k_dim, self.head_v_dim
        q, k, v, z = qkvz.view(B, T, H, 2 * K + 2 * G * V).split([K, K, G * V, G * V], dim=-1)
        b, a = ba.view(B, T, H, 2 * G).split([G, G], dim=-1)
        return (q.reshape(B, T, H * K), k.reshape(B, T, H * K), v.reshape(B, T, H * G * V),
                z.reshape(B, T, H * G, V), b.reshape(B, T, H * G), a.reshape(B, T, H * G))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache=None, use_cache: bool = False):
        """hidden_states: [B, T, hidden_size]; attention_mask: None or [B, T'] (T' ≥ T, its last T
        columns are used; 1 = token, 0 = padding, left or right); cache: a `LinearAttentionCache`
        (read, then updated with this call's final states); use_cache: create a cache if none is given.

        Returns (y [B, T, hidden_size] in hidden_states' dtype, the cache or None).
        """
        B, T, _ = hidden_states.shape
        hidden_states, mask, ends = self._mask(hidden_states, attention_mask)
        cache, (conv_state, recurrent_state) = self._states(cache, use_cache)

        q, k, v, z, b, a = self._split(self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states))
        qkv, new_conv_state = self.conv1d(torch.cat([q, k, v], dim=-1), conv_state, ends)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)

        beta = b.sigmoid()
        ct = torch.float64 if a.dtype == torch.float64 else torch.float32      # gates in fp32 (fp64 for fp64)
        g = -self.A_log.to(ct).exp() * F.softplus(a.to(ct) + self.dt_bias.to(ct))
        if mask is not None:          # padded tokens leave the state as it is: g = 0, β = 0
            beta, g = beta * mask[..., None].to(beta.dtype), g * mask[..., None]

        op = fused_recurrent_gated_delta_rule if self._form(T) == "recurrent" else chunk_gated_delta_rule
        o, final_state = op(q, k, v, g, beta, initial_state=recurrent_state, output_final_state=cache is not None,
                            use_qk_l2norm_in_kernel=True, chunk_size=self.chunk_size, backend=self.backend)
        if cache is not None:
            cache.update(self.layer_idx, new_conv_state, final_state)

        o = self.norm(o, z)                                                   # [B, T, HV, V]
        return self.out_proj(o.reshape(B, T, self.value_dim)), cache
