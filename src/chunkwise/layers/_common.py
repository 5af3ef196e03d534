"""What the two layers share: mode choice, masks, the cache hand-over and the op call."""
from __future__ import annotations

import math

import torch
from torch import nn

from .cache import LinearAttentionCache
from .conv import last_token_end

MODES = ("auto", "chunk", "recurrent")


def inverse_softplus_dt(n: int, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4) -> torch.Tensor:
    """dt_bias init (Mamba2 / GDN): dt log-uniform in [dt_min, dt_max], stored as softplus⁻¹(dt)."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp_min(dt_floor)
    return dt + torch.log(-torch.expm1(-dt))


class DeltaRuleLayer(nn.Module):
    """Base of GatedDeltaNet and KimiDeltaAttention: holds the dispatch options.

    mode: "auto" (the recurrent kernel for inputs of at most ``recurrent_max_len`` tokens outside
    training, the chunk kernel otherwise), "chunk" or "recurrent". backend: as in the ops.
    """

    def _init_dispatch(self, layer_idx, mode, backend, recurrent_max_len, chunk_size):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.layer_idx = layer_idx
        self.mode = mode
        self.backend = backend
        self.recurrent_max_len = recurrent_max_len
        self.chunk_size = chunk_size

    def _init_heads(self, hidden_size: int, num_k_heads: int, num_v_heads: int | None, head_k_dim: int,
                    head_v_dim: int | None, k_heads_arg: str) -> None:
        """hidden_size, num_v_heads (default num_k_heads; a multiple of it, else a ValueError naming ``k_heads_arg``),
        head_k_dim, head_v_dim (default head_k_dim), key_dim = H·K, value_dim = HV·V."""
        num_v_heads = num_v_heads or num_k_heads
        head_v_dim = head_v_dim or head_k_dim
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of {k_heads_arg}={num_k_heads}")
        self.hidden_size = hidden_size
        self.num_v_heads = num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim

    def _form(self, T: int) -> str:
        if self.mode != "auto":
            return self.mode
        return "recurrent" if T <= self.recurrent_max_len and not self.training else "chunk"

    @staticmethod
    def _mask(hidden_states, attention_mask):
        """Zero the padded tokens' inputs; returns (hidden_states, mask [B, T] in fp32 or None, ends [B] or None)."""
        if attention_mask is None:
            return hidden_states, None, None
        T = hidden_states.shape[1]
        if attention_mask.dim() != 2 or attention_mask.shape[0] != hidden_states.shape[0] or attention_mask.shape[1] < T:
            raise ValueError(f"attention_mask must be [B, T'] (1 = token, 0 = padding) with T' ≥ T = {T}, "
                             f"got {tuple(attention_mask.shape)} for hidden_states {tuple(hidden_states.shape)}")
        mask = attention_mask[:, -T:]
        hidden_states = hidden_states * mask[..., None].to(hidden_states.dtype)
        return hidden_states, mask.float(), last_token_end(mask, T)

    def _states(self, cache, use_cache):
        if cache is None and use_cache:
            cache = LinearAttentionCache()
        state = None if cache is None else cache.get(self.layer_idx)
        return cache, (None, None) if state is None else (state.conv_state, state.recurrent_state)
