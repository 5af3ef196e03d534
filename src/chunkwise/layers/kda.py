"""Kimi Delta Attention layer, as in Kimi Linear (fla's KimiDeltaAttention).

    q, k, v = SiLU(causal depthwise conv(q_proj x, k_proj x, v_proj x))
    f = f_proj(x)  (low rank: hidden → V → HV·K),  β = sigmoid(b_proj x)
    g = −exp(A_log) · softplus(f + dt_bias)          per token, value head and key channel
    o = KDA(l2norm(q), l2norm(k), v, g, β)           (chunkwise ops; scale K^-½)
    y = o_proj(RMSNorm(o) · sigmoid(g_proj x))       (g_proj low rank: hidden → V → HV·V)

Parameter names follow fla's KimiDeltaAttention (q_conv1d / k_conv1d / v_conv1d, f_proj.0/1,
g_proj.0/1, o_norm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import chunk_kda, fused_recurrent_kda
from ._common import DeltaRuleLayer, inverse_softplus_dt
from .conv import ShortConvolution
from .norm import GatedRMSNorm


class KimiDeltaAttention(DeltaRuleLayer):
    """Args:
        hidden_size: model width.
        num_heads: H, the q/k heads; num_v_heads: HV (default H), a multiple of H.
        head_dim: K = V, the head dims (head_v_dim overrides V).
        conv_size: W, the short convolutions' width.
        norm_eps: epsilon of the gated RMSNorm.
        layer_idx: the key of this layer's states in a `LinearAttentionCache`.
        mode, backend, recurrent_max_len, chunk_size: see `DeltaRuleLayer` and the ops.
    """

    def __init__(self, hidden_size: int, num_heads: int = 4, head_dim: int = 64, num_v_heads: int | None = None,
                 head_v_dim: int | None = None, conv_size: int = 4, norm_eps: float = 1e-5, layer_idx: int = 0,
                 mode: str = "auto", backend: str = "auto", recurrent_max_len: int = 64, chunk_size: int = 32):
        super().__init__()
        self._init_heads(hidden_size, num_heads, num_v_heads, head_dim, head_v_dim, "num_heads")
        self._init_dispatch(layer_idx, mode, backend, recurrent_max_len, chunk_size)
        self.num_heads = num_heads
        num_v_heads, head_v_dim = self.num_v_heads, self.head_v_dim

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.q_conv1d = ShortConvolution(self.key_dim, conv_size, activation="silu")
        self.k_conv1d = ShortConvolution(self.key_dim, conv_size, activation="silu")
        self.v_conv1d = ShortConvolution(self.value_dim, conv_size, activation="silu")
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False),
                                    nn.Linear(head_v_dim, num_v_heads * head_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(inverse_softplus_dt(num_v_heads * head_dim))
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False),
                                    nn.Linear(head_v_dim, self.value_dim, bias=True))
        self.o_norm = GatedRMSNorm(head_v_dim, eps=norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self, batch_size: int):
        """(conv state [B, 2·H·K + HV·V, W − 1] (q, k, v channels), recurrent state [B, HV, K, V])."""
        return ((batch_size, self.conv_dim, self.q_conv1d.state_len),
                (batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache=None, use_cache: bool = False):
        """As `GatedDeltaNet.forward`: returns (y [B, T, hidden_size], the cache or None)."""
        B, T, _ = hidden_states.shape
        hidden_states, mask, ends = self._mask(hidden_states, attention_mask)
        cache, (conv_state, recurrent_state) = self._states(cache, use_cache)
        cs_q = cs_k = cs_v = None
        if conv_state is not None:
            cs_q, cs_k, cs_v = conv_state.split([self.key_dim, self.key_dim, self.value_dim], dim=1)

        q, s_q = self.q_conv1d(self.q_proj(hidden_states), cs_q, ends)
        k, s_k = self.k_conv1d(self.k_proj(hidden_states), cs_k, ends)
        v, s_v = self.v_conv1d(self.v_proj(hidden_states), cs_v, ends)
        q = q.reshape(B, T, self.num_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)

        f = self.f_proj(hidden_states).reshape(B, T, self.num_v_heads, self.head_k_dim)
        ct = torch.float64 if f.dtype == torch.float64 else torch.float32      # gates in fp32 (fp64 for fp64)
        dt_bias = self.dt_bias.to(ct).reshape(self.num_v_heads, self.head_k_dim)
        g = -self.A_log.to(ct).exp()[:, None] * F.softplus(f.to(ct) + dt_bias)         # [B, T, HV, K]
        beta = self.b_proj(hidden_states).sigmoid()
        if mask is not None:          # padded tokens leave the state as it is: g = 0, β = 0
            beta, g = beta * mask[..., None].to(beta.dtype), g * mask[..., None, None]

        op = fused_recurrent_kda if self._form(T) == "recurrent" else chunk_kda
        o, final_state = op(q, k, v, g, beta, initial_state=recurrent_state, output_final_state=cache is not None,
                            use_qk_l2norm_in_kernel=True, chunk_size=self.chunk_size, backend=self.backend)
        if cache is not None:
            cache.update(self.layer_idx, torch.cat([s_q, s_k, s_v], dim=1), final_state)

        gate = self.g_proj(hidden_states).reshape(B, T, self.num_v_heads, self.head_v_dim)
        o = self.o_norm(o, gate)
        return self.o_proj(o.reshape(B, T, self.value_dim)), cache
